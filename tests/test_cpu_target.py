"""ISA-safe inductor artifacts: compiler.target picks -march, is part of the key and the manifest, and a
host lacking a required CPU feature refuses the bundle before any artifact code runs (1 compile)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from neffbuild import grid
from neffbuild import recipe as R
from neffbuild.compiler.backends import get_backend
from neffbuild.compiler.builder import compile_recipe
from neffbuild.errors import IncompatibleBundle
from neffbuild.runtime.bundle import cpu_features
from tests.conftest import ROOT, cli, write_recipe

FALLBACK_ONLY = {"num_seqs_buckets": [1], "ctx_buckets": [512], "serving__max_num_seqs": 1}  # 1 target: b1, ctx 512
x86 = pytest.mark.skipif(cpu_features.targets() == ("native",), reason="x86-64 micro-architecture levels only")


def test_default_target_is_the_portable_baseline_and_neuron_targets_mean_unset():
    fp = get_backend("inductor", target="trn2").fingerprint()
    assert fp["cpu_target"]["target"] == cpu_features.DEFAULT_TARGET or cpu_features.targets() == ("native",)
    assert fp["cxx"] and "unavailable" not in fp["cxx"]
    # the decode graph's attention traces in float32 on hosts without fast bf16 matmuls: two kinds, two keys
    assert fp["bf16_matmul"] == ("bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32")
    native = get_backend("inductor", target="native").fingerprint()["cpu_target"]
    assert native["march"] == "native" and set(native["features"]) <= cpu_features.host_features()


@pytest.mark.parametrize("value,ok", [("x86-64-v2", True), ("native", True), ("trn1", True), ("x86-64-v9", False),
                                      ("skylake", False)])
def test_recipe_takes_cpu_targets(tiny_raw, tmp_path, value, ok):
    import yaml

    from neffbuild.errors import RecipeError

    if value.startswith("x86-64-v2") and cpu_features.targets() == ("native",):
        pytest.skip("x86-64 levels exist on x86 only")
    tiny_raw["compiler"]["target"] = value
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_raw))
    if ok:
        assert R.load(path).target == value
        return
    with pytest.raises(RecipeError, match=r"compiler\.target"):
        R.load(path)


@x86
def test_target_sets_march_through_the_backend_and_recipe_flags_cannot(tiny_raw, tmp_path):
    """compiler.target reaches inductor's cpp.march/simdlen through the backend; the same options as
    compiler.flags are reserved (compiler/backends/flag_rules.py, checked by the validator and again in the backend)."""
    import yaml

    from neffbuild.compiler.backends.inductor import parse_flags
    from neffbuild.errors import InvalidInput, RecipeError

    tiny_raw["compiler"].update(backend="inductor", target="x86-64-v3")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_raw))
    r = R.load(path)
    cpu = get_backend("inductor", target=r.target).cpu
    assert (cpu["march"], cpu["simdlen"]) == ("x86-64-v3", 256)
    for flag in ("cpp.march=native", "cpp.simdlen=512"):
        tiny_raw["compiler"]["flags"] = [flag]
        path.write_text(yaml.safe_dump(tiny_raw))
        with pytest.raises(RecipeError, match=r"compiler\.flags"):
            R.load(path)
        with pytest.raises(InvalidInput, match="set by neffbuild itself"):
            parse_flags([flag])


def _cpp_build(*flags) -> dict:
    """What one compile of the inductor backend would run with: torch's default wrapper -O in this process,
    the configs the backend passes, its fingerprint, and the wrapper's optimisation flags under those configs."""
    import torch._inductor.config as c
    from torch._inductor.cpp_builder import _get_optimization_cflags

    from neffbuild.compiler.backends.inductor import InductorBackend

    b = InductorBackend(flags=flags)
    with c.patch(b.configs()):  # as aoti_compile_and_package applies them to each compile
        cflags = _get_optimization_cflags("g++", min_optimize=True)[0]  # min_optimize: the wrapper's build
    return {"torch_default": c.aot_inductor.compile_wrapper_opt_level, "configs": b.configs(),
            "fingerprint": b.fingerprint(), "wrapper_cflags": cflags}


def test_aot_inductor_environment_cannot_change_an_artifact_under_its_key():
    """AOT_INDUCTOR_* variables set torch's defaults when it imports (the wrapper's -O among them), and no key
    names them: the backend passes its own values, so a variable left in a shell changes neither the C++ build
    nor the fingerprint. A recipe flag that may change one (aot_inductor.debug_compile) is in the key."""
    plain = _cpp_build()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AOT_INDUCTOR_")}
    env.update(AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL="O0", AOT_INDUCTOR_ENABLE_LINE_TABLES="0",
               AOT_INDUCTOR_DEBUG_COMPILE="1", AOT_INDUCTOR_ENABLE_FRAME_POINTER="0")
    code = "import json; from tests.test_cpu_target import _cpp_build; print(json.dumps(_cpp_build()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    shell = json.loads(out.stdout.strip().splitlines()[-1])
    assert shell["torch_default"] == "O0"  # the variable reached torch's own config in that process
    if not any(k.startswith("AOT_INDUCTOR_") for k in os.environ):
        assert plain["torch_default"] == "O1"
    assert shell["configs"] == plain["configs"] and shell["fingerprint"] == plain["fingerprint"]
    assert shell["wrapper_cflags"] == plain["wrapper_cflags"]
    assert {"O1", "g1", "fno-omit-frame-pointer"} <= set(plain["wrapper_cflags"])
    assert "O0" not in plain["wrapper_cflags"]
    debug = _cpp_build("aot_inductor.debug_compile=true")
    assert "O0" in debug["wrapper_cflags"] and debug["fingerprint"]["flags"] == ["aot_inductor.debug_compile=true"]


@pytest.fixture(scope="module")
def v2_build(tmp_path_factory, small_checkpoint, compile_pool):
    """The 1-target bundle built for x86-64-v2 (1 compile, of the 2-layer test model: what is under test is the
    -march each C++ build gets and the key and manifest that record it): (recipe, cache dir, BuildResult).
    Through the session's warm pool, as the CLI's pool compiles every target after its first: the target's
    flags travel with the job, and the worker's log must show them."""
    if cpu_features.targets() == ("native",):
        pytest.skip("x86-64 micro-architecture levels only")
    folder = tmp_path_factory.mktemp("isa")
    path = write_recipe(folder, small_checkpoint, name="isa", compiler__target="x86-64-v2", **FALLBACK_ONLY)
    res = compile_recipe(R.load(path), folder / "out", jobs=1, cache_root=folder / "c", executor=compile_pool)
    assert not res.failed and res.built == 1
    return R.load(path), folder / "c", res


@x86
@pytest.mark.slow
def test_target_changes_key_is_recorded_and_decodes_the_same(v2_build):
    from neffbuild.compiler.planner import cache_states

    r, cache, res = v2_build
    [t] = grid.targets(r)
    keys = {target: cache_states(r.replace(target=target), [t], cache_root=cache)[t.label]
            for target in ("x86-64-v2", "native", "x86-64-v3")}
    assert len({k["cache_key"] for k in keys.values()}) == 3
    assert [k["cache"] for k in keys.values()] == ["local", "build", "build"]
    assert "cpu_target" in keys["native"]["why"]  # plan says why the other targets miss
    log = (res.bundle / "logs" / f"{t.label}.log").read_text()
    assert "'-march=x86-64-v2'" in log and "-march=native" not in log  # the generated compile commands
    m = json.loads((res.bundle / "manifest.json").read_text())
    assert m["artifacts"][0]["cache_key"] == keys["x86-64-v2"]["cache_key"]
    ins = cli("inspect", res.bundle)  # in this process (tests/helpers.py): no second torch import
    assert "cpu target: x86-64-v2 (-march=x86-64-v2" in ins.stdout and "sse4_2" in ins.stdout
    assert m["toolchain"]["cpu_target"]["target"] == "x86-64-v2" and m["toolchain"]["cxx"]
    gen = cli("generate", res.bundle, "--prompt-ids", "5,9,13,2", "--max-new-tokens", "8", "--check", "--json")
    assert gen.returncode == 0, gen.stderr
    assert json.loads(gen.stdout)["check"]["ok"]  # the same tokens as the eager model


@x86
@pytest.mark.slow
def test_bundle_needing_a_missing_cpu_feature_is_refused_before_native_code(v2_build, tmp_path, monkeypatch):
    from neffbuild.runtime.bundle import aoti_package, loaders
    from neffbuild.runtime.bundle.reader import open_bundle

    bundle = tmp_path / "b"
    shutil.copytree(v2_build[2].bundle, bundle)
    mpath = bundle / "manifest.json"
    m = json.loads(mpath.read_text())
    m["toolchain"]["cpu_target"]["features"] = [*m["toolchain"]["cpu_target"]["features"], "avx10_9", "amx_fp99"]
    mpath.write_text(json.dumps(m, indent=1))
    digest = hashlib.sha256(mpath.read_bytes()).hexdigest()
    (bundle / "manifest.sha256").write_text(f"{digest}  manifest.json\n")

    def no_native(*a, **k):
        raise AssertionError("artifact code was loaded")

    monkeypatch.setattr(aoti_package, "load_package", no_native)
    monkeypatch.setattr(loaders, "load_inductor", no_native)
    with pytest.raises(IncompatibleBundle) as exc:
        open_bundle(bundle, preload=True)
    msg = str(exc.value)
    assert "amx_fp99, avx10_9" in msg and "Rebuild with a portable compiler.target" in msg
