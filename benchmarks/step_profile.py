"""Where a decode step's time goes, op by op, in a bundle's own engine (``neffbuild generate``), one thread.

    .venv/bin/python benchmarks/step_profile.py BUNDLE [--batch 1] [--prompt-len 400] [--new 30] [--top 12]

Runs ``generate`` on ``--batch`` requests (prompts of ``--prompt-len`` tokens, each its own) three times in this
process (a warm-up, then ``--new`` and 2 x ``--new`` new tokens under torch's profiler) and prints, per op, the CPU
time of the extra ``--new`` decode steps divided by their number: what one step costs, with prefill, the first call
of every kernel (the int8 forms quantize their weights then) and the engine's set-up subtracted out. The native ops
(``neffbuild::q8_head``, ``neffbuild::mxfp4_q8_dot``, ...) show by name, as the compiled graph calls them through
torch's dispatcher. At batch > 1 the requests' prefills interleave with the first decode steps (continuous
batching), so the difference of two runs is noisier there: take batch 1's split as the one to read.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run(bundle: str, batch: int, prompt_len: int, new: int) -> tuple[float, dict[str, float]]:
    """(wall seconds, {op: self CPU seconds}) of one ``generate`` under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    from neffbuild.cli import main as cli_main

    prompts = [",".join(str((i * 37 + 101 * r) % 5000 + 10) for i in range(prompt_len)) for r in range(batch)]
    args = ["generate", bundle, *[a for p in prompts for a in ("--prompt-ids", p)], "--max-new-tokens", str(new),
            "--json"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            cli_main.cli.main(args, standalone_mode=False)  # its JSON document is not this table's
        wall = time.perf_counter() - start
    return wall, {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--batch", type=int, default=1, help="requests decoded together (a batch bucket must hold them)")
    ap.add_argument("--prompt-len", type=int, default=400)
    ap.add_argument("--new", type=int, default=30, help="decode steps measured (the difference of two runs)")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    if args.new < 2:
        ap.error("--new must be at least 2")
    torch.set_num_threads(1)
    from neffbuild.cli import main as cli_main

    cli_main._register()
    run(args.bundle, args.batch, args.prompt_len, 2)  # warm: the kernels built and the int8 forms' weights quantized
    (w1, ops1), (w2, ops2) = (run(args.bundle, args.batch, args.prompt_len, n) for n in (args.new, 2 * args.new))
    step = (w2 - w1) / args.new
    per = sorted(((ops2.get(k, 0.0) - ops1.get(k, 0.0)) / args.new, k) for k in ops2)[::-1]
    print(f"{args.bundle}, batch {args.batch}: {step * 1e3:.1f} ms a decode step ({args.batch / step:.2f} tokens/s),"
          " one thread")
    print("| op | ms a step | of the step |\n|---|---|---|")
    for ms, name in per[:args.top]:
        print(f"| {name} | {ms * 1e3:.2f} | {ms / step:.0%} |")
    rest = step - sum(ms for ms, _ in per[:args.top])
    print(f"| the rest | {rest * 1e3:.2f} | {rest / step:.0%} |")


if __name__ == "__main__":
    main()
