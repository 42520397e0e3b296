"""``--json`` is one JSON document on stdout, always: every command that has the flag, on success and on
failure, run as a user runs it (the installed console script, a real process, from a folder outside the repo,
no ``PYTHONPATH``), its whole stdout parsed as one document.

``compile --json`` is held to it on a cold build with the local pool and on an all-hit rebuild with the local
pool (pre-key hits run in the driver's own process, where build-log lines once reached stdout); Ray builds, one
that compiles and an all-hit one, are tests/test_ray_build.py's, parsed the same way (a process of the CLI: the
module's own Ray instance, not one kept for the whole run). Build logs belong in each
target's log file, progress on stderr. One compile here: the cold build has one target (the fallback).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import TINY
from tests.s3_server import closed_endpoint, s3_server  # noqa: F401  (the session fixture)

SCRIPT = Path(sys.executable).parent / "neffbuild"


def run(cwd: Path, *args, env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    # The user's environment (a Ray driver needs its settings to join the local cluster), without PYTHONPATH
    full = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    full.update(PATH=f"{SCRIPT.parent}:{full.get('PATH', '/usr/bin:/bin')}", NEFFBUILD_CACHE_DIR=str(cwd / "cache"),
                OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=cwd, env=full,
                          timeout=timeout)


def one_document(res: subprocess.CompletedProcess, code: int) -> dict | list:
    """The whole of stdout as one JSON document, and the exit code expected; a failure's document says so."""
    assert res.returncode == code, (res.returncode, res.stdout[-2000:], res.stderr[-3000:])
    doc = json.loads(res.stdout)  # the whole stdout: a log line before or after the document fails here
    if code != 0:
        assert doc["ok"] is False and doc["error"]["exit_code"] == code, doc
    return doc


def recipe(folder: Path, name: str, ctx: list[int]) -> Path:
    """The tiny model cut to 2 layers, one batch bucket: len(ctx) context buckets + the fallback."""
    raw = yaml.safe_load(TINY.read_text())
    raw["name"] = name
    raw["model"]["config"]["num_hidden_layers"] = 2
    raw["serving"].update(max_num_seqs=1, num_blocks=64)
    raw["neuron_config"].update(num_seqs_buckets=[1], decode_context_length_buckets=ctx)
    raw["build"] = {"jobs": 1}
    path = folder / f"{name}-{'-'.join(map(str, ctx))}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A working folder outside the repo with its own compile cache, and the bundle of a cold build in it (one
    target: the fallback, ctx 512 = max_model_len)."""
    folder = tmp_path_factory.mktemp("json-home")
    res = run(folder, "compile", recipe(folder, "j", [512]), "-o", "out", "--json")
    doc = one_document(res, 0)
    assert doc["built"] == 1 and doc["cached"] == 0, doc  # cold
    return folder, folder / "out" / "j-0.1.0"


def _again(folder: Path) -> Path:
    """The all-hit rebuild of the cold build's recipe with the local pool (its bundle: the second bundle of diff)."""
    if not (folder / "again" / "j-0.1.0").exists():
        doc = one_document(run(folder, "compile", recipe(folder, "j", [512]), "-o", "again", "--json"), 0)
        assert doc["built"] == 0 and doc["cached"] == 1, doc
    return folder / "again" / "j-0.1.0"


def test_compile_all_hits_with_the_local_pool(home):
    folder, _ = home
    assert (_again(folder) / "manifest.json").is_file()  # built here or by `places`: either way checked in _again


def test_compile_failure_is_one_document(home):
    folder, _ = home
    bad = folder / "bad.yaml"
    bad.write_text(recipe(folder, "j", [128]).read_text().replace("block_size: 16", "block_size: 15"))  # 128 % 15
    one_document(run(folder, "compile", bad, "-o", "bad-out", "--json"), 2)
    assert not (folder / "bad-out" / "j-0.1.0").exists()


def _histogram(path: Path) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["needed_seq", "count"])
        w.writerows([[100, 50], [300, 20], [500, 5]])
    return path


def _keys(folder: Path) -> tuple[Path, Path]:
    pytest.importorskip("cryptography")
    from tests.test_sign import _keypair

    return _keypair(folder, "ci")


# (name, args, exit code): {r} the recipe, {b} the bundle, {b2} a second bundle, {h} a histogram, {k} a key,
# {c} a copy of the bundle to sign, {x} a path that does not exist.
CASES = [
    ("validate ok", ["validate", "{r}"], 0),
    ("validate bad", ["validate", "{bad}"], 2),
    ("plan ok", ["plan", "{r}", "--no-cache"], 0),
    ("plan bad", ["plan", "{bad}"], 2),
    ("inspect ok", ["inspect", "{b}"], 0),
    ("inspect missing", ["inspect", "{x}"], 2),
    ("verify ok", ["verify", "{b}"], 0),
    ("verify missing", ["verify", "{x}"], 2),
    ("diff ok", ["diff", "{b}", "{b2}"], 0),
    ("diff missing", ["diff", "{b}", "{x}"], 2),
    ("sign ok", ["sign", "{c}", "--key", "{k}"], 0),
    ("sign missing key", ["sign", "{c}", "--key", "{x}"], 2),
    ("cache ls", ["cache", "ls"], 0),
    ("cache prune dry run", ["cache", "prune", "--max-size", "100G", "--dry-run"], 0),
    ("cache prune bad size", ["cache", "prune", "--max-size", "lots"], 2),
    ("generate ok", ["generate", "{b}", "--prompt-ids", "1,2,3", "--max-new-tokens", "3"], 0),
    ("generate bad token", ["generate", "{b}", "--prompt-ids", "1,99999"], 2),
    ("recommend ok", ["recommend", "--histogram", "{h}", "--recipe", "{r}"], 0),
    ("recommend missing", ["recommend", "--histogram", "{x}", "--max-model-len", "512"], 2),
    ("bench missing", ["bench", "{x}"], 2),
]


@pytest.fixture(scope="module")
def places(home):
    folder, bundle = home
    other = _again(folder)
    bad = folder / "bad-recipe.yaml"
    bad.write_text("name: x\nversion: 0.1.0\n")
    copy = folder / "to-sign" / bundle.name
    shutil.copytree(bundle, copy)
    priv, _ = _keys(folder)
    return {"r": recipe(folder, "j", [128]), "bad": bad, "b": bundle, "b2": other, "h": _histogram(folder / "h.csv"),
            "k": priv, "c": copy, "x": folder / "does-not-exist"}


@pytest.mark.parametrize(("name", "args", "code"), CASES, ids=[c[0] for c in CASES])
def test_every_command_prints_one_document(places, home, name, args, code):
    folder, _ = home
    one_document(run(folder, *[a.format(**places) for a in args], "--json"), code)


def test_bench_prints_one_document(places, home):
    folder, _ = home
    doc = one_document(run(folder, "bench", places["b"], "--repeat", "3", "--no-dynamic", "--no-startup", "--no-dp",
                           "--json"), 0)
    assert doc


def test_push_pull_and_remote_check_print_one_document(places, home, s3_server):  # noqa: F811
    folder, bundle = home
    env = {k: v for k, v in s3_server.env("rw").items() if k.startswith("AWS_")}
    url = s3_server.url()
    one_document(run(folder, "push", bundle, url, "--json", env=env), 0)
    one_document(run(folder, "pull", f"{url}/{bundle.name}", folder / "pulled", "--json", env=env), 0)
    one_document(run(folder, "pull", f"{url}/nothing-0.1.0", folder / "pulled2", "--json", env=env), 1)
    one_document(run(folder, "pull", "http://x/y", folder / "pulled3", "--json", env=env), 2)
    one_document(run(folder, "cache", "remote", "check", url, "--json", env=env), 0)
    down = dict(env, AWS_ENDPOINT_URL_S3=closed_endpoint())
    res = run(folder, "cache", "remote", "check", url, "--json", env=down)
    assert res.returncode != 0 and json.loads(res.stdout)["reachable"] is False, (res.stdout, res.stderr[-2000:])
