"""Pre-keys hash only the source that shapes a graph (compiler/sources.py): editing or adding a
runtime module the graphs never import leaves every warm rebuild warm; editing a kernel does not."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from neffbuild.compiler.sources import digest, graph_sources

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def tree(tmp_path):
    shutil.copytree(ROOT / "neffbuild", tmp_path / "neffbuild", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_graph_sources_are_the_graphs_and_what_they_import():
    rel = {str(p.relative_to(ROOT)) for p in graph_sources(ROOT)}
    assert {"neffbuild/compiler/graphs.py", "neffbuild/models/gpt_oss/decode.py", "neffbuild/runtime/kv/layout.py",
            "neffbuild/compiler/backends/inductor.py"} <= rel
    assert not rel & {"neffbuild/runtime/step/histogram.py", "neffbuild/runtime/step/stepper.py",
                      "neffbuild/runtime/kv/cache.py",
                      "neffbuild/compiler/builder.py",
                      "neffbuild/cli/main.py", "neffbuild/serve/greedy.py"}


@pytest.mark.parametrize(("edit", "changes"), [
    (lambda r: (r / "neffbuild/runtime/step/histogram.py").open("a").write("\n\ndef new_helper():\n    return 1\n"),
     False),
    (lambda r: (r / "neffbuild/runtime/new_module.py").write_text('"""a new runtime module"""\n'), False),
    (lambda r: (r / "neffbuild/cli/main.py").open("a").write("\n# a comment\n"), False),
    (lambda r: (r / "neffbuild/runtime/kv/layout.py").open("a").write("\n# a comment\n"), True),
    (lambda r: (r / "neffbuild/kernels/__init__.py").open("a").write("\n# a comment\n"), True),
])
def test_only_graph_source_edits_change_the_pre_key_source_digest(tree, edit, changes):
    before = digest(tree)
    edit(tree)
    assert (digest(tree) != before) is changes
