#!/usr/bin/env bash
# Disaggregated serving of a bundle on one host with vLLM: a prefill instance, a decode instance and a proxy
# (neffbuild/vllm/di.py; docs/vllm.md, "Disaggregated serving"), run in the plugin's venv.
#
# Usage: tools/vllm_di.sh BUNDLE [--port 8000] [...]      (python -m neffbuild.vllm.di --help lists the options)
#   VLLM_VENV=DIR   the vLLM venv (default: .venv-vllm at the repository root; built by tools/vllm_venv.sh)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${VLLM_VENV:-$root/.venv-vllm}"
if [[ ! -x "$venv/bin/python" ]]; then
  echo "error: no vLLM venv at $venv (build it: tools/vllm_venv.sh)" >&2
  exit 2
fi
exec "$venv/bin/python" -m neffbuild.vllm.di "$@"
