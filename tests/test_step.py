"""The per-step API as engines drive it: engine-owned tables, DP ranks that never hang, minimum pools."""

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import yaml

from neffbuild import recipe as R
from neffbuild.errors import NeffbuildError, RecipeError
from neffbuild.models.gpt_oss.prefill import prefill
from neffbuild.models.gpt_oss.weights import model_weights
from neffbuild.runtime import StepBatch, Stepper
from neffbuild.runtime.kv.cache import KVLayout
from neffbuild.runtime.step.dispatch import Grid
from neffbuild.serve import procs
from neffbuild.serve.rank import eager_artifacts, serving_rank
from tests.conftest import TINY
from tests.dist_util import forkserver
from tests.engine_runs import greedy
from tests.helpers import cli


def _hf_tokens(folder, prompts_and_counts):
    import transformers

    model = transformers.GptOssForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for prompt, n in prompts_and_counts:
        ids = torch.tensor([prompt])
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        out.append(seq[0, len(prompt):].tolist())
    return out


class Engine:
    """A toy engine with its own allocator: full-width rows, no sliding-window recycling, blocks reused on leave."""

    def __init__(self, bundle, cfg):
        self.bundle, self.cfg = bundle, cfg
        self.bs, self.width = bundle.kv_layout.block_size, bundle.grid.max_model_len // bundle.kv_layout.block_size
        self.free = list(range(bundle.kv_layout.num_blocks - 1, 0, -1))
        self.reqs = {}

    def join(self, name, prompt, n, kv):
        need = -(-(len(prompt) + n) // self.bs)
        rows = [torch.tensor([self.free.pop() for _ in range(need)] + [0] * (self.width - need)) for _ in range(2)]
        logits = prefill(self.cfg, self.bundle.weights, prompt, kv, rows[0], rows[1])
        self.reqs[name] = {"full": rows[0], "sliding": rows[1], "computed": len(prompt), "n": n,
                           "out": [int(logits[-1].argmax())]}

    def leave(self, name):
        r = self.reqs.pop(name)
        self.free += [int(b) for g in ("full", "sliding") for b in r[g] if b]

    def batch(self):
        rs = list(self.reqs.values())
        return StepBatch([[r["out"][-1]] for r in rs], [r["computed"] for r in rs],
                         {g: torch.stack([r[g] for r in rs]) for g in ("full", "sliding")})


@pytest.mark.slow
def test_engine_owned_tables_join_leave_across_buckets(built, small_checkpoint):
    """No block manager: the engine's tables go in as given; batch 1 <-> 4 and ctx 128 -> 256 -> 512."""
    from neffbuild.models.gpt_oss.config import GptOssConfig
    from neffbuild.runtime import open_bundle

    b = open_bundle(built.bundle)
    needed = []
    step = Stepper(b, on_plan=lambda plan: needed.append(plan.needed_seq))
    engine = Engine(b, GptOssConfig.from_hf_dict(b.manifest["graph_inputs"]["model_config"]))
    schedule = {  # name: (joins at step, prompt, tokens to generate)
        "A": (0, [(i * 37) % 256 for i in range(100)], 60), "B": (8, list(range(20, 40)), 30),
        "C": (12, [(i * 11) % 256 for i in range(50)], 40), "D": (16, [5, 6, 7], 50),
        "E": (45, [(i * 7 + 3) % 256 for i in range(250)], 25),
    }
    done, plans = {}, []
    for i in range(200):
        for name, (at, prompt, n) in schedule.items():
            if at == i:
                engine.join(name, prompt, n, step.kv_caches)
        for name in [r for r, v in engine.reqs.items() if len(v["out"]) == v["n"]]:
            done[name] = engine.reqs[name]["out"]
            engine.leave(name)
        if not engine.reqs and len(done) == len(schedule):
            break
        if not engine.reqs:
            continue
        out = step.step(engine.batch())
        plans.append(out.plan)
        assert out.logits.shape == (len(engine.reqs), 1, 256) and out.aux_hidden is None
        for r, tok in zip(engine.reqs.values(), out.logits[:, -1].argmax(-1).tolist(), strict=True):
            r["out"].append(tok)
            r["computed"] += 1
    want = _hf_tokens(small_checkpoint, [(p, n) for _, p, n in schedule.values()])
    assert [done[name] for name in schedule] == want
    assert {p.batch for p in plans} == {1, 4} and {p.ctx for p in plans} == {128, 256, 512}
    assert sorted({p.num_reqs for p in plans}) == [1, 2, 3, 4]
    assert needed == [p.needed_seq for p in plans]  # the hook saw every step's synced needed_seq


def _eager_stepper(cfg, weights, k, batches=(1, 2)):
    """The tiny model's eager graph (max_model_len 512, block 16, num_swa 8) behind a Stepper."""
    layout = KVLayout(cfg.num_kv_buffers, 80, cfg.num_key_value_heads, 16, cfg.head_dim)
    return Stepper(eager_artifacts(cfg, weights, Grid(batches, (128,), 512, k), layout, 8))


def test_spec_step_equals_single_token_steps_and_family_rules():
    """1+k tokens in one target_spec step = the same tokens one by one; aux states come back; the rules fire."""
    cfg = R.load(TINY).model.config
    weights = model_weights(cfg, None, 0)
    prompt, drafts = [(i * 13) % 256 for i in range(45)], [7, 99, 3, 250]
    full, swa = torch.arange(1, 33)[None], torch.arange(33, 65)[None]  # the two groups never share a block
    tables = {"full": full, "sliding": swa}
    results = {}
    for k in (0, 3):
        step = _eager_stepper(cfg, weights, k)
        prefill(cfg, weights, prompt, step.kv_caches, full[0], swa[0])
        if k:
            out = step.step(StepBatch([drafts], [len(prompt)], tables))
            assert (out.plan.family, out.plan.query_len, out.plan.needed_seq) == ("target_spec", 4, len(prompt) + 4)
            assert out.aux_hidden.shape == (1, 4, 3 * cfg.hidden_size)
            results[k] = out.logits[0]
        else:
            results[k] = torch.cat([step.step(StepBatch([[t]], [len(prompt) + i], tables)).logits[0]
                                    for i, t in enumerate(drafts)])
    # 3e-5, not 1e-5: the 4-row step reads KV through the copy + bmm (MKL's blocked sum order) while
    # each 1-row step reads it in place (kernels/attention.py: q.k summed over head_dim, then probs.v over
    # the table's W x block_size slots, by torch.sum). Before issue 24 both rows went through bmm and the
    # largest difference was 9.4e-6 (of 1e-5); with the two orders it is 1.07e-5 (one logit of 1024).
    torch.testing.assert_close(results[3], results[0], atol=3e-5, rtol=0)
    step = _eager_stepper(cfg, weights, 3)
    idle = step.plan(StepBatch([[5], [6]], [50, 60], {"full": full.repeat(2, 1), "sliding": swa.repeat(2, 1)}))
    assert (idle.family, idle.query_len) == ("target_nospec", 1)  # no row has drafts
    near_end = step.plan(StepBatch([drafts], [509], {"full": full}))  # 509 + 3 + 1 > 512: no room for drafts
    assert (near_end.family, near_end.needed_seq, near_end.label) == ("target_nospec", 510, "decode_b1_s1_ctx512")
    assert step.plan(StepBatch([drafts], [508], {"full": full})).label == "decode_b1_s4_ctx512"


def test_rows_with_fewer_drafts_pad_and_write_no_kv():
    """Rows with 3, 1 and 0 drafts run one target_spec step (a host engine's scheduler may schedule fewer than
    k): each row's live positions give the logits of its tokens run one by one, and a padded position writes no
    KV (its slots keep their bytes)."""
    cfg = R.load(TINY).model.config
    weights = model_weights(cfg, None, 0)
    rows = [[7, 99, 3, 250], [11, 42], [5]]
    prompts = [[(i * 13 + 7 * r) % 256 for i in range(45)] for r in range(3)]
    tables = [{"full": torch.arange(1 + 10 * r, 5 + 10 * r)[None],
               "sliding": torch.arange(41 + 10 * r, 45 + 10 * r)[None]} for r in range(3)]
    spec, plain = _eager_stepper(cfg, weights, 3, (1, 4)), _eager_stepper(cfg, weights, 0)
    for step in (spec, plain):
        for prompt, t in zip(prompts, tables, strict=True):
            prefill(cfg, weights, prompt, step.kv_caches, t["full"][0], t["sliding"][0])
    before = [c.clone() for c in spec.kv_caches]
    both = {g: torch.cat([t[g] for t in tables]) for g in ("full", "sliding")}
    out = spec.step(StepBatch(rows, [45] * 3, both))
    assert (out.plan.family, out.plan.query_len) == ("target_spec", 4) and out.logits.shape[:2] == (3, 4)
    for r, toks in enumerate(rows):
        ref = torch.cat([plain.step(StepBatch([[t]], [45 + i], tables[r])).logits[0] for i, t in enumerate(toks)])
        torch.testing.assert_close(out.logits[r, :len(toks)], ref, atol=3e-5, rtol=0)
    # Positions 45 + len(row) .. 48 of each row were padding: their slots (block 2 of the row's full table,
    # offsets 13..15 at most; row 0 has none) hold what they held before.
    for r, toks in enumerate(rows):
        blk = int(tables[r]["full"][0, 2])
        for off in range(45 % 16 + len(toks), 48 % 16 + 1):
            for c, b in zip(spec.kv_caches, before, strict=True):
                assert torch.equal(c[:, blk, :, off], b[:, blk, :, off]), (r, off)
        written = 45 % 16
        assert not all(torch.equal(c[:, blk, :, written], b[:, blk, :, written])
                       for c, b in zip(spec.kv_caches, before, strict=True))


# -- DP: local problems travel through the one collective -------------------------------------------

SPEC = Grid((1, 2), (128,), 256)
# scenario -> (rank, step) -> rows of (tokens, num_computed); every scenario fails at step 3
SCENARIOS = {
    "context": lambda rank, i: [([1], 253 + i)] if rank == 0 else [([2], 10 + i), ([3], 20 + i)],  # 256 -> 257
    "batch": lambda rank, i: [([1], 5 + i)] * (i if i == 3 else 1) if rank == 1 else [([4], 9 + i)],
    "idle_rank": lambda rank, i: [([1], 253 + i)] * 2 if rank == 0 else [],
    "malformed": lambda rank, i: [([1, 2] if i == 3 else [1], 5 + i)] if rank == 0 else [([4], 9 + i)],
}


def _dp_rank(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=20))
    cfg = R.load(TINY).model.config
    layout = KVLayout(cfg.num_kv_buffers, 40, cfg.num_key_value_heads, 16, cfg.head_dim)
    step = Stepper(eager_artifacts(cfg, model_weights(cfg, None, 0), SPEC, layout, 8), group=dist.group.WORLD)
    table = torch.arange(1, 17).repeat(4, 1)
    log = {}
    for name, rows_at in SCENARIOS.items():
        before = step.collectives
        for i in range(6):
            rows = rows_at(rank, i)
            batch = StepBatch([t for t, _ in rows], [n for _, n in rows], {"full": table[:len(rows)]})
            try:
                step.step(batch)
            except NeffbuildError as exc:
                log[name] = {"step": i, "error": type(exc).__name__, "message": str(exc)}
                break
        log[name]["collectives"] = step.collectives - before
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(log))


def test_dp2_local_problems_raise_on_every_rank_same_step(tmp_path):
    import torch.multiprocessing as mp

    start = time.monotonic()
    forkserver()
    ctx = mp.start_processes(_dp_rank, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2, join=False,
                             start_method=procs.START_METHOD)
    while not ctx.join(timeout=1):
        if time.monotonic() - start > 120:
            for p in ctx.processes:
                p.kill()
            pytest.fail("DP ranks hung")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    for name in SCENARIOS:
        a, b = r0[name], r1[name]
        assert a["step"] == b["step"] == 3, name
        assert a["error"] == b["error"] and a["collectives"] == b["collectives"] == 4, name  # one all-reduce per step
        if name != "malformed":
            assert a["error"] == "ShapeNotCovered" and a["message"] == b["message"], name
    assert "needed context 257 is above max_model_len 256" in r0["context"]["message"]
    assert "batch of 3 requests is above the largest num_seqs bucket 2" in r1["batch"]["message"]
    assert "rows [0] run 2 tokens" in r0["malformed"]["message"] and "another DP rank" in r1["malformed"]["message"]
    assert r0["malformed"]["error"] == "StepInputError"
    print(f"DP scenarios took {time.monotonic() - start:.1f} s")


# -- KV accounting: whatever validates must serve ---------------------------------------------------

def _tiny(num_blocks, max_model_len=512):
    raw = yaml.safe_load(TINY.read_text())
    raw["serving"].update(num_blocks=num_blocks, max_model_len=max_model_len)
    if max_model_len < 512:  # short enough to decode to the end in seconds: the fallback bucket only
        raw["neuron_config"]["decode_context_length_buckets"] = [max_model_len]
    return raw


def test_minimum_pool_serves_to_max_model_len_like_a_large_pool():
    with pytest.raises(RecipeError) as exc:  # 128 tokens: 8 full + 3 sliding blocks + the null block
        R.from_dict(_tiny(11, 128))
    assert [p.path for p in exc.value.problems] == ["serving.num_blocks"]
    small, large = R.from_dict(_tiny(12, 128)), R.from_dict(_tiny(512, 128))
    assert any("serving.num_blocks" in w for w in small.warnings)  # 4 sequences at once need 45
    prompt = [(i * 37) % 256 for i in range(40)]
    small_tokens, small_free = _serve_to_max_model_len(small, prompt)
    large_tokens, _ = _serve_to_max_model_len(large, prompt)
    assert len(prompt) + len(small_tokens) == 128 and small_tokens == large_tokens
    assert min(small_free) == 0  # the pool was exactly enough: the formula is tight here


def _serve_to_max_model_len(r, prompt):
    """(tokens, free blocks after each step) of one prompt served to max_model_len through the eager graph."""
    cfg = r.model.config
    weights = model_weights(cfg, None, 0)
    layout = KVLayout(cfg.num_kv_buffers, r.num_blocks, cfg.num_key_value_heads, r.block_size, cfg.head_dim)
    spec = Grid(r.num_seqs_buckets, r.decode_context_length_buckets, r.max_model_len)
    session = serving_rank(cfg, weights, eager_artifacts(cfg, weights, spec, layout, r.num_swa))
    blocks, free = session.block_manager(), []
    gen = greedy(session, [prompt], r.max_model_len - len(prompt), blocks=blocks,
                 on_step=lambda plan, _: free.append(blocks.num_free))
    assert gen.plans[-1].needed_seq == r.max_model_len - 1  # the last token is never fed back
    return gen.tokens[0], free


def test_validate_refuses_a_pool_below_one_sequence(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(_tiny(35)))
    res = cli("validate", path, "--json")
    assert res.returncode == 2, res.stderr
    [err] = json.loads(res.stdout)["errors"]
    assert err["path"] == "serving.num_blocks" and err["value"] == 35
    assert "must be >= 36" in err["message"] and "32 full + 3 sliding + 1 null block" in err["message"]


# -- what the runtime refuses before native code sees it (no compile: the checks run before any artifact)

def _tiny_layout():
    return KVLayout(2, 12, 2, 16, 16)


def _ro_mmap(tmp_path, shape):
    import mmap

    import numpy as np

    path = tmp_path / "kv.bin"
    path.write_bytes(b"\0" * (4 * int(np.prod(shape))))
    with open(path, "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    return torch.from_numpy(np.frombuffer(m, dtype=np.float32).reshape(shape))


def _fake(shape):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(shape)


BUFFER_CASES = [  # (id, make(shape, tmp_path), needle)
    ("readonly-mmap", lambda s, t: _ro_mmap(t, s), "memory torch does not own"),
    ("fake-tensor", lambda s, t: _fake(s), "FakeTensor"),
    ("mkldnn", lambda s, t: torch.zeros(s).to_mkldnn(), "layout torch._mkldnn"),
    ("bytes-backed", lambda s, t: torch.frombuffer(bytes(4 * torch.Size(s).numel()), dtype=torch.float32).view(s),
     "memory torch does not own"),
    ("numpy-backed", lambda s, t: torch.from_numpy(__import__("numpy").zeros(s, dtype="float32")),
     "memory torch does not own"),
    ("subclass", lambda s, t: torch.zeros(s).as_subclass(type("MyTensor", (torch.Tensor,), {})), "MyTensor"),
]


@pytest.mark.parametrize("make,needle", [c[1:] for c in BUFFER_CASES], ids=[c[0] for c in BUFFER_CASES])
def test_kv_buffers_must_be_writable_real_strided_storage(tmp_path, make, needle):
    import warnings

    from neffbuild.errors import StepInputError
    from neffbuild.runtime.kv.cache import check_kv_buffers

    layout = _tiny_layout()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that a read-only buffer is not writable
        bad = make(tuple(layout.buffer_shape), tmp_path)
    with pytest.raises(StepInputError, match="kv_caches") as err:
        check_kv_buffers([bad] * layout.num_buffers, layout, "cpu")
    assert needle in str(err.value)
    good = [torch.empty(layout.buffer_shape), torch.empty(layout.buffer_shape).share_memory_()]
    assert check_kv_buffers(good, layout, "cpu") == good  # torch's own memory, private or shared


@pytest.mark.parametrize("group", ["notagroup", 0, object(), [None]])
def test_stepper_refuses_a_group_that_is_not_a_process_group(group):
    from neffbuild.errors import StepInputError

    with pytest.raises(StepInputError, match="ProcessGroup"):
        Stepper(None, group=group)


@pytest.mark.parametrize("device,toolchain,needle", [
    ("meta", {"backend": "inductor", "device": "cpu"}, "compiled for 'cpu'"),
    ("cuda", {"backend": "inductor", "device": "cpu"}, "compiled for 'cpu'"),
    ("cuda:0", {"backend": "inductor", "device": "cuda"}, "no CUDA device"),
    ("bogus!", {"backend": "inductor", "device": "cpu"}, "not a torch device"),
    (3.5, {"backend": "inductor", "device": "cpu"}, "not a torch device"),
])
def test_open_bundle_refuses_a_device_the_artifacts_cannot_run_on(device, toolchain, needle):
    from neffbuild.runtime.bundle.loaders import device_problem

    if device == "cuda:0" and torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    assert needle in (device_problem(toolchain, device) or "")
    assert device_problem({"backend": "inductor", "device": "cpu"}, "cpu") is None
