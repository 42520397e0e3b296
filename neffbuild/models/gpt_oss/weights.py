"""GPT-OSS weights: checkpoint names, MXFP4 (kept packed or dequantised), random init, GK stacking.

Every checkpoint name lives here. The GK decode graph sees only the stacked layout: one
tensor per kind with a leading ``[num_layers, ...]`` axis, built once on the host, in the
recipe's stored form (``shapes.WeightForm``): float tensors in its dtype; experts dense, or
MXFP4 blocks and scales whose bytes are the checkpoint's own (a dense source, such as random
weights, is quantised here, once).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from neffbuild.errors import InvalidInput
from neffbuild.models.gpt_oss.config import GptOssConfig
from neffbuild.models.gpt_oss.shapes import (  # noqa: F401 - torch-free; re-exported here
    BLOCKS,
    DEFAULT_FORM,
    EXPERTS_OUT_IN,
    PACKED,
    SCALES,
    WeightForm,
    experts_of,
    stacked_shapes,
)

# FP4 (e2m1) code points, indexed by the 4-bit nibble.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCKS, MXFP4_SCALES = BLOCKS, SCALES
MXFP4_SCALE_BIAS = 127

# Stacked GK names -> per-layer checkpoint name pattern (None: not per layer).
LAYER_KEYS = {
    "ln_attn": "model.layers.{i}.input_layernorm.weight",
    "ln_mlp": "model.layers.{i}.post_attention_layernorm.weight",
    "sinks": "model.layers.{i}.self_attn.sinks",
    "o_w": "model.layers.{i}.self_attn.o_proj.weight",
    "o_b": "model.layers.{i}.self_attn.o_proj.bias",
    "router_w": "model.layers.{i}.mlp.router.weight",
    "router_b": "model.layers.{i}.mlp.router.bias",
    "gate_up_w": "model.layers.{i}.mlp.experts.gate_up_proj",
    "gate_up_b": "model.layers.{i}.mlp.experts.gate_up_proj_bias",
    "down_w": "model.layers.{i}.mlp.experts.down_proj",
    "down_b": "model.layers.{i}.mlp.experts.down_proj_bias",
}
QKV = ("q_proj", "k_proj", "v_proj")
GLOBAL_KEYS = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
STACKED_NAMES = tuple(GLOBAL_KEYS) + ("qkv_w", "qkv_b") + tuple(LAYER_KEYS)


def stacked_names(experts: str = "dense") -> tuple[str, ...]:
    """The stacked tensors of a form, in a fixed order: MXFP4 replaces each dense expert weight by its pair."""
    if experts != "mxfp4":
        return STACKED_NAMES
    return tuple(p for n in STACKED_NAMES for p in ((n + BLOCKS, n + SCALES) if n in EXPERTS_OUT_IN else (n,)))


# ----------------------------------------------------------------------------- MXFP4


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """MXFP4 -> dense. blocks [..., G, 16] uint8 (low nibble first), scales [..., G] uint8 (2^(s-127)).

    Returns [..., G * 32]: each group of 32 values shares one power-of-two scale.
    """
    if blocks.shape[:-1] != scales.shape:
        raise InvalidInput(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    b = blocks.to(torch.uint8)
    lo, hi = lut[(b & 0x0F).long()], lut[(b >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).flatten(-2)  # [..., G, 32]
    exp = scales.to(torch.int32) - MXFP4_SCALE_BIAS
    vals = torch.ldexp(vals, exp.unsqueeze(-1).to(dtype))
    return vals.flatten(-2)


def quant_mxfp4(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [..., K] (K % 32 == 0) -> (blocks, scales), rounding to the nearest FP4 code.

    Used to write test checkpoints in the real GPT-OSS layout.
    """
    *prefix, K = dense.shape
    groups = dense.float().reshape(*prefix, K // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.pow(2.0, exp).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + MXFP4_SCALE_BIAS).to(torch.uint8)


# ----------------------------------------------------------------------------- loading


def _checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise InvalidInput(f"{index}: not a safetensors index ({exc})") from None
        files = sorted({folder / f for f in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InvalidInput(f"{folder}: no *.safetensors files (expected a Hugging Face checkpoint folder)")
    for f in files:
        if not f.is_file():
            raise InvalidInput(f"{f}: listed in the index but missing")
    return files


def load_checkpoint(folder: str | Path, dtype=torch.float32, keep_mxfp4: bool = False) -> dict[str, torch.Tensor]:
    """HF-layout state dict (single file or sharded), MXFP4 experts dequantised to ``dtype`` (or, with
    ``keep_mxfp4``, their ``*_blocks`` / ``*_scales`` as stored)."""
    raw: dict[str, torch.Tensor] = {}
    for f in _checkpoint_files(Path(folder)):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():  # noqa: SIM118 - a safe_open handle has keys() but is not iterable
                raw[k] = fh.get_tensor(k)
    out = {}
    for k, t in raw.items():
        if keep_mxfp4 and (k.endswith(MXFP4_BLOCKS) or k.endswith(MXFP4_SCALES)):
            out[k] = t  # as stored: no dense copy (at GPT-OSS-20B's 24 layers that copy alone is ~38 GB)
            continue
        if k.endswith(MXFP4_SCALES):
            continue
        if k.endswith(MXFP4_BLOCKS):
            base = k[: -len(MXFP4_BLOCKS)]
            scales = raw.get(base + MXFP4_SCALES)
            if scales is None:
                raise InvalidInput(f"{folder}: {k} has no matching {base + MXFP4_SCALES}")
            # [E, out, G, 16] -> [E, out, in] -> transposed to the [E, in, out] the model multiplies by.
            out[base] = dequant_mxfp4(t, scales, dtype).transpose(1, 2).contiguous()
        else:
            out[k] = t.to(dtype) if t.is_floating_point() else t
    return out


def random_state_dict(cfg: GptOssConfig, seed: int, std: float = 0.2) -> dict[str, torch.Tensor]:
    """HF-named random weights. std is large enough that greedy decoding is not degenerate."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=std):
        return torch.randn(*shape, generator=g) * scale

    H, d = cfg.hidden_size, cfg.head_dim
    Hq, Hk = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_layer = {key: shape[1:] for key, shape in stacked_shapes(cfg).items() if key in LAYER_KEYS}
    for key in EXPERTS_OUT_IN:  # the checkpoint's [E, in, out]
        E, n_out, n_in = per_layer[key]
        per_layer[key] = (E, n_in, n_out)
    sd = {
        GLOBAL_KEYS["embed"]: rnd(cfg.vocab_size, H, scale=1.0),
        GLOBAL_KEYS["norm"]: 1 + rnd(H, scale=0.1),
        GLOBAL_KEYS["lm_head"]: rnd(cfg.vocab_size, H),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, rows in zip(QKV, (Hq, Hk, Hk), strict=False):
            sd[f"{p}self_attn.{name}.weight"] = rnd(rows, H)
            sd[f"{p}self_attn.{name}.bias"] = rnd(rows, scale=0.05)
        for key in LAYER_KEYS:  # a fixed order, so a seed always gives the same weights
            t = rnd(*per_layer[key])
            sd[LAYER_KEYS[key].format(i=i)] = 1 + 0.5 * t if key.startswith("ln") else t
    return sd


# ----------------------------------------------------------------------------- stacking


def stack(cfg: GptOssConfig, sd: dict[str, torch.Tensor], form: WeightForm = DEFAULT_FORM,
          consume: bool = False) -> dict[str, torch.Tensor]:
    """HF state dict -> GK layout: per-layer tensors stacked once on a leading [L, ...] axis, the expert
    weights [out, in] (shapes.EXPERTS_OUT_IN), float tensors in ``form.dtype``. MXFP4 experts: the
    checkpoint's blocks and scales stacked byte for byte (already [out, in]); dense experts are quantised.
    ``consume``: each per-layer tensor is dropped from ``sd`` once copied into its stack, so the peak holds the
    model about once, not twice (a 24-layer GPT-OSS-20B is ~13 GB)."""
    L = cfg.num_hidden_layers
    dtype = getattr(torch, form.dtype)

    def get(name: str) -> torch.Tensor:
        if name not in sd:
            raise InvalidInput(f"checkpoint is missing tensor {name!r}")
        return sd.pop(name) if consume else sd[name]

    def stacked(names: list[str], piece=lambda t: t) -> torch.Tensor:
        """The L pieces in one new tensor, each copied in (and dropped, with ``consume``) in turn."""
        first = piece(get(names[0]))
        out = torch.empty((len(names), *first.shape), dtype=first.dtype)
        out[0].copy_(first)
        del first
        for i, n in enumerate(names[1:], 1):
            out[i].copy_(piece(get(n)))
        return out

    out = {k: get(v).contiguous() for k, v in GLOBAL_KEYS.items()}
    for kind, suffix in (("qkv_w", "weight"), ("qkv_b", "bias")):
        out[kind] = torch.stack([torch.cat([get(f"model.layers.{i}.self_attn.{n}.{suffix}") for n in QKV])
                                 for i in range(L)])
    for key, pattern in LAYER_KEYS.items():
        names = [pattern.format(i=i) for i in range(L)]
        if form.mxfp4 and key in EXPERTS_OUT_IN:
            if all(n + BLOCKS in sd and n + SCALES in sd for n in names):  # the checkpoint's bytes
                out[key + BLOCKS] = stacked([n + BLOCKS for n in names])
                out[key + SCALES] = stacked([n + SCALES for n in names])
            else:
                out.update(_packed_experts(key, names, sd))
                for n in names if consume else ():
                    del sd[n]
            continue
        if key in EXPERTS_OUT_IN:  # experts [in, out] -> [out, in]
            out[key] = stacked(names, lambda t: t.transpose(-1, -2))
        else:
            out[key] = stacked(names)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}


def _packed_experts(key: str, names: list[str], sd: dict) -> dict[str, torch.Tensor]:
    """One expert weight's stacked blocks [L, E, out, G, 16] and scales [L, E, out, G] from its dense
    [E, in, out] weight, quantised (round to nearest code); ``stack`` takes a checkpoint's own bytes as stored."""
    missing = [n for n in names if n not in sd]
    if missing:
        raise InvalidInput(f"checkpoint is missing tensor {missing[0]!r} (or its {BLOCKS} / {SCALES} pair)")
    blocks, scales = zip(*(quant_mxfp4(sd[n].float().transpose(1, 2)) for n in names), strict=True)
    return {key + BLOCKS: torch.stack(blocks).contiguous(), key + SCALES: torch.stack(scales).contiguous()}


def model_weights(cfg: GptOssConfig, checkpoint: Path | None, random_seed: int | None,
                  form: WeightForm = DEFAULT_FORM) -> dict[str, torch.Tensor]:
    """Stacked GK weights in ``form`` from a checkpoint folder or a random seed."""
    if checkpoint is not None:
        sd = load_checkpoint(checkpoint, getattr(torch, form.dtype), keep_mxfp4=form.mxfp4)
    else:
        sd = random_state_dict(cfg, random_seed or 0)
    return stack(cfg, sd, form, consume=True)  # sd is this function's own
