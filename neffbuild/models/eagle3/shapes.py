"""Shapes and stored bytes of the EAGLE3 draft's tensors: plain arithmetic, no torch.

The bundle stores the draft's tensors (``draft_*``) beside the target's in the shared
weights file, every rank maps them (the draft is not sharded): float32, except the vocabulary
map ``draft_d2t`` (int64), plus the draft's own ``draft_embed [V, H]`` when its checkpoint
brings one (read from the safetensors headers only: 8-byte length, then JSON).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from neffbuild.errors import InvalidInput
from neffbuild.models.eagle3.config import Eagle3Config

EMBED = "embed_tokens.weight"
ITEMSIZE = {"draft_d2t": 8}  # int64; every other draft tensor is float32
FLOAT_ITEMSIZE = 4


def shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Bundle-name shapes of the draft's tensors (without the optional own embedding)."""
    H, d, I, Vd = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.draft_vocab_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    return {
        "draft_fc": (H, 3 * H), "draft_ln_embed": (H,), "draft_ln_hidden": (H,), "draft_qkv_w": (qkv, 2 * H),
        "draft_o_w": (H, cfg.num_attention_heads * d), "draft_ln_mlp": (H,), "draft_gate_w": (I, H),
        "draft_up_w": (I, H), "draft_down_w": (H, I), "draft_norm": (H,), "draft_lm_head": (Vd, H), "draft_d2t": (Vd,),
    }


def weight_bytes(cfg: Eagle3Config, own_embed: bool = False) -> int:
    """Bytes of the draft's tensors as the bundle stores them (on every rank)."""
    total = sum(math.prod(s) * ITEMSIZE.get(n, FLOAT_ITEMSIZE) for n, s in shapes(cfg).items())
    return total + (cfg.vocab_size * cfg.hidden_size * FLOAT_ITEMSIZE if own_embed else 0)


def has_own_embed(checkpoint: str | Path) -> bool:
    """Whether a draft checkpoint brings its own token embedding (read from the headers only)."""
    folder = Path(checkpoint)
    for f in sorted(folder.glob("*.safetensors")) if folder.is_dir() else [folder]:
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(min(n, 100 << 20)))
        except (OSError, struct.error, ValueError) as exc:
            raise InvalidInput(f"speculative.draft.checkpoint {f}: unreadable safetensors header ({exc})") from None
        if isinstance(header, dict) and any(k.removeprefix("model.") == EMBED for k in header):
            return True
    return False
