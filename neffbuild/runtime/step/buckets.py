"""Pure bucket math shared by the compile grid and the runtime dispatcher.

Every function here is public API: the grid decides what gets compiled with them and the
runtime decides what gets executed with them, so the two can never disagree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from neffbuild.errors import ShapeNotCovered

P_MAX = 128  # attention tile: context buckets are multiples of it


def bucket_for(count: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= count; count <= 0 gives the smallest; above all raises ShapeNotCovered."""
    if not buckets:
        raise ValueError("bucket_for: empty bucket list")
    for b in buckets:
        if b >= count:
            return b
    raise ShapeNotCovered(f"{count} is above the largest bucket {buckets[-1]} (buckets: {list(buckets)})")


def default_num_seqs_buckets(max_num_seqs: int) -> list[int]:
    """Powers of two below max_num_seqs, then max_num_seqs (8 -> [1,2,4,8]; 6 -> [1,2,4,6])."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    out, p = [], 1
    while p < max_num_seqs:
        out.append(p)
        p *= 2
    return out + [max_num_seqs]


def needed_seq(num_computed_tokens: Sequence[int] | int, num_draft_tokens: int = 0) -> int:
    """max(num_computed_tokens) + 1 + num_draft_tokens: the context the step must see."""
    top = num_computed_tokens if isinstance(num_computed_tokens, int) else max(num_computed_tokens, default=0)
    return int(top) + 1 + int(num_draft_tokens)


def ctx_buckets_with_fallback(ctx_buckets: Sequence[int], max_model_len: int) -> list[int]:
    """The compiled context values: the configured buckets, then max_model_len."""
    return [b for b in ctx_buckets if b < max_model_len] + [max_model_len]


def ctx_bucket_for(needed: int, ctx_buckets: Sequence[int], max_model_len: int) -> int:
    """Smallest of buckets + [max_model_len] that is >= needed."""
    return bucket_for(needed, ctx_buckets_with_fallback(ctx_buckets, max_model_len))


def table_width(ctx: int, block_size: int) -> int:
    """Block-table columns that cover ctx tokens: ceil(ctx / block_size)."""
    return -(-ctx // block_size)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def num_swa_blocks(window: int, block_size: int, max_model_len: int, query_len: int = 1) -> int:
    """Columns of the tail-trimmed sliding-window table.

    The most blocks a step can read in a sliding layer: keys from the first query's
    ``position - window + 1`` to the last position written (``query_len - 1`` later), a run
    of ``window + query_len - 1`` positions, which touches at most
    ``(window + query_len - 1 + block_size - 2) // block_size + 1`` blocks (runtime/kv/blocks.py
    holds the same blocks). Rounded up to a whole attention tile (128 // block_size blocks),
    but never more than a full-length sequence has.
    """
    tile_blocks = max(1, P_MAX // block_size)
    span = window + query_len - 1
    return min(round_up((span + block_size - 2) // block_size + 1, tile_blocks), math.ceil(max_model_len / block_size))
