"""Session fixtures: the compiled test bundles every end-to-end test reuses (each a ``TestBundle``,
tests/helpers.py), built once per session through one compile cache (``build_cache``).

AOTInductor compiles per cold run (CI): built 6, fp8_built 1, built_tp2 2, built_dp2_ep2 1, eagle3_built 6,
production_built 3 (19), the vLLM modules' 11 (the stream module's bundle is the serve module's graphs, the EAGLE3
module's ``eagle3_built``'s: tests/vllm_helpers.eagle3_recipe) and the serving-dtype modules' 5, and ~15 in the
tests about compiling (58 in a run measured 2026-12-07 before the EAGLE3 graphs were shared, 10 of them taking g++'s
objects from an earlier compile of the same code: compiler/backends/objects.py). Every one is of the 2-layer
test model (one sliding, one full layer: both attention kinds, the one buffer pair, every bucket and family as
before): a 2-layer graph compiles in about 60 % of a 4-layer one. The 4-layer ``hf_checkpoint`` stays for the eager
model tests (oracle vs transformers, prefill vs decode), which compile nothing.
"""

import copy
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import (  # noqa: F401 - re-exported: tests import these from tests.conftest too
    EAGLE3_TINY,
    POOL,
    ROOT,
    STANDIN,
    TINY,
    TestBundle,
    assert_failed_target,
    build_bundle,
    cli,
    neuron_recipe,
    standin_env,
    write_recipe,
)
from tests.s3_server import s3_server  # noqa: F401  (the moto S3 server fixture, for every test module)

os.environ.setdefault("NEFFBUILD_CACHE_DIR", str(ROOT / ".ci-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the oracle model is built locally; never reach a hub
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One core per xdist worker: two workers whose steps each run an OpenMP team as wide as the host spin for
    # each other's cores. Subprocesses (CLI runs, ranks, compile workers) inherit the setting.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# Fixtures that compile (or hand out something compiled): a test using one is `slow` whatever its own marks
# say, so `make test-fast` (-m "not slow") compiles nothing.
COMPILED_FIXTURES = {"built", "fp8_built", "built_fp8", "built_tp2", "built_dp2_ep2", "eagle3_built",
                     "production_built", "neuron_bundle", "build_cache", "compile_pool", "ray_cluster",
                     "home"}  # test_json_output's cold build

# `make test` runs three pytest-xdist workers (--dist loadgroup). Every test of a fixture named here runs on
# one worker, so that fixture is built once: the Ray module's instance, the two 6-graph bundles that only
# a few tests use, the stand-in's bundle (its own cache), and the module fixtures that compile into caches of
# their own (test_remote_cache's first push, test_cpu_target's v2 build), and the small session bundles few tests
# use (tp2, dp2 x ep2, fp8), and the vLLM serve module's fixture (its native vLLM run and its one `vllm serve`
# start once, on one worker, not once per worker that draws one of its tests): xdist starts every group (largest
# first) before the ungrouped tests, so each compile happens early, while the other worker has work, and not in
# the run's tail (the dp2 x ep2 compile was last).
# A test of two groups' fixtures takes the first group named. The rest spread over both workers; a bundle both
# need is compiled once anyway (one compile cache for the run, `build_cache`: a key's lock makes the second
# worker take the first's entry).
XDIST_GROUPS = ("ray_cluster", "production_built", "eagle3_built", "neuron_bundle", "first_push", "v2_build",
                "built_tp2", "built_dp2_ep2", "fp8_built", "vllm_setup", "vllm_dtype_bundles", "vllm_stream",
                "vllm_spec", "vllm_parallel", "home")


def pytest_configure(config):
    """CPU-seconds per module at the end of a run (tests/cpu_account.py): what sets the suite's length."""
    from tests import cpu_account

    config.pluginmanager.register(cpu_account, "neffbuild_cpu_account")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    grouped = set()  # ids of the grouped items
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if COMPILED_FIXTURES & names:
            item.add_marker(pytest.mark.slow)
        group = next((g for g in XDIST_GROUPS if g in names), None)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
            _group_suffix(config, item, group)
            grouped.add(id(item))
    if _loadgroup_worker(config):
        # --dist loadgroup queues work units largest first, and a group of one test ties with every ungrouped
        # test, so it kept its collection place: the dp2 x ep2 bundle's compile (its group's one test, in
        # test_parallel_bundle) started in the run's last minute and was its tail. Every grouped test goes first
        # (a stable sort: the order inside a group and among the rest is unchanged), so each group's compile
        # starts while both workers still have work and the run ends on short ungrouped tests.
        items.sort(key=lambda item: id(item) not in grouped)


def _group_suffix(config, item, group: str) -> None:
    """``--dist loadgroup`` schedules by a ``@group`` node-id suffix that pytest-xdist 3.8 writes into
    ``item._nodeid``, which pytest >= 9.2 no longer reads (the id is ``item._id`` there): every test became its
    own unit and each worker built the Ray instance and the grouped bundles again. Write it where xdist's
    write would not take (``pytest_collection_finish`` checks that it shows)."""
    if _loadgroup_worker(config) and not hasattr(item, "_nodeid"):
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(f"{item.nodeid}@{group}")


def _loadgroup_worker(config) -> bool:
    return bool(os.environ.get("PYTEST_XDIST_WORKER") and getattr(config.option, "loadgroup", False))


def pytest_collection_finish(session):
    if not _loadgroup_worker(session.config):
        return
    for item in session.items:
        group = next((m.args[0] for m in item.iter_markers("xdist_group") if m.args), None)
        if group and not item.nodeid.endswith(f"@{group}"):
            raise pytest.UsageError(f"{item.nodeid}: its xdist group {group!r} did not reach the node id, so "
                                    "--dist loadgroup would run its tests on both workers (pytest/xdist versions)")


@pytest.fixture
def failing_cxx(tmp_path):
    """A C++ compiler that refuses every compile: env for a real compile failure (recipe flags cannot
    fail a build on purpose any more: they come from an allow-list). Its --version is the real
    compiler's, so the cache keys (which name the compiler) stay those of the session's builds and
    only the target the test changes is compiled: a broken toolchain under the same identity."""
    real = shutil.which("g++") or "g++"
    script = tmp_path / "failing-cxx"
    script.write_text(f'#!/bin/sh\ncase "$1" in --version) exec {real} --version;; esac\n'
                      'echo "failing-cxx: this compiler refuses every translation unit" >&2\nexit 1\n')
    script.chmod(0o755)
    return {"CXX": str(script)}


@pytest.fixture
def tiny_raw():
    return copy.deepcopy(yaml.safe_load(TINY.read_text()))


@pytest.fixture(scope="session")
def tiny_recipe():
    from neffbuild import recipe

    return recipe.load(TINY)


@pytest.fixture(scope="session")
def tiny_cfg(tiny_recipe):
    return tiny_recipe.model.config


def _save_hf(folder: Path, cfg) -> Path:
    import transformers

    from neffbuild.models.gpt_oss.weights import random_state_dict

    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**cfg.to_hf_dict()))
    missing, unexpected = model.load_state_dict(random_state_dict(cfg, seed=0), strict=True)
    assert not missing and not unexpected
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory, tiny_cfg):
    """A random GptOssForCausalLM saved by transformers (safetensors), non-degenerate weights."""
    return _save_hf(tmp_path_factory.mktemp("hf_tiny"), tiny_cfg)


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory, tiny_cfg):
    """The same model cut to 2 layers (one sliding, one full: the fewest gk_decode allows), saved the same way:
    the model of every compiled test bundle (each compile costs about 60 % of a 4-layer one, on the same paths;
    no test bundle's point is the layer count)."""
    from neffbuild.models.gpt_oss.config import GptOssConfig

    hf = dict(tiny_cfg.to_hf_dict(), num_hidden_layers=2)
    hf.pop("layer_types")
    return _save_hf(tmp_path_factory.mktemp("hf_small"), GptOssConfig.from_hf_dict(hf))


@pytest.fixture(scope="session")
def build_cache(tmp_path_factory):
    """The session bundles' compile cache: a fresh folder (one for all xdist workers of a run), or
    NEFFBUILD_TEST_CACHE when a developer sets it (compiled test graphs then survive between runs; CI never
    sets it, so CI always compiles cold)."""
    shared = os.environ.get("NEFFBUILD_TEST_CACHE")
    if shared:
        Path(shared).mkdir(parents=True, exist_ok=True)
        return Path(shared)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one cache for every worker of this run (their common base temp)
        folder = tmp_path_factory.getbasetemp().parent / "build-cache"
        folder.mkdir(exist_ok=True)
        return folder
    return tmp_path_factory.mktemp("cache")


def _session_bundle(tmp_path_factory, checkpoint, cache, pool, name: str, **changes) -> TestBundle:
    folder = tmp_path_factory.mktemp(name)
    return build_bundle(folder, cache, write_recipe(folder, checkpoint, name=name, **changes), executor=pool)


@pytest.fixture(scope="session")
def compile_pool():
    """One warm local pool of 2 workers for every session bundle (a fresh pool per build would pay the
    workers' start-up, torch and inductor included, once per bundle)."""
    from neffbuild.compiler.executor import LocalExecutor

    pool = LocalExecutor(2, keep_warm=True)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def built(tmp_path_factory, small_checkpoint, build_cache, compile_pool):
    """The test recipe: b1, b4 x ctx 128, 256 + fallback 512 (6 targets)."""
    return _session_bundle(tmp_path_factory, small_checkpoint, build_cache, compile_pool, "gpt-oss-test")


@pytest.fixture(scope="session")
def fp8_built(tmp_path_factory, small_checkpoint, build_cache, compile_pool):
    """One packed-FP8-KV artifact (decode_b4_ctx512)."""
    return _session_bundle(tmp_path_factory, small_checkpoint, build_cache, compile_pool, "fp8", num_seqs_buckets=[4],
                           ctx_buckets=[512], neuron_config__fp8_packed_kv=True)


@pytest.fixture(scope="session")
def built_fp8(fp8_built):
    """The same packed-FP8-K bundle (b4, fallback context 512): the BuildResult."""
    return fp8_built.result


@pytest.fixture(scope="session")
def neuron_bundle(tmp_path_factory, small_checkpoint):
    """`neffbuild compile` of a backend: neuron recipe through the stand-in SDK (a subprocess: the stand-in
    must not enter this process): a TestBundle whose ``env`` loads it."""
    folder = tmp_path_factory.mktemp("neuron")
    env = standin_env(folder / "cache")
    path = neuron_recipe(folder, small_checkpoint, "gpt-oss-neuron")
    out = cli("compile", path, "-o", folder / "out", "--jobs", "2", env=env, process=True)
    assert out.returncode == 0, out.stderr
    return TestBundle(path, folder / "out" / "gpt-oss-neuron-0.1.0", env=env)


def _parallel(tmp_path_factory, checkpoint, cache, pool, name: str, parallel: dict, ctx_buckets: list[int]):
    return _session_bundle(tmp_path_factory, checkpoint, cache, pool, name, num_seqs_buckets=[4],
                           ctx_buckets=ctx_buckets, **{f"parallel__{k}": v for k, v in parallel.items()})


@pytest.fixture(scope="session")
def built_tp2(tmp_path_factory, small_checkpoint, build_cache, compile_pool):
    """A tp 2 / ep 2 bundle of the test recipe: 2 targets (one context bucket and the fallback)."""
    return _parallel(tmp_path_factory, small_checkpoint, build_cache, compile_pool, "gpt-oss-tp2", {"tp": 2, "ep": 2},
                     [128])


@pytest.fixture(scope="session")
def built_dp2_ep2(tmp_path_factory, small_checkpoint, build_cache, compile_pool):
    """A dp 2 / ep 2 bundle (experts across DP ranks: the gather combine): 1 target (the fallback only)."""
    return _parallel(tmp_path_factory, small_checkpoint, build_cache, compile_pool, "gpt-oss-dp2-ep2",
                     {"dp": 2, "ep": 2}, [512])


@pytest.fixture(scope="session")
def eagle3_built(tmp_path_factory, build_cache, compile_pool):
    """The suite's EAGLE3 bundle (``vllm_helpers.eagle3_recipe``: k = 3, batch bucket 2, context 128 and the
    fallback 256, 1 x 2 x 3 = 6 targets) on a random 2-layer target of the vLLM tests' shape and a random draft.

    Every spec test runs two requests (a DP rank with one is padded to the synced batch), so a b1 artifact would
    never be dispatched. test_vllm_spec.py's bundle has the same graphs with other weights: whichever of the two
    builds first compiles them, the other finds them in the run's cache."""
    from tests.vllm_helpers import eagle3_recipe, save_checkpoint, save_draft

    folder = tmp_path_factory.mktemp("eagle3")
    checkpoint = save_checkpoint(folder / "ckpt")
    path = eagle3_recipe(folder, checkpoint, save_draft(folder / "draft", checkpoint), name="gpt-oss-tiny-eagle3")
    return build_bundle(folder, build_cache, path, executor=compile_pool)


def _two_layer_copy(recipe_path: Path, folder: Path, **changes) -> Path:
    """A shipped inline-config recipe cut to 2 target layers (one sliding, one full, as ``small_checkpoint``), with
    ``section__key`` changes: each graph compiles in about 60 % of a 4-layer one, through the same code (the
    draft's aux layers then repeat a layer, which the fusion treats as any three target layers)."""
    raw = yaml.safe_load(recipe_path.read_text())
    raw["model"]["config"]["num_hidden_layers"] = 2
    for key, value in changes.items():
        section, name = key.split("__")
        raw[section][name] = value
    path = folder / recipe_path.name
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance (2 CPUs, this machine) for the module that asks (tests/test_ray_build.py alone); yields
    its address for CLI drivers. Per module, not per session: an idle instance (GCS, raylet, its agents and idle
    workers) took about 2.4 CPU-seconds a minute for the rest of a run after its tests had finished."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=256 << 20,
             _system_config={"worker_niceness": 0})  # compile at the test's priority, not Ray's background one
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


PRODUCTION_TINY = ROOT / "recipes" / "gpt-oss-tiny-production.yaml"


@pytest.fixture(scope="session")
def production_built(tmp_path_factory, build_cache, compile_pool):
    """The production case on the tiny model (EAGLE3, packed FP8, tp 2 x dp 2 x ep 4): 3 targets; the bundle.

    recipes/gpt-oss-tiny-production.yaml with 2 target layers (its parallel layout, draft and KV format as
    shipped) and its context buckets folded into the fallback (256, max_model_len): the three families of one
    context, through the session's warm pool. Crossing context buckets is eagle3_built's (tests/test_spec.py);
    the shipped grid's second context would add three sharded compiles (about 75 CPU-seconds) and no path."""
    folder = tmp_path_factory.mktemp("production")
    path = _two_layer_copy(PRODUCTION_TINY, folder, neuron_config__decode_context_length_buckets=[256])
    return build_bundle(folder, build_cache, path, executor=compile_pool).bundle
