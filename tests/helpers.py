"""What the tests share: one CLI runner, one fixture builder, one ``TestBundle`` shape.

- ``cli(*args)`` runs ``neffbuild ARGS`` in this process (click's runner: no second torch
  import, ~3 s saved per call) and returns what ``subprocess.run`` would: ``returncode``,
  ``stdout``, ``stderr``. An exception the CLI does not handle becomes exit 1 with its
  traceback on stderr, as in a real process, so "no Traceback" assertions keep their meaning.
  ``process=True`` starts a real ``python -m neffbuild.cli.main`` for what needs one: another
  ``PYTHONPATH`` (the SDK stand-in, a fake module), signals, concurrency, exit paths.
- ``build_bundle(...)`` writes a test recipe and compiles it into a ``TestBundle``.
- ``seed_cache(...)`` copies chosen entries of one compile cache into a fresh one, so a test
  whose point is a build step (a kill, a resume, a Ray build) compiles only the keys it needs to.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "recipes" / "gpt-oss-tiny.yaml"
EAGLE3_TINY = ROOT / "recipes" / "gpt-oss-tiny-eagle3.yaml"
STANDIN = ROOT / "tests" / "sdk_standin"  # the Neuron SDK stand-in: on the path only where a test asks for it
# Test bundles use a prime KV pool: any generated loop bound divisible by it scales with the
# pool (neffbuild/compiler/codegen.py), which tests/test_stepcost.py forbids.
POOL = 509


# ----------------------------------------------------------------------------------------------- the CLI runner

@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str
    unhandled: BaseException | None = None  # in-process only: what a real process would have died of


def _entry():
    from neffbuild.cli import main as entry

    register = getattr(entry, "_register", None)
    if register is not None:
        register()
    return entry.cli


def cli(*args, env: dict | None = None, process: bool = False, timeout: float | None = 600,
        cwd: Path = ROOT) -> CliResult:
    """``neffbuild ARGS`` in ``cwd`` with ``env`` (the whole environment, as for subprocess)."""
    args = [str(a) for a in args]
    if process:
        res = subprocess.run([sys.executable, "-m", "neffbuild.cli.main", *args], capture_output=True, text=True,
                             cwd=cwd, env=env, timeout=timeout, check=False)
        return CliResult(res.returncode, res.stdout, res.stderr)
    from click.testing import CliRunner

    overrides = None
    if env is not None:  # click's runner takes changes: set what env has, unset what it lacks
        overrides = {k: v for k, v in env.items() if os.environ.get(k) != v}
        overrides.update({k: None for k in os.environ if k not in env})
    with contextlib.chdir(cwd):
        res = CliRunner().invoke(_entry(), args, env=overrides, prog_name="neffbuild", catch_exceptions=True)
    err = res.stderr
    unhandled = res.exception if res.exception and not isinstance(res.exception, SystemExit) else None
    if unhandled is not None:
        buf = io.StringIO()
        traceback.print_exception(type(unhandled), unhandled, unhandled.__traceback__, file=buf)
        err += buf.getvalue()
    return CliResult(1 if unhandled is not None else res.exit_code, res.stdout, err, unhandled)


def last_json(res: CliResult) -> dict:
    """The JSON document a ``--json`` command printed: the whole of stdout (a line beside it fails here)."""
    return json.loads(res.stdout)


# ----------------------------------------------------------------------------------------------- test bundles

@dataclass(frozen=True)
class TestBundle:
    """A bundle a test compiled: the recipe it came from, the bundle folder, the builder's result
    (None when a CLI subprocess built it) and the environment a subprocess needs to load it.

    As a path (``os.fspath``, ``str``, ``/``) it is the bundle folder.
    """

    __test__ = False  # not a test class
    recipe: Path
    bundle: Path
    result: object | None = None
    env: dict | None = None

    def __fspath__(self) -> str:
        return str(self.bundle)

    def __str__(self) -> str:
        return str(self.bundle)

    def __truediv__(self, rel) -> Path:
        return self.bundle / rel


def write_recipe(folder: Path, checkpoint: Path, **changes) -> Path:
    """The test bundle's recipe: the tiny model from a transformers checkpoint, 6 targets.

    ``section__key=value`` sets one recipe field (``neuron_config__fp8_packed_kv=True``)."""
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


def build_bundle(folder: Path, cache: Path, recipe: Path, **kw) -> TestBundle:
    """Compile ``recipe`` (a path) into ``folder/out`` through ``cache`` (``kw``: compile_recipe's, e.g. the
    session's warm ``executor``); every target must build."""
    from neffbuild import recipe as recipe_mod
    from neffbuild.compiler.builder import compile_recipe

    res = compile_recipe(recipe_mod.load(recipe), folder / "out", cache_root=cache, **kw)
    assert not res.failed, res.failed
    return TestBundle(recipe, res.bundle, res)


def seed_cache(source: Path, dest: Path, keys) -> Path:
    """A new cache at ``dest`` holding ``source``'s entries for ``keys`` (and the pre-keys that name them)."""
    from neffbuild.compiler.cache import CACHE_VERSION

    keys = set(keys)
    src, out = Path(source) / f"v{CACHE_VERSION}", Path(dest) / f"v{CACHE_VERSION}"
    for key in keys:
        shutil.copytree(src / "entries" / key, out / "entries" / key)
    (out / "prekeys").mkdir(parents=True, exist_ok=True)
    for pre in (src / "prekeys").glob("*.json") if (src / "prekeys").is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(pre.read_text()).get("key") in keys:
                shutil.copy2(pre, out / "prekeys" / pre.name)
    return Path(dest)


def cache_key(bundle: Path, label: str) -> str:
    """The cache key the bundle's manifest records for ``label``."""
    m = json.loads((Path(bundle) / "manifest.json").read_text())
    [key] = [a["cache_key"] for a in m["artifacts"] if a["label"] == label]
    return key


# ----------------------------------------------------------------------------------------------- shared assertions

def assert_failed_target(res, out_dir: Path, *, label: str, cached: int, needle: str) -> dict:
    """A `compile --json` with one target failing: exit 1, no bundle, the failure classified and its log kept."""
    assert res.returncode == 1, res.stderr
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert doc["bundle"] is None and doc["cached"] == cached
    [fail] = doc["failed"]
    assert fail["label"] == label and fail["kind"] == "compiler_error"
    assert needle in Path(fail["log"]).read_text()
    assert not (out_dir / "gpt-oss-test-0.1.0").exists()
    assert "Traceback" not in res.stderr and label in res.stderr
    return doc


# ----------------------------------------------------------------------------------------------- the SDK stand-in

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


# ----------------------------------------------------------------------------------------------- hostile input

def strict_json(text: str):
    """JSON that refuses NaN and Infinity (what the CLI must never print)."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def run_cli(*args):
    """In-process CLI: (exit code, stdout, stderr, unhandled exception or None)."""
    res = cli(*args)
    return res.returncode, res.stdout, res.stderr, res.unhandled


def tampered(src: Path, dest: Path, edit) -> Path:
    """A copy of bundle ``src`` at ``dest`` with ``edit(root, manifest)`` applied and its checksums and manifest
    digest rewritten to match ("consistent": what the schema and the header and artifact checks must catch)."""
    from neffbuild.bundle import manifest, paths
    from neffbuild.fsutil import sha256_file

    shutil.copytree(src, dest)
    m = json.loads((dest / paths.MANIFEST_PATH).read_text())
    out = edit(dest, m)
    if isinstance(out, str):
        text = out
    else:
        for rel in out or []:
            p = dest / rel
            m["files"][rel] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for a in m["artifacts"]:
                if a["file"] == rel:
                    a.update(m["files"][rel])
        text = manifest.dumps(m)
    (dest / paths.MANIFEST_PATH).write_text(text)
    digest = __import__("hashlib").sha256(text.encode()).hexdigest()
    (dest / paths.MANIFEST_DIGEST_PATH).write_text(f"{digest}  {paths.MANIFEST_PATH}\n")
    return dest


def gi(fn):
    def edit(root, m):
        fn(m["graph_inputs"])

    return edit


def kv_sigs(m, fn):
    for a in m["artifacts"]:
        for s in a["input_signature"]:
            if s["name"].startswith("kv_caches"):
                fn(s)
