"""The step API's input checks (runtime/step/checks.py) vs the tiny bundle's decode steps.

    .venv/bin/python benchmarks/step_checks.py BUNDLE [--rounds 30]

Side by side in one process, one torch thread, interleaved: each round times ``step_ok`` (the
check the Stepper runs before the DP collective; ``step_problem`` only where it says no) and
its rule-by-rule reference (``_step_reference``, the path every malformed or unusual step takes) for one request (the
``decode_b1_ctx128`` step) and for four requests at mixed positions (``decode_b4``), then
``Stepper.step`` for the same two batches (plan + check + metadata + artifact). Medians over
every round's samples, so a load that comes and goes weighs on check and step alike (a check
sample times 10 calls in a row, so the timer's own ~0.2 us is not counted as check; those calls
run warm). ``check_after_step_*``: one check timed right after a ``Stepper.step``, as a serving
loop calls it, with the caches the artifact left cold (what the CPU backend pays; a device's
artifact does not evict the host's caches). The load
average is reported: above 0.5 the host was loaded and only the ratios count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from _common import machine

from neffbuild.bench.overhead import timed_seconds
from neffbuild.runtime import StepBatch, Stepper
from neffbuild.runtime.bundle.reader import open_bundle
from neffbuild.runtime.kv.tables import TableBuffer
from neffbuild.runtime.step import checks as step_checks


def main(path: str, rounds: int) -> dict:
    step = Stepper(open_bundle(path))
    lay, mml = step.artifacts.kv_layout, step.grid.max_model_len
    one = StepBatch([[5]], [20], {"full": torch.arange(1, 3)[None], "sliding": torch.arange(9, 11)[None]})
    four = StepBatch([[5], [6], [7], [8]], [20, 100, 300, 7],
                     {"full": torch.arange(1, 129).reshape(4, 32), "sliding": torch.arange(200, 328).reshape(4, 32)})
    one_rows, four_rows = (StepBatch(b.tokens, b.num_computed, _buffer_view(b.block_tables)) for b in (one, four))
    kw = {"k": 0, "vocab": step.vocab_size, "layout": lay, "max_model_len": mml}
    vocab = step.vocab_size

    def check(b):  # called as Stepper.plan calls it
        return lambda: None if step_checks.step_ok(b.tokens, b.num_computed, b.block_tables, 0, vocab, lay.block_size,
                                                   lay.num_blocks, mml) else step_checks.step_problem(
            b, k=0, vocab=vocab, layout=lay, max_model_len=mml)

    def reference(b):
        return lambda: step_checks._step_reference(b.tokens, b.num_computed, b.block_tables, **kw)

    def ten(fn):  # one sample = 10 calls (per-call time = sample / 10)
        def run():
            for _ in range(10):
                fn()
        return run

    for b in (one, four, one_rows, four_rows):  # all well-formed, and the fast path is the one timed
        assert check(b)() is None and reference(b)() is None
        assert step_checks.step_ok(b.tokens, b.num_computed, b.block_tables, 0, step.vocab_size,
                                    lay.block_size, lay.num_blocks, mml)
    fns = {"check_b1_us": (ten(check(one)), 20, 10), "reference_b1_us": (ten(reference(one)), 20, 10),
           "check_b4_mixed_us": (ten(check(four)), 20, 10), "reference_b4_mixed_us": (ten(reference(four)), 20, 10),
           "step_b1_us": (lambda: step.step(one), 10, 1), "step_b4_us": (lambda: step.step(four), 10, 1)}
    fns |= {"check_rows_b1_us": (ten(check(one_rows)), 20, 10),
            "check_rows_b4_mixed_us": (ten(check(four_rows)), 20, 10)}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    after = {"check_after_step_b1_us": one, "check_after_step_b4_mixed_us": four,
             "check_rows_after_step_b1_us": one_rows, "check_rows_after_step_b4_mixed_us": four_rows}
    samples |= {name: [] for name in after}
    samples |= {name.replace("check_rows", "argmax"): [] for name in after if "rows" in name}
    paired: dict[str, list[float]] = {"b1": [], "b4_mixed": []}
    load = [os.getloadavg()[0]]
    for _ in range(rounds):
        for name, (fn, n, calls) in fns.items():
            samples[name] += [t / calls for t in timed_seconds(fn, n, warmup=1)]
        for name, b in after.items():
            fn = check(b)
            for _ in range(10):  # one check right after a step, as in a serving loop: the artifact
                out = step.step(b)  # has just run, so the interpreter's caches are cold
                if "rows" in name:  # the engine's update: the argmax alone
                    a0 = time.perf_counter()
                    out.logits.argmax(-1).tolist()
                    samples[name.replace("check_rows", "argmax")].append(time.perf_counter() - a0)
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
        for name, b in (("b1", one_rows), ("b4_mixed", four_rows)):
            paired[name] += _paired_step_cost(step, b, 40)
    load.append(os.getloadavg()[0])
    out = {name: round(statistics.median(s) * 1e6, 2) for name, s in samples.items()}
    for name, diffs in paired.items():  # the step with its check minus the same step without it, pair by pair
        out[f"check_in_step_{name}_us"] = round(statistics.median(diffs) * 1e6, 2)
        out[f"check_in_step_of_step_{name}_pct"] = round(
            100 * out[f"check_in_step_{name}_us"] / out["step_b1_us" if name.endswith("b1") else "step_b4_us"], 2)
    out |= {"step_b1_label": step.plan(one).label, "step_b4_label": step.plan(four).label,
            "check_of_step_b1_pct": round(100 * out["check_b1_us"] / out["step_b1_us"], 2),
            "check_of_step_b4_pct": round(100 * out["check_b4_mixed_us"] / out["step_b4_us"], 2),
            "reference_of_step_b1_pct": round(100 * out["reference_b1_us"] / out["step_b1_us"], 2),
            "check_after_step_of_step_b1_pct": round(100 * out["check_after_step_b1_us"] / out["step_b1_us"], 2),
            "check_after_step_of_step_b4_pct": round(100 * out["check_after_step_b4_mixed_us"] / out["step_b4_us"], 2),
            "check_rows_after_step_of_step_b1_pct": round(
                100 * out["check_rows_after_step_b1_us"] / out["step_b1_us"], 2),
            "check_rows_after_step_of_step_b4_pct": round(
                100 * out["check_rows_after_step_b4_mixed_us"] / out["step_b4_us"], 2),
            "load_average_1min": [round(x, 2) for x in load],
            "host": "loaded" if max(load) > 0.5 else "idle"}
    return out


def _paired_step_cost(step: Stepper, batch: StepBatch, pairs: int) -> list[float]:
    """Per pair, ``Stepper.step`` with its input check minus the same step with the check skipped (in ABBA
    order, so drift cancels): what the check adds to a step, the caches it warms for the code after it
    included."""
    real, skip = step_checks.step_ok, (lambda *a: True)
    diffs = []
    try:
        for i in range(pairs):
            took = {}
            for checked in ((True, False) if i % 2 == 0 else (False, True)):
                step_checks.step_ok = real if checked else skip
                t0 = time.perf_counter()
                step.step(batch)
                took[checked] = time.perf_counter() - t0
            diffs.append(took[True] - took[False])
    finally:
        step_checks.step_ok = real
    return diffs


def _buffer_view(tables: dict):
    """The same tables as the engine hands them: a TableBuffer view, each row checked when it was written."""
    groups = list(tables)
    R, W = tables[groups[0]].shape
    buf = TableBuffer(groups, R, W)
    for gi, g in enumerate(groups):
        for r, row in enumerate(tables[g].tolist()):
            buf.write(gi, r, row)
    return buf.view(R, W)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", help="a bundle of the tiny model (e.g. the test bundle gpt-oss-test)")
    ap.add_argument("--rounds", type=int, default=30, help="interleaved rounds (default 30)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(json.dumps({"machine": machine(), **main(args.bundle, args.rounds)}, indent=1))
