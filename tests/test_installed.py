"""The product as a user gets it: the wheel, installed into a fresh virtual environment outside the repo, run
through its console script from a temporary folder with no ``PYTHONPATH``.

The new environment reuses the test environment's third-party packages (one ``.pth`` line naming its
site-packages: a path added that way is not a site dir, so the editable install's finder there never runs and
the repo is not importable), and holds the project only as the wheel installs it. Hugging Face's ``kernels``
distribution (which transformers requires) is among the reused packages, as it is beside a user's install.

The wheel must install no top-level import name but ``neffbuild``: a second name can collide with another
distribution's (the old top-level ``kernels`` did). ``test_the_record_check_bites`` shows that check fails on
a wheel built with a top-level ``kernels`` package put back (a copy of ``neffbuild/kernels`` at the root of the
source and ``kernels*`` in ``packages.find``): that is how the check was seen to fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SKIP = shutil.ignore_patterns(".git", ".venv*", "artifacts", ".ci-cache", "__pycache__", "*.egg-info", "build",
                              "dist", ".pytest_cache", ".hypothesis", "wt*")

pytestmark = pytest.mark.slow  # builds a wheel, a venv, and compiles one graph through the installed script


def build_wheel(src: Path, out: Path) -> Path:
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          str(src), "-w", str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    (wheel,) = out.glob("neffbuild-*.whl")
    return wheel


def top_level_names(wheel: Path) -> set[str]:
    """The import names a wheel installs: the first path part of every file its RECORD lists, but its metadata."""
    with zipfile.ZipFile(wheel) as z:
        (record,) = [n for n in z.namelist() if n.endswith(".dist-info/RECORD")]
        rows = z.read(record).decode().splitlines()
    names = {row.split(",")[0].split("/")[0] for row in rows if row}
    return {n.removesuffix(".py") for n in names if not n.endswith((".dist-info", ".data"))}


def source_copy(dest: Path) -> Path:
    shutil.copytree(ROOT, dest, ignore=SKIP)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv bin folder, wheel) with the wheel installed and nothing of the repo importable."""
    work = tmp_path_factory.mktemp("installed")
    wheel = build_wheel(source_copy(work / "src"), work / "dist")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path("
                                "'purelib'))"], capture_output=True, text=True, check=True).stdout.strip())
    (site / "reused-test-env.pth").write_text(sysconfig.get_path("purelib") + "\n")
    res = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                          "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return venv / "bin", wheel


def run(bin_dir: Path, cwd: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(cwd), "NEFFBUILD_CACHE_DIR": str(cwd / "cache"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run([str(bin_dir / "neffbuild"), *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)


def test_the_wheel_installs_only_neffbuild(installed):
    _, wheel = installed
    assert top_level_names(wheel) == {"neffbuild"}
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert "neffbuild/kernels/attention.py" in names
    assert any(n.startswith("neffbuild/bundle/templates/") for n in names)  # package data travels too


def test_the_record_check_bites(tmp_path):
    src = source_copy(tmp_path / "src")
    shutil.copytree(src / "neffbuild" / "kernels", src / "kernels")
    project = src / "pyproject.toml"
    text = project.read_text()
    assert 'include = ["neffbuild*"]' in text
    project.write_text(text.replace('include = ["neffbuild*"]', 'include = ["neffbuild*", "kernels*"]'))
    assert "kernels" in top_level_names(build_wheel(src, tmp_path / "dist"))


def test_the_installed_cli_validates_compiles_inspects_and_generates(installed, tmp_path):
    bin_dir, _ = installed
    probe = subprocess.run([str(bin_dir / "python"), "-c", "import neffbuild, sys; print(neffbuild.__file__); "
                            "print(any(p.rstrip('/') == sys.argv[1] for p in sys.path))", str(ROOT)],
                           capture_output=True, text=True, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, check=True)
    where, repo_on_path = probe.stdout.split()
    assert not where.startswith(str(ROOT)) and where.startswith(str(bin_dir.parent)), where
    assert repo_on_path == "False"

    raw = yaml.safe_load((ROOT / "recipes" / "gpt-oss-tiny.yaml").read_text())
    raw["name"] = "one-graph"
    raw["model"]["config"]["num_hidden_layers"] = 2
    raw["serving"].update(max_num_seqs=1, num_blocks=64)
    raw["neuron_config"].update(num_seqs_buckets=[1], decode_context_length_buckets=[512])  # folded: fallback only
    (tmp_path / "one.yaml").write_text(yaml.safe_dump(raw))

    res = run(bin_dir, tmp_path, "validate", "one.yaml", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["valid"] is True, res.stderr
    res = run(bin_dir, tmp_path, "compile", "one.yaml", "-o", "out", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(res.stdout)
    assert doc["built"] == 1 and doc["failed"] == []
    bundle = tmp_path / "out" / "one-graph-0.1.0"
    res = run(bin_dir, tmp_path, "inspect", str(bundle), "--json")
    assert res.returncode == 0, res.stderr
    assert [a["label"] for a in json.loads(res.stdout)["artifacts"]] == ["decode_b1_ctx512"]
    res = run(bin_dir, tmp_path, "generate", str(bundle), "--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "6",
              "--check", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(res.stdout)
    assert doc["check"]["ok"] is True and len(doc["requests"][0]["tokens"]) == 6, doc
