"""KV ingestion: region geometry and the head mapping (pure), then real multi-process NIXL pulls between a
prefill group of P ranks and decode ranks of TP T (heterogeneous TP), one READ per request and prefill rank."""


import pytest
import torch

from neffbuild.errors import KVLayoutMismatch, KVTransferError
from neffbuild.runtime.di.regions import (
    HeadSegment,
    KVRegions,
    block_pairs,
    head_segments,
    last_blocks,
    pull_descriptors,
    regions_for,
    register_regions,
)
from neffbuild.runtime.kv.cache import KVLayout, allocate
from tests.dist_util import forkserver

H = 2  # the model's KV heads in these tests
LAYOUT = KVLayout(num_buffers=2, num_blocks=8, kv_heads=H, block_size=4, head_dim=3)


def per_layer(caches, num_layers=4):
    return [caches[i // 2] for i in range(num_layers)]  # the GPT-OSS pairing (models/gpt_oss/kv_buffers.py)


def test_four_layers_on_two_buffers_give_four_regions():
    caches = allocate(LAYOUT)
    regions = register_regions(per_layer(caches))
    assert regions.block_len == 2 * 4 * 3 * 4 and regions.head_len == 4 * 3 * 4 and regions.num_layers == 4
    assert regions.bases == (caches[0].data_ptr(), caches[0][1].data_ptr(), caches[1].data_ptr(),
                             caches[1][1].data_ptr())
    assert register_regions([caches[0], caches[1], caches[0]]).bases == regions.bases  # a seen buffer adds nothing
    assert regions.addr(3, 5, 1) == caches[1][1, 5, 1].data_ptr()  # head 1 of block 5 of the V region of buffer 1


def test_packed_fp8_k_block_keeps_heads_outermost():
    fp8 = KVLayout(2, 8, 2, 4, 3, fp8=True, packed_k=True)
    caches = allocate(fp8)
    regions = register_regions(per_layer(caches), packed_fp8=True)
    packed = caches[0][0].view(8, 2, 2, 3, 2)  # kv_cache.packed_k_view: [blocks, heads, bs // 2, d, 2]
    assert regions.block_len == 2 * 4 * 3 and regions.dtype == "float8_e4m3fn"
    assert regions.addr(0, 3, 1) == packed[3, 1].data_ptr()


def test_head_mapping_decode_tp_larger_takes_a_slice():
    # prefill P=1 holds heads 0..1; decode T=2 rank 1 holds head 1: one segment, offset 1 in the remote block
    assert head_segments(range(1, 2), [range(0, 2)]) == [HeadSegment(0, 1, 0, 1)]
    assert head_segments(range(0, 2), [range(0, 2)]) == [HeadSegment(0, 0, 0, 2)]


def test_head_mapping_decode_tp_smaller_gathers_from_several_ranks():
    # prefill P=2 (one head each) into decode T=1 (both heads): local head 0 from rank 0, head 1 from rank 1
    assert head_segments(range(0, 2), [range(0, 1), range(1, 2)]) == [HeadSegment(0, 0, 0, 1), HeadSegment(1, 0, 1, 1)]
    # P=4 over 8 heads into T=2: each decode rank gathers two ranks' pairs of heads
    four = [range(2 * r, 2 * r + 2) for r in range(4)]
    assert head_segments(range(4, 8), four) == [HeadSegment(2, 0, 0, 2), HeadSegment(3, 0, 2, 2)]


def test_head_mapping_with_replicated_heads():
    # decode T=4 over 2 KV heads (sharding.kv_heads_of replicates: ranks hold 0, 0, 1, 1); prefill P=2
    assert head_segments(range(1, 2), [range(0, 1), range(1, 2)]) == [HeadSegment(1, 0, 0, 1)]
    # prefill P=4 replicated (0, 0, 1, 1) into decode T=1: the first holder of each head supplies it
    assert head_segments(range(0, 2), [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]) == [
        HeadSegment(0, 0, 0, 1), HeadSegment(2, 0, 1, 1)]


def test_head_mapping_refuses_a_head_nobody_holds():
    with pytest.raises(KVLayoutMismatch, match=r"decode holds KV heads 0..1 but no prefill rank holds head 1 "
                                               r"\(prefill heads: rank 0: 0..0\)"):
        head_segments(range(0, 2), [range(0, 1)])


def test_pull_descriptors_merge_whole_blocks_and_slice_heads():
    local = register_regions(per_layer(allocate(LAYOUT)))
    remote = register_regions(per_layer(allocate(LAYOUT)))
    ld, rd = pull_descriptors(local, remote, HeadSegment(0, 0, 0, 2), [4, 5, 6, 1], [1, 2, 3, 7])
    assert len(ld) == len(rd) == 4 * 2  # per region: the run 4..6 <- 1..3 as one descriptor, then 1 <- 7
    assert ld[0] == (local.addr(0, 4), 3 * local.block_len, 0) and rd[0] == (remote.addr(0, 1), 3 * local.block_len, 0)
    one = register_regions(per_layer(allocate(KVLayout(2, 8, 1, 4, 3))), heads=range(1, 2), total_heads=2)
    ld, rd = pull_descriptors(one, remote, HeadSegment(0, 1, 0, 1), [4, 5], [1, 2])
    assert len(ld) == 4 * 2 and ld[1] == (one.addr(0, 5), one.head_len, 0)  # a slice: one per block
    assert rd[1] == (remote.addr(0, 2, 1), remote.head_len, 0)


def test_layout_mismatch_names_both_sides():
    a = register_regions(per_layer(allocate(LAYOUT)))
    b = register_regions(per_layer(allocate(KVLayout(2, 16, 2, 8, 3))), packed_fp8=True)
    why = a.mismatch(b, "decode rank 0", "prefill rank 0")
    for part in ("block_size 4 on decode rank 0 vs 8 on prefill rank 0", "packed_fp8 False on decode rank 0 vs True",
                 "decode rank 0: 4 layers on 4 regions, KV heads 0..1 of 2, block_size 4"):
        assert part in why
    assert "num_blocks" not in why  # the pools may differ
    assert a.mismatch(KVRegions.from_json(a.to_json()), "decode", "prefill") is None


def test_the_eagle3_drafts_kv_moves_in_the_targets_regions():
    """regions_for's draft_kv (the vLLM plugin's DI with EAGLE3): a draft buffer sharing a target buffer's storage
    (vLLM's hybrid KV manager) adds no region, one of its own adds its K and V; either way the layout says so,
    and a side without the draft cannot map onto one with it."""
    from types import SimpleNamespace

    caches = allocate(LAYOUT)
    facts = SimpleNamespace(layer_buffers=[0, 0, 1, 1], fp8_packed_kv=False, kv_heads=range(H),
                            config=SimpleNamespace(num_key_value_heads=H))
    target = regions_for(facts, caches)
    shared, own = regions_for(facts, caches, draft_kv=caches[0]), regions_for(facts, caches, draft_kv=allocate(
        KVLayout(1, 8, H, 4, 3))[0])
    assert (shared.bases, shared.num_layers, shared.draft, target.draft) == (target.bases, 4, True, False)
    assert own.bases[:4] == target.bases and len(own.bases) == 6 and own.num_layers == 4
    assert "EAGLE3 draft KV False on decode vs True on prefill" in target.mismatch(shared, "decode", "prefill")
    assert KVRegions.from_json(shared.to_json()) == shared and "EAGLE3 draft KV" in shared.describe()
    with pytest.raises(KVLayoutMismatch, match=r"draft's KV buffer is \(2, 8, 1, 4, 3\).*target's \(2, 8, 2"):
        regions_for(facts, caches, draft_kv=allocate(KVLayout(1, 8, 1, 4, 3))[0])


def test_block_pairs_and_partial_prefix():
    assert last_blocks([7, 8, 9, 10], [3, 4]) == [9, 10] and last_blocks([7, 8], []) == []
    with pytest.raises(KVTransferError, match="3 local blocks but the prefill worker has only 2"):
        last_blocks([7, 8], [1, 2, 3])
    assert block_pairs("r", [[1, 2, 3], [5, 6, 7]], [[4, 1, 2], [3, 6]], 8, 8) == ([1, 2, 3, 6, 7], [4, 1, 2, 3, 6])
    with pytest.raises(KVTransferError, match=r"remote block ids \[9\] outside \[0, 8\)"):
        block_pairs("r", [9], [1], 8, 8)


def test_bad_buffer_is_refused():
    with pytest.raises(KVTransferError, match="layer 0"):
        register_regions([torch.zeros(8, 2, 4, 3)])
    with pytest.raises(KVTransferError, match=r"layer 1.*differs"):
        register_regions([torch.zeros(2, 8, 2, 4, 3), torch.zeros(2, 9, 2, 4, 3)])


# -- real processes: a prefill group of P ranks (each its own NIXL agent), decode ranks in this process


def _full(layout=LAYOUT):
    """The single-process KV: every value says which buffer, half, block, head and element it is."""
    caches = allocate(layout)
    for j, c in enumerate(caches):
        c.copy_(torch.arange(c.numel(), dtype=torch.float32).view(c.shape) + 1000.0 * (j + 1))
    return caches


def ranks_heads(tp: int, heads: int = H) -> list[range]:
    """Each TP rank's KV heads, replicated when tp > heads (as models/gpt_oss/sharding.kv_heads_of does)."""
    per = max(1, heads // tp)
    return [range(r * per, r * per + per) if heads >= tp else range(r * heads // tp, r * heads // tp + 1)
            for r in range(tp)]


def _prefill_rank(layout, heads, port_q, stop_q):
    from neffbuild.runtime.di.ingest import KVProducer

    shard = [c[:, :, heads.start:heads.stop].contiguous() for c in _full(layout)]
    producer = KVProducer(f"prefill-r{heads.start}", per_layer(shard), heads=heads, total_heads=H)
    ok = {"ok": True}
    port_q.put(producer.serve({"expect": lambda m: (producer.expect(m["request"]), ok)[1],
                               "done": lambda m: (producer.done(m["request"]), ok)[1]}))
    stop_q.get()
    producer.close()


@pytest.fixture
def prefill_group():
    ctx = forkserver()
    procs = []

    def start(tp, layout=LAYOUT):
        ports = []
        for heads in ranks_heads(tp):
            port_q, stop_q = ctx.Queue(), ctx.Queue()
            p = ctx.Process(target=_prefill_rank, args=(layout, heads, port_q, stop_q), daemon=True)
            p.start()
            procs.append((p, stop_q))
            ports.append(port_q.get(timeout=60))
        return ports

    yield start
    for p, q in procs:
        q.put("stop")
        p.join(timeout=20)
        if p.is_alive():
            p.kill()
    assert not any(p.is_alive() for p, _ in procs)


def _decode_rank(name, heads, layout=LAYOUT):
    from neffbuild.runtime.di.ingest import KVIngest

    caches = allocate(KVLayout(layout.num_buffers, layout.num_blocks, len(heads), layout.block_size, layout.head_dim))
    return KVIngest(name, per_layer(caches), heads=heads, total_heads=H), caches


@pytest.mark.parametrize("prefill_tp", [1, 2])
@pytest.mark.parametrize("decode_tp", [1, 2, 4])
def test_hetero_tp_pull_equals_the_single_process_kv(prefill_group, prefill_tp, decode_tp):
    ports = prefill_group(prefill_tp)
    full = _full()
    remote, local = [[1, 2, 3], [5, 6, 7]], [[4, 1, 2], [3, 6]]  # two groups; the sliding one a partial prefix
    pairs = [(4, 1), (1, 2), (2, 3), (3, 6), (6, 7)]
    for t, heads in enumerate(ranks_heads(decode_tp)):  # decode_tp 4: replicated heads 0, 0, 1, 1
        kv, caches = _decode_rank(f"decode-t{t}-of{decode_tp}", heads)
        try:
            kv.connect(ports)
            sources = sorted({s.rank for s in kv.segments})
            for r in sources:
                kv.call("expect", "req-1", rank=r)
            before = kv.transfers
            res = kv.pull("req-1", remote, local)
            assert kv.transfers - before == res.transfers == len(sources)  # one READ per prefill rank drawn from
            assert len(sources) == (prefill_tp // decode_tp if prefill_tp > decode_tp else 1)
            assert res.blocks == 5 and res.bytes == 5 * 4 * kv.regions.block_len
            for lb, rb in pairs:
                for j in range(2):
                    assert torch.equal(caches[j][:, lb], full[j][:, rb, heads.start:heads.stop]), (lb, rb, j)
            untouched = [b for b in range(8) if b not in dict(pairs)]
            assert all(float(c[:, b].abs().sum()) == 0 for c in caches for b in untouched)
            for r in sources:
                kv.call("done", "req-1", rank=r)
        finally:
            kv.close()


def test_one_read_per_request_whatever_its_blocks(prefill_group):
    ports = prefill_group(1)
    kv, caches = _decode_rank("decode-many", range(2))
    full = _full()
    try:
        kv.connect(ports)
        kv.call("expect", "big")
        res = kv.pull("big", [[1, 2, 3, 4, 5, 6], [7]], [[2, 3, 4, 6, 7, 1], [5]])  # 7 blocks x 4 regions
        assert res.transfers == 1 and kv.transfers == 1
        assert res.descriptors == 4 * 4  # per region: runs 2..4 <- 1..3 and 6..7 <- 4..5 merged, 1 <- 6, 5 <- 7
        assert torch.equal(caches[1][:, 6], full[1][:, 4]) and torch.equal(caches[0][:, 5], full[0][:, 7])
    finally:
        kv.close()


def test_handshake_refuses_a_layout_that_cannot_map(prefill_group):
    ports = prefill_group(1, KVLayout(2, 8, 2, 8, 3))  # block_size 8 on the prefill side
    kv, _ = _decode_rank("decode-bs4", range(2))
    try:
        with pytest.raises(KVLayoutMismatch, match=r"block_size 8 on prefill prefill-r0 vs 4 on decode.*"
                                                   r"decode: 4 layers on 4 regions, KV heads 0..1 of 2, block_size 4"):
            kv.connect(ports)
    finally:
        kv.close()


def test_handshake_refuses_a_group_missing_heads(prefill_group):
    ports = prefill_group(2)
    kv, _ = _decode_rank("decode-all", range(2))
    try:
        with pytest.raises(KVLayoutMismatch, match=r"decode decode-all holds KV heads 0..1 but no prefill "
                                                   r"rank holds head 1"):
            kv.connect(ports[:1])  # only rank 0 (head 0)
    finally:
        kv.close()


def test_runtime_stays_thin_and_imports_nixl_lazily():
    import subprocess
    import sys

    from tests.conftest import ROOT

    mods = "neffbuild.runtime.di.ingest, neffbuild.runtime.di.regions, neffbuild.runtime.di.side_channel, " \
           "neffbuild.runtime.di.nixl_agent, neffbuild.runtime.di.prompt"
    code = (f"import sys, neffbuild.runtime as rt, {mods}; [getattr(rt, n) for n in rt.__all__]; "
            "print([m for m in ('nixl', 'nixl_cu12', 'neffbuild.serve', 'neffbuild.models', 'neffbuild.cli', "
            "'click', 'yaml') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
