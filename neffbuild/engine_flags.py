"""A serving engine's command-line flags from a mapping of its engine arguments (``neffbuild inspect
--vllm-config --json``'s ``engine_args``): one rule for the printed ``vllm serve`` line, the DI launcher, the tests
and the benchmarks. Base module: standard library only."""

from __future__ import annotations

import json


def argv(engine_args: dict) -> list[str]:
    """``{"max_model_len": 1024, "enforce_eager": True, "speculative_config": {...}}`` ->
    ``["--max-model-len", "1024", "--enforce-eager", "--speculative-config", "{...}"]``: ``True`` a bare flag, a
    mapping as JSON (what vLLM's parser reads for its config flags), anything else as text."""
    out: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [flag, json.dumps(value, sort_keys=True) if isinstance(value, dict)
                                             else str(value)]
    return out
