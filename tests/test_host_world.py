"""A host engine's world: the runtime opens a bundle onto process groups the caller made (as vLLM makes its
TP, EP and DP groups), runs the DP collective over the group it is handed, counts collectives per Stepper, and
lets an idle rank complete a busy rank's collective with the documented empty step. Real gloo processes."""

from __future__ import annotations

import pytest
import torch

from tests.dist_util import run_ranks

STEPS = [([[5], [7]], [3, 9]), ([[11], [13]], [4, 10]), ([[2]], [130])]  # the last crosses the 128 bucket


def _tables(n: int) -> dict:
    rows = torch.arange(1, 1 + 16 * n).reshape(n, 16)
    return {"full": rows, "sliding": rows + 16 * n}


def _eager_stepper(group):
    from neffbuild import recipe as R
    from neffbuild.models.gpt_oss.weights import model_weights
    from neffbuild.runtime import Grid, KVLayout, Stepper
    from neffbuild.serve.rank import eager_artifacts
    from tests.helpers import TINY

    cfg = R.load(TINY).model.config
    layout = KVLayout(cfg.num_kv_buffers, 80, cfg.num_key_value_heads, 16, cfg.head_dim)
    return Stepper(eager_artifacts(cfg, model_weights(cfg, None, 0), Grid((1, 2), (128,), 512), layout, 8),
                   group=group)


def _dp_on_caller_groups(rank, world):
    """Rank 0 decodes, rank 1 is idle; once over the world group, once over a group the test made."""
    import torch.distributed as dist

    from neffbuild.runtime import StepBatch

    mine = dist.new_group([0, 1])  # the caller's group, as a host engine's DP group
    out = {}
    for name, group in (("world", dist.group.WORLD), ("caller", mine)):
        step = _eager_stepper(group)
        labels = []
        for tokens, computed in STEPS:
            if rank == 0:
                res = step.step(StepBatch(tokens, computed, _tables(len(tokens))))
            else:
                res = step.idle()
                assert res.logits.shape[0] == 0  # no rows of its own: the synced artifact ran on padding only
            labels.append(res.plan.label)
        out[name] = {"labels": labels, "collectives": step.collectives}
    return out


def test_dp_steps_over_the_callers_group_equal_the_world_group_and_idle_ranks_complete_them():
    r0, r1 = run_ranks(_dp_on_caller_groups, 2)
    assert r0["world"]["labels"] == r1["world"]["labels"] == r0["caller"]["labels"] == r1["caller"]["labels"]
    assert r0["world"]["labels"] == ["decode_b2_ctx128", "decode_b2_ctx128", "decode_b1_ctx512"]
    # One all-reduce per step, counted by each Stepper (two in each process), not by a process-wide counter.
    assert {r["world"]["collectives"] for r in (r0, r1)} == {r["caller"]["collectives"] for r in (r0, r1)} == {3}


def _sharded_on_host_groups(rank, world, bundle):
    import torch.distributed as dist

    from neffbuild.runtime import HostGroups, StepBatch, Stepper, open_bundle

    def run(b):
        step = Stepper(b, group=b.group)
        return [step.step(StepBatch(t, c, _tables(len(t)))).logits for t, c in STEPS]

    ours = run(open_bundle(bundle))  # neffbuild makes the TP and EP groups (world.join)
    tp, ep, tp_eager, ep_eager = (dist.new_group([0, 1]) for _ in range(4))  # the host's groups, made here
    hosted = open_bundle(bundle, host_groups=HostGroups(rank, tp=tp, ep=ep, dp=None, eager_tp=tp_eager,
                                                        eager_ep=ep_eager))
    assert hosted.context.rank == rank and hosted.group is None
    theirs = run(hosted)
    return all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), [x.shape for x in theirs]


@pytest.mark.slow
def test_a_sharded_bundle_opened_on_the_hosts_groups_runs_the_same_steps(built_tp2):
    results = run_ranks(_sharded_on_host_groups, 2, built_tp2.bundle)
    for same, shapes in results:
        assert same and [tuple(s[:2]) for s in shapes] == [(2, 1), (2, 1), (1, 1)]


def _wrong_sizes(rank, world, bundle):
    import torch.distributed as dist

    from neffbuild.errors import IncompatibleBundle
    from neffbuild.runtime import HostGroups, open_bundle

    lonely = [dist.new_group([r]) for r in range(2)][rank]
    try:
        open_bundle(bundle, host_groups=HostGroups(rank, tp=lonely, ep=lonely))
    except IncompatibleBundle as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_host_groups_of_the_wrong_size_are_refused_naming_both(built_tp2):
    for msg in run_ranks(_wrong_sizes, 2, built_tp2.bundle):
        assert msg is not None and "its tp group has 2 ranks, the host's has 1" in msg
