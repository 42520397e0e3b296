# Two entry points do all the set-up on a fresh machine:
#   make demo   compile the tiny recipe to artifacts/ with the embedded backend and inspect it
#   make test   run the test suite (everything but the timing benchmarks)
#   make test-fast  the tests that compile nothing (-m "not slow"; tests/conftest.py marks every test that
#               uses a compiled fixture slow): a few minutes, for the edit-test loop
#   make lint   ruff over every Python file in the tree (rules in pyproject.toml)
#   make bench  the timing benchmarks (docs/benchmarks.md), from a fresh clone
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint venv lock clean bench bench-real-width bench-real-depth bench-vllm-di bench-vllm-spec

$(BIN)/python:
	$(PY) -m venv $(VENV)

LOCK := requirements/test.lock
UV_VERSION := 0.13.9

# The exact, hashed versions of every test and benchmark dependency (requirements/test.lock, made by
# `make lock`), so CI, a developer and a fresh machine get the same packages; torch is the CPU wheel on disk
# (requirements/torch.txt), never a multi-GB CUDA build. Then the project itself, editable, without deps. pip
# installs with --no-compile (its byte-compiling runs one file at a time: minutes), then compileall byte-compiles
# every .py at once on every core (about 20 s here, as tools/vllm_venv.sh): without the .pyc files a test run's
# first imports of torch, in many processes at once, each compiled what it imported (the suite took 1,008 s from a
# fresh clone against 750-775 s with them). A file a package ships that is not Python 3.11 is skipped, as pip does.
$(STAMP): $(BIN)/python pyproject.toml $(LOCK)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile --require-hashes -r $(LOCK)
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/pip check
	$(BIN)/python -m compileall -q -j 0 -x '/tests?/' $(VENV)/lib > /dev/null 2>&1 || true
	touch $(STAMP)

# The vLLM plugin's tests run vLLM from its own venv (vLLM pins an older transformers and needs torchvision et al.,
# which do not load beside the CPU torch): exactly requirements/vllm.lock, built by tools/vllm_venv.sh.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): requirements/vllm.lock tools/vllm_venv.sh pyproject.toml
	tools/vllm_venv.sh $(VLLM_VENV)
	touch $(VLLM_STAMP)

venv: $(STAMP) $(VLLM_STAMP)

# Refresh the lock from pyproject.toml's ranges (the test and bench extras), then `make venv` installs it.
lock: $(BIN)/python
	$(BIN)/pip install -q uv==$(UV_VERSION)
	$(BIN)/uv pip compile pyproject.toml --extra test --extra bench --generate-hashes --python-version 3.11 \
		--find-links /opt/wheels -c requirements/torch.txt --no-header -o $(LOCK)

demo: $(STAMP)
	$(BIN)/neffbuild validate recipes/gpt-oss-tiny.yaml
	$(BIN)/neffbuild plan recipes/gpt-oss-tiny.yaml --no-cache
	$(BIN)/neffbuild compile recipes/gpt-oss-tiny.yaml -o artifacts
	$(BIN)/neffbuild inspect artifacts/gpt-oss-tiny-0.1.0
	$(BIN)/neffbuild generate artifacts/gpt-oss-tiny-0.1.0 --prompt-ids $$(seq -s, 1 120) --prompt-ids 7,8 --max-new-tokens 150 --check

# Four pytest-xdist workers on the 2-core CI host: a worker that waits (a server starting, a timeout being proved,
# a subprocess's compile) leaves its core to the others (idle AMD EPYC host: 732 s and 744 s on 4 workers, 773 s on
# 3 for nearly the same tree; docs/benchmarks.md, "Test suite");
# tests/conftest.py keeps each Ray test and each 6-graph bundle's tests on one worker, and gives the workers one
# compile cache. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 4
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

# --durations: the 25 slowest tests and fixtures, then (tests/cpu_account.py) the CPU-seconds per module, printed at
# the end, so a run that nears the 20-minute bound says
# where its time went (docs/benchmarks.md, "Test suite").
test: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest -q $(XDIST) --durations=25 -m "not bench" tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow and not bench" tests

lint: $(STAMP)
	$(BIN)/ruff check .

# Timing on a shared host is noisy: run it alone, or under `nice -n -5` (see docs/benchmarks.md).
bench: $(STAMP)
	$(BIN)/python -m pytest -q -m bench tests
	$(BIN)/python benchmarks/step_cost.py --plot docs/img/step-cost.png
	$(BIN)/python benchmarks/build_pipeline.py
	$(BIN)/python benchmarks/dispatch_overhead.py
	$(BIN)/python benchmarks/serving_dtypes.py
	$(MAKE) bench-real-width

# GPT-OSS-20B's width against llama.cpp and vLLM CPU: benchmarks/peers.sh installs them in their own venvs.
# Two interleaved rounds (about 35 minutes on 2 cores); transformers (hf-bf16) and the dense-expert bundle
# (bundle-bf16) are opt-in with --engines: transformers' bf16 eager took over 19 minutes a round on a CPU
# without AVX-512 (docs/benchmarks.md, "Real width").
REAL_WIDTH_DIR ?= /tmp/neffbuild-real-width
bench-real-width: $(STAMP)
	benchmarks/peers.sh
	$(BIN)/python benchmarks/real_width.py --workdir $(REAL_WIDTH_DIR) --rounds 2 \
		--engines bundle-mxfp4,bundle-int8,llama-mxfp4,llama-ft38,llama-bf16,vllm-bf16,vllm-plugin-mxfp4 --plot docs/img/real-width.png
	$(BIN)/python benchmarks/vllm_streaming.py --workdir $(REAL_WIDTH_DIR) --requests 12 --gap 1.0 --rounds 2

# The same at GPT-OSS-20B's real depth, 24 layers: the bundle's exact and int8 forms against llama.cpp's file type 38
# GGUF. Needs ~55 GB of disk under REAL_DEPTH_DIR (an MXFP4-only checkpoint, the bundles' one weights file, the GGUFs;
# the converter's GGUF is removed once quantized) and ~15 GiB of memory; the set-up (about 25 minutes on 2 cores) runs first, then
# two interleaved rounds of 64-token prompts and 100 new tokens (about 36 minutes on an AVX2 host: each engine
# prefills 14 prompts a round) that reuse its bundles as built.
REAL_DEPTH_DIR ?= /tmp/neffbuild-real-depth
REAL_DEPTH_ARGS = --workdir $(REAL_DEPTH_DIR) --layers 24 --prompt 64 --new 100 --engines bundle-mxfp4,bundle-int8,llama-ft38
bench-real-depth: $(STAMP)
	benchmarks/peers.sh
	$(BIN)/python benchmarks/real_width.py $(REAL_DEPTH_ARGS) --prepare
	$(BIN)/python benchmarks/real_width.py $(REAL_DEPTH_ARGS) --rounds 2 --no-rebuild

# Disaggregated serving in vLLM (issue 51): NIXL transfer vs a DRAM copy per UCX_TLS, TTFT and decode tok/s vs one
# instance. Needs the vLLM venv (tools/vllm_venv.sh), so not part of `bench`; about 10 minutes on 2 cores.
bench-vllm-di: $(STAMP)
	$(BIN)/python benchmarks/vllm_di.py --tls tcp,sm,self --tls tcp

# EAGLE3 in vLLM (issue 50): vLLM native EAGLE3 against vLLM + bundle with and without speculation, batch 1 and 4,
# tokens/s and acceptance, interleaved; stops if any engine's tokens differ. Needs the vLLM venv; ~10 minutes.
bench-vllm-spec: $(STAMP)
	$(BIN)/python benchmarks/vllm_spec.py --rounds 2

clean:
	rm -rf $(VENV) $(VLLM_VENV) artifacts/*/ .pytest_cache
