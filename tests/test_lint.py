"""`make lint` (run by .ci/run) covers every Python file in the tree, and the tree is clean; the house's size
budgets hold (functions: ruff's PLR0915 and C901 in pyproject.toml; modules: here)."""

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


MAX_MODULE_LINES = 400
LONG_MODULES: dict[str, str] = {}  # path -> why it may be longer (none today)


def test_product_modules_stay_under_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "neffbuild").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) >= MAX_MODULE_LINES}
    assert set(long) <= set(LONG_MODULES), f"split these by concept (or name the exception here): {long}"
