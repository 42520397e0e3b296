"""The DI prefill worker: P rank processes (``--prefill-tp P``), each with ``kv_heads / P`` heads of the KV.

``PrefillGroup(bundle, tp=P)`` spawns the ranks. Each runs the model's eager per-layer
prefill on its own TP shard (the bundle's weights joined and re-split for P, so P need not be
the bundle's tp), with its own KV cache and NIXL agent (``runtime.di.ingest.KVProducer``) and
its own side channel. Rank 0 leads: it owns the block manager and answers ``prefill`` and
``release``; it hands each request (tokens and block rows) to the other ranks over their gloo
group, and all P ranks run the prefill together (the TP all-reduces). A ``prefill`` call
names how many decode ranks will pull the request (``pullers``: decode's TP); every one of
them may call it, the first runs it and the others get the same answer; the blocks are
released once every puller said ``release``. Several decode ranks (TP x DP) may be clients
at once; rank 0 serves them one request at a time.

Decode side: ``connect_decode`` gives a decode rank its ``KVIngest`` (its heads, from its
bundle rank) connected to every prefill rank; ``pull_prompt`` asks for one prompt's prefill,
reserves this rank's blocks, pulls them and releases the worker's.

A rank exits when its parent dies (watchdog) or a peer rank fails; the decode side then
sees ``PrefillWorkerLost`` naming the request, and ``PrefillGroup`` kills what is left.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import threading
import time
from datetime import timedelta
from typing import Self

from neffbuild import registry
from neffbuild.errors import InvalidInput, KVTransferError
from neffbuild.runtime.bundle.reader import read_facts
from neffbuild.runtime.di.ingest import KVIngest, KVProducer
from neffbuild.runtime.di.nixl_agent import load_nixl
from neffbuild.runtime.di.prompt import di_prompt, strip_leading_null
from neffbuild.runtime.di.regions import regions_for
from neffbuild.runtime.parallel import ParallelLayout
from neffbuild.serve import procs
from neffbuild.serve.rank import PREFILL_ONLY, ServingRank, open_rank

_IDS = itertools.count()
GLOO_TIMEOUT = timedelta(seconds=20)


def _window(cfg) -> int | None:
    return cfg.sliding_window if cfg.has_sliding_layers else None


def bundle_tp(bundle_path) -> int:
    facts = read_facts(bundle_path, strict=False, files=False)  # a default degree: the manifest's part suffices
    return facts.parallel.tp if facts is not None else 1


def check_prefill_tp(cfg, arch: str, tp: int) -> None:
    """``--prefill-tp`` must split the model's heads as a TP degree does (exit 2 otherwise)."""
    try:
        registry.arch(arch).get("check_layout")(cfg, ParallelLayout(tp=tp))
    except InvalidInput as exc:
        raise InvalidInput(f"--prefill-tp {tp}: {exc}") from None


def check_group_tp(bundle_path, tp: int) -> None:
    """A prefill group of ``tp`` ranks can split the bundle's model (exit 2 naming ``--prefill-tp`` otherwise).

    The flag is the user's, so it is judged first, on a manifest the runtime's judge passes (its files are
    ``open_rank``'s to judge, exit 1)."""
    facts = read_facts(bundle_path, strict=False, files=False)
    if facts is not None:
        check_prefill_tp(facts.config, facts.arch, tp)


class _Rank:
    """One prefill rank: its shard, KV cache and producer; rank 0 also the block manager and the handlers."""

    def __init__(self, bundle_path: str, tp: int, rank: int, n_minus_1: bool):
        import torch.distributed as dist

        self.tp, self.rank, self.n_minus_1, self.dist = tp, rank, n_minus_1, dist
        me = open_rank(bundle_path, decode=PREFILL_ONLY, tp=tp, rank=rank)
        self.cfg, self.kv_layout, self.caches = me.config, me.kv_layout, me.kv_caches
        self.producer = KVProducer(f"prefill-{os.getpid()}-r{rank}", regions_for(me.facts, self.caches,
                                                                                  heads=me.kv_heads))
        self._prefill = lambda tokens, rows: me.prefill(tokens, self.caches, rows, logits="none")  # KV only
        self.lock = threading.Lock()
        self.blocks = me.block_manager() if rank == 0 else None
        self.answers: dict[str, dict] = {}  # request -> its prefill answer, until every puller released it
        self.released: dict[str, int] = {}

    # -- what every rank runs
    def run(self, order: dict) -> None:
        import torch

        if order["op"] == "prefill":
            self.producer.expect(order["request"])
            rows = {g: torch.tensor(r, dtype=torch.long) for g, r in order["rows"].items()}
            self._prefill(order["tokens"], rows)
        elif order["op"] == "release":
            self.producer.done(order["request"])

    def _order(self, order: dict) -> None:
        """Rank 0: every rank runs ``order`` (followers get it over gloo); a failed broadcast ends this rank."""
        if self.tp > 1:
            try:
                self.dist.broadcast_object_list([order], src=0)
            except Exception:
                os._exit(3)  # a peer rank is gone: close this rank's sockets so the decode side sees it
        self.run(order)

    # -- rank 0's side-channel handlers
    def prefill(self, msg: dict) -> dict:
        rid, tokens = str(msg["request"]), [int(t) for t in msg["tokens"]]
        with self.lock:
            if rid in self.answers:
                if self.answers[rid]["tokens"] != tokens:
                    return {"error": f"request {rid!r} was prefilled with other tokens"}
                return self.answers[rid]["reply"]
            p = di_prompt(tokens, _window(self.cfg), _n_minus_1=self.n_minus_1)
            self.blocks.reserve(rid, p.kv_len, p.kv_len)
            table = self.blocks.tables[rid]
            width = -(-p.kv_len // self.blocks.block_size)
            rows = {g.name: self.blocks.row(rid, g.name, width) for g in self.blocks.groups}
            t0 = time.perf_counter()
            self._order({"op": "prefill", "request": rid, "tokens": list(p.tokens[: p.kv_len]), "rows": rows})
            reply = {"kv_len": p.kv_len, "truncated": p.truncated, "prefill_seconds": time.perf_counter() - t0,
                     "blocks": {g.name: strip_leading_null(table[g.name]) for g in self.blocks.groups}}
            self.answers[rid] = {"tokens": tokens, "reply": reply, "pullers": max(1, int(msg.get("pullers", 1)))}
            self.released[rid] = 0
            return reply

    def release(self, msg: dict) -> dict:
        rid = str(msg["request"])
        with self.lock:
            if rid not in self.answers:
                return {"error": f"release of request {rid!r}, which this prefill worker does not hold"}
            self.released[rid] += 1
            if self.released[rid] >= self.answers[rid]["pullers"]:
                del self.answers[rid], self.released[rid]
                self.blocks.release(rid)
                self._order({"op": "release", "request": rid})
            return {"ok": True}

    def stop(self) -> None:
        with self.lock:
            if self.tp > 1:
                with contextlib.suppress(Exception):
                    self.dist.broadcast_object_list([{"op": "stop"}], src=0)


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(4)  # the decode process is gone: leave no orphan


def _rank_main(env: dict[str, str], bundle_path: str, tp: int, rank: int, init_file: str, ready, stop,
               n_minus_1: bool) -> None:
    # the parent is the fork server (serve/procs.py), which ends with the decode process: then this one does
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    procs.adopt_environment(env)
    try:
        if tp > 1:
            import torch.distributed as dist

            from neffbuild.runtime import world

            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp,
                                    timeout=GLOO_TIMEOUT)
            world.join(ParallelLayout(tp=tp), "prefill group")
        me = _Rank(bundle_path, tp, rank, n_minus_1)
        port = me.producer.serve({"prefill": me.prefill, "release": me.release} if rank == 0 else {})
    except Exception as exc:
        ready.put((rank, "error", f"{type(exc).__name__}: {exc}"))
        return
    ready.put((rank, "ready", port))
    if rank == 0:
        stop.get()  # a queue, not an Event: setting an Event waits for every waiter, a killed one never answers
        me.stop()
    else:
        while True:
            box = [None]
            try:
                dist.broadcast_object_list(box, src=0)
            except Exception:
                os._exit(3)  # rank 0 is gone
            if box[0]["op"] == "stop":
                break
            me.run(box[0])
    me.producer.close()


class PrefillGroup:
    """The prefill ranks: ``with PrefillGroup(bundle, tp=2) as g: ... g.addresses``."""

    def __init__(self, bundle_path, tp: int | None = None, *, timeout: float = 180.0, _n_minus_1: bool = True):
        if tp is not None:
            check_group_tp(bundle_path, tp)  # the user's flag first (exit 2), before spawning anything
        load_nixl()  # fail here, with the extra to install, before spawning anything
        self.bundle_path, self.tp = str(bundle_path), tp or bundle_tp(bundle_path)
        self.timeout, self._n_minus_1 = timeout, _n_minus_1
        self.addresses: list[tuple[str, int]] = []
        self.processes: list = []

    @property
    def ports(self) -> list[int]:
        return [p for _, p in self.addresses]

    @property
    def port(self) -> int:
        """Rank 0's side-channel port (a one-rank group's only one)."""
        return self.addresses[0][1]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def __enter__(self) -> Self:
        ctx = procs.context()
        self._tmp = tempfile.TemporaryDirectory(prefix="neffbuild-prefill-")
        init = os.path.join(self._tmp.name, "rendezvous")
        self._ready, self._stop = ctx.Queue(), ctx.Queue()
        self.processes = [ctx.Process(target=_rank_main, daemon=True, name=f"neffbuild-prefill-{r}",
                                      args=(procs.caller_environment(), self.bundle_path, self.tp, r, init,
                                            self._ready, self._stop, self._n_minus_1)) for r in range(self.tp)]
        for p in self.processes:
            p.start()
        ports: dict[int, int] = {}
        deadline = time.monotonic() + self.timeout
        while len(ports) < self.tp:
            try:
                rank, kind, value = self._ready.get(timeout=1.0)
            except Exception:
                if not self.alive() or time.monotonic() > deadline:
                    codes = [p.exitcode for p in self.processes]
                    self.__exit__(None, None, None)
                    raise KVTransferError(f"prefill worker did not start (exit codes {codes})") from None
                continue
            if kind == "error":
                self.__exit__(None, None, None)
                raise KVTransferError(f"prefill worker rank {rank} failed to start: {value}")
            ports[rank] = value
        self.addresses = [("127.0.0.1", ports[r]) for r in range(self.tp)]
        return self

    def __exit__(self, *exc) -> None:
        self._stop.put("stop")
        for p in self.processes:
            p.join(timeout=10)
        for p in self.processes:
            if p.is_alive():
                p.kill()
                p.join()
        self._tmp.cleanup()


# -- decode side


def connect_decode(session: ServingRank, addresses, *, alive=None, name: str | None = None) -> KVIngest:
    """This decode rank's ``KVIngest`` over its KV buffers, connected to the prefill ranks at ``addresses``."""
    kv = KVIngest(name or f"decode-{os.getpid()}-{next(_IDS)}", regions_for(session.facts, session.kv_caches))
    try:
        kv.connect(addresses, alive=alive)
    except BaseException:
        kv.close()
        raise
    return kv


def pull_prompt(kv: KVIngest, blocks, config, prompt, request: str, *, pullers: int = 1, key=None,
                n_minus_1: bool = True) -> dict:
    """Prefill ``prompt`` in the worker as ``request`` and pull its KV into this rank's blocks (reserved under
    ``key``, default ``request``, as the pull's ``kv_len`` computed tokens); the transfer's record. Every decode
    TP rank of the request calls it (``pullers``: how many)."""
    key = request if key is None else key
    p = di_prompt(prompt, _window(config), _n_minus_1=n_minus_1)
    reply = kv.call("prefill", request, tokens=list(p.tokens), pullers=pullers)
    if reply["kv_len"] != p.kv_len:
        raise KVTransferError(f"request {request}: the prefill worker computed KV for {reply['kv_len']} tokens, "
                              f"this decode worker expects {p.kv_len}; both sides must apply the same N-1 rule")
    blocks.reserve(key, p.kv_len, p.kv_len)
    groups = [g.name for g in blocks.groups]
    local = [strip_leading_null(blocks.tables[key][g]) for g in groups]
    res = kv.pull(request, [reply["blocks"][g] for g in groups], local)
    kv.call("release", request)
    return {"kv_len": p.kv_len, "truncated": p.truncated, "blocks": res.blocks, "bytes": res.bytes,
            "pull_seconds": res.seconds, "prefill_seconds": reply["prefill_seconds"], "transfers": res.transfers}
