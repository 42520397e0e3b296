"""The house's arrows (DESIGN.md section 2), checked on the AST: every import, at module top or
inside a function, between neffbuild's parts; no import cycle between modules; the thin runtime
imports no third-party package but torch, safetensors, nixl and prometheus_client; the CLI
starts without torch. ``test_a_planted_upward_import_fails`` shows the check bites."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# base modules: every part may import them
BASE = {"neffbuild", "errors", "settings", "fsutil", "registry", "engine_flags", "ports"}
# The runtime's rooms are parts of their own (neffbuild/runtime/<room>/), so an upward arrow inside the
# runtime fails too; "runtime" alone is its top (parallel.py, world.py, the lazy __init__).
ROOMS = ("bundle", "step", "kv", "di")
RUNTIME = {"runtime", *(f"runtime.{r}" for r in ROOMS)}
# part -> the parts it may import (besides the base modules and itself).
ALLOWED = {
    "base": set(),
    # the group names the graphs and eager collectives use (runtime/parallel.py); the KV layout's one access (kv.access)
    "kernels": {"runtime", "runtime.kv"},
    "runtime": set(),
    "runtime.kv": {"runtime"},
    "runtime.di": {"runtime"},
    "runtime.step": {"runtime", "runtime.kv"},
    "runtime.bundle": {"runtime", "runtime.step", "runtime.kv"},
    # runtime: plain layout types only (tests/test_runtime.py checks the names)
    "models": {"kernels", "runtime", "runtime.kv"},
    "grid": RUNTIME,
    "recipe": RUNTIME | {"memory"},  # the pure bucket, block and label math, so a formula exists once
    "memory": RUNTIME,  # a rank's bytes by the runtime's KV layout (neffbuild/memory.py, torch-free)
    "recommend": {"grid"} | RUNTIME,
    "s3": set(),  # the S3 client over boto3 (neffbuild/s3.py): base modules only; boto3 imported on use
    "s3_probe": {"s3"},  # the connect / first-byte probe every remote user runs first (neffbuild/s3_probe.py)
    # recipe: recipe_check reads recipe.yaml with the validator's rules
    "bundle": RUNTIME | {"recipe", "s3", "s3_probe"},
    "compiler": {"models", "bundle", "kernels", "grid", "memory", "s3", "s3_probe"} | RUNTIME,
    # no recipe: a bundle's model config is judged in the runtime (runtime/bundle/config_rules.py, the recipe's
    # own rule set) when any engine opens it
    "serve": {"models"} | RUNTIME,
    "bench": {"compiler", "models", "serve", "grid", "memory"} | RUNTIME,
    # the vLLM plugin (neffbuild/vllm): the runtime and the base modules; no part imports it
    "vllm": RUNTIME,
    "cli": {"serve", "compiler", "models", "bundle", "grid", "recipe", "recommend", "bench", "memory", "s3"} | RUNTIME,
}
# torch_neuronx: the neuron loader (runtime/bundle/loaders.py), imported lazily on a Neuron host.
# cryptography: signature checks (runtime/bundle/model_sig.py), imported only when trusted keys are given.
RUNTIME_THIRD_PARTY = {"torch", "safetensors", "nixl", "nixl_cu12", "prometheus_client", "torch_neuronx",
                       "cryptography"}


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.glob("neffbuild/**/*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        out[name] = path
    return out


def part(module: str) -> str:
    bits = module.split(".")
    if len(bits) > 3 and bits[1] == "runtime" and bits[2] in ROOMS:
        return f"runtime.{bits[2]}"
    return "base" if len(bits) == 1 or bits[1] in BASE else bits[1]


def arrows() -> list[str]:
    """The allowed arrows, one line per part (docs/architecture.md shows this list: ``python -m tests.test_layers``)."""
    def short(parts):
        names = sorted(parts - RUNTIME) + (["runtime.*"] if parts >= RUNTIME else sorted(parts & RUNTIME))
        return ", ".join(names) or "(base modules only)"
    return [f"{p} -> {short(t)}" for p, t in ALLOWED.items() if p != "base"]


def imports(path: Path, known: dict) -> set[str]:
    """Project modules and top-level third-party packages ``path`` imports, anywhere in the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name if a.name in known else a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out.add(full if full in known else node.module if node.module in known
                        else node.module.split(".")[0])
    return out


def problems(root: Path) -> list[str]:
    known = modules(root)
    graph = {m: {i for i in imports(p, known) if i in known and i != m} for m, p in known.items()}
    out = []
    for m, targets in graph.items():
        for t in sorted(targets):
            src, dst = part(m), part(t)
            if dst != src and dst != "base" and dst not in ALLOWED[src]:
                out.append(f"{known[m].relative_to(root)} imports {t}: {src} -> {dst} is not an allowed arrow")
            if src == "base" and dst == "base" and not (t == "neffbuild.errors" or m == "neffbuild"):
                out.append(f"{known[m].relative_to(root)} imports {t}: base modules import only errors")
    for m, p in known.items():
        if part(m) in RUNTIME:
            third = {i for i in imports(p, known) if i not in known and i != "neffbuild"}
            bad = sorted(i for i in third if i not in sys.stdlib_module_names and i not in RUNTIME_THIRD_PARTY)
            out += [f"{p.relative_to(root)} imports {b}: the runtime's only third-party imports are "
                    f"{sorted(RUNTIME_THIRD_PARTY)}" for b in bad]
    out += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = counter[0]
                counter[0] += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def test_every_import_follows_an_allowed_arrow_and_nothing_cycles():
    assert set(map(part, modules(ROOT))) <= set(ALLOWED), "a new part needs a row in ALLOWED"
    assert problems(ROOT) == []


def test_the_architecture_doc_shows_the_allowed_arrows():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    block = doc.split("<!-- arrows -->")[1].split("```")[1].strip("\n").splitlines()
    assert block == arrows(), "docs/architecture.md: paste the output of python -m tests.test_layers"


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "neffbuild", tmp_path / "neffbuild", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


@pytest.mark.parametrize(("file", "line", "needle"), [
    ("neffbuild/runtime/step/buckets.py", "\ndef _up():\n    from neffbuild.recipe import load\n",
     "runtime.step -> recipe"),
    ("neffbuild/runtime/kv/blocks.py", "\ndef _up():\n    from neffbuild.runtime.step import stepper\n",
     "runtime.kv -> runtime.step"),
    ("neffbuild/runtime/step/stepper.py", "\nfrom neffbuild.runtime.bundle import reader\n",
     "runtime.step -> runtime.bundle"),
    ("neffbuild/models/gpt_oss/config.py", "\nimport neffbuild.compiler.cache\n", "models -> compiler"),
    ("neffbuild/runtime/step/dispatch.py", "\ndef _c():\n    import yaml\n", "imports yaml"),
    ("neffbuild/compiler/cache.py", "\ndef _c():\n    from neffbuild.compiler import builder\n", "import cycle"),
])
def test_a_planted_upward_import_fails(tmp_path, file, line, needle):
    root = _copy(tmp_path)
    assert problems(root) == []
    with open(root / file, "a") as f:
        f.write(line)
    found = problems(root)
    assert found and any(needle in p for p in found), found


START = ("import sys, runpy; sys.argv = ['neffbuild', *sys.argv[1:]]\n"
         "try:\n    runpy.run_module('neffbuild.cli.main', run_name='__main__')\n"
         "except SystemExit as e:\n    code = e.code\n"
         "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code, file=sys.stderr)")


@pytest.mark.parametrize("args", [["--help"], ["validate", "recipes/gpt-oss-tiny.yaml"],
                                  ["validate", "recipes/gpt-oss-tiny.yaml", "--json"],
                                  ["plan", "recipes/gpt-oss-tiny.yaml", "--no-cache"], ["cache", "ls"],
                                  ["compile", "--help"], ["compile", "--no-such-flag"], ["validate"],
                                  ["inspect", "--help"]])
def test_the_cli_starts_without_torch(args, tmp_path):
    res = subprocess.run([sys.executable, "-c", START, *args], capture_output=True, text=True, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "NEFFBUILD_CACHE_DIR": str(tmp_path), "HOME": str(tmp_path),
                              "PYTHONPATH": str(ROOT)})
    assert res.stderr.strip().splitlines()[-1].startswith("NO-TORCH"), res.stderr


if __name__ == "__main__":
    print("\n".join(arrows()))


# The vLLM plugin drives the runtime as any host engine would: through its public names only (plus vLLM, the base
# modules and its own modules), never a room's internals.
PUBLIC_ONLY = {"vllm"}


def private_runtime_imports(root: Path) -> list[str]:
    known = modules(root)
    out = []
    for m, p in known.items():
        if part(m) not in PUBLIC_ONLY:
            continue
        for i in sorted(imports(p, known)):
            if part(i) in RUNTIME and i != "neffbuild.runtime":
                out.append(f"{p.relative_to(root)} imports {i}: the plugin uses neffbuild.runtime's public names only")
    return out


def test_the_plugin_imports_only_the_runtimes_public_names():
    assert private_runtime_imports(ROOT) == []


# Engines (and neffbuild's engine benchmarks) read a bundle through the runtime's typed facts
# (runtime/bundle/facts.py), never the manifest's dicts. The bundle's writer side (bundle/) and the CLI's display
# commands (inspect, diff) read the manifest as the document it is.
ENGINES = ("serve", "vllm", "bench")
MANIFEST_READS = ("manifest", "read_manifest", "graph_inputs_json", "of_manifest")


def raw_manifest_reads(root: Path) -> list[str]:
    out = []
    for m, p in modules(root).items():
        if part(m) not in ENGINES:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else \
                node.value if isinstance(node, ast.Constant) and node.value == "graph_inputs" else None
            if name in MANIFEST_READS or (name == "graph_inputs" and isinstance(node, ast.Constant)):
                out.append(f"{p.relative_to(root)}:{node.lineno} reads {name}")
    return out


def test_engines_read_no_raw_manifest():
    assert raw_manifest_reads(ROOT) == []


def test_a_planted_private_import_and_manifest_read_fail(tmp_path):
    shutil.copytree(ROOT / "neffbuild", tmp_path / "neffbuild")
    (tmp_path / "neffbuild/vllm/planted.py").write_text(
        "from neffbuild.runtime.step.dispatch import Grid\n\n\ndef f(b):\n    return b.manifest['graph_inputs']\n")
    assert private_runtime_imports(tmp_path) == ["neffbuild/vllm/planted.py imports neffbuild.runtime.step.dispatch: "
                                                 "the plugin uses neffbuild.runtime's public names only"]
    assert [r.split(" ")[0] for r in raw_manifest_reads(tmp_path)] == ["neffbuild/vllm/planted.py:5"] * 2
