"""benchmarks/real_width.py's bookkeeping (nothing compiled, nothing timed): bytes per step, the
checkpoint's layout, token agreement."""

import json
import math

import torch
from safetensors import safe_open

from benchmarks import real_width as RW
from benchmarks.real_width_ckpt import config, write
from neffbuild.bench.bytes import weight_bytes
from neffbuild.models.gpt_oss import weights as W
from neffbuild.models.gpt_oss.shapes import stacked_shapes


def _meta(shapes: dict, dtype) -> dict:
    return {k: torch.empty(s, dtype=torch.uint8 if k.endswith(("_blocks", "_scales")) else dtype, device="meta")
            for k, s in shapes.items()}


def test_step_bytes_count_what_neffbuild_bench_bytes_counts():
    """Dense forms: the same count as weight_bytes; MXFP4: blocks + scales of the routed experts (17 bytes / 32)."""
    cfg = config(2, tiny=True)
    for batch in (1, 4):
        for itemsize, dtype in ((2, torch.bfloat16), (4, torch.float32)):
            dense = weight_bytes(_meta(stacked_shapes(cfg), dtype), cfg, batch)
            assert RW.step_bytes(cfg, (itemsize, itemsize, itemsize), batch, ctx=0) == dense
        packed = _meta(stacked_shapes(cfg, "mxfp4"), torch.bfloat16)
        experts = {k: v for k, v in packed.items() if k.endswith(("_blocks", "_scales"))}
        routed = sum(t.numel() for t in experts.values()) * min(batch * cfg.num_experts_per_tok,
                                                                cfg.num_local_experts) // cfg.num_local_experts
        rest = weight_bytes({k: v for k, v in packed.items() if k not in experts}, cfg, batch)
        assert RW.step_bytes(cfg, (17 / 32, 2, 2), batch, ctx=0) == rest + routed
    # int8 rows (bundle-int8's head and qkv / o projections): 1 byte a weight and a 4-byte scale a row, not 2 a weight
    shapes = stacked_shapes(cfg)
    saved = sum(math.prod(shapes[n]) - 4 * math.prod(shapes[n][:-1]) for n in ("lm_head", "qkv_w", "o_w"))
    for batch in (1, 4):
        int8 = RW.step_bytes(cfg, RW.ENGINES["bundle-int8"][2], batch, ctx=0)
        assert abs(RW.step_bytes(cfg, (17 / 32, 2, 2), batch, ctx=0) - int8 - saved) <= 1
    # KV: full layers read the context, sliding ones at most the window
    kv = RW.step_bytes(cfg, (2, 2, 2), 1, ctx=500) - RW.step_bytes(cfg, (2, 2, 2), 1, ctx=0)
    per_token = cfg.num_key_value_heads * cfg.head_dim * 2 * 2
    assert kv == per_token * sum(500 if k == "full_attention" else 128 for k in cfg.layer_types)


def test_checkpoints_hold_the_same_model(tmp_path):
    """The MXFP4 folder dequantises to the dense folder's experts bit for bit; other tensors are shared."""
    out = write(tmp_path, layers=1, tiny=True)
    cfg = json.loads((out["mxfp4"] / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4" and "quantization_config" not in json.loads(
        (out["bf16"] / "config.json").read_text())
    with safe_open(out["mxfp4"] / "model.safetensors", "pt") as q, safe_open(out["bf16"] / "model.safetensors",
                                                                            "pt") as d:
        name = "model.layers.0.mlp.experts.down_proj"
        dense = W.dequant_mxfp4(q.get_tensor(name + "_blocks"), q.get_tensor(name + "_scales"), torch.bfloat16)
        assert torch.equal(dense.transpose(1, 2), d.get_tensor(name))  # transformers' [E, in, out]
        assert torch.equal(q.get_tensor("lm_head.weight"), d.get_tensor("lm_head.weight"))
        assert q.get_tensor("lm_head.weight").dtype == torch.bfloat16


def test_agreement_counts_tokens_before_the_first_difference():
    class A:
        batches, new, prompt = [2], 4, 10

    runs = {"bundle-mxfp4": [{"batches": {"2": {"decode_s": [1.0], "tokens": [[1, 2, 3, 4], [5, 6, 7, 8]]}},
                   "peak_rss_mb": 1, "load": "0-0"}],
            "llama-mxfp4": [{"batches": {"2": {"decode_s": [1.0], "tokens": [[1, 2, 9, 4], [5, 6, 7, 8]]}},
                   "peak_rss_mb": 1, "load": "0-0"}]}
    lines = RW.report(A, runs, config(1, tiny=True), bw=1e9)
    assert "| bundle-mxfp4 / llama-mxfp4 | 2 | 0.75 |" in lines  # 2 of 4, then 4 of 4: (2 + 4) / 8
