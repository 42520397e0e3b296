"""Run in the vLLM venv: each ``additional_config`` through vLLM's own configuration builder, no engine started.

    python config_sections.py CHECKPOINT ARCHITECTURE SECTIONS_JSON

``EngineArgs(...).create_engine_config()`` is where ``vllm serve`` builds its configuration (and runs the plugin's
hooks, neffbuild/vllm/startup.py and neffbuild/vllm/__init__.py). ARCHITECTURE overrides the checkpoint's
``architectures`` (``-`` keeps it), so a non-GPT-OSS model is the same small checkpoint under another name.
Prints one JSON line: per section, ``"ok"`` or the raised error's class and message.
"""

import json
import sys

from vllm.engine.arg_utils import EngineArgs


def build(checkpoint: str, architecture: str, additional: dict) -> str:
    overrides = {} if architecture == "-" else {"architectures": [architecture]}
    args = EngineArgs(model=checkpoint, dtype="float32", max_model_len=512, block_size=32,
                      num_gpu_blocks_override=128, max_num_seqs=4, enforce_eager=True, skip_tokenizer_init=True,
                      hf_overrides=overrides, additional_config=additional)
    try:
        args.create_engine_config()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "ok"


if __name__ == "__main__":
    checkpoint, architecture, sections = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    print(json.dumps([build(checkpoint, architecture, s) for s in sections]))
