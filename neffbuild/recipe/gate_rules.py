"""Validate is the gate: a recipe that validates plans and compiles without a traceback.

Rules that were only found later, in ``plan`` or ``compile``, and now fail validation, naming
the field: packed FP8 K needs an even ``block_size`` (tokens are packed in pairs); RoPE needs
an even ``head_dim`` (target and draft); the EAGLE3 draft config's keys have the types the
draft reads; every ``*.safetensors`` of a checkpoint folder has a header the safetensors
library accepts; the compile grid has at most ``MAX_TARGETS`` targets (a bound on plan's
output and on compile's work). YAML 1.1 sexagesimal (``4:16``) and leading-zero octal
(``0400``) integers are refused by the loader (``construct_int``), not read as 256.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from neffbuild import registry
from neffbuild.errors import NO_VALUE, InvalidInput

MAX_TARGETS = 4096  # graphs one recipe may ask for (the production grid is under 100)
_YAML11_INT = re.compile(r"[-+]?(0[0-7_]+|[0-9][0-9_]*(:[0-5]?[0-9])+)")


def construct_int(loader, node):
    """YAML ints as YAML 1.2 reads them: ``4:16`` and ``0400`` are refused instead of read as 256."""
    text = loader.construct_scalar(node)
    if _YAML11_INT.fullmatch(str(text)):
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is a YAML 1.1 sexagesimal or octal integer (it would read as "
            f"{yaml.SafeLoader.construct_yaml_int(loader, node)}); write the decimal value, or quote it for a string",
            node.start_mark)
    return yaml.SafeLoader.construct_yaml_int(loader, node)


def check(v, cfg, serving: dict, fp8: bool, spec, model, num_seqs, ctx) -> None:
    """Every rule above (``v.err(path, value, message)``); each runs only on values that are themselves valid."""
    bs = serving.get("block_size")
    if fp8 and isinstance(bs, int) and bs % 2:
        v.err("serving.block_size", bs, "must be even with neuron_config.fp8_packed_kv (packed K holds token pairs)")
    if cfg is not None and cfg.head_dim % 2:
        v.err("model.config.head_dim", cfg.head_dim, "must be even (rotary embeddings rotate pairs of dimensions)")
    if model is not None and model.checkpoint is not None:
        checkpoint_headers(v, model.checkpoint, "model.checkpoint")
    if spec is not None:
        if spec.draft_checkpoint is not None:
            checkpoint_headers(v, spec.draft_checkpoint, "speculative.draft.checkpoint")
        if cfg is not None:
            draft_config(v, spec.draft_hf_config, cfg, spec.method)
    if num_seqs and ctx is not None:
        n = len(num_seqs) * (len(ctx) + 1) * (3 if spec is not None else 1)
        if n > MAX_TARGETS:
            v.err("neuron_config", NO_VALUE, f"the grid has {n} targets (num_seqs_buckets x (context buckets + 1)"
                  f"{' x 3 families' if spec is not None else ''}); the limit is {MAX_TARGETS}")


def checkpoint_headers(v, folder: Path, path: str) -> None:
    """Each *.safetensors header as the runtime checks it, then as the safetensors library reads it."""
    import importlib.util

    from safetensors import SafetensorError, safe_open

    from neffbuild.errors import BundleError
    from neffbuild.runtime.bundle.weights_file import read_header

    # The library checks a header the same way for every framework; numpy's import costs ~0.1 s, torch's ~3 s
    # (`validate` reads no tensor).
    framework = "numpy" if importlib.util.find_spec("numpy") else "pt"
    for f in sorted(folder.glob("*.safetensors"))[:256]:
        try:
            read_header(f)
            with safe_open(str(f), framework=framework) as handle:
                handle.keys()
        except BundleError as exc:
            v.err(path, str(f), f"holds an unreadable safetensors file: {str(exc).removeprefix(str(f) + ': ')}")
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            v.err(path, str(f), f"holds a safetensors file the library refuses: {str(exc)[:160]}")


_DRAFT_TYPES = {"eagle_config": dict, "rope_parameters": dict, "rope_scaling": dict, "aux_layers": list}


def draft_config(v, hf: dict, cfg, method: str) -> None:
    """The EAGLE3 draft config as the draft reads it: key types, even head_dim, the draft's own checks."""
    where = "speculative.draft.config"
    bad = False
    for key, typ in _DRAFT_TYPES.items():
        if hf.get(key) is not None and not isinstance(hf[key], typ):
            v.err(f"{where}.{key}", hf[key], f"must be a {'mapping' if typ is dict else 'list'}")
            bad = True
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") if not bad else None
    if ids is not None and (not isinstance(ids, list) or not all(type(i) is int for i in ids)):
        v.err(f"{where}.eagle_config.eagle_aux_hidden_state_layer_ids", ids, "must be a list of layer indices")
        bad = True
    if bad:
        return
    try:
        draft = registry.speculative(method).get("config").from_hf_dict(hf, cfg)
    except InvalidInput as exc:
        v.err(where, NO_VALUE, str(exc).removeprefix(where + "."))
        return
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        v.err(where, NO_VALUE, f"cannot be read as an EAGLE3 draft config ({str(exc)[:120]})")
        return
    if draft.head_dim % 2:
        v.err(f"{where}.head_dim", draft.head_dim, "must be even (rotary embeddings rotate pairs of dimensions)")
