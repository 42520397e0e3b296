"""KV ingestion over NIXL: a prefill group's ranks serve their KV, a decode rank pulls its heads.

Roles (one process each side may hold one of them):
- ``KVProducer``: one prefill rank. Its regions hold ``kv_heads / P`` heads of every
  layer; it answers ``hello`` on the side channel (agent metadata and region layout) and
  the serving code's own ops (``serve(handlers)``), and progresses its agent while reads
  are outstanding (``expect`` / ``done``).
- ``KVIngest``: one decode rank, a client of the whole prefill group (every rank's side
  channel). ``connect`` handshakes with each rank, checks what must match (layers, block
  size, head dim, dtype, packed-FP8 K, the model's KV heads; ``KVRegions.mismatch``) and
  derives which prefill rank supplies each of its heads (``head_segments``); a head no
  prefill rank holds is refused naming both sides. ``pull`` reads a request's blocks from
  every region in ONE READ per prefill rank it draws from (all blocks, all regions, one
  descriptor list): one READ when decode's TP is at least prefill's, P/T when smaller.
  Several decode ranks (TP and DP) may be clients of one prefill group at once.

A prefill rank that dies closes its sockets: a call or a pull waiting on it raises
``PrefillWorkerLost`` naming the request, within the call's timeout (30 s) at the latest.
Region geometry: ``runtime/di/regions.py``; messages: ``runtime/di/side_channel.py``; the NIXL
agent: ``runtime/di/nixl_agent.py``; the sliding-window N-1 rule: ``runtime/di/prompt.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from neffbuild.errors import KVLayoutMismatch, KVTransferError, PrefillWorkerLost
from neffbuild.runtime.di.nixl_agent import NixlAgent, Progress, Pull, PullResult, load_nixl  # noqa: F401  (callers check NIXL here)
from neffbuild.runtime.di.regions import (
    HeadSegment,
    KVRegions,
    block_pairs,
    head_segments,
    pull_descriptors,
    register_regions,
)
from neffbuild.runtime.di.side_channel import ChannelClosed, ChannelTimeout, Client, Handler, Server

DEFAULT_TIMEOUT = 30.0


class KVProducer:
    """One prefill rank's KV, readable over NIXL; ``serve`` answers the side channel on ``host``."""

    def __init__(self, name: str, layer_buffers: Sequence[torch.Tensor] | KVRegions, *, packed_fp8: bool = False,
                 heads: range | None = None, total_heads: int | None = None):
        self.name = name
        self.regions = layer_buffers if isinstance(layer_buffers, KVRegions) else \
            register_regions(layer_buffers, packed_fp8=packed_fp8, heads=heads, total_heads=total_heads)
        self.agent = NixlAgent(name, self.regions)
        self.progress = Progress(self.agent)
        self.server: Server | None = None

    def serve(self, handlers: dict[str, Handler] | None = None, port: int = 0, host: str = "127.0.0.1") -> int:
        self.server = Server({"hello": self._hello, **(handlers or {})}, port, host)
        return self.server.port

    def _hello(self, msg: dict) -> dict:
        why = self.regions.mismatch(KVRegions.from_json(msg["layout"]), f"prefill {self.name}", "decode")
        if why:
            return {"error": why}
        return {"agent": self.name, "metadata": self.agent.metadata(), "layout": self.regions.to_json()}

    def expect(self, request: str) -> None:
        """Reads of ``request`` may come: progress the agent until ``done``."""
        self.progress.begin(request)

    def done(self, request: str) -> None:
        self.progress.end(request)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.progress.close()
        self.agent.close()


class KVIngest:
    """One decode rank's KV and its connection to a prefill group (``connect``), then ``pull``s."""

    def __init__(self, name: str, layer_buffers: Sequence[torch.Tensor] | KVRegions, *, packed_fp8: bool = False,
                 heads: range | None = None, total_heads: int | None = None):
        self.name = name
        self.regions = layer_buffers if isinstance(layer_buffers, KVRegions) else \
            register_regions(layer_buffers, packed_fp8=packed_fp8, heads=heads, total_heads=total_heads)
        self.agent = NixlAgent(name, self.regions)
        self.clients: list[Client] = []
        self.remotes: list[KVRegions] = []
        self.segments: list[HeadSegment] = []
        self._agents: dict[int, str] = {}  # prefill rank -> its NIXL agent name

    @property
    def transfers(self) -> int:
        return self.agent.transfers

    def connect(self, addresses: Sequence[tuple[str, int] | int], *, alive: Callable[[], bool] | None = None,
                timeout: float = DEFAULT_TIMEOUT) -> list[str]:
        """Handshake with every prefill rank (``(host, port)`` or a port on 127.0.0.1, rank order); their agent
        names. ``alive``: an extra liveness check (e.g. the worker processes' own)."""
        if not addresses:
            raise KVTransferError("connect: no prefill rank addresses")
        replies = []
        for rank, addr in enumerate(addresses):
            host, port = ("127.0.0.1", addr) if isinstance(addr, int) else addr
            try:
                client = Client(host, int(port), connect_timeout=timeout, alive=alive)
                self.clients.append(client)
                replies.append(client.call("hello", timeout, layout=self.regions.to_json()))
            except (ChannelClosed, ChannelTimeout) as exc:
                raise PrefillWorkerLost("handshake", f"prefill rank {rank} at {host}:{port}: {exc}") from None
            except KVTransferError as exc:
                raise KVLayoutMismatch(f"prefill rank {rank} refused decode {self.name}: {exc}") from None
        self.remotes = [KVRegions.from_json(r["layout"]) for r in replies]
        for rank, remote in enumerate(self.remotes):
            why = self.regions.mismatch(remote, f"decode {self.name}", f"prefill rank {rank}")
            if why:
                raise KVLayoutMismatch(why)
        self.segments = head_segments(self.regions.heads, [r.heads for r in self.remotes], f"decode {self.name}",
                                      "prefill")
        for rank in sorted({s.rank for s in self.segments}):
            self._agents[rank] = self.agent.add_remote(replies[rank]["metadata"], self.remotes[rank])
        return [r["agent"] for r in replies]

    def alive(self) -> bool:
        return all(c.peer_alive() for c in self.clients)

    def call(self, op: str, request: str, rank: int = 0, timeout: float = DEFAULT_TIMEOUT, **payload) -> dict:
        """One side-channel call to prefill ``rank`` on behalf of ``request``; a dead or silent rank is
        ``PrefillWorkerLost`` naming the request."""
        if not self.clients:
            raise KVTransferError(f"request {request!r}: call({op!r}) before connect()")
        client = self.clients[rank]
        try:
            return client.call(op, timeout, request=request, **payload)
        except (ChannelClosed, ChannelTimeout) as exc:
            raise PrefillWorkerLost(request, f"prefill rank {rank} at {client.host}:{client.port} stopped during "
                                             f"{op!r}: {exc}") from None

    def start_pull(self, request: str, remote_block_ids, local_block_ids) -> Pull:
        """Post the READs of a request's blocks: per KV group a list of block ids (or one flat list).

        Where a group has fewer local than remote blocks (a prefix already cached here), the
        LAST ``len(local)`` remote blocks are read. One READ per prefill rank this rank draws from.
        """
        if not self.remotes:
            raise KVTransferError(f"pull of request {request!r} before connect()")
        remote, local = block_pairs(request, remote_block_ids, local_block_ids, self.regions.num_blocks,
                                    min(r.num_blocks for r in self.remotes))
        reads: dict[int, tuple[list, list]] = {}
        if local:
            for seg in self.segments:
                ld, rd = pull_descriptors(self.regions, self.remotes[seg.rank], seg, local, remote)
                mine = reads.setdefault(seg.rank, ([], []))
                mine[0].extend(ld)
                mine[1].extend(rd)
        return self.agent.start_read(request, [(self._agents[r], ld, rd) for r, (ld, rd) in sorted(reads.items())],
                                     len(local))

    def pull(self, request: str, remote_block_ids, local_block_ids, timeout: float = DEFAULT_TIMEOUT) -> PullResult:
        """READ the request's blocks and wait (see ``start_pull``); a prefill rank lost meanwhile is
        ``PrefillWorkerLost``."""
        pull = self.start_pull(request, remote_block_ids, local_block_ids)
        try:
            return pull.wait(timeout, self.alive)
        except KVTransferError as exc:
            if not self.alive():
                raise PrefillWorkerLost(request, f"a prefill rank died during the pull ({exc})") from None
            raise

    def close(self) -> None:
        """End the side channels, forget the remote agents, deregister the KV."""
        for c in self.clients:
            c.close()
        self.clients = []
        self.agent.close()
