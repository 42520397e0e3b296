"""DI with a prefill TP that differs from decode's, a prefill rank that dies, and the DI decode step's cost.

Real processes, real NIXL/UCX (tcp kept in UCX_TLS), the session bundles (no new compiles):
``built`` (unsharded: decode T=1), ``built_tp2`` (tp 2 / ep 2: decode T=2).
"""

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from neffbuild.errors import PrefillWorkerLost
from neffbuild.serve import procs
from tests import engine_runs
from tests.dist_util import forkserver
from tests.helpers import cli
from tests.test_di import _prompts, _single_process

GOLDEN_MANIFEST = Path(__file__).parent / "golden" / "manifest-tiny.json"

LENGTHS = [17, 47, 5, 33]


def _di_tokens(bundle_path, prefill_tp, lengths, new=4):
    from neffbuild.runtime.bundle.reader import open_bundle
    from neffbuild.serve.prefill_worker import PrefillGroup
    from neffbuild.serve.rank import open_rank

    session = open_rank(open_bundle(bundle_path))
    prompts = _prompts(lengths)
    with PrefillGroup(bundle_path, prefill_tp) as group:
        assert len(group.processes) == prefill_tp
        gen = engine_runs.di(session, group.addresses, prompts, new, alive=group.alive)
    return gen, _single_process(session, prompts, new)


@pytest.mark.slow
def test_prefill_tp2_feeds_an_unsharded_decode(built):
    """P=2 (one KV head per prefill rank) into T=1: every local block gathers two remote blocks (two READs)."""
    gen, ref = _di_tokens(built.bundle, 2, LENGTHS)
    assert gen.tokens == ref
    assert [t["transfers"] for t in gen.transfers] == [2] * len(LENGTHS)


@pytest.mark.slow
def test_nixl_source_admits_requests_that_arrive_mid_run(built):
    """The engine with NixlSource: requests arriving at later steps are pulled while others decode."""
    from neffbuild.runtime.bundle.reader import open_bundle
    from neffbuild.serve.di import NixlSource
    from neffbuild.serve.engine import Engine
    from neffbuild.serve.parts import Request
    from neffbuild.serve.prefill_worker import PrefillGroup
    from neffbuild.serve.rank import open_rank

    session = open_rank(open_bundle(built.bundle))
    prompts = _prompts([30, 9, 47])
    arrivals = [0, 2, 4]
    reqs = [Request(f"r{n}", p, 5 + n, arrival=arrivals[n], index=n) for n, p in enumerate(prompts)]
    with PrefillGroup(built.bundle) as group:
        source = NixlSource(session, group.addresses, alive=group.alive, prefix="mid-")
        try:
            Engine(session.stepper, session.block_manager(), source).run(reqs)
        finally:
            source.close()
    solo = [_single_process(session, [p], 5 + n)[0] for n, p in enumerate(prompts)]
    assert [r.tokens for r in reqs] == solo
    assert [r.first_step for r in reqs] == [0, 2, 4]
    assert [t["kv_len"] for t in source.transfers] == [29, 8, 46]


def _tp2_rank(rank, init_file, bundle_path, addresses, prompts, new, out_dir):
    import torch.distributed as dist

    from neffbuild.runtime.bundle.reader import open_bundle
    from neffbuild.serve.rank import open_rank

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        bundle = open_bundle(bundle_path, group=dist.group.WORLD)
        session = open_rank(bundle, group=dist.group.WORLD)
        gen = engine_runs.di(session, [tuple(a) for a in addresses], prompts, new,
                          request_ids=[f"req-{n}" for n in range(len(prompts))])
        res = {"tokens": gen.tokens, "transfers": gen.transfers}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))


def _tp2_decode(bundle_path, prefill_tp, prompts, new):
    import torch.multiprocessing as mp

    from neffbuild.serve.prefill_worker import PrefillGroup

    with PrefillGroup(bundle_path, prefill_tp) as group, tempfile.TemporaryDirectory() as tmp:
        forkserver()
        mp.start_processes(_tp2_rank, args=(os.path.join(tmp, "rdv"), str(bundle_path), group.addresses, prompts, new,
                                            tmp), nprocs=2, join=True, start_method=procs.START_METHOD)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("prefill_tp", [1, 2])
def test_tp2_decode_pulls_its_heads_from_any_prefill_tp(built_tp2, prefill_tp):
    """Decode T=2 (one KV head per rank) fed by P=1 (a slice of each remote block) or P=2 (rank to rank);
    both decode ranks are clients of one prefill group; tokens equal the unsharded model's."""
    from neffbuild.serve.parts import Request
    from neffbuild.serve.result import reference_tokens

    prompts, new = _prompts(LENGTHS), 4
    ranks = _tp2_decode(built_tp2, prefill_tp, prompts, new)
    ref = reference_tokens(str(built_tp2), [Request(str(n), p, new, index=n) for n, p in enumerate(prompts)])
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == ref
    for r in ranks:
        assert all(t["transfers"] == 1 for t in r["transfers"])  # T >= P: one READ per request
        assert all(t["kv_len"] == n - 1 for t, n in zip(r["transfers"], LENGTHS, strict=True))


def _children():
    import psutil

    return [p for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != "zombie"]


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_a_prefill_rank_that_dies_is_a_typed_error_naming_the_request(built, victim):
    """SIGKILL one prefill rank between two requests: the next request fails with PrefillWorkerLost naming it,
    well within 30 s, from the side channel alone (no process handles: as a decode rank on another host sees
    it); afterwards no prefill process is left."""
    from neffbuild.runtime.bundle.reader import open_bundle
    from neffbuild.serve.prefill_worker import PrefillGroup, connect_decode, pull_prompt
    from neffbuild.serve.rank import open_rank

    session = open_rank(open_bundle(built.bundle))
    blocks = session.block_manager()
    [first, second] = _prompts([20, 30])
    with PrefillGroup(built.bundle, 2) as group:
        pids = [p.pid for p in group.processes]
        kv = connect_decode(session, group.addresses)
        try:
            assert pull_prompt(kv, blocks, session.config, first, "req-ok")["transfers"] == 2
            os.kill(pids[victim], signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(PrefillWorkerLost, match="request 'req-lost'") as err:
                pull_prompt(kv, blocks, session.config, second, "req-lost")
            assert time.monotonic() - t0 < 30
            assert err.value.request == "req-lost" and err.value.exit_code == 1
        finally:
            kv.close()
    assert not [p for p in _children() if p.pid in pids]


def _prefill_ranks(proc) -> list:
    """The prefill rank processes under ``proc``: the fork server's children (neffbuild/serve/procs.py; a fork
    carries its server's command line), not the server itself or the resource tracker."""
    import psutil

    out = []
    for c in proc.children(recursive=True):
        try:
            if "forkserver" in " ".join(c.cmdline()) and "forkserver" in " ".join(c.parent().cmdline()):
                out.append(c)
        except (psutil.Error, AttributeError):  # gone, or no parent any more
            continue
    return out


@pytest.mark.slow
def test_generate_di_exits_1_naming_the_request_when_the_prefill_worker_dies(built, tmp_path):
    """`generate --requests FILE --di` as a user runs it: SIGKILL the prefill worker once the decode side is
    connected. Three waves of long requests (batch 4) keep prefills coming, so the kill lands while the run
    is serving: exit 1 within 30 s, the error names a request of the file by its id, no traceback, and no
    process the command started is left alive."""
    import subprocess
    import sys

    import psutil

    from tests.helpers import ROOT

    ids = [f"user-{n}" for n in range(12)]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt_ids": p, "max_new_tokens": 480}) + "\n"
                            for i, p in zip(ids, _prompts([8] * 12), strict=True)))
    proc = subprocess.Popen([sys.executable, "-m", "neffbuild.cli.main", "generate", str(built.bundle),
                             "--requests", str(path), "--di"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    me = psutil.Process(proc.pid)
    seen: set = set()
    try:
        deadline, victim = time.monotonic() + 300, None
        while victim is None and proc.poll() is None and time.monotonic() < deadline:
            seen.update(me.children(recursive=True))
            for rank in _prefill_ranks(me):  # connected: the decode process holds a connection to the rank
                ports = {c.laddr.port for c in rank.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
                if any(c.raddr and c.raddr.port in ports and c.status == psutil.CONN_ESTABLISHED
                       for c in me.net_connections("tcp")):
                    victim = rank
            time.sleep(0.05)
        assert victim is not None, f"no connected prefill worker (exit {proc.poll()})"
        time.sleep(0.3)  # past the handshake: requests are being prefilled, pulled and decoded
        victim.kill()
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, (proc.returncode, err[-2000:])
    assert elapsed < 30
    named = [i for i in ids if f"request {i!r}" in err]
    assert len(named) == 1, err[-2000:]
    assert "prefill" in err and "Traceback" not in err
    assert out == ""
    time.sleep(2)  # the watchdog of a rank that outlived its parent checks every second
    assert not [p for p in seen if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.bench
def test_di_decode_step_costs_what_a_plain_step_costs(built):
    """benchmarks/di_step.py: `generate` and `generate --di` (one process per run, rounds interleaved), per-step
    medians within 20%. One OpenMP thread per run: on a shared 2-core host a 2-thread step's spin-waiting
    barriers put whole runs, plain and DI alike, at ~280 ms a step (docs/benchmarks.md)."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "di_step.py"), str(built.bundle), "--rounds",
                          "4", "--threads", "1"], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    res = json.loads(out.strip().splitlines()[-1])
    print(json.dumps(res))
    assert res["ratio"] < 1.2


def test_prefill_tp_must_split_the_heads_as_a_tp_degree_does(tiny_cfg):
    from neffbuild.errors import InvalidInput
    from neffbuild.serve.prefill_worker import check_prefill_tp

    for ok in (1, 2, 4):  # 4 attention heads, 2 KV heads: tp 4 replicates each KV head on two ranks
        check_prefill_tp(tiny_cfg, "gpt_oss", ok)
    with pytest.raises(InvalidInput, match=r"--prefill-tp 3: tp 3 must divide the 4 attention heads"):
        check_prefill_tp(tiny_cfg, "gpt_oss", 3)


def test_generate_di_prefill_tp_that_cannot_split_the_heads_exits_2_naming_the_flag(tmp_path):
    """The product path guards the flag: a valid manifest of the tiny model (2 KV heads, 4 attention heads) is
    enough, as the check runs before NIXL, any rank or any prefill worker starts."""
    shutil.copy(GOLDEN_MANIFEST, tmp_path / "manifest.json")
    res = cli("generate", str(tmp_path), "--di", "--prefill-tp", "3", "--prompt-ids", "1,2", "--json")
    assert res.returncode == 2, res.stderr
    msg = json.loads(res.stdout)["error"]["message"]
    assert msg.startswith("--prefill-tp 3:") and "4 attention heads" in msg
