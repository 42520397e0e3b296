"""Dispatch overhead (plan + attention metadata) vs the decode step of the smallest bucket.

    .venv/bin/python benchmarks/dispatch_overhead.py [BUNDLE]

(`neffbuild bench BUNDLE` measures plan + metadata for one request on any bundle.)

Overhead: B=8 requests, max_model_len 131072, block 128, buckets [16384, 32768, 65536]
(the production recipe's grid), SWA table of 2 blocks. Step: the smallest artifact of
BUNDLE on a zeroed KV cache, when a BUNDLE is given.
"""

from __future__ import annotations

import json
import sys

import torch
from _common import machine, median_us

from neffbuild.runtime.step import attn_metadata
from neffbuild.runtime.step.dispatch import Grid, plan_step


def overhead() -> dict:
    spec = Grid((1, 2, 4, 8), (16384, 32768, 65536), 131072)
    bs, num_swa, B = 128, 2, 8
    max_blocks = 131072 // bs
    full = torch.randint(1, 8000, (B, max_blocks))
    swa = torch.randint(1, 8000, (B, max_blocks))
    computed = [3000, 4100, 12000, 9000, 15000, 700, 16000, 2]
    tokens = torch.randint(0, 1000, (B, 1))
    computed_t = torch.tensor(computed)

    def plan_only():
        return plan_step(computed, B, spec=spec)

    def both():
        p = plan_step(computed, B, spec=spec)
        return attn_metadata.build(tokens, computed_t, full, swa, batch=p.batch, ctx=p.ctx, block_size=bs,
                                   num_swa=num_swa)

    return {"plan_us": median_us(plan_only), "plan_plus_metadata_us": median_us(both),
            "plan_label": plan_only().label}


def step_time(bundle_path: str) -> dict:
    from neffbuild.runtime.bundle.reader import open_bundle
    from neffbuild.runtime.kv.cache import allocate

    b = open_bundle(bundle_path)
    label = min(b.entries.values(), key=lambda a: (a["batch"] * a["ctx"], a["label"]))["label"]
    e = b.entries[label]
    B, ctx, bs = e["batch"], e["ctx"], b.kv_layout.block_size
    kv = allocate(b.kv_layout)
    args = (torch.zeros(B, 1, dtype=torch.long), torch.full((B, 1), 10), torch.arange(1, 1 + B * ctx // bs).view(B, -1),
            torch.ones(B, max(b.num_swa, 1), dtype=torch.long), torch.zeros(B, dtype=torch.long),
            torch.full((B,), -1), torch.full((B,), -1), tuple(kv))
    fn = b.artifact(label)
    return {"step_label": label, "step_us": median_us(lambda: fn(*args), repeat=300, warmup=20)}


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = {"machine": machine(), **overhead()}
    if len(sys.argv) > 1:
        out.update(step_time(sys.argv[1]))
    print(json.dumps(out, indent=1))
