"""Sharded bundles end to end: compiled tp/ep/dp artifacts in real gloo processes vs the unsharded model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.dist_util import run_ranks
from tests.helpers import cli

pytestmark = pytest.mark.slow

# Prompts of different lengths; the 120-token one crosses the 128 context bucket while decoding.
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9], list(range(10, 130)), [200, 201]]
N_NEW = 12


_cli = cli  # in-process; `generate` starts the ranks' processes itself


def _generate(bundle, prompts, *extra):
    args = [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]
    res = _cli("generate", str(bundle), *args, "--max-new-tokens", str(N_NEW), "--json", *extra)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def _unsharded_tokens(checkpoint, bundle, prompts):
    """The tp-1 tokens of the same recipe: the eager unsharded model on the checkpoint's own weights."""
    from neffbuild.models.gpt_oss import weights as W
    from neffbuild.models.gpt_oss.config import GptOssConfig
    from neffbuild.models.gpt_oss.sharding import unshard
    from neffbuild.runtime.bundle import reader, weights_file
    from neffbuild.runtime.parallel import ParallelLayout
    from neffbuild.serve.requests import from_prompts
    from neffbuild.serve.result import reference_tokens

    m = reader.read_manifest(Path(bundle))
    cfg = GptOssConfig.from_hf_dict(m["graph_inputs"]["model_config"])
    parts = {n: weights_file.load(Path(bundle) / e["file"], e["tensors"]) for n, e in m["parallel"]["pieces"].items()}
    parts["shared"] = weights_file.load(Path(bundle) / m["weights"]["file"], m["weights"]["tensors"])
    joined = unshard(cfg, parts, ParallelLayout.from_json(m["parallel"]))
    want = W.model_weights(cfg, checkpoint, None)
    assert joined.keys() == want.keys() and all(torch.equal(joined[k], want[k]) for k in want)
    return reference_tokens(str(bundle), from_prompts(prompts, N_NEW))


def test_tp2_ep2_tokens_equal_tp1_across_bucket_boundary(built_tp2, small_checkpoint):
    out = _generate(built_tp2.bundle, PROMPTS, "--check")
    assert out["check"]["ok"], out["check"]
    assert out["tokens"] == _unsharded_tokens(small_checkpoint, built_tp2.bundle, PROMPTS)
    assert [r["rank"] for r in out["ranks"]] == [0, 1]
    labels = [[s["label"] for s in r["steps"]] for r in out["ranks"]]
    assert labels[0] == labels[1]
    assert {"decode_b4_ctx128", "decode_b4_ctx512"} <= set(labels[0])  # crossed the bucket boundary


def test_dp2_ep2_each_rank_gets_single_process_tokens(built_dp2_ep2, small_checkpoint):
    """Experts split across the two DP ranks (gather + reduce-scatter inside the artifact); uneven
    prompt counts and lengths (rank 0 gets 2 prompts, rank 1 gets 1, so it also runs idle rows)."""
    prompts = PROMPTS[:3]
    out = _generate(built_dp2_ep2.bundle, prompts)
    assert out["tokens"] == _unsharded_tokens(small_checkpoint, built_dp2_ep2.bundle, prompts)
    r0, r1 = out["ranks"]
    assert (r0["dp_rank"], r1["dp_rank"]) == (0, 1)
    assert len(r0["steps"]) == len(r1["steps"]) == N_NEW - 1
    assert [s["label"] for s in r0["steps"]] == [s["label"] for s in r1["steps"]]


def test_sharded_bundle_refuses_a_world_of_one(built_tp2):
    from neffbuild.errors import IncompatibleBundle
    from neffbuild.runtime.bundle.reader import open_bundle

    with pytest.raises(IncompatibleBundle, match=r"compiled for tp 2 x dp 1 = 2 ranks.*world of 1.*start 2 processes"):
        open_bundle(built_tp2.bundle)
    res = _cli("generate", str(built_tp2.bundle), "--prompt-ids", "1,2", "--dp", "2")
    assert res.returncode == 2 and "compiled for dp 1" in res.stderr


def _mapped(rank, world, bundle):
    from neffbuild.runtime.bundle.reader import open_bundle

    b = open_bundle(bundle)
    maps = Path("/proc/self/maps").read_text()
    files = sorted(p.name for p in (Path(bundle) / "weights").iterdir() if str(p) in maps)
    return files, {k: tuple(v.shape) for k, v in b.weights.items()}


def test_rank_maps_only_its_pieces_and_manifest_records_layout(built_tp2):
    from neffbuild.models.gpt_oss.config import GptOssConfig
    from neffbuild.models.gpt_oss.sharding import TP_SPLIT, rank_shapes
    from neffbuild.models.gpt_oss.weights import stacked_shapes
    from neffbuild.runtime.parallel import ParallelLayout

    m = json.loads((built_tp2.bundle / "manifest.json").read_text())
    par = m["parallel"]
    assert (par["tp"], par["dp"], par["ep"], par["world_size"], par["ep_combine"]) == (2, 1, 2, 2, "all_reduce")
    assert sorted(par["pieces"]) == ["ep0", "ep1", "tp0", "tp1"]
    assert par["shard_layout"]["o_w"] == {"over": "tp", "axis": 2}
    cfg = GptOssConfig.from_hf_dict(m["graph_inputs"]["model_config"])
    entries = [m["weights"], *par["pieces"].values()]
    numel = sum(math.prod(t["shape"]) for e in entries for t in e["tensors"].values())
    assert numel == sum(math.prod(s) for s in stacked_shapes(cfg).values())  # every weight stored exactly once
    assert set(par["pieces"]["tp1"]["tensors"]) == set(TP_SPLIT) and not set(TP_SPLIT) & set(m["weights"]["tensors"])
    results = run_ranks(_mapped, 2, built_tp2.bundle)
    assert results[0][0] == ["ep0.safetensors", "model.safetensors", "tp0.safetensors"]
    assert results[1][0] == ["ep1.safetensors", "model.safetensors", "tp1.safetensors"]
    assert results[0][1] == rank_shapes(cfg, ParallelLayout(2, 1, 2))
    shown = _cli("inspect", str(built_tp2.bundle))
    assert "parallel: tp 2 x dp 1 = 2 ranks, ep 2" in shown.stdout.replace("\n", " ")
    assert json.loads(_cli("inspect", str(built_tp2.bundle), "--json").stdout)["parallel"]["pieces"]["tp1"]["file"] == \
        "weights/tp1.safetensors"
