import copy
import os
from pathlib import Path

import pytest
import yaml

from tests.s3_server import s3_server  # noqa: F401  (the moto S3 server fixture, for every test module)

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "recipes" / "gpt-oss-tiny.yaml"
# Test bundles use a prime KV pool: any generated loop bound divisible by it scales with the
# pool (neffbuild/compiler/codegen.py), which tests/test_stepcost.py forbids.
POOL = 509

os.environ.setdefault("NEFFBUILD_CACHE_DIR", str(ROOT / ".ci-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the oracle model is built locally; never reach a hub


def assert_failed_target(res, out_dir: Path, *, label: str, cached: int, needle: str) -> dict:
    """A `compile --json` with one target failing: exit 1, no bundle, the failure classified and its log kept."""
    import json

    assert res.returncode == 1, res.stderr
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert doc["bundle"] is None and doc["cached"] == cached
    [fail] = doc["failed"]
    assert fail["label"] == label and fail["kind"] == "compiler_error"
    assert needle in Path(fail["log"]).read_text()
    assert not (out_dir / "gpt-oss-test-0.1.0").exists()
    assert "Traceback" not in res.stderr and label in res.stderr
    return doc


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


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory, tiny_cfg):
    """A random GptOssForCausalLM saved by transformers (safetensors), non-degenerate weights."""
    import transformers

    from neffbuild.models.gpt_oss.weights import random_state_dict

    folder = tmp_path_factory.mktemp("hf_tiny")
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**tiny_cfg.to_hf_dict()))
    missing, unexpected = model.load_state_dict(random_state_dict(tiny_cfg, seed=0), strict=True)
    assert not missing and not unexpected
    model.save_pretrained(folder)
    return folder


def write_recipe(folder: Path, checkpoint: Path, **changes) -> Path:
    """The test bundle's recipe: the tiny model from a transformers checkpoint, 6 targets."""
    raw = yaml.safe_load(TINY.read_text())
    raw["name"] = changes.pop("name", "gpt-oss-test")
    raw["model"] = {"arch": "gpt_oss", "checkpoint": str(checkpoint)}
    raw["neuron_config"]["num_seqs_buckets"] = changes.pop("num_seqs_buckets", [1, 4])
    raw["neuron_config"]["decode_context_length_buckets"] = changes.pop("ctx_buckets", [128, 256])
    raw["serving"]["num_blocks"] = changes.pop("num_blocks", POOL)
    for key, value in changes.items():
        section, name = key.split("__")
        raw.setdefault(section, {})[name] = value
    path = folder / f"{raw['name']}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="session")
def build_cache(tmp_path_factory):
    """The session bundles' compile cache: a fresh folder, or NEFFBUILD_TEST_CACHE when a developer sets it
    (compiled test graphs then survive between runs; CI never sets it, so CI always compiles cold)."""
    shared = os.environ.get("NEFFBUILD_TEST_CACHE")
    if shared:
        Path(shared).mkdir(parents=True, exist_ok=True)
        return Path(shared)
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def built(tmp_path_factory, hf_checkpoint, build_cache):
    """Compile the test recipe once per session: (recipe path, BuildResult)."""
    from neffbuild import recipe
    from neffbuild.compiler.builder import compile_recipe

    folder = tmp_path_factory.mktemp("build")
    path = write_recipe(folder, hf_checkpoint)
    res = compile_recipe(recipe.load(path), folder / "out", jobs=2, cache_root=build_cache)
    assert not res.failed, res.failed
    return path, res


@pytest.fixture(scope="session")
def fp8_built(tmp_path_factory, hf_checkpoint, build_cache):
    """One packed-FP8-KV artifact (decode_b4_ctx512): (recipe path, BuildResult)."""
    from neffbuild import recipe
    from neffbuild.compiler.builder import compile_recipe

    folder = tmp_path_factory.mktemp("fp8")
    path = write_recipe(folder, hf_checkpoint, name="fp8", num_seqs_buckets=[4], ctx_buckets=[512],
                        neuron_config__fp8_packed_kv=True)
    res = compile_recipe(recipe.load(path), folder / "out", jobs=1, cache_root=build_cache)
    assert not res.failed, res.failed
    return path, res


@pytest.fixture(scope="session")
def built_fp8(fp8_built):
    """The same packed-FP8-K bundle (b4, fallback context 512): the BuildResult."""
    return fp8_built[1]


# The Neuron SDK stand-in (tests/sdk_standin): on the path only where a test asks for it.
STANDIN = ROOT / "tests" / "sdk_standin"


def standin_env(cache: Path, **extra) -> dict:
    """Environment for a subprocess that sees the stand-in SDK as if it were installed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(STANDIN)]), NEFFBUILD_CACHE_DIR=str(cache))
    env.pop("NEURON_LOGICAL_NC_CONFIG", None)
    return {**env, **extra}


def neuron_recipe(folder: Path, checkpoint: Path, name: str, num_seqs_buckets=(1, 2), ctx_buckets=(128,)) -> Path:
    """A backend: neuron recipe for trn2 with LNC 2 (the stand-in host's default)."""
    return write_recipe(folder, checkpoint, name=name, num_seqs_buckets=list(num_seqs_buckets),
                        ctx_buckets=list(ctx_buckets), serving__max_num_seqs=num_seqs_buckets[-1],
                        compiler__backend="neuron", neuron_config__lnc=2)


@pytest.fixture(scope="session")
def neuron_bundle(tmp_path_factory, hf_checkpoint):
    """`neffbuild compile` of a backend: neuron recipe through the stand-in SDK: (bundle path, env)."""
    import subprocess
    import sys

    folder = tmp_path_factory.mktemp("neuron")
    env = standin_env(folder / "cache")
    path = neuron_recipe(folder, hf_checkpoint, "gpt-oss-neuron")
    out = subprocess.run([sys.executable, "-m", "neffbuild.cli.main", "compile", str(path), "-o", str(folder / "out"),
                          "--jobs", "2"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    return folder / "out" / "gpt-oss-neuron-0.1.0", env


def _build_parallel(tmp_path_factory, checkpoint, cache, name: str, parallel: dict, ctx_buckets: list[int]):
    from neffbuild import recipe
    from neffbuild.compiler.builder import compile_recipe

    folder = tmp_path_factory.mktemp(name)
    path = write_recipe(folder, checkpoint, name=name, num_seqs_buckets=[4], ctx_buckets=ctx_buckets,
                        **{f"parallel__{k}": v for k, v in parallel.items()})
    res = compile_recipe(recipe.load(path), folder / "out", jobs=2, cache_root=cache)
    assert not res.failed, res.failed
    return res.bundle


@pytest.fixture(scope="session")
def built_tp2(tmp_path_factory, hf_checkpoint, build_cache):
    """A tp 2 / ep 2 bundle of the test recipe: 2 targets (one context bucket and the fallback)."""
    return _build_parallel(tmp_path_factory, hf_checkpoint, build_cache, "gpt-oss-tp2", {"tp": 2, "ep": 2}, [128])


@pytest.fixture(scope="session")
def built_dp2_ep2(tmp_path_factory, hf_checkpoint, build_cache):
    """A dp 2 / ep 2 bundle (experts across DP ranks: the gather combine): 1 target (the fallback only)."""
    return _build_parallel(tmp_path_factory, hf_checkpoint, build_cache, "gpt-oss-dp2-ep2", {"dp": 2, "ep": 2}, [512])


EAGLE3_TINY = ROOT / "recipes" / "gpt-oss-tiny-eagle3.yaml"


@pytest.fixture(scope="session")
def eagle3_built(tmp_path_factory, build_cache):
    """The tiny EAGLE3 recipe compiled once per session (2 x 2 x 3 = 12 targets): (recipe path, BuildResult)."""
    from neffbuild import recipe
    from neffbuild.compiler.builder import compile_recipe

    folder = tmp_path_factory.mktemp("eagle3")
    res = compile_recipe(recipe.load(EAGLE3_TINY), folder / "out", jobs=2, cache_root=build_cache)
    assert not res.failed, res.failed
    return EAGLE3_TINY, res


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance per session (2 CPUs, this machine); yields its address for CLI drivers."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=256 << 20,
             _system_config={"worker_niceness": 0})  # compile at the test's priority, not Ray's background one
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
