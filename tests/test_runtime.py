"""Runtime: dispatch, attention metadata, generate against transformers, DP sync, import cost."""

import json
import random
import subprocess
import sys

import pytest
import torch

from neffbuild import grid
from neffbuild import recipe as R
from neffbuild.errors import ShapeNotCovered
from neffbuild.runtime.step import attn_metadata
from neffbuild.runtime.step.dispatch import Grid, plan_step
from tests.helpers import ROOT, cli

SPEC = Grid((1, 2, 4), (128, 256), 512)


def _prompt_args(prompts) -> list[str]:
    return [arg for p in prompts for arg in ("--prompt-ids", ",".join(map(str, p)))]


_cli = cli  # in-process (tests/helpers.py); `generate --dp` starts the ranks' processes itself


@pytest.mark.parametrize("computed,num_reqs,label,needed", [
    ([0], 1, "decode_b1_ctx128", 1),
    ([127], 1, "decode_b1_ctx128", 128),
    ([128], 1, "decode_b1_ctx256", 129),
    ([10, 300], 2, "decode_b2_ctx512", 301),
    ([10, 20, 30], 3, "decode_b4_ctx128", 31),
])
def test_plan_step(computed, num_reqs, label, needed):
    p = plan_step(computed, num_reqs, grid=SPEC)
    assert (p.label, p.needed_seq, p.padding) == (label, needed, p.batch - num_reqs)


def test_shape_not_covered():
    with pytest.raises(ShapeNotCovered, match=r"batch of 5 .* largest num_seqs bucket 4"):
        plan_step([1] * 5, 5, grid=SPEC)
    with pytest.raises(ShapeNotCovered, match=r"needed context 513 is above max_model_len 512"):
        plan_step([512], 1, grid=SPEC)


def test_eagle3_family_choice():
    spec = Grid((1, 2), (128,), 512, num_speculative_tokens=3)
    assert plan_step([10], 1, 3, grid=spec).label == "decode_b1_s4_ctx128"
    assert plan_step([10], 1, 0, grid=spec).label == "decode_b1_s1_ctx128"  # no drafts
    assert plan_step([10], 1, 3, grid=spec, after_transfer=True).family == "target_nospec"
    assert plan_step([509], 1, 3, grid=spec).label == "decode_b1_s1_ctx512"  # no room for drafts
    assert plan_step([124], 1, 3, grid=spec).label == "decode_b1_s4_ctx128"  # needed 128
    assert plan_step([125], 1, 3, grid=spec).label == "decode_b1_s4_ctx512"


@pytest.mark.parametrize("name", ["gpt-oss-tiny", "gpt-oss-120b-di-decode"])
def test_reachable_shapes_equal_compiled_shapes(name):
    r = R.load(ROOT / "recipes" / f"{name}.yaml")
    spec = Grid(r.num_seqs_buckets, r.decode_context_length_buckets, r.max_model_len, r.num_speculative_tokens)
    compiled = {t.label for t in grid.targets(r) if t.family != "draft"}
    reachable = set()
    points = sorted({0, r.max_model_len - 1} | {c + d for c in r.decode_context_length_buckets for d in (-5, -4, -1, 0)}
                    | {c // 2 for c in r.decode_context_length_buckets})
    for n in range(1, r.max_num_seqs + 1):
        for top in points:
            for drafts in ({0, r.num_speculative_tokens} if r.num_speculative_tokens else {0}):
                if top + 1 + drafts <= r.max_model_len or drafts:
                    reachable.add(plan_step([top] * n, n, drafts, grid=spec).label)
    assert reachable == compiled
    drafts = {t.label for t in grid.targets(r) if t.family == "draft"}
    assert len(drafts) == (len(compiled) // 2 if r.num_speculative_tokens else 0)  # one draft per (batch, ctx)


def test_swa_tail_trim_examples():
    table = torch.arange(3 * 10).view(3, 10)
    trimmed, offset = attn_metadata.tail_trim(table, torch.tensor([0, 100, 1000]), 128, 2)
    assert offset.tolist() == [0, 0, 768]
    assert trimmed.tolist() == [[0, 1], [10, 11], [26, 27]]
    same, zero = attn_metadata.tail_trim(table, torch.tensor([5, 500, 1000]), 128, 10)
    assert torch.equal(same, table) and zero.tolist() == [0, 0, 0]


def test_head_trim_is_fresh_and_padding_rows_write_nothing():
    full = torch.arange(2 * 32).view(2, 32)
    swa = full + 100
    inp = attn_metadata.build(torch.tensor([[1], [2]]), torch.tensor([5, 40]), full, swa, batch=4, ctx=128,
                              block_size=16, num_swa=8)
    assert inp.block_table.shape == (4, 8) and inp.block_table.is_contiguous()
    assert inp.block_table.data_ptr() != full.data_ptr()
    assert inp.slot_mapping.tolist() == [0 * 16 + 5, 34 * 16 + 8, -1, -1]
    assert inp.slot_mapping_swa.tolist()[2:] == [-1, -1] and inp.block_table[2:].eq(0).all()
    assert inp.positions[:, 0].tolist() == [5, 40, 0, 0]


def test_import_runtime_is_cheap():
    code = ("import sys, neffbuild.runtime as rt, neffbuild.runtime.bundle.reader, neffbuild.runtime.step.stepper, "
            "neffbuild.runtime.kv.blocks, neffbuild.runtime.step.dp_sync, neffbuild.runtime.step.attn_metadata; "
            "[getattr(rt, n) for n in rt.__all__]; "
            "bad = [m for m in ('click', 'yaml', 'rich', 'jinja2', 'neffbuild.compiler', 'neffbuild.build', "
            "'neffbuild.bundle', 'neffbuild.grid', 'neffbuild.cli', 'neffbuild.recipe', 'neffbuild.models', "
            "'neffbuild.serve', 'transformers') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_public_api():
    import neffbuild.runtime as rt
    from neffbuild.errors import NeffbuildError

    assert rt.open_bundle.__module__ == "neffbuild.runtime.bundle.reader"
    assert issubclass(rt.ShapeNotCovered, NeffbuildError) and issubclass(rt.IncompatibleBundle, NeffbuildError)
    # what a host engine calls; an engine's own conveniences (the block manager, neffbuild's KV transfer) are in
    # their rooms, not here
    assert {"Stepper", "StepBatch", "StepOutput", "BundleFacts", "HostGroups", "regions_for", "kv_access"} <= set(
        dir(rt)) and not {"BlockManager", "blocks_needed", "KVIngest"} & set(dir(rt))
    assert rt.kv_access.write_kv.__module__ == "neffbuild.runtime.kv.access"
    assert len(rt.__all__) <= 20, "neffbuild.runtime exports what serving code calls; the rest lives in its room"
    arch = (ROOT / "docs" / "architecture.md").read_text()
    assert all(f"`{n}`" in arch for n in rt.__all__), "docs/architecture.md lists the runtime's exports"
    with pytest.raises(AttributeError, match="no attribute 'Decoder'"):
        rt.Decoder  # noqa: B018


def test_models_import_no_runtime_logic():
    """models/ may import plain layout constants and types from the runtime, nothing else (STYLE.md #11)."""
    import ast

    plain = {"neffbuild.runtime.kv.blocks": {"NULL_BLOCK"}, "neffbuild.runtime.kv.layout": {"KVLayout"},
             "neffbuild.runtime.parallel": {"ParallelLayout", "TP_GROUP", "EP_GROUP", "rank_tensor"}}
    for path in (ROOT / "neffbuild" / "models").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("neffbuild.runtime"):
                assert {a.name for a in node.names} <= plain.get(node.module, set()), (path, node.module)


@pytest.mark.slow
def test_generate_equals_transformers_across_bucket_boundaries(built, small_checkpoint):
    import transformers

    prompts = [[(i * 37) % 256 for i in range(100)], list(range(10, 40)), [5, 6, 7]]
    n_new = 170
    res = _cli("generate", str(built.bundle), *_prompt_args(prompts),
               "--max-new-tokens", str(n_new), "--json", "--check")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["check"]["ok"]
    assert out["decode_seconds"] > 0 and out["decode_tokens"] == 3 * (n_new - 1)  # decode steps only
    later = out["decode_seconds"] - out["first_step_seconds"]  # tokens/s: the steps after the first
    assert out["tokens_per_second"] == pytest.approx(3 * (n_new - 2) / later, rel=1e-3)
    model = transformers.GptOssForCausalLM.from_pretrained(small_checkpoint, dtype=torch.float32).eval()
    for n, p in enumerate(prompts):
        ids = torch.tensor([p])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False)
        assert out["tokens"][n] == ref[0, len(p):].tolist(), f"prompt {n}"
    steps = out["steps"]
    assert len(steps) == n_new - 1
    ctxs = [s["ctx"] for s in steps]
    assert sorted(set(ctxs)) == [128, 256, 512]  # two boundaries crossed
    for i, s in enumerate(steps):
        assert s["ctx"] >= s["needed_seq"] and s["batch"] == 4
        if i and s["ctx"] != steps[i - 1]["ctx"]:
            assert steps[i - 1]["needed_seq"] == steps[i - 1]["ctx"]  # switched on the first step past the bucket
            assert s["needed_seq"] == steps[i - 1]["ctx"] + 1


@pytest.mark.slow
def test_generate_human_output_reports_speed(built):
    res = _cli("generate", str(built.bundle), "--prompt-ids", "1,2,3", "--max-new-tokens", "5")
    assert res.returncode == 0, res.stderr
    line = [x for x in res.stdout.splitlines() if x.startswith("decode:")]
    assert line and " s, " in line[0] and "tokens/s" in line[0], res.stdout


@pytest.mark.slow
@pytest.mark.parametrize("case", ["busy-idle", "uneven"])
def test_dp2_ranks_agree_every_step(built, case):
    """Both bucket boundaries (128 -> 256 -> 512) crossed under DP sync, with the fewest tokens that do it:
    the longest prompt starts just below 128 and decodes until its needed_seq passes 256."""
    rng = random.Random(11)
    if case == "busy-idle":
        prompts = [[rng.randrange(256) for _ in range(rng.randrange(100, 127))]]
    else:
        spans = ((100, 127), (5, 100), (5, 100))  # the longest on rank 0; rank 1 holds one short request
        prompts = [[rng.randrange(256) for _ in range(rng.randrange(*span))] for span in spans]
    n_new = 260 - max(map(len, prompts))  # the last step's needed_seq is 259: in the fallback (512)
    args = _prompt_args(prompts)
    dp = _cli("generate", str(built.bundle), *args, "--max-new-tokens", str(n_new), "--dp", "2", "--json")
    assert dp.returncode == 0, dp.stderr
    dp = json.loads(dp.stdout)
    single = json.loads(_cli("generate", str(built.bundle), *args, "--max-new-tokens", str(n_new), "--json").stdout)
    r0, r1 = dp["ranks"]
    assert len(r0["steps"]) == len(r1["steps"]) == n_new - 1
    assert [s["label"] for s in r0["steps"]] == [s["label"] for s in r1["steps"]]
    assert r0["collectives"] == r1["collectives"] == n_new - 1  # exactly one all-reduce per step
    assert sorted({s["ctx"] for s in r0["steps"]}) == [128, 256, 512]  # both boundaries crossed
    assert dp["tokens"] == single["tokens"]
    assert dp["decode_seconds"] == pytest.approx(max(r["decode_seconds"] for r in dp["ranks"]), abs=1e-6)
    assert dp["tokens_per_second"] > 0
    if case == "uneven":  # rank 1 holds one request but runs rank 0's batch-4 bucket
        assert {s["batch"] for s in r1["steps"]} == {4}


def test_stepper_fails_closed_before_running_anything():
    from neffbuild.errors import StepInputError
    from neffbuild.runtime.kv.cache import KVLayout
    from neffbuild.runtime.step.stepper import StepBatch, Stepper
    from neffbuild.serve.eager import EagerArtifacts

    ran = []

    class Recording(EagerArtifacts):
        def artifact(self, label):
            ran.append(label)

    step = Stepper(Recording(Grid((1, 2), (128,), 256), KVLayout(1, 64, 1, 16, 4), 8, None))
    table = torch.arange(1, 17).repeat(3, 1)
    with pytest.raises(ShapeNotCovered, match="batch of 3 requests is above the largest num_seqs bucket 2"):
        step.step(StepBatch([[1]] * 3, [5] * 3, {"full": table}))
    with pytest.raises(ShapeNotCovered, match="needed context 257 is above max_model_len 256"):
        step.step(StepBatch([[1], [1]], [256, 3], {"full": table[:2]}))
    with pytest.raises(StepInputError, match=r"rows \[1\] run 2 tokens; must be 1 to 1\+k \(1\)"):
        step.step(StepBatch([[1], [1, 2]], [5, 5], {"full": table[:2]}))
    with pytest.raises(StepInputError, match="must be \\[R=2, W>=1\\]"):
        step.step(StepBatch([[1], [1]], [5, 5], {"full": table}))
    assert ran == []


def test_verify_refuses_nan_weights_with_recomputed_digests(built, tmp_path):
    """NaN weights whose digests were recomputed passed verify, and generate printed zeros."""
    import hashlib
    import json
    import shutil
    import struct

    from neffbuild.bundle import manifest as manifest_mod
    from tests.helpers import cli

    root = tmp_path / built.bundle.name
    shutil.copytree(built.bundle, root)
    wpath = root / "weights" / "model.safetensors"
    raw = bytearray(wpath.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name, info = next((k, v) for k, v in sorted(header.items()) if k != "__metadata__" and v["dtype"] == "F32")
    at = 8 + n + info["data_offsets"][0]
    raw[at:at + 4] = struct.pack("<f", float("nan"))
    wpath.write_bytes(bytes(raw))
    m = json.loads((root / "manifest.json").read_text())
    m["files"]["weights/model.safetensors"]["sha256"] = hashlib.sha256(raw).hexdigest()
    text = manifest_mod.dumps(m)
    (root / "manifest.json").write_text(text)
    (root / "manifest.sha256").write_text(f"{hashlib.sha256(text.encode()).hexdigest()}  manifest.json\n")
    res = cli("verify", str(root), "--json")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    [problem] = json.loads(res.stdout)["problems"]
    assert problem["path"] == "weights/model.safetensors" and name in problem["message"] and "NaN" in problem["message"]
    assert cli("verify", str(built.bundle)).returncode == 0


def test_nonfinite_finds_nan_and_inf_and_not_an_overflowing_sum(tmp_path):
    from safetensors.torch import save_file

    from neffbuild.runtime.bundle import weights_file

    big = torch.full((8,), 3e38)  # finite values whose float32 sum overflows: the exact test clears them
    nan, inf = torch.zeros(10), torch.ones(3, 3, dtype=torch.bfloat16)
    nan[7], inf[2, 1] = float("nan"), float("-inf")
    ints = torch.full((4,), 255, dtype=torch.uint8)  # packed MXFP4 bytes: not floats, not read
    path = tmp_path / "w.safetensors"
    save_file({"big": big, "nan": nan, "inf": inf, "ints": ints, "ok": torch.randn(100)}, str(path))
    assert weights_file.nonfinite(path) == ["inf", "nan"]
