"""The step API's input checks (runtime/step_checks.py) vs the tiny bundle's smallest decode step.

    .venv/bin/python benchmarks/step_checks.py BUNDLE

Side by side in one process, one torch thread: ``step_problem`` alone for one request (the
``decode_b1_ctx128`` step) and for four requests at mixed positions (``decode_b4``), and
``Stepper.step`` for the same one-request batch (plan + checks + metadata + artifact).
"""

from __future__ import annotations

import json
import sys

import torch
from _common import machine, median_us

from neffbuild.runtime import StepBatch, Stepper, step_checks
from neffbuild.runtime.bundle import open_bundle


def main(path: str) -> dict:
    step = Stepper(open_bundle(path))
    lay, mml = step.artifacts.kv_layout, step.spec.max_model_len
    one = StepBatch([[5]], [20], {"full": torch.arange(1, 3)[None], "sliding": torch.arange(9, 11)[None]})
    four = StepBatch([[5], [6], [7], [8]], [20, 100, 300, 7],
                     {"full": torch.arange(1, 129).reshape(4, 32), "sliding": torch.arange(200, 328).reshape(4, 32)})

    def check(batch):
        return lambda: step_checks.step_problem(batch, k=0, vocab=step.vocab_size, layout=lay, max_model_len=mml)

    assert check(one)() is None and check(four)() is None
    out = {"check_b1_us": median_us(check(one), repeat=2000, warmup=100),
           "check_b4_mixed_us": median_us(check(four), repeat=2000, warmup=100),
           "step_b1_us": median_us(lambda: step.step(one), repeat=300, warmup=20),
           "step_label": step.plan(one).label}
    out["check_of_step_pct"] = round(100 * out["check_b1_us"] / out["step_b1_us"], 2)
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps({"machine": machine(), **main(sys.argv[1])}, indent=1))
