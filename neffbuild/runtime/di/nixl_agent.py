"""One NIXL agent over a rank's KV regions: load NIXL lazily, register, post READs, progress.

The agent runs without NIXL's progress thread. That thread polls UCX with no delay: on a
small host one such thread per agent (decode and every prefill rank) took a core each and
made a decode step 60x slower than the same step without DI. Instead a transfer progresses
when its owner polls it (``Pull.wait``), and the side that is read from progresses only
while it expects reads (``Progress``: a thread that sleeps ``interval`` between polls, and
waits on an event, at no cost, when nothing is outstanding). UCX's ``tcp`` transport needs
the read side's progress; shared memory (``sm``) does not.

``UCX_TLS`` (``settings.export_ucx_tls``) is set before NIXL is imported: ``tcp`` is always
kept (it connects agents on two hosts, and UCX needs it to wire up), ``sm`` moves the bytes
when both agents are on one host.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from neffbuild.errors import KVTransferError, NixlUnavailable
from neffbuild.runtime.di.regions import Desc, KVRegions

NIXL_EXTRA = "nixl"  # pip install 'neffbuild[nixl]' pulls nixl-cu12


def load_nixl():
    """The nixl agent classes (``nixl`` or the ``nixl_cu12`` wheel), with ``tcp`` kept in UCX_TLS."""
    from neffbuild import settings

    settings.export_ucx_tls()
    try:
        from nixl_cu12 import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError:
            raise NixlUnavailable(f"NIXL is not installed: disaggregated inference needs it; install the extra with "
                                  f"pip install 'neffbuild[{NIXL_EXTRA}]' (the nixl-cu12 package)") from None
    _quiet_nixl_logger()
    return nixl_agent, nixl_agent_config


def _quiet_nixl_logger() -> None:
    """NIXL logs INFO lines to stdout; keep stdout for results (``--json``): warnings and up, on stderr."""
    log = logging.getLogger("nixl")
    for h in list(log.handlers):
        log.removeHandler(h)
    log.propagate = True
    if log.level < logging.WARNING:
        log.setLevel(logging.WARNING)


@dataclass
class PullResult:
    request: str
    blocks: int
    bytes: int
    seconds: float
    transfers: int = 1
    descriptors: int = 0


class Pull:
    """Posted READs (one per remote agent); ``wait`` polls them to completion and releases the handles."""

    def __init__(self, agent: NixlAgent, request: str, blocks: int, nbytes: int, descriptors: int):
        self.agent, self.request = agent, request
        self.blocks, self.bytes, self.descriptors = blocks, nbytes, descriptors
        self.t0 = time.perf_counter()
        self.handles: list = []
        self.states: list[str] = []

    def poll(self) -> bool:
        """True once every READ is done. A failed READ is a ``KVTransferError`` naming the request, whether NIXL
        reports it as the state "ERR" or raises (a peer gone mid-transfer raised NIXL_ERR_REMOTE_DISCONNECT out
        of ``check_xfer_state``: a traceback instead of the request's error)."""
        for i, h in enumerate(self.handles):
            if self.states[i] == "PROC":
                try:
                    self.states[i] = self.agent.agent.check_xfer_state(h)
                except Exception as exc:  # the binding's own error types: any of them fails this pull
                    self.release()
                    raise KVTransferError(f"pull of request {self.request!r} from the prefill side failed in NIXL "
                                          f"({self.blocks} blocks: {type(exc).__name__}: {exc})") from None
        if "ERR" in self.states:
            raise KVTransferError(f"pull of request {self.request!r} from the prefill side failed in NIXL "
                                  f"({self.blocks} blocks)")
        return all(s == "DONE" for s in self.states)

    def wait(self, timeout: float = 30.0, alive: Callable[[], bool] | None = None) -> PullResult:
        """Poll until done; past ``timeout`` or once ``alive()`` is False, a ``KVTransferError``."""
        deadline, check = self.t0 + timeout, self.t0 + 0.5
        while not self.poll():
            now = time.perf_counter()
            if now > deadline:
                self.release()
                raise KVTransferError(f"pull of request {self.request!r} did not finish within {timeout:.0f} s")
            if alive is not None and now > check:
                check = now + 0.5
                if not alive():
                    self.release()
                    raise KVTransferError(f"pull of request {self.request!r}: the prefill side is gone")
        seconds = time.perf_counter() - self.t0
        transfers = len(self.handles)
        self.release()
        return PullResult(self.request, self.blocks, self.bytes, seconds, transfers, self.descriptors)

    def release(self) -> None:
        for h in self.handles:
            with contextlib.suppress(Exception):  # a failed transfer may refuse; the agent's teardown frees it
                self.agent.agent.release_xfer_handle(h)
        self.handles = []


class NixlAgent:
    """A NIXL agent (UCX backend, no progress thread) with ``regions`` registered."""

    def __init__(self, name: str, regions: KVRegions):
        nixl_agent, nixl_agent_config = load_nixl()
        self.name, self.regions = name, regions
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        if "UCX" not in self.agent.backends:
            raise KVTransferError("NIXL has no UCX backend on this machine; DI transfers need it")
        r = regions
        self._reg = self.agent.register_memory([(b, r.region_len, r.device_id, "") for b in r.bases], r.mem_type)
        # read once, here: later the agent may be in use by a Progress thread (the agent is not thread-safe)
        self._metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self._remotes: dict[str, KVRegions] = {}
        self.transfers = 0  # READs posted by this agent (benchmarks and tests count them)

    def metadata(self) -> str:
        return self._metadata

    def add_remote(self, metadata: str, regions: KVRegions) -> str:
        name = self.agent.add_remote_agent(base64.b64decode(metadata))
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes[name] = regions
        return name

    def start_read(self, request: str, reads: list[tuple[str, list[Desc], list[Desc]]], blocks: int) -> Pull:
        """Post one READ per (remote agent, local descriptors, remote descriptors); the notification names
        the request."""
        nbytes = sum(n for _, local, _ in reads for _, n, _ in local)
        pull = Pull(self, request, blocks, nbytes, sum(len(local) for _, local, _ in reads))
        try:
            for remote, local, there in reads:
                mem = self._remotes[remote].mem_type
                handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, self.regions.mem_type),
                                                    self.agent.get_xfer_descs(there, mem), remote,
                                                    str(request).encode())
                pull.handles.append(handle)
                pull.states.append(self.agent.transfer(handle))
                self.transfers += 1
        except Exception as exc:
            pull.release()
            raise KVTransferError(f"pull of request {request!r}: NIXL refused the transfer ({exc})") from None
        return pull

    def notify(self, remote: str, message: str) -> None:
        self.agent.send_notif(remote, message.encode())

    def notes(self) -> list[str]:
        """Notifications received since the last call (polling them also progresses UCX)."""
        return [m.decode() for msgs in self.agent.get_new_notifs().values() for m in msgs]

    def close(self) -> None:
        """Forget the remote agents and deregister the KV (NIXL lets go of the memory)."""
        if self._reg is None:
            return
        for name in list(self._remotes):
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(name)
        self._remotes.clear()
        self.agent.deregister_memory(self._reg)
        self._reg = None


class Progress:
    """Progress an agent that is read from, only while ``begin``/``end`` say reads are outstanding."""

    def __init__(self, agent: NixlAgent, interval: float = 0.0005):
        self.agent, self.interval = agent, interval
        self.outstanding: set[str] = set()
        self.notes: list[str] = []
        self._lock, self._wake, self._stop = threading.Lock(), threading.Event(), False
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"nixl-progress-{agent.name}")
        self._thread.start()

    def begin(self, request: str) -> None:
        with self._lock:
            self.outstanding.add(request)
            self._wake.set()

    def end(self, request: str) -> None:
        with self._lock:
            self.outstanding.discard(request)
            if not self.outstanding:
                self._wake.clear()

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait()
            if self._stop:
                return
            with self._lock:
                self.notes += self.agent.notes()
            time.sleep(self.interval)

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
