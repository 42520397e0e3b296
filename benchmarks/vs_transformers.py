"""Decode tokens/s of a bundle against transformers' own ``GptOssForCausalLM.generate``, same checkpoint.

    nice -n -5 .venv/bin/python benchmarks/vs_transformers.py [--workdir DIR] [--repeat 3]

The shape (issue 24): 8 layers, hidden 256, 8 experts top 2; batch 4, 400-token prompts,
200 new tokens, greedy, fp32, one thread. One random checkpoint saved by transformers
(safetensors) is compiled into a bundle (batch bucket 4, context buckets 512 and 768,
fallback 1024) and loaded back into transformers' eager model.

Decode only: each side runs the 200-token generation and a 1-token generation (prefill plus
the first token) of the same prompts; decode seconds = the difference, for 4 x 199 tokens.
The bundle runs through the serving engine (local prefill, continuous batching: all four
requests arrive at step 0). Runs interleave (bundle, transformers, bundle, ...); medians.
The tokens must be identical (the script exits 1 if not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import machine  # noqa: E402

BATCH, PROMPT, NEW = 4, 400, 200
CONFIG = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 8,
          "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "num_local_experts": 8,
          "num_experts_per_tok": 2, "sliding_window": 128, "max_position_embeddings": 1024}


def checkpoint(folder: Path) -> Path:
    import transformers

    from neffbuild.models.gpt_oss.config import GptOssConfig
    from neffbuild.models.gpt_oss.weights import random_state_dict

    cfg = GptOssConfig.from_hf_dict(CONFIG)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**cfg.to_hf_dict()))
    model.load_state_dict(random_state_dict(cfg, seed=0), strict=True)
    model.save_pretrained(folder)
    return folder


def recipe_file(ckpt: Path, work: Path) -> Path:
    raw = {"name": "vs-transformers", "version": "0.1.0", "model": {"arch": "gpt_oss", "checkpoint": str(ckpt)},
           "serving": {"max_model_len": 1024, "max_num_seqs": BATCH, "block_size": 16, "num_blocks": 401},
           "neuron_config": {"num_seqs_buckets": [BATCH], "decode_context_length_buckets": [512, 768],
                             "gk_decode": True, "fp8_packed_kv": False},
           "parallel": {"tp": 1, "dp": 1, "ep": 1}, "compiler": {"backend": "inductor"}, "build": {"jobs": 2}}
    path = work / "vs-transformers.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def build(ckpt: Path, work: Path, cache: Path) -> Path:
    from neffbuild import recipe
    from neffbuild.compiler.builder import compile_recipe

    path = recipe_file(ckpt, work)
    res = compile_recipe(recipe.load(path), work / "out", jobs=2, cache_root=cache)
    if res.failed:
        raise SystemExit(f"build failed: {res.failed}")
    return res.bundle


def prompts() -> list[list[int]]:
    return [[(7 * i + 31 * r + 3) % (CONFIG["vocab_size"] - 1) + 1 for i in range(PROMPT)] for r in range(BATCH)]


def bundle_run(session, new: int) -> tuple[float, list[list[int]]]:
    from neffbuild.serve.engine import Engine
    from neffbuild.serve.parts import LocalPrefill, Request

    reqs = [Request(str(r), p, new, 0, index=r) for r, p in enumerate(prompts())]
    engine = Engine(session.stepper, session.block_manager(), LocalPrefill(session.prefill, session.stepper.kv_caches))
    t0 = time.perf_counter()
    engine.run(reqs)
    return time.perf_counter() - t0, [r.tokens for r in sorted(reqs, key=lambda r: r.index)]


def hf_run(model, new: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts())
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
        secs = time.perf_counter() - t0
    return secs, out[:, PROMPT:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, help="checkpoint, bundle, cache and JSON (default: a new temp dir)")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds (medians over them)")
    ap.add_argument("--cache-dir", type=Path, help="compile cache (default: WORKDIR/cache)")
    args = ap.parse_args()
    import transformers

    from neffbuild.runtime.bundle.reader import open_bundle
    from neffbuild.serve.rank import open_rank

    work = args.workdir or Path(tempfile.mkdtemp(prefix="neffbuild-vs-hf-"))
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    ckpt = checkpoint(work / "checkpoint")
    bundle = build(ckpt, work, args.cache_dir or work / "cache")
    session = open_rank(open_bundle(bundle, preload=True))
    model = transformers.GptOssForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # a fixed 200 tokens on both sides
    runs = {"bundle": bundle_run, "transformers": lambda m, n: hf_run(m, n)}
    handles = {"bundle": session, "transformers": model}
    decode = {k: [] for k in runs}
    tokens = {}
    for rnd in range(args.repeat + 1):  # round 0 warms both sides up
        for name, fn in runs.items():
            full, toks = fn(handles[name], NEW)
            first, _ = fn(handles[name], 1)
            tokens[name] = toks
            if rnd:
                decode[name].append(full - first)
    same = tokens["bundle"] == tokens["transformers"]
    first_diff = next(([r, i] for r, (a, b) in enumerate(zip(tokens["bundle"], tokens["transformers"], strict=True))
                       for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
    n = BATCH * (NEW - 1)
    tps = {k: n / statistics.median(v) for k, v in decode.items()}
    doc = {"machine": machine(), "config": CONFIG, "batch": BATCH, "prompt": PROMPT, "new_tokens": NEW,
           "decode_seconds": decode, "tokens_per_second": {k: round(v, 1) for k, v in tps.items()},
           "speedup": round(tps["bundle"] / tps["transformers"], 3), "tokens_identical": same,
           "first_difference": first_diff}  # [request, new-token index] where the two first disagree
    (work / "vs_transformers.json").write_text(json.dumps(doc, indent=1))
    print(f"machine: {doc['machine']}")
    print(f"decode tokens/s, batch {BATCH}, {PROMPT}-token prompts, {NEW} new, greedy (medians of {args.repeat}):")
    print(f"  bundle {tps['bundle']:.1f}  transformers {tps['transformers']:.1f}  ->  x{doc['speedup']}  "
          f"(goal x2: {'PASS' if doc['speedup'] >= 2 else 'FAIL'}); tokens identical: {same}"
          + ("" if same else f" (first difference: request {first_diff[0]}, new token {first_diff[1]})"))
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
