"""What the vLLM plugin's tests share: the checkpoint vLLM and the bundle both read, the bundle's recipe, and
running scripts in the plugin's own virtual environment (``.venv-vllm``, built by tools/vllm_venv.sh).

vLLM lives in its own venv (requirements/vllm.lock): it pins an older transformers than the test venv and needs
no torchvision. The tests therefore run vLLM as subprocesses of that venv's python; they skip, saying how to
build it, when the venv is absent. The transformers oracle runs here, in the test venv.

The model: GPT-OSS, 2 layers (one sliding, one full: one KV buffer pair, both attention kinds), shaped for
vLLM's CPU attention (head_dim 64, one of its kernel sizes; block_size 32, a multiple its kernels need).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import yaml

from neffbuild import engine_flags
from neffbuild.ports import free_port  # noqa: F401 - the tests' servers pick their ports the launcher's way
from tests.helpers import ROOT

VLLM_VENV = ROOT / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
SKIP_REASON = f"the vLLM venv {VLLM_VENV} is absent (build it: tools/vllm_venv.sh)"

HF_CONFIG = {
    "vocab_size": 512, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_local_experts": 8,
    "num_experts_per_tok": 2, "sliding_window": 64, "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 128, "rope_theta": 150000.0},
}
MAX_MODEL_LEN, BLOCK_SIZE, NUM_BLOCKS = 512, 32, 128
BATCH_BUCKETS, CTX_BUCKETS = [2, 4], [128]


def have_vllm() -> bool:
    return VLLM_PYTHON.is_file()


def target_config():
    """HF_CONFIG as the project's GptOssConfig (2 layers: one sliding, one full): every vLLM test model's shape."""
    from neffbuild.models.gpt_oss.config import GptOssConfig

    return GptOssConfig.from_hf_dict(dict(HF_CONFIG, layer_types=["sliding_attention", "full_attention"]))


def save_checkpoint(folder: Path) -> Path:
    """A random GPT-OSS checkpoint saved by transformers (fp32 safetensors + config.json), with the project's
    non-degenerate random weights (greedy tokens vary, so a wrong step shows)."""
    import transformers

    from neffbuild.models.gpt_oss.weights import random_state_dict

    cfg = target_config()
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**cfg.to_hf_dict()))
    missing, unexpected = model.load_state_dict(random_state_dict(cfg, seed=0), strict=True)
    assert not missing and not unexpected
    model.save_pretrained(folder)
    return folder


def write_recipe(folder: Path, checkpoint: Path, *, name: str = "gpt-oss-vllm", num_blocks: int = NUM_BLOCKS,
                 num_seqs_buckets=tuple(BATCH_BUCKETS), ctx_buckets=tuple(CTX_BUCKETS),
                 max_model_len: int = MAX_MODEL_LEN, neuron: dict | None = None, parallel: dict | None = None,
                 **serving) -> Path:
    raw = {
        "name": name, "version": "0.1.0",
        "model": {"arch": "gpt_oss", "checkpoint": str(checkpoint)},
        "serving": {"max_model_len": max_model_len, "max_num_seqs": num_seqs_buckets[-1], "block_size": BLOCK_SIZE,
                    "num_blocks": num_blocks, **serving},
        "neuron_config": {"num_seqs_buckets": list(num_seqs_buckets),
                          "decode_context_length_buckets": list(ctx_buckets), "gk_decode": True,
                          "fp8_packed_kv": False, "lnc": 1, **(neuron or {})},
        "parallel": {"tp": 1, "dp": 1, "ep": 1, **(parallel or {})},
        "compiler": {"backend": "inductor", "target": "trn2", "optlevel": 2, "flags": []},
        "build": {"jobs": 2},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


SPEC_K, SPEC_MAX_MODEL_LEN = 3, 256


def save_draft(folder: Path, checkpoint: Path, *, copying: bool = False) -> Path:
    """An EAGLE3 draft checkpoint (common layout) for a target of HF_CONFIG's shape: random (seed 1), or, with
    ``copying``, one that proposes the token two back (fc keeps the layer-0 aux state, the layer adds nothing, the
    LM head is the target's embedding: test_vllm_spec's, whose drafts are sometimes right)."""
    import torch
    from safetensors.torch import load_file

    from neffbuild.models.eagle3 import weights as dw
    from neffbuild.models.eagle3.config import Eagle3Config

    cfg = Eagle3Config.from_hf_dict({}, target_config())
    sd = dw.random_state_dict(cfg, seed=1)
    if copying:
        H = cfg.hidden_size
        sd["fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, 2 * H)], dim=1)  # aux (0, 1, 2): the embeddings
        for name in ("midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight"):
            sd[name] = torch.zeros_like(sd[name])
        sd["norm.weight"] = torch.ones(H)
        tensors = load_file(str(checkpoint / "model.safetensors"))
        sd["lm_head.weight"] = next(t for n, t in tensors.items() if n.endswith("embed_tokens.weight")).clone()
    return dw.save_checkpoint(sd, folder, cfg)


def eagle3_recipe(folder: Path, checkpoint: Path, draft: Path, *, name: str = "gpt-oss-vllm-eagle3",
                  num_seqs_buckets=(2,), max_model_len: int = SPEC_MAX_MODEL_LEN) -> Path:
    """The suite's one EAGLE3 recipe shape: HF_CONFIG's model, k = 3, batch bucket 2, context bucket 128 and the
    fallback 256 (1 x 2 x 3 = 6 graphs). tests/conftest.py's ``eagle3_built`` (random weights) and
    test_vllm_spec.py's bundle (weights that make drafts sometimes right) differ in their weights only, which no
    graph key covers: whichever builds first compiles the six graphs, the other finds them in the run's cache.
    (The tiny EAGLE3 recipe's head_dim and block size, 16, are not vLLM's; this shape serves both engines.) The
    buckets and max_model_len may be changed (benchmarks/vllm_spec.py's grid), the rest is the tests' draft section."""
    recipe = write_recipe(folder, checkpoint, name=name, num_seqs_buckets=num_seqs_buckets, max_model_len=max_model_len)
    raw = yaml.safe_load(recipe.read_text())
    raw["speculative"] = {"method": "eagle3", "num_speculative_tokens": SPEC_K, "draft": {"checkpoint": str(draft)}}
    recipe.write_text(yaml.safe_dump(raw))
    return recipe


def vllm_env(threads: int = 1, **extra: str) -> dict:
    """The environment of a vLLM subprocess: this worktree's code first, offline, one compute thread. A vLLM
    started with the plugin's printed settings takes its KV memory from them (``--kv-cache-memory-bytes``): pass
    ``VLLM_CPU_KVCACHE_SPACE=None`` to leave the legacy variable out, as a user's shell would."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(threads),
               VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING",
               TOKENIZERS_PARALLELISM="false")
    env.pop("PYTEST_XDIST_WORKER", None)
    env.update({k: v for k, v in extra.items() if v is not None})
    for k in [k for k, v in extra.items() if v is None]:
        env.pop(k, None)
    return env


def run_vllm_script(script: Path, args: list[str], *, timeout: float = 600, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(VLLM_PYTHON), str(script), *args], env=vllm_env(**env), capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def transformers_greedy(checkpoint: Path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """The oracle: transformers' greedy generation, one prompt at a time (fp32)."""
    import torch
    import transformers

    model = transformers.GptOssForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt, n in zip(prompts, max_tokens, strict=True):
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            out.append(gen[0, len(prompt):].tolist())
    return out


def python_json(out: str) -> dict:
    """The last line of a script's stdout that is a JSON document."""
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON document on stdout:\n{out[-2000:]}")




# ------------------------------------------------------------------------------------------- vllm serve

def start_refused(argv: list[str], log: Path, env: dict, port: int, limit: float = 90) -> tuple[int, bool, float]:
    """Start ``vllm serve`` that must refuse: (its exit status, whether its port ever answered, seconds it took);
    killed after ``limit`` seconds (its status then negative). The log is in ``log``."""
    import time
    import urllib.request

    start = time.monotonic()
    served = False
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT)
        while proc.poll() is None and time.monotonic() - start < limit:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    served = True
            except OSError:
                time.sleep(0.5)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, served, time.monotonic() - start


def serve_argv(model: Path | str, engine_args: dict, additional: dict | None, port: int) -> list[str]:
    """``vllm serve MODEL`` with ``inspect --vllm-config``'s engine arguments (and its --additional-config): MODEL
    is the bundle folder it prints (or a checkpoint, for vLLM native)."""
    argv = [str(VLLM_VENV / "bin" / "vllm"), "serve", str(model), *engine_flags.argv(engine_args)]
    if additional is not None:
        argv += ["--additional-config", json.dumps(additional)]
    if not engine_args.get("skip_tokenizer_init"):
        argv.append("--skip-tokenizer-init")
    return [*argv, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m", "--seed", "0"]


class Server:
    """A ``vllm serve`` process on 127.0.0.1 (started and stopped by the test), its log in a file."""

    def __init__(self, argv: list[str], log: Path, env: dict):
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"

    def wait_ready(self, timeout: float = 300) -> None:
        import time
        import urllib.request

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1)
        raise AssertionError(f"vllm serve not ready after {timeout} s:\n{self.log()[-4000:]}")

    def complete(self, prompt: list[int], max_tokens: int, dp_rank: int | None = None) -> list[int]:
        return complete(self.url, prompt, max_tokens, dp_rank=dp_rank)

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return r.read().decode()

    def rpc(self, method: str) -> list:
        return rpc(self.url, method)

    def all_at_once(self, requests: list[dict], limit: float = 60) -> list[list[int]]:
        """Every request in one scheduling round: vLLM's dev-mode ``POST /pause?mode=keep`` holds new requests in
        its queue, they are sent, and ``/resume`` once vLLM counts them all waiting (or after ``limit`` s), so a
        loaded host's slow HTTP threads cannot spread them over steps (tests that need the largest batch)."""
        import time
        import urllib.request
        from concurrent.futures import ThreadPoolExecutor

        def post(path: str) -> None:
            with urllib.request.urlopen(urllib.request.Request(self.url + path, data=b"", method="POST"), timeout=60):
                pass

        post("/pause?mode=keep")
        with ThreadPoolExecutor(len(requests)) as pool:
            futures = [pool.submit(self.complete, r["prompt"], r["max_tokens"]) for r in requests]
            end = time.monotonic() + limit
            while time.monotonic() < end and sum(prom_samples(self.metrics(), "vllm:num_requests_waiting").values()) \
                    < len(requests):
                time.sleep(0.5)
            post("/resume")
            return [f.result() for f in futures]

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # the group: vLLM's engine core is a child of the server
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def complete(url: str, prompt: list[int], max_tokens: int, timeout: float = 300, dp_rank: int | None = None
             ) -> list[int]:
    """One greedy token-id completion at ``url`` (a ``vllm serve`` or the DI launcher's proxy): its token ids;
    ``dp_rank``: to that DP rank (vLLM's ``X-data-parallel-rank``), not its balancer's."""
    import urllib.request

    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    headers = {"Content-Type": "application/json"}
    if dp_rank is not None:
        headers["X-data-parallel-rank"] = str(dp_rank)
    req = urllib.request.Request(url + "/v1/completions", data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return list(json.loads(r.read())["choices"][0]["token_ids"])


def rpc(url: str, method: str) -> list:
    """vLLM's dev-mode ``POST /collective_rpc`` (VLLM_SERVER_DEV_MODE=1): ``method`` of every worker, e.g. the
    plugin's worker extension's ``neffbuild_report`` (neffbuild.vllm.model.WorkerReport)."""
    import urllib.request

    req = urllib.request.Request(url + "/collective_rpc", data=json.dumps({"method": method}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["results"]


def report(url: str) -> dict:
    """The plugin's report of the first worker of a ``vllm serve`` started with ``--worker-extension-cls
    neffbuild.vllm.model.WorkerReport`` in dev mode."""
    return rpc(url, "neffbuild_report")[0]


def prom_samples(text: str, name: str) -> dict[tuple, float]:
    """{label tuple: value} of one metric in Prometheus text (pid labels of multiprocess mode dropped)."""
    import re

    out: dict[tuple, float] = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? ([0-9.e+-]+)$", line)
        if m:
            labels = tuple(sorted(kv for kv in re.findall(r'(\w+)="([^"]*)"', m.group(1) or "") if kv[0] != "pid"))
            out[labels] = out.get(labels, 0.0) + float(m.group(2))
    return out
