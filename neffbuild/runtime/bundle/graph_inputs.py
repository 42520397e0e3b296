"""``GraphInputs``: the manifest's ``graph_inputs`` as one type, written by the bundle writer and
read by every reader (``open_bundle``, the benchmarks, sessions, ``generate --check``).

It holds what decides every step's artifact and its input shapes: the grid, the KV layout
(with the EAGLE3 draft's group), ``num_swa``, the parallel layout, the architecture and its
Hugging Face config (``config()`` builds the dataclass through the registry), and the
draft's config keys. ``to_json`` / ``from_json`` are the one encoding (docs/bundle-format.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from neffbuild import registry
from neffbuild.runtime.kv.layout import KVLayout
from neffbuild.runtime.parallel import ParallelLayout
from neffbuild.runtime.step.dispatch import Grid


@dataclass(frozen=True)
class GraphInputs:
    grid: Grid
    block_size: int
    num_blocks: int
    num_swa: int
    parallel: ParallelLayout
    lnc: int
    fp8_packed_kv: bool
    kv_layout: KVLayout
    arch: str
    model_config: dict  # Hugging Face keys (the architecture config's to_hf_dict)
    draft_config: dict | None = None  # EAGLE3: the draft's keys as the recipe gave them
    speculative_method: str | None = None  # the registry's speculative method of the draft (with draft_config)

    @classmethod
    def from_recipe(cls, recipe, kv_layout: KVLayout) -> GraphInputs:
        s, r = recipe.speculative, recipe
        return cls(Grid(tuple(r.num_seqs_buckets), tuple(r.decode_context_length_buckets), r.max_model_len,
                        r.num_speculative_tokens),
                   r.block_size, r.num_blocks, r.num_swa, r.parallel, r.lnc, r.fp8_packed_kv,
                   kv_layout, r.model.arch, r.model.config.to_hf_dict(), s.draft_hf_config if s else None,
                   s.method if s else None)

    @classmethod
    def of_manifest(cls, manifest: dict) -> GraphInputs:
        return cls.from_json(manifest["graph_inputs"])

    @classmethod
    def from_json(cls, gi: dict) -> GraphInputs:
        """From a schema-checked manifest field (runtime/bundle/schema.py)."""
        grid = Grid(tuple(gi["num_seqs_buckets"]), tuple(gi["decode_context_length_buckets"]), gi["max_model_len"],
                    gi["num_speculative_tokens"])
        return cls(grid, gi["block_size"], gi["num_blocks"], gi["num_swa"], ParallelLayout.from_json(gi),
                   gi.get("lnc", 1), gi["fp8_packed_kv"], KVLayout.from_json(gi["kv_layout"]), gi["arch"],
                   dict(gi["model_config"]), gi.get("draft_config"), gi.get("speculative_method"))

    def to_json(self) -> dict:
        g, p = self.grid, self.parallel
        out = {
            "num_seqs_buckets": list(g.num_seqs_buckets), "decode_context_length_buckets": list(g.ctx_buckets),
            "max_model_len": g.max_model_len, "block_size": self.block_size, "num_blocks": self.num_blocks,
            "num_swa": self.num_swa, "tp": p.tp, "dp": p.dp, "ep": p.ep, "lnc": self.lnc,
            "fp8_packed_kv": self.fp8_packed_kv, "num_speculative_tokens": g.num_speculative_tokens,
            "kv_layout": self.kv_layout.to_json(), "arch": self.arch, "model_config": self.model_config,
        }
        if self.draft_config is not None:
            out["draft_config"], out["speculative_method"] = self.draft_config, self.speculative_method
        return out

    def config(self):
        """The architecture's config dataclass (through the registry)."""
        return registry.arch(self.arch).get("config").from_hf_dict(self.model_config)

    def draft(self, target_config):
        """The draft's config dataclass over the target's (through the registry), or None without drafts."""
        if not self.grid.num_speculative_tokens or self.draft_config is None:
            return None
        return registry.speculative(self.speculative_method).get("config").from_hf_dict(self.draft_config,
                                                                                       target_config)
