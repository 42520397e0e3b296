"""KV ingestion: region registration for the per-buffer layout, and real two-process NIXL pulls."""

import multiprocessing as mp

import pytest
import torch

from neffbuild.errors import KVTransferError
from neffbuild.runtime.kv_cache import KVLayout, allocate
from neffbuild.runtime.kv_ingest import KVRegions, last_blocks, layer_buffers, register_regions

LAYOUT = KVLayout(num_buffers=2, num_blocks=8, kv_heads=2, block_size=4, head_dim=3)


def test_four_layers_on_two_buffers_give_four_regions():
    caches = allocate(LAYOUT)
    regions = register_regions(layer_buffers(caches, 4))
    block_len = 2 * 4 * 3 * 4  # kv_heads * block_size * head_dim * itemsize
    assert regions.block_len == block_len
    assert regions.bases == (caches[0].data_ptr(), caches[0].data_ptr() + 8 * block_len,
                             caches[1].data_ptr(), caches[1].data_ptr() + 8 * block_len)
    assert regions.bases[1] == caches[0][1].data_ptr() and regions.bases[3] == caches[1][1].data_ptr()


def test_block_addresses_and_ids():
    caches = allocate(LAYOUT)
    regions = register_regions(layer_buffers(caches, 4))
    for r in range(4):
        for b in range(8):
            assert regions.addr(r, b) == regions.bases[r] + b * regions.block_len
            assert regions.block_id(r, b) == r * 8 + b
    descs = regions.descriptors()
    assert len(descs) == 4 * 8
    assert descs[regions.block_id(3, 5)] == (caches[1][1, 5].data_ptr(), regions.block_len, 0)
    assert regions.ids([5, 2]) == [5, 2, 13, 10, 21, 18, 29, 26]
    # block b of the V region is exactly the bytes of cache[1][b] (the V half the decode graph reads)
    assert caches[0][1, 3].data_ptr() == regions.addr(1, 3)


def test_a_layer_whose_base_was_seen_adds_nothing():
    caches = allocate(LAYOUT)
    once = register_regions(caches)
    assert register_regions(layer_buffers(caches, 4)) == once
    assert register_regions([caches[0], caches[1], caches[0]]) == once
    assert len(register_regions([caches[0]]).bases) == 2


def test_packed_fp8_k_block_has_the_same_bytes():
    fp8 = KVLayout(2, 8, 2, 4, 3, fp8=True, packed_k=True)
    regions = register_regions(layer_buffers(allocate(fp8), 4), packed_fp8=True)
    assert regions.block_len == 2 * 4 * 3 * 1 and regions.packed_fp8 and regions.dtype == "float8_e4m3fn"


def test_layout_mismatch_names_every_difference():
    a = register_regions(allocate(LAYOUT))
    b = register_regions(allocate(KVLayout(1, 16, 2, 8, 3)), packed_fp8=True)
    why = a.mismatch(b, "decode", "prefill")
    for part in ("block_len 96 on decode vs 192 on prefill", "region count 4 on decode vs 2 on prefill",
                 "packed_fp8 False on decode vs True on prefill", "num_blocks 8 on decode vs 16 on prefill"):
        assert part in why
    assert a.mismatch(KVRegions.from_json(a.to_json()), "decode", "prefill") is None


def test_partial_prefix_pull_reads_the_last_remote_blocks():
    assert last_blocks([7, 8, 9, 10], [3, 4]) == [9, 10]
    assert last_blocks([7, 8], [3, 4]) == [7, 8]
    assert last_blocks([7, 8], []) == []
    with pytest.raises(KVTransferError, match="3 local blocks but the prefill worker has only 2"):
        last_blocks([7, 8], [1, 2, 3])


def test_bad_buffer_is_refused():
    with pytest.raises(KVTransferError, match="layer 0"):
        register_regions([torch.zeros(8, 2, 4, 3)])
    with pytest.raises(KVTransferError, match=r"layer 1.*differs"):
        register_regions([torch.zeros(2, 8, 2, 4, 3), torch.zeros(2, 9, 2, 4, 3)])


# -- two processes, real NIXL (UCX over tcp on this host)


def _fill(caches):
    for j, c in enumerate(caches):  # every value says which buffer, half, block and element it is
        c.copy_(torch.arange(c.numel(), dtype=torch.float32).view(c.shape) + 1000.0 * (j + 1))


def _producer(layout: KVLayout, port_q, stop_q, packed: bool):
    from neffbuild.runtime.kv_ingest import KVAgent

    caches = allocate(layout)
    if not layout.fp8:
        _fill(caches)
    agent = KVAgent("producer", caches, 2 * layout.num_buffers, packed_fp8=packed)
    done: list[str] = []

    def pulled(_msg):
        done.extend(agent.pulled())
        return {"pulled": list(done)}

    port_q.put(agent.serve({"pulled": pulled}))
    stop_q.get()  # wait for the test to finish before tearing down the registered memory
    agent.close()


@pytest.fixture
def producer():
    ctx = mp.get_context("spawn")
    procs = []

    def start(layout=LAYOUT, packed=False):
        port_q, stop_q = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_producer, args=(layout, port_q, stop_q, packed), daemon=True)
        p.start()
        procs.append((p, stop_q))
        return port_q.get(timeout=60)

    yield start
    for p, q in procs:
        q.put("stop")
        p.join(timeout=20)
        if p.is_alive():
            p.kill()


def _wait_pulled(agent, request, tries=200):
    import time

    for _ in range(tries):
        got = agent.call("pulled")["pulled"]
        if request in got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"producer never saw the pull of {request}")


def test_two_process_pull_lands_blocks_on_the_same_block_of_every_buffer(producer):
    from neffbuild.runtime.kv_ingest import KVAgent

    port = producer()
    caches = allocate(LAYOUT)
    expect = allocate(LAYOUT)
    _fill(expect)
    agent = KVAgent("consumer", caches, 4)
    try:
        assert agent.connect(port) == "producer"
        # two groups (full, sliding); the sliding group pulls a prefix: its last 2 remote blocks
        res = agent.pull("req-1", [[1, 2, 3], [5, 6, 7]], [[4, 1, 2], [3, 6]])
        assert res.blocks == 5 and res.bytes == 5 * 4 * agent.regions.block_len
        for local, remote in [(4, 1), (1, 2), (2, 3), (3, 6), (6, 7)]:
            for j in range(2):
                assert torch.equal(caches[j][:, local], expect[j][:, remote]), (local, remote, j)
        untouched = [b for b in range(8) if b not in (4, 1, 2, 3, 6)]
        assert all(float(c[:, b].abs().sum()) == 0 for c in caches for b in untouched)
        assert "req-1" in _wait_pulled(agent, "req-1")
    finally:
        agent.close()


def test_handshake_refuses_a_different_layout(producer):
    from neffbuild.runtime.kv_ingest import KVAgent

    port = producer(KVLayout(2, 8, 2, 8, 3))  # block_size 8 on the prefill side
    agent = KVAgent("consumer", allocate(LAYOUT), 4)
    try:
        with pytest.raises(KVTransferError, match="block_len 192 on prefill vs 96 on decode"):
            agent.connect(port)
    finally:
        agent.close()


def test_handshake_refuses_packed_fp8_on_one_side_only(producer):
    from neffbuild.runtime.kv_ingest import KVAgent

    fp8 = KVLayout(2, 8, 2, 4, 3, fp8=True, packed_k=True)
    port = producer(fp8, packed=True)
    agent = KVAgent("consumer", allocate(KVLayout(2, 8, 2, 4, 3, fp8=True)), 4, packed_fp8=False)
    try:
        with pytest.raises(KVTransferError, match="packed_fp8 True on prefill vs False on decode"):
            agent.connect(port)
    finally:
        agent.close()


def test_kv_ingest_imports_nixl_lazily_and_stays_thin():
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = ("import sys, neffbuild.runtime as rt, neffbuild.runtime.kv_ingest, neffbuild.runtime.di_prompt; "
            "[getattr(rt, n) for n in rt.__all__]; "
            "print([m for m in ('nixl', 'nixl_cu12', 'neffbuild.serve', 'neffbuild.models', 'neffbuild.cli', "
            "'click', 'yaml') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
