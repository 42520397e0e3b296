"""neffbuild/registry.py: the one place that names backends and architectures."""

import re
import subprocess
import sys

import pytest

from neffbuild import recipe as R
from neffbuild import registry
from neffbuild.errors import InvalidInput, RecipeError
from tests.conftest import ROOT


@pytest.mark.parametrize("table", [registry.BACKENDS, registry.ARCHITECTURES], ids=["backends", "architectures"])
def test_every_registered_part_imports(table):
    for entry in table.values():
        for part in entry.parts:
            assert callable(entry.get(part)), f"{entry.name}.{part}"


def test_backend_entries_name_their_own_compile_side():
    for name, entry in registry.BACKENDS.items():
        assert entry.get("compile_side").name == name


def test_unknown_names_say_what_is_known():
    with pytest.raises(InvalidInput, match=r"unknown backend 'nueron'.*did you mean 'neuron'"):
        registry.backend("nueron")
    with pytest.raises(InvalidInput, match=r"model.arch: unknown architecture 'gpt-oss'.*known: gpt_oss"):
        registry.arch("gpt-oss")


def test_validator_choices_come_from_the_registry(tiny_raw, monkeypatch):
    tiny_raw["compiler"]["backend"] = "ray"
    with pytest.raises(RecipeError) as err:
        R.from_dict(tiny_raw)
    assert all(name in str(err.value) for name in registry.backend_choices())


ALLOWED = re.compile(r"^neffbuild/(registry\.py|models/|compiler/backends/|runtime/loaders\.py)")


def test_nothing_else_names_gpt_oss_or_a_backend():
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "neffbuild/*.py"],
                           capture_output=True, text=True, cwd=ROOT).stdout.split()
    names = re.compile(r"gpt_oss|GptOss|[\"'](neuron|inductor)[\"']")
    offenders = [f for f in files if not ALLOWED.match(f) and names.search((ROOT / f).read_text())]
    assert files and not offenders


def test_runtime_gets_a_loader_without_the_compile_side():
    code = ("import sys; from neffbuild import registry; import neffbuild.runtime.bundle; "
            "registry.backend('inductor').get('loader'); registry.backend('neuron').get('host_problem'); "
            "print([m for m in sys.modules if m.startswith(('neffbuild.compiler', 'neffbuild.models'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
