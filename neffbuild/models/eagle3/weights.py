"""EAGLE3 draft weights: the common checkpoint layout, random init, and the bundle's names.

Checkpoint (safetensors, one file or several in a folder; an optional ``model.`` prefix is
accepted): ``fc.weight [H, 3H]``; ``midlayer.input_layernorm.weight`` (token embedding),
``midlayer.hidden_norm.weight`` (fused state), ``midlayer.self_attn.{q,k,v}_proj.weight``
``[*, 2H]``, ``midlayer.self_attn.o_proj.weight``, ``midlayer.post_attention_layernorm.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``; ``norm.weight``; ``lm_head.weight [Vd, H]``;
``d2t [Vd]`` (target id = draft id + d2t[draft id]); ``t2d [V]`` (bool: target id is in
the draft vocabulary); optionally ``embed_tokens.weight`` (else the target's is shared).

In the bundle the draft's tensors sit beside the target's, under ``draft_*`` names (``DRAFT_NAMES``),
in the recipe's ``model.weights_dtype`` (``d2t`` int64), split over TP like the target's
(``models/eagle3/sharding.py``); the shared embedding is the target's ``embed``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from neffbuild.errors import InvalidInput
from neffbuild.models.eagle3.config import Eagle3Config
from neffbuild.models.eagle3.shapes import EMBED, has_own_embed, rank_specs, shapes  # noqa: F401  (torch-free)
from neffbuild.runtime.parallel import ParallelLayout

# bundle name -> checkpoint name (q/k/v are concatenated into draft_qkv_w)
CHECKPOINT_KEYS = {
    "draft_fc": "fc.weight",
    "draft_ln_embed": "midlayer.input_layernorm.weight",
    "draft_ln_hidden": "midlayer.hidden_norm.weight",
    "draft_o_w": "midlayer.self_attn.o_proj.weight",
    "draft_ln_mlp": "midlayer.post_attention_layernorm.weight",
    "draft_gate_w": "midlayer.mlp.gate_proj.weight",
    "draft_up_w": "midlayer.mlp.up_proj.weight",
    "draft_down_w": "midlayer.mlp.down_proj.weight",
    "draft_norm": "norm.weight",
    "draft_lm_head": "lm_head.weight",
    "draft_d2t": "d2t",
}
QKV_KEYS = tuple(f"midlayer.self_attn.{n}_proj.weight" for n in "qkv")
T2D = "t2d"
DRAFT_EMBED = "draft_embed"  # only when the checkpoint brings its own embedding
DRAFT_NAMES = tuple(CHECKPOINT_KEYS) + ("draft_qkv_w",)


def embed_name(own_embed: bool) -> str:
    """The bundle name of the token embedding the draft reads: its own, or the target's."""
    return DRAFT_EMBED if own_embed else "embed"


def placeholders(cfg: Eagle3Config, par: ParallelLayout | None = None, dtype: str = "float32",
                 own_embed: bool = False) -> dict[str, torch.Tensor]:
    """One rank's uninitialised draft tensors in the shapes and dtypes the bundle stores (for tracing)."""
    specs = rank_specs(cfg, par or ParallelLayout(), dtype, own_embed)
    return {n: torch.empty(s, dtype=getattr(torch, t)) for n, (s, t) in specs.items()}


def random_state_dict(cfg: Eagle3Config, seed: int, std: float = 0.2) -> dict[str, torch.Tensor]:
    """Checkpoint-named random weights; a draft vocabulary smaller than the target's is a
    seeded random subset of it (sorted), with d2t and t2d to match."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in shapes(cfg).items():
        if name == "draft_d2t":
            continue
        t = torch.randn(shape, generator=g) * std
        if name in ("draft_fc", "draft_o_w", "draft_down_w"):
            t = t / shape[1] ** 0.5 * 4  # keep the residual stream's scale near the target's
        if len(shape) == 1:  # norms
            t = 1 + 0.5 * t
        key = CHECKPOINT_KEYS.get(name)
        if key:
            sd[key] = t
        else:  # draft_qkv_w
            q, k = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            for ck, part in zip(QKV_KEYS, t.split([q, k, k]), strict=True):
                sd[ck] = part.contiguous()
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    ids = torch.arange(V) if Vd == V else torch.randperm(V, generator=g)[:Vd].sort().values
    sd["d2t"] = ids - torch.arange(Vd)
    sd[T2D] = torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)
    return sd


def save_checkpoint(sd: dict[str, torch.Tensor], folder: str | Path, cfg: Eagle3Config) -> Path:
    """Write ``sd`` in the common layout (``model.safetensors`` + ``config.json``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=1, sort_keys=True) + "\n")
    return folder


def load_checkpoint(folder: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by common-layout name (a leading ``model.`` is dropped)."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else [folder]
    if not files or not all(f.is_file() for f in files):
        raise InvalidInput(f"{folder}: no *.safetensors files (expected an EAGLE3 draft checkpoint folder)")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():  # noqa: SIM118 - safe_open is not a dict
                out[k.removeprefix("model.")] = fh.get_tensor(k)
    return out


def to_bundle(cfg: Eagle3Config, sd: dict[str, torch.Tensor], source: str = "draft checkpoint",
              dtype: str = "float32") -> dict[str, torch.Tensor]:
    """Common-layout state dict -> the bundle's ``draft_*`` tensors in ``dtype`` (``d2t`` int64), checked
    against ``cfg``."""
    floats = getattr(torch, dtype)

    def get(name: str) -> torch.Tensor:
        if name not in sd:
            raise InvalidInput(f"{source}: missing tensor {name!r} (common EAGLE3 layout: fc, midlayer.*, norm, "
                               f"lm_head, d2t, t2d)")
        return sd[name]

    if "d2t" not in sd and cfg.draft_vocab_size == cfg.vocab_size:  # the whole vocabulary: identity (vLLM's form)
        sd = dict(sd, d2t=torch.zeros(cfg.vocab_size, dtype=torch.long))
    out = {name: get(key) for name, key in CHECKPOINT_KEYS.items()}
    out["draft_qkv_w"] = torch.cat([get(k) for k in QKV_KEYS])
    for name, shape in shapes(cfg).items():
        if tuple(out[name].shape) != shape:
            raise InvalidInput(f"{source}: {CHECKPOINT_KEYS.get(name, 'q/k/v_proj')} has shape "
                               f"{list(out[name].shape)}, the draft config needs {list(shape)}")
    out = {n: (t.long() if n == "draft_d2t" else t.to(floats)).contiguous() for n, t in out.items()}
    _check_vocab_map(cfg, out["draft_d2t"], sd.get(T2D), source)
    if EMBED in sd:
        out[DRAFT_EMBED] = sd[EMBED].to(floats).contiguous()
    return out


def _check_vocab_map(cfg: Eagle3Config, d2t: torch.Tensor, t2d: torch.Tensor | None, source: str) -> None:
    target_ids = torch.arange(cfg.draft_vocab_size) + d2t
    if bool((target_ids < 0).any() or (target_ids >= cfg.vocab_size).any()):
        raise InvalidInput(f"{source}: d2t maps draft ids outside the target vocabulary [0, {cfg.vocab_size})")
    if t2d is not None:
        if tuple(t2d.shape) != (cfg.vocab_size,):
            raise InvalidInput(f"{source}: t2d has shape {list(t2d.shape)}, expected [{cfg.vocab_size}]")
        if not bool(t2d.bool()[target_ids].all()) or int(t2d.bool().sum()) != cfg.draft_vocab_size:
            raise InvalidInput(f"{source}: t2d and d2t disagree about which target ids are in the draft vocabulary")


def to_checkpoint(cfg: Eagle3Config, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The bundle's ``draft_*`` tensors back in the common layout (``to_bundle``'s inverse), floats in ``dtype``."""
    q, k = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    sd = {key: tensors[name].to(dtype) for name, key in CHECKPOINT_KEYS.items() if name != "draft_d2t"}
    sd.update(zip(QKV_KEYS, (t.to(dtype).contiguous() for t in tensors["draft_qkv_w"].split([q, k, k])), strict=True))
    d2t = tensors["draft_d2t"].long()
    sd["d2t"] = d2t
    sd[T2D] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, torch.arange(cfg.draft_vocab_size) + d2t,
                                                                       True)
    if DRAFT_EMBED in tensors:
        sd[EMBED] = tensors[DRAFT_EMBED].to(dtype)
    return sd


def write_engine_folder(cfg: Eagle3Config, tensors: dict[str, torch.Tensor], folder: str | Path, *, dtype: str,
                        max_position_embeddings: int) -> Path:
    """The draft as a model folder a host engine loads (vLLM's EAGLE3 loader: ``--speculative-config``'s
    ``model``), written from the bundle's own draft tensors, so a random draft or a converted one needs no second
    download: ``model.safetensors`` in the common layout (without ``d2t``/``t2d`` when the draft's vocabulary is
    the target's: vLLM refuses a map it does not need) and a Llama ``config.json``.

    The folder's ``eagle_aux_hidden_state_layer_ids`` are the bundle's own: one numbering everywhere (id i: the
    residual stream entering target layer i, 0 the embeddings, as EAGLE3 checkpoints and vLLM number them)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = to_checkpoint(cfg, tensors, getattr(torch, dtype))
    if cfg.draft_vocab_size == cfg.vocab_size:  # no vocabulary map: vLLM refuses one its draft does not need
        sd = {k: v for k, v in sd.items() if k not in ("d2t", T2D)}
    save_file({k: v.contiguous() for k, v in sorted(sd.items())}, str(folder / "model.safetensors"))
    hf = dict(cfg.to_hf_dict(), model_type="llama", torch_dtype=dtype, tie_word_embeddings=False,
              max_position_embeddings=max_position_embeddings,
              eagle_config={"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),
                            "use_aux_hidden_state": True})
    (folder / "config.json").write_text(json.dumps(hf, indent=1, sort_keys=True) + "\n")
    return folder


def draft_weights(cfg: Eagle3Config, checkpoint: Path | None, random_seed: int | None,
                  dtype: str = "float32") -> dict[str, torch.Tensor]:
    """The bundle's draft tensors, whole, in ``dtype`` (the recipe's weights_dtype), from a checkpoint folder or a
    random seed (a random draft is drawn in float32, then stored in ``dtype``: the same draft in either)."""
    if checkpoint is not None:
        return to_bundle(cfg, load_checkpoint(checkpoint), str(checkpoint), dtype)
    return to_bundle(cfg, random_state_dict(cfg, random_seed or 0), f"random draft (seed {random_seed})", dtype)
