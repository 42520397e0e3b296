"""KV ingestion for disaggregated inference: NIXL registration, handshake and block pulls.

A prefill worker (producer) and a decode worker (consumer) register the same region set
over their per-buffer KV caches: one K and one V region per KV buffer, de-duplicated by
base address (paired layers share a buffer, so L layers on G buffers give 2 x G regions).
Block ``b`` of region ``r`` is the descriptor ``(base_r + b * block_len, block_len)`` with id
``r * num_blocks + b``; ``block_len = kv_heads * block_size * head_dim * itemsize`` (a packed
FP8 K block has the same bytes). A pull of block ids reads that block from every region, so
one call moves a request's blocks for all layers; each KV group (full, sliding) is a list.

The handshake runs over a small side channel (a socket on 127.0.0.1, length-prefixed JSON):
the consumer sends its region layout, the producer answers with its agent metadata and
layout, and either side refuses a layout that differs. The same channel carries the serving
loop's own calls (``handlers``). NIXL is imported lazily; ``UCX_TLS`` keeps ``tcp`` so two
processes on one host connect. Not covered here: block allocation and which blocks a request
owns (the engine or ``serve/``), and the sliding-window N-1 rule (``runtime/di_prompt.py``).
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from neffbuild.errors import KVTransferError, NixlUnavailable

NIXL_EXTRA = "nixl"  # pip install 'neffbuild[nixl]' pulls nixl-cu12
MAX_FRAME = 64 << 20


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
    log.propagate = True  # the application's logging (or Python's last resort: stderr) prints it
    if log.level < logging.WARNING:
        log.setLevel(logging.WARNING)


# -- regions


@dataclass(frozen=True)
class KVRegions:
    """The registered region set: bases in registration order and the per-block geometry."""

    bases: tuple[int, ...]
    block_len: int
    num_blocks: int
    packed_fp8: bool
    dtype: str
    device_id: int = 0
    mem_type: str = "DRAM"

    @property
    def region_len(self) -> int:
        return self.block_len * self.num_blocks

    def addr(self, region: int, block: int) -> int:
        return self.bases[region] + block * self.block_len

    def block_id(self, region: int, block: int) -> int:
        return region * self.num_blocks + block

    def descriptors(self) -> list[tuple[int, int, int]]:
        """(addr, len, device) of every block of every region, in block-id order."""
        return [(self.addr(r, b), self.block_len, self.device_id)
                for r in range(len(self.bases)) for b in range(self.num_blocks)]

    def ids(self, blocks: Sequence[int]) -> list[int]:
        """Descriptor ids of ``blocks`` in every region (region-major)."""
        return [self.block_id(r, b) for r in range(len(self.bases)) for b in blocks]

    def to_json(self) -> dict:
        return {"bases": list(self.bases), "block_len": self.block_len, "num_blocks": self.num_blocks,
                "num_regions": len(self.bases), "packed_fp8": self.packed_fp8, "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: dict) -> KVRegions:
        return cls(tuple(int(b) for b in d["bases"]), int(d["block_len"]), int(d["num_blocks"]),
                   bool(d["packed_fp8"]), str(d["dtype"]))

    def mismatch(self, other: KVRegions, here: str, there: str) -> str | None:
        """Why two region sets cannot exchange blocks, or None when they can."""
        fields = [("block_len", self.block_len, other.block_len, "kv_heads * block_size * head_dim * itemsize"),
                  ("region count", len(self.bases), len(other.bases), "2 per KV buffer"),
                  ("packed_fp8", self.packed_fp8, other.packed_fp8, "packed FP8 K"),
                  ("num_blocks", self.num_blocks, other.num_blocks, "KV pool size"),
                  ("dtype", self.dtype, other.dtype, "KV dtype")]
        bad = [f"{name} {a} on {here} vs {b} on {there} ({why})" for name, a, b, why in fields if a != b]
        if not bad:
            return None
        return ("KV layouts differ between the prefill and decode workers: " + "; ".join(bad)
                + ". Both sides must use the same bundle's kv_layout.")


def layer_buffers(kv_caches: Sequence[torch.Tensor], num_layers: int) -> list[torch.Tensor]:
    """The KV buffer each layer writes: layers 2j and 2j+1 share buffer j."""
    return [kv_caches[i // 2] for i in range(num_layers)]


def register_regions(layers: Sequence[torch.Tensor], *, packed_fp8: bool = False) -> KVRegions:
    """Region set over per-layer KV buffers ``[2, num_blocks, kv_heads, block_size, head_dim]``.

    One K and one V region per distinct buffer, in layer order; a layer whose buffer base was
    already seen adds nothing.
    """
    if not layers:
        raise KVTransferError("register_regions: no KV buffers to register")
    bases: list[int] = []
    geometry = None
    for i, buf in enumerate(layers):
        if buf.dim() != 5 or buf.shape[0] != 2 or not buf.is_contiguous():
            raise KVTransferError(f"KV buffer of layer {i}: expected a contiguous [2, num_blocks, kv_heads, "
                                  f"block_size, head_dim] tensor, got shape {tuple(buf.shape)}")
        _, nb, h, bs, d = buf.shape
        here = (nb, h * bs * d * buf.element_size(), buf.dtype, buf.get_device())
        if geometry is not None and here != geometry:
            raise KVTransferError(f"KV buffer of layer {i}: shape {tuple(buf.shape)} {buf.dtype} differs from "
                                  "layer 0's; every buffer must share one layout")
        geometry = here
        if buf.data_ptr() in bases:
            continue
        bases += [buf[0].data_ptr(), buf[1].data_ptr()]
    nb, block_len, dtype, dev = geometry
    return KVRegions(tuple(bases), block_len, nb, packed_fp8, str(dtype).removeprefix("torch."),
                     max(dev, 0), "DRAM" if dev < 0 else "VRAM")


def last_blocks(remote: Sequence[int], local: Sequence[int]) -> list[int]:
    """The remote blocks that land on ``local``: the last len(local) ones (a partial prefix pull)."""
    if len(local) > len(remote):
        raise KVTransferError(f"pull: {len(local)} local blocks but the prefill worker has only {len(remote)}")
    return list(remote[len(remote) - len(local):])


# -- side channel


def send_msg(sock: socket.socket, msg: dict) -> None:
    data = json.dumps(msg).encode()
    sock.sendall(struct.pack("<Q", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise KVTransferError("side channel closed by the peer")
        buf += chunk
    return bytes(buf)


def recv_msg(sock: socket.socket) -> dict:
    (n,) = struct.unpack("<Q", _recv_exact(sock, 8))
    if n > MAX_FRAME:
        raise KVTransferError(f"side channel frame of {n} bytes is above the {MAX_FRAME}-byte limit")
    return json.loads(_recv_exact(sock, n))


# -- the agent


Handler = Callable[[dict], dict]


@dataclass
class PullResult:
    request: str
    blocks: int
    bytes: int
    seconds: float


class Pull:
    """One posted READ; ``wait`` polls it to completion and releases the handle."""

    def __init__(self, agent, handle, request: str, blocks: int, nbytes: int):
        self.agent, self.handle, self.request = agent, handle, request
        self.blocks, self.bytes, self.t0 = blocks, nbytes, time.perf_counter()
        self.state = "PROC"

    def poll(self) -> bool:
        if self.state == "PROC":
            self.state = self.agent.check_xfer_state(self.handle)
        if self.state == "ERR":
            raise KVTransferError(f"pull of request {self.request!r} failed in NIXL ({self.blocks} blocks)")
        return self.state == "DONE"

    def wait(self, timeout: float = 60.0) -> PullResult:
        deadline = self.t0 + timeout
        while not self.poll():
            if time.perf_counter() > deadline:
                raise KVTransferError(f"pull of request {self.request!r} did not finish within {timeout:.0f} s")
        seconds = time.perf_counter() - self.t0
        if self.handle is not None:
            self.agent.release_xfer_handle(self.handle)
            self.handle = None
        return PullResult(self.request, self.blocks, self.bytes, seconds)


class KVAgent:
    """One side of a KV transfer: a NIXL agent with the KV regions registered.

    Producer: ``serve()`` answers handshakes (and ``handlers``) on 127.0.0.1. Consumer:
    ``connect()`` handshakes, then ``pull()`` READs blocks from the producer.
    """

    def __init__(self, name: str, kv_caches: Sequence[torch.Tensor], num_layers: int, *, packed_fp8: bool = False):
        nixl_agent, nixl_agent_config = load_nixl()
        self.name = name
        self.regions = register_regions(layer_buffers(kv_caches, num_layers), packed_fp8=packed_fp8)
        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        if "UCX" not in self.agent.backends:
            raise KVTransferError("NIXL has no UCX backend on this machine; DI transfers need it")
        r = self.regions
        self._reg = self.agent.register_memory([(b, r.region_len, r.device_id, "") for b in r.bases], r.mem_type)
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", r.descriptors(), r.mem_type)
        self._remote = self._remote_regions = self._remote_name = self._sock = None
        self._server: socket.socket | None = None
        self._handlers: dict[str, Handler] = {}

    # producer side
    def serve(self, handlers: dict[str, Handler] | None = None, port: int = 0, *, background: bool = True) -> int:
        """Listen on 127.0.0.1 (port 0 picks a free one); return the port. ``close`` stops it."""
        self._handlers = {"hello": self._hello, **(handlers or {})}
        self._server = socket.create_server(("127.0.0.1", port))
        port = self._server.getsockname()[1]
        if background:
            threading.Thread(target=self.serve_forever, daemon=True, name=f"kv-side-channel-{port}").start()
        return port

    def serve_forever(self) -> None:
        while self._server is not None:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    def _session(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    msg = recv_msg(conn)
                except (KVTransferError, OSError):
                    return
                op = msg.get("op")
                if op == "close":
                    send_msg(conn, {"ok": True})
                    return
                try:
                    handler = self._handlers.get(op)
                    reply = handler(msg) if handler else {"error": f"unknown side-channel op {op!r}"}
                except Exception as exc:
                    reply = {"error": f"{type(exc).__name__}: {exc}"}
                send_msg(conn, reply)

    def _hello(self, msg: dict) -> dict:
        why = self.regions.mismatch(KVRegions.from_json(msg["layout"]), "prefill", "decode")
        if why:
            return {"error": why}
        meta = base64.b64encode(self.agent.get_agent_metadata()).decode()
        return {"agent": self.name, "metadata": meta, "layout": self.regions.to_json()}

    def pulled(self) -> list[str]:
        """Requests whose pulls finished since the last call (the consumer's completion notes)."""
        notes = self.agent.get_new_notifs()
        return [m.decode() for msgs in notes.values() for m in msgs]

    # consumer side
    def connect(self, port: int, host: str = "127.0.0.1", timeout: float = 30.0) -> str:
        """Handshake with the producer on ``host:port``; return its agent name."""
        self._sock = socket.create_connection((host, port), timeout=timeout)
        reply = self.call("hello", layout=self.regions.to_json())
        remote = KVRegions.from_json(reply["layout"])
        why = self.regions.mismatch(remote, "decode", "prefill")
        if why:
            raise KVTransferError(why)
        self._remote_name = self.agent.add_remote_agent(base64.b64decode(reply["metadata"]))
        self._remote_regions = remote
        self._remote = self.agent.prep_xfer_dlist(self._remote_name, remote.descriptors(), remote.mem_type)
        name = self._remote_name
        return name.decode() if isinstance(name, bytes) else str(name)

    def call(self, op: str, **payload) -> dict:
        """One request/answer on the side channel; an answer with ``error`` raises it."""
        if self._sock is None:
            raise KVTransferError(f"side channel: call({op!r}) before connect()")
        send_msg(self._sock, {"op": op, **payload})
        reply = recv_msg(self._sock)
        if "error" in reply:
            raise KVTransferError(reply["error"])
        return reply

    def start_pull(self, request: str, remote_block_ids, local_block_ids) -> Pull:
        """Post a READ of the request's blocks: per KV group a list of block ids (or one flat list).

        Where a group has fewer local than remote blocks (a prefix already cached here), the
        LAST ``len(local)`` remote blocks are read. The producer is told when the READ is done.
        """
        if self._remote is None:
            raise KVTransferError(f"pull of request {request!r} before connect()")
        remote_groups, local_groups = _groups(remote_block_ids), _groups(local_block_ids)
        if len(remote_groups) != len(local_groups):
            raise KVTransferError(f"pull of request {request!r}: {len(remote_groups)} remote groups but "
                                  f"{len(local_groups)} local groups")
        remote, local = [], []
        for rg, lg in zip(remote_groups, local_groups, strict=True):
            remote += last_blocks(rg, lg)
            local += list(lg)
        _check_ids(local, self.regions.num_blocks, "local", request)
        _check_ids(remote, self._remote_regions.num_blocks, "remote", request)
        nbytes = len(local) * len(self.regions.bases) * self.regions.block_len
        if not local:  # nothing to move (all cached here): still tell the producer
            self.agent.send_notif(self._remote_name, str(request).encode())
            pull = Pull(self.agent, None, str(request), 0, 0)
            pull.state = "DONE"
            return pull
        handle = self.agent.make_prepped_xfer("READ", self._local, self.regions.ids(local), self._remote,
                                              self._remote_regions.ids(remote), str(request).encode())
        pull = Pull(self.agent, handle, str(request), len(local), nbytes)
        pull.state = self.agent.transfer(handle)
        return pull

    def pull(self, request: str, remote_block_ids, local_block_ids, timeout: float = 60.0) -> PullResult:
        """READ the request's blocks and wait for completion (see ``start_pull``)."""
        return self.start_pull(request, remote_block_ids, local_block_ids).wait(timeout)

    def close(self) -> None:
        """End the side channel (and the server), release the descriptor lists, deregister the KV."""
        if self._sock is not None:
            try:
                send_msg(self._sock, {"op": "close"})
                recv_msg(self._sock)
            except (OSError, KVTransferError):
                pass
            self._sock.close()
            self._sock = None
        if self._server is not None:
            server, self._server = self._server, None
            server.close()
        if self._reg is not None:  # NIXL lets go of the KV memory: the caller may free it
            for handle in (self._remote, self._local):
                if handle is not None:
                    handle.release()
            if self._remote_name is not None:
                self.agent.remove_remote_agent(self._remote_name)
            self.agent.deregister_memory(self._reg)
            self._reg = self._remote = self._local = self._remote_name = None


def _groups(ids) -> list[list[int]]:
    ids = list(ids)
    if ids and isinstance(ids[0], (list, tuple)):
        return [list(map(int, g)) for g in ids]
    return [list(map(int, ids))]


def _check_ids(ids: list[int], num_blocks: int, side: str, request: str) -> None:
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise KVTransferError(f"pull of request {request!r}: {side} block ids {bad[:5]} outside [0, {num_blocks})")
