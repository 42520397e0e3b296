"""The plugin's KV connector for disaggregated serving: vLLM's NIXL connector over the bundle's KV layout.

A prefill instance (vLLM + the plugin, ``kv_role: kv_producer``) and a decode instance (``kv_consumer``) serve
the same bundle; vLLM's NIXL connector moves a prompt's KV blocks from the first to the second. Two things of
vLLM's connector do not fit the plugin as they are, and this module changes exactly those:

1. **Regions.** vLLM registers each layer's KV tensor as one region of block-major pages (``block_id *
   page``). The plugin keeps vLLM's allocation but lays the bytes out as the bundle's buffer ``[2, num_blocks,
   kv_heads, block_size, head_dim]`` (neffbuild/vllm/kv.py): a page holds no block. The worker here registers the
   bundle's per-buffer K and V regions instead (the runtime's ``regions_for``: block_len ``kv_heads *
   block_size * head_dim * itemsize``, one K and one V region per buffer, de-duplicated by base), by handing
   vLLM's registration each layer's buffer viewed as ``[2 * num_blocks, kv_heads, block_size, head_dim]``:
   vLLM then splits it into its two segments, K and V, each a region of ``num_blocks`` blocks. After
   registering, the regions vLLM built are compared with ``regions_for``'s; any difference stops start-up.
2. **Compatibility.** vLLM's handshake hash covers the model, dtypes and attention backend, not the bytes inside
   a block: a plain-vLLM peer, or a plugin peer on another bundle, would pass it and a transfer would move the
   wrong bytes silently. The worker appends its layout (``layout_tag``: the bundle's manifest digest and the
   regions' geometry) to the hash it publishes, and before vLLM's own handshake the decode side reads the
   peer's published hash and refuses a peer whose layout differs with one line naming both layouts.

And one thing of NIXL's: vLLM makes its NIXL agent with NIXL's progress thread, which never sleeps (a core per
instance, which on a small host the engines need); the worker makes it with a delay instead
(``kv_connector_extra_config: {"progress_delay_us": N}``, default 1,000; 0 is NIXL's own), so the thread waits for
UCX events (nixl_progress.py).

And the sliding-window rule of the seeds (runtime/di/prompt.py: both sides at prompt length N - 1): vLLM's
connector already has the mechanism, ``_prefill_backoff`` (the prefill side drops the prompt's last token and
answers with one token, the decode side pulls N - 1 tokens of KV and runs token N - 1 itself as its first,
one-token step). The scheduler here sets it to one token for a model with sliding-window layers, so the prefill
side's window manager keeps what a query at position N - 1 reads (docs/vllm.md, "Disaggregated serving").

And EAGLE3 (a bundle with a draft; both instances get the bundle's ``--speculative-config``, the launcher passes
the printed settings to both). As in vLLM's own P/D with a drafter, the prefill instance runs the drafter on the
prompt (neffbuild/vllm/draft.py: the runtime's eager catch-up over the prompt's rows, the draft graph on the last),
so the draft's KV for the prompt is written there, in the draft's buffer (the draft's vLLM layer, numbered after
the target's; the bundle's layout), and vLLM's connector moves the draft's KV cache group beside the target's
groups. The worker registers the draft's buffer with the target's (``regions_for(..., draft_kv=...)``: the same
geometry or start-up stops; vLLM's hybrid KV manager may give it a target buffer's storage, which then adds no
region) and the layout tag says "EAGLE3 draft KV", so a peer started without ``--speculative-config`` is refused
at the handshake like any other layout. The decode instance's first step for a transferred request has no drafts
(no aux hidden states yet; vLLM pads it with placeholder drafts, which the plugin recognises) and runs
``target_nospec`` (neffbuild/vllm/decode.py, ``_placeholders``: apart from rows with real drafts);
vLLM's drafter then catches up on that one row, over the transferred draft KV, and speculation starts on the next
step. One row differs from a single instance's draft KV: with the N - 1 rule the prefill instance drafts its last
row (position N - 2) from the token it sampled there, not the prompt's last token, which it never saw (vLLM's own
prefill backoff does the same); tokens stay exact (greedy verification), acceptance may move slightly.
neffbuild's own DI engine (serve/di.py) moves no draft KV: its prefill worker runs no draft.

Start both instances with ``--kv-transfer-config '{"kv_connector": "NeffbuildNixlConnector",
"kv_connector_module_path": "neffbuild.vllm.connector", "kv_role": ..., "kv_buffer_device": "cpu"}'`` (the
launcher, neffbuild/vllm/di.py, does).
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import msgspec
import torch
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlConnector,
    NixlHandshakePayload,
    NixlPullConnectorScheduler,
    NixlPullConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG
from vllm.logger import init_logger
from vllm.utils.network_utils import make_zmq_path

from neffbuild.errors import IncompatibleBundle, InvalidInput, KVLayoutMismatch, KVTransferError
from neffbuild.runtime import regions_for
from neffbuild.vllm import startup
from neffbuild.vllm.config import from_additional_config
from neffbuild.vllm.kv import bundle_view
from neffbuild.vllm.nixl_progress import PROGRESS_DELAY_US, delayed_progress

logger = init_logger(__name__)

TAG = "|neffbuild-layout "  # what separates vLLM's hash from the layout in the published compatibility string
HANDSHAKE_TRIES = 3  # vLLM's handshake query (5 s each) while the peer's side channel still accepts connections
_LAYER = re.compile(r"\.layers\.(\d+)\.")


class NeffbuildNixlConnector(NixlConnector):
    """vLLM's pull-mode NIXL connector with the plugin's scheduler (N - 1) and worker (regions, layout check)."""

    def __init__(self, vllm_config, role, kv_cache_config):
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = BundleScheduler(vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
        else:
            self.connector_scheduler = None
            self.connector_worker = BundleWorker(vllm_config, self.engine_id, kv_cache_config)


class BundleScheduler(NixlPullConnectorScheduler):
    def _prefill_backoff(self) -> int:
        """One token with sliding-window layers (the seeds' N - 1 rule), else vLLM's own (0 for GPT-OSS)."""
        return max(super()._prefill_backoff(), 1 if any(self.blocks_per_sw) else 0)


class BundleWorker(NixlPullConnectorWorker):
    def __init__(self, vllm_config, engine_id, kv_cache_config):
        settings = from_additional_config(vllm_config.additional_config)
        if settings is None:
            raise IncompatibleBundle("neffbuild: NeffbuildNixlConnector moves a bundle's KV layout; this vLLM serves "
                                     "no bundle (give --additional-config '{\"neffbuild\": {\"bundle\": ...}}', or "
                                     "use vLLM's own NixlConnector for vLLM's own layout)")
        self.bundle = startup.open_configured(settings)
        self.layout: str | None = None
        # NIXL's progress thread waits for UCX events instead of spinning on a core (nixl_progress.py)
        delay_us = vllm_config.kv_transfer_config.get_from_extra_config("progress_delay_us", PROGRESS_DELAY_US)
        if not isinstance(delay_us, int) or isinstance(delay_us, bool) or delay_us < 0:
            raise InvalidInput(f"--kv-transfer-config: kv_connector_extra_config.progress_delay_us is {delay_us!r}; "
                               "give the NIXL progress thread's delay in microseconds, 0 or more (0: NIXL's own "
                               f"spinning thread; default {PROGRESS_DELAY_US})")
        with delayed_progress(delay_us):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        logger.info("neffbuild: NIXL progress thread delay %d us (0: NIXL's own, a spinning thread)", delay_us)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        views, buffers, draft = split_views(kv_caches, self.bundle.facts.layer_buffers)
        super().register_kv_caches(views)
        regions = regions_for(self.bundle.facts, buffers, draft_kv=draft)
        got = (list(self.kv_caches_base_addr[self.engine_id][self.tp_rank]), set(self.block_len_per_layer))
        if got != (list(regions.bases), {regions.block_len}):
            raise KVLayoutMismatch(f"neffbuild: vLLM registered regions at {got[0]} with block lengths {got[1]}; the "
                                   f"bundle's are {list(regions.bases)} of {regions.block_len} bytes "
                                   f"({regions.describe()})")
        self.layout = layout_tag(self.bundle, regions)
        self.compat_hash = f"{self.compat_hash}{TAG}{self.layout}"
        self.xfer_handshake_metadata = NixlHandshakePayload(
            compatibility_hash=self.compat_hash,
            agent_metadata_bytes=self.xfer_handshake_metadata.agent_metadata_bytes)
        logger.info("neffbuild: NIXL regions are the bundle's per-buffer K and V regions (%s)", self.layout)

    def _nixl_handshake(self, host, port, remote_tp_size, expected_engine_id, remote_dcp_size=1, remote_pp_size=1,
                        notif_agents_only=False):
        """vLLM's handshake, after the peer's published layout is checked against this one's (one line if not)."""
        rank = self.transfer_topo.handshake_target_ranks(remote_tp_size, remote_dcp_size)[0]
        refusal = layout_refusal(self.layout, peer_compat(host, port, rank), f"{host}:{port}")
        if refusal:
            raise KVLayoutMismatch(refusal)
        args = (host, port, remote_tp_size, expected_engine_id, remote_dcp_size, remote_pp_size, notif_agents_only)
        for _ in range(HANDSHAKE_TRIES - 1):  # vLLM's own query waits 5 s, once; the peer just answered ours
            try:
                return super()._nixl_handshake(*args)
            except zmq.Again:
                if not listening(host, port):
                    raise
                logger.warning("neffbuild: the NIXL handshake with %s:%s got no answer in 5 s; asking again",
                               host, port)
        return super()._nixl_handshake(*args)


def split_views(kv_caches: dict[str, torch.Tensor], layer_buffers
                ) -> tuple[dict, list[torch.Tensor], torch.Tensor | None]:
    """({layer: its buffer as [2 * num_blocks, kv, bs, d]}, [buffer j as the bundle's [2, nb, kv, bs, d]], the
    EAGLE3 draft's buffer or None).

    The first is what vLLM's registration splits into a K and a V region per distinct tensor; the other two are
    what ``regions_for`` reads. Buffer j is the tensor of the first layer the bundle maps to j; the draft's layer
    is the one numbered after the target's (neffbuild/vllm/draft.py names it ``layers.{num_hidden_layers}``)."""
    views, buffers, draft = {}, {}, None
    for name, cache in kv_caches.items():
        match = _LAYER.search(name)
        index = int(match.group(1)) if match is not None else -1
        if not 0 <= index <= len(layer_buffers):
            raise IncompatibleBundle(f"neffbuild: vLLM's KV layer {name!r} is not one of the plugin's layers")
        buf = bundle_view(cache[0] if isinstance(cache, (list, tuple)) else cache)
        if index == len(layer_buffers):
            draft = buf
        else:
            buffers.setdefault(layer_buffers[index], buf)
        views[name] = buf.flatten(0, 1)
    return views, [buffers[j] for j in sorted(buffers)], draft


def layout_tag(bundle, regions) -> str:
    """The layout both sides must share: the bundle (name and manifest digest) and the regions' geometry."""
    digest_line = (Path(bundle.root) / "manifest.sha256").read_text().split()
    digest = digest_line[0][:16] if digest_line else "none"
    return (f"bundle {Path(bundle.root).name} sha256:{digest} ({len(regions.bases)} regions of "
            f"{regions.block_len}-byte blocks: {regions.describe()})")


def peer_compat(host: str, port: int, rank: int, timeout_s: float = 30, attempt_s: float = 5) -> str:
    """The compatibility string a peer publishes on its NIXL side channel (what vLLM's handshake reads first).

    Up to 30 s, not vLLM's 5: a prefill instance busy prefilling on a loaded host answered the first query late
    (one of six requests failed in a test run under load, 2 cores, load average 5). The query is sent again on a
    new socket every ``attempt_s``: once, under load 17, a just-restarted prefill instance answered none of 30 s
    of waiting on one socket, and the next query at once. A peer that is gone (its side channel refuses
    connections: the prefill instance was killed after answering) fails the query within a second, so the
    request fails with it instead of waiting out the 30 s (ZeroMQ itself would only reconnect)."""
    deadline = time.monotonic() + timeout_s
    while True:
        payload = _query(host, port, rank, min(attempt_s, max(deadline - time.monotonic(), 0.1)))
        if payload is not None:
            return msgspec.msgpack.Decoder(NixlHandshakePayload).decode(payload).compatibility_hash
        if time.monotonic() > deadline:
            raise KVTransferError(f"neffbuild: the prefill instance's NIXL side channel {host}:{port} did not "
                                  f"answer in {timeout_s:g} s; the request fails")


def _query(host: str, port: int, rank: int, wait_s: float) -> bytes | None:
    """One GET_META query on a fresh REQ socket: the payload, or None after ``wait_s`` without an answer."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(make_zmq_path("tcp", host, port))
        sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, rank)))
        end = time.monotonic() + wait_s
        while not sock.poll(500):
            if not listening(host, port):
                raise KVTransferError(f"neffbuild: the prefill instance's NIXL side channel {host}:{port} refuses "
                                      "connections (the instance exited after answering); the request fails")
            if time.monotonic() > end:
                return None
        return sock.recv_multipart()[0]
    finally:
        sock.close()
        ctx.term()


def listening(host: str, port: int) -> bool:
    """Whether something accepts TCP connections at host:port (a refused connect says the peer is gone)."""
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:  # a slow or filtered answer is not proof the peer is gone: keep waiting for it
        return True


def layout_refusal(ours: str | None, peer_hash: str, where: str) -> str | None:
    """One line when the peer's KV layout is not ours, else None (vLLM's own hash check follows)."""
    theirs = peer_hash.split(TAG, 1)[1] if TAG in peer_hash else None
    if theirs == ours:
        return None
    there = "vLLM's own KV layout (one block-major region per layer, no bundle)" if theirs is None else theirs
    return (f"neffbuild: refusing KV transfer with the vLLM instance at {where}: it serves {there}; this instance "
            f"serves {ours}. Serve the same bundle with the plugin and NeffbuildNixlConnector on both sides")
