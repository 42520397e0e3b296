"""`make lint` (run by .ci/run) covers every Python file in the tree, and the tree is clean."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _ruff() -> str:
    found = Path(sys.executable).with_name("ruff")
    return str(found) if found.exists() else (shutil.which("ruff") or pytest.skip("ruff is not installed"))


def test_ruff_sees_every_tracked_python_file():
    listed = subprocess.run([_ruff(), "check", "--show-files", "."], capture_output=True, text=True, cwd=ROOT)
    seen = {str(Path(line).resolve().relative_to(ROOT)) for line in listed.stdout.splitlines() if line.endswith(".py")}
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
                             capture_output=True, text=True, cwd=ROOT).stdout.split()
    assert tracked and set(tracked) <= seen, sorted(set(tracked) - seen)


def test_ruff_is_clean():
    out = subprocess.run([_ruff(), "check", "."], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout
