"""Smoke run: bind a compiled artifact to the bundle's weights and run one step on zeroed inputs.

The builder runs it for every target before it publishes a bundle, so a bundle never holds
an artifact that cannot load or run (missing constants, a foreign or truncated file, a
crash in the generated code). A failure is a ``load_error`` of that target.

The KV caches are allocated but not zeroed, except block 0 (the null block every pad row
reads), so a pool of many GB costs only the pages the step touches.
"""

from __future__ import annotations

from pathlib import Path

import torch

from neffbuild.compiler.graphs import DRAFT, TargetGraph, example_inputs
from neffbuild.errors import BuildFailed


class LoadFailed(BuildFailed):
    """A compiled artifact failed to load, bind the bundle's weights, or run one step."""


def _inputs(spec: TargetGraph) -> tuple:
    if spec.family == DRAFT:  # the draft's own KV group (one layer): zeroed in full
        return example_inputs(spec)
    args = list(example_inputs(spec, caches=False))
    layout = spec.kv_layout()
    kv = tuple(torch.empty(layout.buffer_shape, dtype=layout.graph_dtype) for _ in range(layout.num_buffers))
    for cache in kv:
        cache[:, 0].zero_()
    args[7] = kv  # the KV caches' place (a sharded graph's rank input follows them)
    return tuple(args)


def smoke_run(backend, artifact: Path, spec: TargetGraph, weights: dict[str, torch.Tensor]) -> None:
    """Raise LoadFailed unless the artifact loads with ``weights`` and returns finite logits of the right shape."""
    try:
        runner = backend.load(Path(artifact), weights)
        with torch.no_grad():
            out = runner(*_inputs(spec))
    except Exception as exc:  # any failure here means the bundle would not serve
        raise LoadFailed(f"{type(exc).__name__}: {exc}".strip()) from exc
    logits = out[0] if isinstance(out, (tuple, list)) else out
    if spec.family == DRAFT:  # k proposed token ids per row
        if logits.shape[0] != spec.batch:
            raise LoadFailed(f"one draft step returned shape {tuple(logits.shape)}, expected {spec.batch} rows")
        return
    want = (spec.batch, spec.query_len, spec.config.vocab_size)
    if tuple(logits.shape) != want:
        raise LoadFailed(f"one step returned logits of shape {tuple(logits.shape)}, expected {want}")
    if not torch.isfinite(logits).all():
        raise LoadFailed("one step on zeroed inputs returned non-finite logits")


CHILD_TIMEOUT_S = 600.0


def fetched_check(job):
    """The check a remote cache entry fetched for ``job`` passes before it is published locally: the smoke run
    in a child process (None where the job's smoke run is skipped: no weights here, or a sharded graph)."""
    if job.weights_path is None or not Path(job.weights_path).is_file() or job.graph.parallel.sharded:
        return None
    return lambda artifact: smoke_in_child(job.backend, artifact, job.graph, job.weights_path)


def smoke_in_child(backend_kwargs: dict, artifact: Path, spec: TargetGraph, weights_path: str,
                   timeout_s: float = CHILD_TIMEOUT_S) -> None:
    """``smoke_run`` in a fresh process: an artifact fetched from elsewhere may crash the process that loads it
    (SIGSEGV in its generated code), so it is run where a crash costs only that process. LoadFailed on a crash,
    a timeout or any failure, naming the signal."""
    import os
    import pickle
    import signal
    import subprocess
    import sys
    import tempfile

    import neffbuild

    with tempfile.TemporaryDirectory(prefix="neffbuild-smoke-") as tmp:
        job = Path(tmp) / "job.pkl"
        job.write_bytes(pickle.dumps((backend_kwargs, str(artifact), spec, weights_path)))
        env = dict(os.environ)  # the child imports this very package, wherever it was imported from
        env["PYTHONPATH"] = os.pathsep.join([str(Path(neffbuild.__file__).resolve().parents[1]),
                                             *filter(None, [env.get("PYTHONPATH")])])
        try:
            res = subprocess.run([sys.executable, "-m", "neffbuild.compiler.smoke", str(job)], env=env,
                                 capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise LoadFailed(f"the smoke run did not finish within {timeout_s:.0f} s") from None
        why = job.with_suffix(".err")
        message = why.read_text(errors="replace")[:400] if why.is_file() else None
    if res.returncode < 0:
        name = signal.Signals(-res.returncode).name if -res.returncode in signal.valid_signals() else "?"
        raise LoadFailed(f"the smoke run died of signal {-res.returncode} ({name})")
    if res.returncode != 0:
        tail = message or (res.stderr.strip().splitlines() or ["no message"])[-1][:400]
        raise LoadFailed(f"the smoke run failed: {tail}")


def _child(job_file: str) -> int:
    import pickle
    import sys

    from neffbuild.compiler.backends import get_backend
    from neffbuild.runtime import weights_file

    backend_kwargs, artifact, spec, weights_path = pickle.loads(Path(job_file).read_bytes())
    try:
        smoke_run(get_backend(**backend_kwargs), Path(artifact), spec, weights_file.load(Path(weights_path)))
    except LoadFailed as exc:  # its first line (a C++ error's stack trace follows it) for the parent's message
        Path(job_file).with_suffix(".err").write_text((str(exc).strip().splitlines() or ["?"])[0])
        print(str(exc), file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_child(sys.argv[1]))
