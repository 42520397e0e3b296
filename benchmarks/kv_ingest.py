"""KV ingestion over NIXL between two processes on this host, beside in-process copies.

    PYTHONPATH=. .venv/bin/python benchmarks/kv_ingest.py [--repeat 20]

1. Raw pull bandwidth: one READ of 8 MiB and of 128 MiB (a one-buffer layout with 1 MiB
   blocks, every block pulled), beside ``torch`` copying the same bytes in this process.
2. KV ingest of a 4K-token prompt on the small benchmark model's KV layout
   (recipes/gpt-oss-small.yaml: 8 layers on 4 buffers, 2 KV heads, block 32, head_dim 32,
   fp32, 8192 blocks): the full group's 128 blocks plus the sliding group's window blocks
   (N-1 rule), from every region, beside an in-process block copy of the same blocks.
The producer is a second process (spawned); the consumer is this one. Each pull is ONE NIXL
READ (every block of every region; consecutive blocks merged into one descriptor). UCX_TLS
keeps tcp; run with ``UCX_TLS=tcp`` and ``UCX_TLS=tcp,sm,self`` (the default) to compare.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch
from _common import machine

from neffbuild.bench.overhead import timed_seconds
from neffbuild.runtime.di.ingest import KVIngest, KVProducer
from neffbuild.runtime.di.prompt import di_prompt, strip_leading_null
from neffbuild.runtime.kv.cache import KVLayout, allocate

SMALL = KVLayout(num_buffers=4, num_blocks=8192, kv_heads=2, block_size=32, head_dim=32)
SMALL_LAYERS, SMALL_WINDOW = 8, 128
MIB = 1 << 20


def raw_layout(mib: int) -> KVLayout:
    """One buffer of ``mib`` MiB: K and V regions of ``mib / 2`` blocks of 1 MiB each."""
    return KVLayout(num_buffers=1, num_blocks=mib // 2, kv_heads=1, block_size=256, head_dim=1024)


def per_layer(caches, num_layers: int):
    return [caches[i // 2] for i in range(num_layers)]  # GPT-OSS: layers 2j, 2j+1 share buffer j


def _producer(layout: KVLayout, num_layers: int, port_q, stop_q):
    caches = allocate(layout)
    for c in caches:
        c.uniform_()
    producer = KVProducer("bench-producer", per_layer(caches, num_layers))
    producer.expect("bench")  # progress the agent for the whole run (the worker does it per request)
    port_q.put(producer.serve())
    stop_q.get()
    producer.close()


def _timed_pulls(agent: KVIngest, remote, local, repeat: int) -> list[float]:
    agent.pull("warm-up", remote, local)
    return [agent.pull(f"r{i}", remote, local).seconds for i in range(repeat)]


def measure(layout: KVLayout, num_layers: int, remote, local, repeat: int) -> dict:
    """Pull and in-process copy of the same blocks (every region): median and best of ``repeat``."""
    ctx = mp.get_context("spawn")
    port_q, stop_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_producer, args=(layout, num_layers, port_q, stop_q), daemon=True)
    proc.start()
    try:
        caches, src = allocate(layout), allocate(layout)
        for c in src:
            c.uniform_()
        t0 = time.perf_counter()
        agent = KVIngest("bench-consumer", per_layer(caches, num_layers))
        agent.connect([port_q.get(timeout=120)])
        setup = time.perf_counter() - t0
        pulls = _timed_pulls(agent, remote, local, repeat)
        flat_r = torch.tensor([b for g in remote for b in g])
        flat_l = torch.tensor([b for g in local for b in g])
        whole = flat_l.tolist() == flat_r.tolist() == list(range(layout.num_blocks))

        def copy():  # every block: one contiguous memcpy per buffer; else gather + scatter of the blocks
            for dst, s in zip(caches, src, strict=True):
                if whole:
                    dst.copy_(s)
                else:
                    dst.index_copy_(1, flat_l, s.index_select(1, flat_r))

        copies = timed_seconds(copy, repeat, warmup=1)
        nbytes = len(flat_l) * len(agent.regions.bases) * agent.regions.block_len
        last = agent.pull("count", remote, local)
        agent.close()
    finally:
        stop_q.put("stop")
        proc.join(timeout=30)
    out = {"bytes": nbytes, "descriptors": last.descriptors, "transfers_per_pull": last.transfers,
           "setup_s": round(setup, 3)}
    for stat, f in (("median", statistics.median), ("best", min)):  # best: least disturbed by other load
        pull_s, copy_s = f(pulls), f(copies)
        out[stat] = {"pull_ms": round(pull_s * 1e3, 3), "copy_ms": round(copy_s * 1e3, 3),
                     "pull_GBps": round(nbytes / pull_s / 1e9, 2), "copy_GBps": round(nbytes / copy_s / 1e9, 2),
                     "pull_over_copy": round(pull_s / copy_s, 1)}
    return out


def ingest_blocks(prompt_len: int) -> tuple[list[list[int]], list[list[int]]]:
    """Remote and local block lists of one prompt (full group, sliding group) under the N-1 rule."""
    bs = SMALL.block_size
    kv_len = di_prompt(range(prompt_len), SMALL_WINDOW).kv_len
    n_full = -(-kv_len // bs)
    first_swa = max(0, kv_len - SMALL_WINDOW + 1) // bs
    full_r = list(range(1, 1 + n_full))
    swa_r = strip_leading_null([0] * first_swa + list(range(1000, 1000 + n_full - first_swa)))
    full_l = list(range(2000, 2000 + n_full))
    swa_l = list(range(4000, 4000 + len(swa_r)))
    return [full_r, swa_r], [full_l, swa_l]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from neffbuild import settings

    out = {"machine": machine(), "UCX_TLS": settings.export_ucx_tls()}
    for mib in (8, 128):
        lay = raw_layout(mib)
        blocks = [list(range(lay.num_blocks))]
        out[f"raw_{mib}MiB"] = measure(lay, 2, blocks, blocks, args.repeat)
    remote, local = ingest_blocks(4096)
    out["ingest_4k_small"] = {"blocks": [len(g) for g in local], **measure(SMALL, SMALL_LAYERS, remote, local,
                                                                            args.repeat)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
