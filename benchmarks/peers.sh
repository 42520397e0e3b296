#!/usr/bin/env bash
# Install the peers of benchmarks/real_width.py into their own environments (never the project's venv)
# and say how long each took.
#
#   .venv-llama            llama-cpp-python built from its sdist (the index has no wheel for it) with
#                          CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON" (~10 CPU-minutes; pip's wheel
#                          cache makes a second install quick)
#   .venv-llama/llama.cpp  llama.cpp's own convert_hf_to_gguf.py, conversion/ and gguf-py, taken from the
#                          same sdist (the converter runs under the project's python: it needs torch)
#   .venv-vllm             vLLM CPU from requirements/vllm.lock via tools/vllm_venv.sh, where the tree has it
#
# Usage: benchmarks/peers.sh            (idempotent: an environment that is there is kept)
#   LLAMA_CPP_VERSION=0.3.36            the llama-cpp-python release
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
version="${LLAMA_CPP_VERSION:-0.3.36}"
venv="$root/.venv-llama"

if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
  start=$(date +%s)
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON" "$venv/bin/pip" install -q "llama-cpp-python==$version" numpy
  echo "llama-cpp-python $version installed in $venv in $(( $(date +%s) - start )) s" >&2
else
  echo "llama-cpp-python: $venv is there (kept)" >&2
fi

if [[ ! -f "$venv/llama.cpp/convert_hf_to_gguf.py" ]]; then
  start=$(date +%s)
  tmp="$(mktemp -d)"
  "$venv/bin/pip" download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$tmp"
  top="llama_cpp_python-$version/vendor/llama.cpp"
  tar -xzf "$tmp"/llama_cpp_python-"$version".tar.gz -C "$tmp" \
    "$top/convert_hf_to_gguf.py" "$top/conversion" "$top/gguf-py"
  mkdir -p "$venv/llama.cpp"
  cp -r "$tmp/$top/convert_hf_to_gguf.py" "$tmp/$top/conversion" "$tmp/$top/gguf-py" "$venv/llama.cpp/"
  rm -rf "$tmp"
  echo "llama.cpp's converter unpacked to $venv/llama.cpp in $(( $(date +%s) - start )) s" >&2
fi

if [[ -x "$root/.venv-vllm/bin/python" ]]; then
  echo "vLLM CPU: $root/.venv-vllm is there (kept)" >&2
elif [[ -x "$root/tools/vllm_venv.sh" ]]; then
  start=$(date +%s)
  "$root/tools/vllm_venv.sh" "$root/.venv-vllm"
  echo "vLLM CPU installed in $root/.venv-vllm in $(( $(date +%s) - start )) s" >&2
else
  echo "vLLM CPU: not installed (this tree has no tools/vllm_venv.sh; build a venv from requirements/vllm.lock" \
       "with it, or point VLLM_PYTHON at one); real_width.py skips vLLM" >&2
fi
