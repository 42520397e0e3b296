"""The one table of a compiled step's inputs: name, shape (from batch, ctx, query_len and the
KV layout) and dtype, for the target families and for the EAGLE3 draft.

Everything else derives from it: ``compiler/graphs.py`` builds the example inputs it traces
with, the manifest records the resulting signature, and ``manifest_schema`` checks each
artifact's recorded signature against ``signature(...)`` here. What the runtime actually
passes is built by ``attn_metadata`` / ``draft_inputs`` (+ ``kv_cache.graph_view``), which
tests/test_runtime.py checks against this table. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from neffbuild.runtime.step.buckets import table_width

INT64 = "int64"


@dataclass(frozen=True)
class Dims:
    """What input shapes depend on: the grid cell and the bundle's KV layout (JSON form)."""

    batch: int
    ctx: int
    query_len: int
    block_size: int
    num_swa: int
    kv_layout: dict  # KVLayout.to_json(): num_buffers, buffer_shape, dtype, packed_k, draft
    hidden_size: int = 0  # the draft's input width is 3 x the target's hidden size
    sharded: bool = False  # tp or ep above 1: the rank id is the last input

    @property
    def graph_kv_dtype(self) -> str:
        """FP8 KV buffers enter compiled graphs as their uint8 bytes (kv_cache.graph_view)."""
        return "uint8" if self.kv_layout["dtype"].startswith("float8") else self.kv_layout["dtype"]


@dataclass(frozen=True)
class Input:
    name: str
    shape: Callable[[Dims], list[int]]
    dtype: str | Callable[[Dims], str] = INT64
    fill: int = 0  # example value: -1 marks a pad write slot (nothing written)

    def dtype_of(self, d: Dims) -> str:
        return self.dtype(d) if callable(self.dtype) else self.dtype


def _rows(d: Dims) -> list[int]:
    return [d.batch, d.query_len]


def _flat(d: Dims) -> list[int]:
    return [d.batch * d.query_len]


def _table(d: Dims) -> list[int]:
    return [d.batch, table_width(d.ctx, d.block_size)]


STEP_INPUTS = (
    Input("input_ids", _rows),
    Input("positions", _rows),
    Input("block_table", _table),  # head-trimmed to ctx / block_size columns
    Input("block_table_swa", lambda d: [d.batch, max(d.num_swa, 1)]),  # tail-trimmed to num_swa columns
    Input("swa_kv_pos_offset", lambda d: [d.batch]),
    Input("slot_mapping", _flat, fill=-1),
    Input("slot_mapping_swa", _flat, fill=-1),
)
KV_CACHES = Input("kv_caches", lambda d: list(d.kv_layout["buffer_shape"]), lambda d: d.graph_kv_dtype)
RANK = Input("rank", lambda d: [1])
DRAFT_INPUTS = (
    Input("input_ids", _rows),
    Input("positions", _rows),
    Input("hidden", lambda d: [d.batch, d.query_len, 3 * d.hidden_size], "float32"),  # the target's aux states
    Input("num_valid", lambda d: [d.batch]),
    Input("block_table", _table),
    Input("slot_mapping", _flat, fill=-1),
    Input("kv_cache", lambda d: list(d.kv_layout.get("draft", {}).get("buffer_shape", [])),
          lambda d: d.graph_kv_dtype),
)
INPUT_NAMES = tuple(i.name for i in STEP_INPUTS) + (KV_CACHES.name, RANK.name)
DRAFT_INPUT_NAMES = tuple(i.name for i in DRAFT_INPUTS) + (RANK.name,)


def signature(d: Dims, *, draft: bool = False) -> list[dict]:
    """The inputs, flattened as the manifest records them (``kv_caches[j]`` one per buffer)."""
    if draft:  # a sharded bundle's draft takes the rank too (the target's vocabulary-split embedding)
        out = [{"name": i.name, "shape": i.shape(d), "dtype": i.dtype_of(d)} for i in DRAFT_INPUTS]
    else:
        out = [{"name": i.name, "shape": i.shape(d), "dtype": i.dtype_of(d)} for i in STEP_INPUTS]
        out += [{"name": f"{KV_CACHES.name}[{j}]", "shape": KV_CACHES.shape(d), "dtype": KV_CACHES.dtype_of(d)}
                for j in range(d.kv_layout["num_buffers"])]
    if d.sharded:
        out.append({"name": RANK.name, "shape": RANK.shape(d), "dtype": RANK.dtype_of(d)})
    return out
