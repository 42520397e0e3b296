"""A GPT-OSS checkpoint in the layout of openai's MXFP4 release, as transformers reads and writes one.

``config.json`` carries ``quantization_config`` (``quant_method: mxfp4``, the modules left in
bfloat16) and ``dtype: bfloat16``; every expert weight is two tensors, ``*_blocks`` [E, out, in/32, 16]
uint8 (two E2M1 nibbles a byte, the earlier value in the low nibble) and ``*_scales`` [E, out, in/32]
uint8 (E8M0); everything else is bfloat16. The weights are the project's seeded random ones, the
experts rounded to the nearest FP4 code (``weights.quant_mxfp4``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from neffbuild.models.gpt_oss import weights as W

KEEP_BF16 = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def write_mxfp4_checkpoint(folder: Path, cfg, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in W.random_state_dict(cfg, seed).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = W.quant_mxfp4(t.transpose(1, 2))  # transformers' [E, in, out] -> stored [E, out, in]
            tensors[name + W.MXFP4_BLOCKS], tensors[name + W.MXFP4_SCALES] = blocks, scales
        else:
            tensors[name] = t.to(torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = dict(cfg.to_hf_dict(), architectures=["GptOssForCausalLM"], dtype="bfloat16",
                  quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": KEEP_BF16})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder
