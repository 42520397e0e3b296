"""The sliding-window DI truncation rule (N-1): how many prompt tokens travel as KV.

In disaggregated inference the decode worker never receives logits: it recomputes the last
prompt token (position ``N - 1``) in its first decode step. A sliding-window block manager
that admits the prompt at length ``N`` keeps the blocks a query at position ``N`` reads, from
``(N - window + 1) // block_size`` on; the recomputed query at ``N - 1`` also reads token
``N - window``, whose block is one earlier when ``(N - window + 1) % block_size == 0``. That
block is dropped before the transfer and decode reads a block nobody wrote.

The rule: both sides work at prompt length ``N - 1``. The producer prefills ``tokens[:N-1]``;
the consumer counts the pull as ``N - 1`` tokens (so it keeps the window of position ``N - 1``)
and runs ``tokens[N-1]`` at position ``N - 1`` in its first decode step. It applies only to
models with sliding-window layers and prompts longer than one token, and only once
(``truncated`` marks it, so a second application changes nothing). Not covered: block
allocation itself (``runtime/kv/blocks.py``) and the transfer (``runtime/di/ingest.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

NULL_BLOCK = 0  # kv_cache.NULL_BLOCK (that module imports torch)


@dataclass(frozen=True)
class DIPrompt:
    """A prompt as DI moves it: ``kv_len`` tokens of KV over the wire, then one decode step."""

    tokens: tuple[int, ...]
    kv_len: int
    truncated: bool = False

    @property
    def first_position(self) -> int:
        """Where the decode worker's first step runs: always the last prompt token."""
        return len(self.tokens) - 1


def truncate(prompt: DIPrompt, sliding_window: int | None) -> DIPrompt:
    """Apply the N-1 rule (idempotent; a no-op without sliding-window layers or for one token)."""
    if prompt.truncated or not sliding_window or len(prompt.tokens) <= 1:
        return prompt
    return replace(prompt, kv_len=len(prompt.tokens) - 1, truncated=True)


def di_prompt(tokens: Sequence[int], sliding_window: int | None, *, _n_minus_1: bool = True) -> DIPrompt:
    """The DI view of a prompt; ``_n_minus_1=False`` is the private switch that shows why the rule exists."""
    prompt = DIPrompt(tuple(int(t) for t in tokens), len(tokens))
    return truncate(prompt, sliding_window) if _n_minus_1 else prompt


def strip_leading_null(blocks: Sequence[int]) -> list[int]:
    """A sliding group's block list without the null entries of blocks that left the window."""
    i = 0
    while i < len(blocks) and blocks[i] == NULL_BLOCK:
        i += 1
    return list(blocks[i:])


def unwritten_reads(row: Sequence[int], position: int, block_size: int, window: int | None = None) -> list[int]:
    """Logical blocks a query at ``position`` reads (its window, or all) whose table entry is the null block."""
    first = max(0, position - window + 1) // block_size if window else 0
    return [i for i in range(first, position // block_size + 1) if i >= len(row) or row[i] == NULL_BLOCK]
