"""Random GPT-OSS checkpoints at GPT-OSS-20B's dimensions, written tensor by tensor (low peak memory).

Two folders from one seed, the same weights:
  ``mxfp4/``  openai's release layout as transformers reads it (``quantization_config`` mxfp4, every
              expert weight as ``*_blocks`` / ``*_scales`` uint8, everything else bfloat16; the layout
              of tests/mxfp4_checkpoint.py, which quantises a whole state dict at once and would need
              tens of GB at this width);
  ``bf16/``   the same model with the experts dequantised, dense bfloat16 (for the peers that read
              dense checkpoints only).
The weights are random (std 0.02 for matrices, so activations stay near unit scale at width 2,880):
speed does not depend on their values, and token agreement is reported as a number.

``--mxfp4-only`` (the real depth, 24 layers: the dense copy alone would be ~38 GB) writes the MXFP4 folder
only, one safetensors shard a layer with its index (peak memory one layer), the expert blocks as random
bytes and the scales as random exponents of 2^-8 .. 2^-6 (values of the same scale as the std-0.02 weights,
without quantising a dense draw: minutes instead of hours at this size).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from neffbuild.models.gpt_oss import weights as W  # noqa: E402
from neffbuild.models.gpt_oss.config import GptOssConfig  # noqa: E402
from tests.mxfp4_checkpoint import KEEP_BF16  # noqa: E402

# GPT-OSS-20B's dimensions; the layer count is the benchmark's choice (memory).
DIMS = {"vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
        "sliding_window": 128, "max_position_embeddings": 131072}
# A toy shape with the same structure, for checking the pipeline in seconds (--tiny); not a benchmark.
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 128, "max_position_embeddings": 4096}
CHUNK = 1  # experts quantised at a time: quant_mxfp4 holds ~20 floats per weight while it rounds


def config(layers: int, tiny: bool = False) -> GptOssConfig:
    return GptOssConfig.from_hf_dict(dict(TINY if tiny else DIMS, num_hidden_layers=layers))


def _quant(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, out, in] -> blocks [E, out, in/32, 16], scales [E, out, in/32], a few experts at a time."""
    parts = [W.quant_mxfp4(dense[e:e + CHUNK]) for e in range(0, dense.shape[0], CHUNK)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _tensors(cfg: GptOssConfig, seed: int, fast: torch.Generator | None = None):
    """(name, bf16 tensor or (blocks, scales)) in a fixed order: one seed, one model. ``fast``: the expert blocks
    and scales drawn as random bytes and exponents from that generator (``--mxfp4-only``)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    H, d, E, inter = cfg.hidden_size, cfg.head_dim, cfg.num_local_experts, cfg.intermediate_size
    Hq, Hk = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    yield W.GLOBAL_KEYS["embed"], rnd(cfg.vocab_size, H, std=1.0)
    yield W.GLOBAL_KEYS["norm"], (1 + rnd(H, std=0.1).float()).bfloat16()
    yield W.GLOBAL_KEYS["lm_head"], rnd(cfg.vocab_size, H)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, rows in zip(W.QKV, (Hq, Hk, Hk), strict=True):
            yield f"{p}self_attn.{name}.weight", rnd(rows, H)
            yield f"{p}self_attn.{name}.bias", rnd(rows, std=0.01)
        yield f"{p}self_attn.o_proj.weight", rnd(H, Hq)
        yield f"{p}self_attn.o_proj.bias", rnd(H, std=0.01)
        yield f"{p}self_attn.sinks", rnd(cfg.num_attention_heads, std=1.0)
        yield f"{p}input_layernorm.weight", (1 + rnd(H, std=0.1).float()).bfloat16()
        yield f"{p}post_attention_layernorm.weight", (1 + rnd(H, std=0.1).float()).bfloat16()
        yield f"{p}mlp.router.weight", rnd(E, H, std=0.05)
        yield f"{p}mlp.router.bias", rnd(E, std=0.01)
        for name, (n_out, n_in) in (("gate_up_proj", (2 * inter, H)), ("down_proj", (H, inter))):
            base = f"{p}mlp.experts.{name}"
            if fast is None:
                blocks, scales = _quant(torch.randn(E, n_out, n_in, generator=g) * 0.02)
            else:  # E2M1 codes uniform, scales 2^-8 .. 2^-6 (E8M0: 119 .. 121)
                blocks = torch.randint(0, 256, (E, n_out, n_in // 32, 16), dtype=torch.uint8, generator=fast)
                scales = torch.randint(119, 122, (E, n_out, n_in // 32), dtype=torch.uint8, generator=fast)
            yield base, (blocks, scales)
            yield base + "_bias", rnd(E, n_out, std=0.01)


def write(folder: Path, layers: int, seed: int = 0, tiny: bool = False) -> dict[str, Path]:
    """Write both checkpoints under ``folder`` (skipped when present); returns {"mxfp4": dir, "bf16": dir}."""
    cfg = config(layers, tiny)
    out = {"mxfp4": folder / "mxfp4", "bf16": folder / "bf16"}
    if all((d / "config.json").is_file() for d in out.values()):
        return out
    packed, dense = {}, {}
    for name, t in _tensors(cfg, seed):
        if isinstance(t, tuple):
            blocks, scales = t
            packed[name + W.MXFP4_BLOCKS], packed[name + W.MXFP4_SCALES] = blocks, scales
            # transformers' dense expert layout is [E, in, out]
            pairs = zip(blocks, scales, strict=True)
            dense[name] = torch.stack([W.dequant_mxfp4(b, s, torch.bfloat16).T for b, s in pairs])
        else:
            packed[name] = dense[name] = t
    hf = dict(cfg.to_hf_dict(), architectures=["GptOssForCausalLM"], dtype="bfloat16", model_type="gpt_oss")
    for kind, tensors, extra in (("mxfp4", packed, {"quantization_config": {
            "quant_method": "mxfp4", "modules_to_not_convert": KEEP_BF16}}), ("bf16", dense, {})):
        out[kind].mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out[kind] / "model.safetensors"), metadata={"format": "pt"})
        (out[kind] / "config.json").write_text(json.dumps(dict(hf, **extra), indent=1))
    return out


def write_mxfp4_only(folder: Path, layers: int, seed: int = 0, tiny: bool = False) -> dict[str, Path]:
    """The MXFP4 folder alone, a shard a layer (``--mxfp4-only``); skipped when present. {"mxfp4": dir}."""
    cfg = config(layers, tiny)
    out = folder / "mxfp4"
    if (out / "config.json").is_file():
        return {"mxfp4": out}
    tmp = folder / "mxfp4.partial"
    tmp.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shards, index, shard = [], {}, {}
    total = layers + 1

    def flush():
        name = f"model-{len(shards) + 1:05d}-of-{total:05d}.safetensors"
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, name))
        shards.append(name)
        shard.clear()

    group = None
    for name, t in _tensors(cfg, seed, fast=g):
        here = name.split(".")[2] if name.startswith("model.layers.") else "global"  # a shard a layer
        if shard and here != group:
            flush()
        group = here
        if isinstance(t, tuple):
            shard[name + W.MXFP4_BLOCKS], shard[name + W.MXFP4_SCALES] = t
        else:
            shard[name] = t
    flush()
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    hf = dict(cfg.to_hf_dict(), architectures=["GptOssForCausalLM"], dtype="bfloat16", model_type="gpt_oss",
              quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": KEEP_BF16})
    (tmp / "config.json").write_text(json.dumps(hf, indent=1))
    tmp.rename(out)
    return {"mxfp4": out}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="toy dimensions (a pipeline check, not a benchmark)")
    ap.add_argument("--mxfp4-only", action="store_true",
                    help="the MXFP4 folder only, a shard a layer, random blocks and scales (the real depth)")
    a = ap.parse_args()
    fn = write_mxfp4_only if a.mxfp4_only else write
    print(json.dumps({k: str(v) for k, v in fn(a.folder, a.layers, tiny=a.tiny).items()}))
