"""The smoke run of an artifact fetched from elsewhere, in a child process: a crash costs the child only.

An entry from a shared remote cache may hold native code that kills the process loading it (SIGSEGV in its
generated code). So it is loaded and run (compiler/smoke.py's ``smoke_run``) in a child, before anything is
published locally. The child is long-lived, one per process that fetches (the driver, each worker): it pays
torch's import once, then each check costs the load and one step. Requests and answers travel as
length-prefixed pickles over the child's original stdout (its fds 1 and 2 go to the null device, so what the
loader prints cannot corrupt them). A child that dies (a signal, an exit) answers that check with LoadFailed
naming the signal and is started afresh for the next one; one that does not answer within the timeout is
killed the same way (SmokeTimedOut: the remote cache then fetches nothing more in that build).

The timeout of a fetched entry's check is scaled to one load and one step, not a fixed 10 minutes: a few
times the time to read the artifact and the weights at a slow disk's pace, at least the floor
``NEFFBUILD_REMOTE_SMOKE_TIMEOUT_S`` (30 s by default). Code that loops is found in seconds for a small
model, and a line on stderr says what is being waited for.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

from neffbuild.compiler.smoke import LoadFailed

CHILD_TIMEOUT_S = 600.0
READ_BYTES_PER_S = 250e6  # a slow disk: loading the artifact and binding the weights reads each byte once
TIMEOUT_FACTOR = 4.0  # what one load and one step may take against that estimate
_LEN = struct.Struct("<Q")


class SmokeTimedOut(LoadFailed):
    """A smoke run that did not answer within its timeout (killed): code that loops, or a machine far too slow."""


class _Child:
    def __init__(self):
        import neffbuild

        env = dict(os.environ)  # the child imports this very package, wherever it was imported from
        env["PYTHONPATH"] = os.pathsep.join([str(Path(neffbuild.__file__).resolve().parents[1]),
                                             *filter(None, [env.get("PYTHONPATH")])])
        self.proc = subprocess.Popen([sys.executable, "-m", "neffbuild.compiler.smoke_child"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def ask(self, request: tuple, timeout_s: float) -> str | None:
        """The child's answer (None: ok, else the failure); LoadFailed when it dies or times out."""
        body = pickle.dumps(request)
        expired = []
        timer = threading.Timer(timeout_s, lambda: (expired.append(True), self.proc.kill()))
        timer.start()
        try:
            self.proc.stdin.write(_LEN.pack(len(body)) + body)
            self.proc.stdin.flush()
            head = self.proc.stdout.read(_LEN.size)
            answer = self.proc.stdout.read(_LEN.unpack(head)[0]) if len(head) == _LEN.size else None
        except OSError:  # a broken pipe: the child is gone
            answer = None
        finally:
            timer.cancel()
        if answer is None:
            code = self.proc.wait()
            if expired:
                raise SmokeTimedOut(f"the smoke run did not finish within {timeout_s:.0f} s")
            if code < 0:
                name = signal.Signals(-code).name if -code in signal.valid_signals() else "?"
                raise LoadFailed(f"the smoke run died of signal {-code} ({name})")
            raise LoadFailed(f"the smoke run's process exited with {code}")
        return answer.decode("utf-8", "replace") or None

    def alive(self) -> bool:
        return self.proc.poll() is None


def fetched_check(job):
    """The check a remote cache entry fetched for ``job`` passes before it is published locally: the smoke run
    here (None where the job's smoke run is skipped: no weights on this node, or a sharded graph)."""
    if job.weights_path is None or not Path(job.weights_path).is_file() or job.graph.parallel.sharded:
        return None

    def check(artifact: Path) -> None:
        from neffbuild.s3_probe import say_while_waiting

        timeout_s = fetched_timeout_s(artifact, Path(job.weights_path))
        timer = say_while_waiting(f"the smoke run of the remote cache entry for {job.label} in a child process",
                                  timeout_s)
        try:
            smoke_in_child(job.backend, artifact, job.graph, job.weights_path, timeout_s)
        finally:
            timer.cancel()

    return check


def fetched_timeout_s(artifact: Path, weights: Path) -> float:
    """How long a fetched entry's load and one step may take: TIMEOUT_FACTOR x reading the artifact and the
    weights at READ_BYTES_PER_S, at least ``NEFFBUILD_REMOTE_SMOKE_TIMEOUT_S``."""
    from neffbuild import settings

    size = sum(p.stat().st_size for p in (artifact, weights) if p.is_file())
    return max(settings.remote_smoke_timeout_s(), TIMEOUT_FACTOR * size / READ_BYTES_PER_S)


_CHILD: list[_Child] = []
_LOCK = threading.Lock()


def smoke_in_child(backend_kwargs: dict, artifact: Path, spec, weights_path: str,
                   timeout_s: float = CHILD_TIMEOUT_S) -> None:
    """``smoke_run`` of ``artifact`` in this process's smoke child; LoadFailed on any failure, a crash or a
    timeout (naming the signal)."""
    with _LOCK:  # one check at a time per child (a worker's threads, the driver's hits)
        if not _CHILD or not _CHILD[0].alive():
            _CHILD[:] = [_Child()]
        child = _CHILD[0]
        try:
            why = child.ask((backend_kwargs, str(artifact), spec, weights_path), timeout_s)
        except LoadFailed:
            _CHILD.clear()  # dead: the next check starts a fresh one
            raise
    if why is not None:
        raise LoadFailed(f"the smoke run failed: {why}")


def _serve() -> int:
    """The child's loop: read a request, smoke-run it, answer '' (ok) or the failure's first line."""
    proto_in, proto_out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # whatever the loader prints goes nowhere near the answers
        os.dup2(null, fd)
    from neffbuild.compiler.backends import get_backend
    from neffbuild.compiler.smoke import smoke_run
    from neffbuild.runtime.bundle import weights_file

    while True:
        head = proto_in.read(_LEN.size)
        if len(head) < _LEN.size:
            return 0  # the parent is gone
        backend_kwargs, artifact, spec, weights_path = pickle.loads(proto_in.read(_LEN.unpack(head)[0]))
        try:
            smoke_run(get_backend(**backend_kwargs), Path(artifact), spec, weights_file.load(Path(weights_path)))
            why = ""
        except Exception as exc:  # a C++ error's stack trace follows its first line
            why = (f"{type(exc).__name__}: {exc}".strip().splitlines() or ["?"])[0][:400]
            if isinstance(exc, LoadFailed):
                why = (str(exc).strip().splitlines() or ["?"])[0][:400]
        body = why.encode()
        proto_out.write(_LEN.pack(len(body)) + body)
        proto_out.flush()


if __name__ == "__main__":
    sys.exit(_serve())
