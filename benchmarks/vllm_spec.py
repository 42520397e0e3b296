"""EAGLE3 inside vLLM (issue 50, item 5): vLLM native EAGLE3 against vLLM + bundle with EAGLE3 and without.

    .venv/bin/python benchmarks/vllm_spec.py [--workdir DIR] [--rounds 2] [--new 160]

One target checkpoint and one draft (tests/test_vllm_spec.py's: a 2-layer GPT-OSS of the test width whose greedy
output alternates between token pairs, and an EAGLE3 draft that proposes the token two back, so drafts are
sometimes right), one EAGLE3 bundle (k = 3, batch buckets 1 and 4, context buckets 128 and the 512 fallback).
Engines, one ``vllm.LLM`` process each per round, rounds interleaved:

  native      vLLM alone (no plugin) on the checkpoint, with the bundle's draft/ folder as its EAGLE3 draft
  plugin      vLLM + bundle with the --speculative-config ``neffbuild inspect --vllm-config`` prints
  plugin-off  vLLM + the same bundle without speculation (its target_nospec graphs)

Batch 1 (one request) and batch 4 (four at once), ``--new`` tokens each, greedy; a warm-up of the same shapes
first. Decode tokens/s = generated tokens / the generate call's seconds (prompts of 40-90 tokens: the prefill is
in the time). Acceptance rate = accepted / drafted tokens (vLLM's spec-decode counters). The tokens of every
engine must agree (greedy speculation is lossless): the script stops otherwise. Prints a markdown table with the
machine, its ISA and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._common import machine  # noqa: E402
from neffbuild.runtime.bundle.cpu_features import host_features, isa_features  # noqa: E402

SCRIPT = ROOT / "tests" / "vllm_scripts" / "spec_generate.py"  # the EAGLE3 tests' vllm.LLM driver, --warmup
ENGINES = ("native", "plugin", "plugin-off")


def build(work: Path) -> tuple[Path, Path]:
    """The checkpoint, draft and EAGLE3 bundle (compiled through NEFFBUILD_CACHE_DIR); returns (checkpoint,
    settings file)."""

    from neffbuild import recipe as recipe_mod
    from neffbuild.compiler.builder import compile_recipe
    from tests.test_vllm_spec import save_alternating_checkpoint
    from tests.vllm_helpers import MAX_MODEL_LEN, eagle3_recipe, save_draft

    ckpt = work / "ckpt"
    if not (ckpt / "config.json").is_file():
        save_alternating_checkpoint(ckpt)
    if not (work / "draft" / "config.json").is_file():
        save_draft(work / "draft", ckpt, copying=True)
    recipe = eagle3_recipe(work, ckpt, work / "draft", name="gpt-oss-vllm-eagle3-bench", num_seqs_buckets=(1, 4),
                           max_model_len=MAX_MODEL_LEN)
    res = compile_recipe(recipe_mod.load(recipe), work / "out",
                         cache_root=Path(os.environ.get("NEFFBUILD_CACHE_DIR") or work / "cache"))
    if res.failed:
        raise SystemExit(f"compile failed: {res.failed}")
    settings = work / "settings.json"
    settings.write_text(subprocess.run([sys.executable, "-m", "neffbuild.cli.main", "inspect", str(res.bundle),
                                        "--vllm-config", "--json"], capture_output=True, text=True, check=True,
                                       env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout)
    return ckpt, settings


def request_files(work: Path, new: int) -> list[Path]:
    rng = random.Random(7)
    out = []
    for batch in (1, 4):
        reqs = [{"prompt": [rng.randrange(512) for _ in range(rng.randrange(40, 90))], "max_tokens": new}
                for _ in range(batch)]
        path = work / f"b{batch}.json"
        path.write_text(json.dumps(reqs))
        out.append(path)
    return out


def run(engine: str, ckpt: Path, settings: Path, files: list[Path]) -> dict:
    from tests.vllm_helpers import python_json, run_vllm_script

    extra = {"native": ["--native", str(ckpt)], "plugin": [], "plugin-off": ["--no-spec"]}[engine]
    out = run_vllm_script(SCRIPT, ["--settings", str(settings), "--requests", *map(str, files), "--warmup", *extra],
                          timeout=1200, OMP_NUM_THREADS="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    if out.returncode:
        raise SystemExit(f"{engine} failed:\n{out.stderr[-3000:]}")
    return python_json(out.stdout)


def table(results: dict, rounds: int) -> str:
    lines = ["| engine | batch 1 tok/s | batch 4 tok/s | acceptance b1 | acceptance b4 |", "|---|---|---|---|---|"]
    for engine in ENGINES:
        cells = []
        for i in (0, 1):
            rates = [sum(map(len, r["runs"][i]["tokens"])) / r["runs"][i]["seconds"] for r in results[engine]]
            cells.append(" / ".join(f"{x:.1f}" for x in rates))
        for i in (0, 1):
            run = results[engine][0]["runs"][i]
            drafted, accepted = (run["spec"].get(k, 0) - run["spec_before"].get(k, 0)
                                 for k in ("num_draft_tokens", "num_accepted_tokens"))
            cells.append(f"{accepted / drafted:.3f}" if drafted else "-")
        lines.append(f"| {engine} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\n(tok/s: round 1 / round 2 ... of {rounds}; acceptance: round 1)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/neffbuild-vllm-spec"))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--new", type=int, default=160, help="new tokens per request (max_model_len 512)")
    a = p.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    ckpt, settings = build(a.workdir)
    files = request_files(a.workdir, a.new)
    results: dict[str, list] = {e: [] for e in ENGINES}
    loads = []
    for r in range(a.rounds):
        for engine in ENGINES:
            print(f"round {r + 1}: {engine}", file=sys.stderr, flush=True)
            results[engine].append(run(engine, ckpt, settings, files))
            loads.append(os.getloadavg()[0])
    reference = results["plugin-off"][0]["runs"]
    for engine, runs in results.items():
        for doc in runs:
            if [x["tokens"] for x in doc["runs"]] != [x["tokens"] for x in reference]:
                raise SystemExit(f"{engine}: tokens differ from the bundle without speculation")
    print(f"Machine: {machine()}; ISA: {' '.join(isa_features(host_features()))}")
    print(f"Load average (1 min) after each run: {', '.join(f'{x:.2f}' for x in loads)}; median "
          f"{statistics.median(loads):.2f}")
    print("Tokens: every engine's equal the bundle's without speculation (both batches, every round).\n")
    print(table(results, a.rounds))


if __name__ == "__main__":
    main()
