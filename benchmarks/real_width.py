"""Decode at GPT-OSS-20B's width: the bundle beside llama.cpp, vLLM CPU and transformers, same checkpoint.

    /work/heavy .venv/bin/python benchmarks/real_width.py [--workdir DIR] [--layers 2] [--new 200]
        [--rounds 1] [--engines bundle-mxfp4,llama-mxfp4,...] [--plot docs/img/real-width.png]

A random checkpoint with GPT-OSS-20B's dimensions (hidden 2,880, 64 heads, 8 KV heads of 64, 32
experts top 4, intermediate 2,880, vocab 201,088, sliding window 128) and ``--layers`` layers
(benchmarks/real_width_ckpt.py: openai's MXFP4 layout, and the same weights with dense bf16
experts). Engines, each in its own process, one after the other (memory is freed between them;
peak RSS is reported per engine), with ``--rounds`` interleaved rounds:

  bundle-mxfp4  neffbuild bundle, ``weights_dtype: bfloat16``, ``experts: mxfp4``, bf16 KV (CLI compile)
  bundle-int8   bundle-mxfp4 with the opt-in int8 kernel forms (runtime/native_q8.py): ``expert_kernel: int8``
                (MXFP4 experts times int8-quantized activations), ``head_kernel: int8`` (the bf16 LM head read
                as int8 with a float scale a row, greedy-exact) and ``attn_kernel: int8`` (the qkv and o
                projections read so too, lossy)
  bundle-q8head bundle-mxfp4 with ``head_kernel: int8`` alone (exact experts)
  bundle-bf16   the same with dense bf16 experts
  bundle-fp32   float32 everywhere (reference; ~4.5x the weight bytes)
  llama-mxfp4   llama.cpp on the GGUF its converter makes of the MXFP4 checkpoint, f16 KV, flash attention
  llama-ft38    llama.cpp on that GGUF quantized by llama.cpp's own quantizer to file type 38 (MXFP4_MOE: experts
                MXFP4, the other 2-D weights Q8_0; the form the published gpt-oss GGUFs ship), f16 KV, flash
  llama-bf16    llama.cpp on the dense checkpoint's GGUF (bf16), f16 KV, flash attention off
  vllm-bf16     vLLM CPU, bf16, eager (needs the vLLM venv: tools/vllm_venv.sh); vLLM CPU cannot serve the
                MXFP4 checkpoint without AMX, so this is what a vLLM user on such a host runs
  vllm-plugin-mxfp4  vLLM CPU with neffbuild's plugin serving bundle-mxfp4's bundle from the bundle folder alone,
                started with the settings ``neffbuild inspect --vllm-config --json`` prints
  hf-bf16       transformers eager ``generate``, bf16

Batch 1 and 4, one thread each, the same ``--prompt``-token prompts, ``--new`` greedy tokens;
decode seconds = t(new) - t(1) of the same prompts. Bytes per step: the weights the step must
read (one embedding row a token, the router's experts ``min(B * top_k, E)`` of each layer in the
engine's expert format, the LM head and the qkv and o projections in their form (int8 rows: 1 byte a
weight and a 4-byte scale a row), every other weight in its dtype) plus the KV at the mean decode context;
bandwidth fraction = (bytes per step / step time) / the copy bandwidth measured at the start
(``neffbuild.bench.bytes.copy_bandwidth``). Token agreement per pair: the fraction of the
generated tokens before the first difference; an int8 engine run without bundle-mxfp4 is compared
with the bundle-mxfp4 round WORKDIR kept from an earlier run (same prompts and lengths). A peer
that is not installed is skipped with a line saying how to install it (benchmarks/peers.sh). The
load average is printed with every number: a number taken on a busy host says so.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
HERE = Path(__file__).resolve().parent
LLAMA_PY = Path(os.environ.get("LLAMA_PYTHON", ROOT / ".venv-llama" / "bin" / "python"))
VLLM_PY = Path(os.environ.get("VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
CONVERTER = os.environ.get("LLAMA_CONVERTER", str(ROOT / ".venv-llama" / "llama.cpp" / "convert_hf_to_gguf.py"))
INSTALL = "benchmarks/peers.sh (make bench runs it): {what}"
# engine -> (checkpoint kind, runner, form); form: (expert bytes a weight, other weights' itemsize, KV itemsize[,
# {weight name: (bytes a weight, bytes a row)} for the weights not in the other weights' itemsize])
INT8_ROWS = (1, 4)  # int8 weights, one float32 scale a row (runtime/native_q8.py)
ENGINES = {
    "bundle-mxfp4": ("mxfp4", "bundle", (17 / 32, 2, 2)),
    "bundle-int8": ("mxfp4", "bundle", (17 / 32, 2, 2, {"lm_head": INT8_ROWS, "qkv_w": INT8_ROWS, "o_w": INT8_ROWS})),
    "bundle-q8head": ("mxfp4", "bundle", (17 / 32, 2, 2, {"lm_head": INT8_ROWS})),
    "bundle-bf16": ("bf16", "bundle", (2, 2, 2)),
    "bundle-fp32": ("bf16", "bundle", (4, 4, 4)),
    "llama-mxfp4": ("mxfp4", "llama", (17 / 32, 2, 2)),
    "llama-ft38": ("mxfp4", "llama", (17 / 32, 34 / 32, 2)),  # Q8_0: 32 int8 + one f16 scale
    "llama-bf16": ("bf16", "llama", (2, 2, 2)),
    "vllm-bf16": ("bf16", "vllm", (2, 2, 2)),
    "vllm-plugin-mxfp4": ("mxfp4", "vllm-plugin", (17 / 32, 2, 2)),
    "hf-bf16": ("bf16", "hf", (2, 2, 2)),
}
INT8_ENGINES = ("bundle-int8", "bundle-q8head")  # opt-in numeric forms: their tokens are compared with bundle-mxfp4's
DEFAULT = "bundle-mxfp4,bundle-bf16,llama-mxfp4,llama-bf16,vllm-bf16,hf-bf16"


def load() -> str:
    return f"load average {os.getloadavg()[0]:.2f}"


def env(plugin: bool = False) -> dict:
    """One thread, offline, vLLM in one process; vLLM native loads no plugin at all, the plugin side takes its KV
    memory from the printed settings (no VLLM_CPU_KVCACHE_SPACE)."""
    out = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_LOGGING_LEVEL="WARNING", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    if not plugin:
        out.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_PLUGINS="")
    else:
        out.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return out


def last_json(argv: list[str], log: Path, *, plugin: bool = False) -> dict:
    t0 = time.perf_counter()
    with open(log, "a") as err:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env(plugin), check=False)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        raise RuntimeError(f"{argv[:3]} exited {p.returncode}: see {log}")
    return dict(json.loads(lines[-1]), wall_s=time.perf_counter() - t0)


# ----------------------------------------------------------------------------- set-up


def recipe_for(name: str, ckpt: Path, work: Path, batches: list[int], ctx: int) -> Path:
    form = {"bundle-mxfp4": ("bfloat16", "mxfp4", "bfloat16"), "bundle-bf16": ("bfloat16", "dense", "bfloat16"),
            "bundle-fp32": ("float32", "dense", "float32"), "bundle-int8": ("bfloat16", "mxfp4", "bfloat16"),
            "bundle-q8head": ("bfloat16", "mxfp4", "bfloat16")}[name]
    kernels = {"bundle-int8": {"expert_kernel": "int8", "head_kernel": "int8", "attn_kernel": "int8"},
               "bundle-q8head": {"head_kernel": "int8"}}.get(name, {})
    raw = {"name": f"real-width-{name}", "version": "0.1.0",
           "model": {"arch": "gpt_oss", "checkpoint": str(ckpt), "weights_dtype": form[0], "experts": form[1],
                     **kernels},
           # block 32: vLLM's CPU backend allocates KV in multiples of 32 (the plugin serves this bundle too)
           "serving": {"max_model_len": ctx, "max_num_seqs": max(batches), "block_size": 32,
                       "num_blocks": max(batches) * ctx // 32 + 1},
           "neuron_config": {"num_seqs_buckets": batches, "decode_context_length_buckets": [ctx],
                             "gk_decode": True, "fp8_packed_kv": False, "kv_dtype": form[2]},
           "parallel": {"tp": 1, "dp": 1, "ep": 1}, "compiler": {"backend": "inductor"}, "build": {"jobs": 1}}
    path = work / f"{raw['name']}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def build_bundle(name: str, ckpt: Path, work: Path, a) -> tuple[Path, float]:
    """Compile through the CLI (the serving-dtypes keys in the recipe), every time: the compile cache
    under WORKDIR makes a rerun of unchanged code compile nothing, and changed code is rebuilt."""
    out = work / "out" / f"real-width-{name}-0.1.0"
    recipe = recipe_for(name, ckpt, work, a.batches, a.ctx)
    if a.no_rebuild and (out / "manifest.json").is_file():
        return out, 0.0
    t0 = time.perf_counter()
    argv = [sys.executable, "-m", "neffbuild.cli.main", "compile", str(recipe), "-o", str(work / "out"),
            "--cache-dir", str(work / "cache"), "-j", "1"]
    with open(work / "build.log", "a") as log:
        rc = subprocess.run(argv, stdout=log, stderr=log, env=env(), check=False).returncode
    if rc:
        raise RuntimeError(f"compile of {recipe} exited {rc}: see {work / 'build.log'}")
    return out, time.perf_counter() - t0


def gguf_for(kind: str, ckpt: Path, work: Path) -> tuple[Path, float]:
    out = work / f"real-width-{kind}.gguf"
    if out.is_file():
        return out, 0.0
    # The converter needs torch (+ numpy, safetensors): the project's python, the converter's own gguf-py.
    argv = [sys.executable, str(HERE / "real_width_peers.py"), "convert", "--converter", CONVERTER, str(ckpt),
            str(out.with_suffix(".tmp")), "--outtype", "auto" if kind == "mxfp4" else "bf16"]
    doc = last_json(argv, work / "convert.log")
    out.with_suffix(".tmp").rename(out)
    return out, doc["seconds"]


def quantized(gguf: Path, work: Path) -> tuple[Path, float]:
    """``gguf`` quantized to file type 38 by llama.cpp's own quantizer (llama-cpp-python binds it)."""
    out = work / f"{gguf.stem}-ft38.gguf"
    if out.is_file():
        return out, 0.0
    tmp = out.with_suffix(".tmp")
    doc = last_json([str(LLAMA_PY), str(HERE / "real_width_peers.py"), "quantize", str(gguf), str(tmp)],
                    work / "quantize.log")
    tmp.rename(out)
    return out, doc["seconds"]


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    return [[(7 * i + 31 * r + 3) % (vocab - 1) + 1 for i in range(length)] for r in range(n)]


# ----------------------------------------------------------------------------- bytes


def step_bytes(cfg, form: tuple, batch: int, ctx: int) -> int:
    """Bytes one decode step of ``batch`` tokens must read at context ``ctx`` (module docstring's rule)."""
    from neffbuild.models.gpt_oss.shapes import stacked_shapes

    expert_bpw, itemsize, kv_isz, *rows = form
    rows = rows[0] if rows else {}
    experts = min(batch * cfg.num_experts_per_tok, cfg.num_local_experts) / cfg.num_local_experts
    total = 0.0
    for name, shape in stacked_shapes(cfg).items():
        n = 1
        for s in shape:
            n *= s
        if name == "embed":
            total += batch * shape[-1] * itemsize
        elif name in ("gate_up_w", "down_w"):
            total += n * expert_bpw * experts
        elif name in ("gate_up_b", "down_b"):
            total += n * itemsize * experts
        elif name in rows:  # [..., rows, K] read as int8 rows
            total += n * rows[name][0] + n // shape[-1] * rows[name][1]
        else:
            total += n * itemsize
    per_token = cfg.num_key_value_heads * cfg.head_dim * 2 * kv_isz
    for kind in cfg.layer_types:
        total += batch * per_token * (ctx if kind == "full_attention" else min(ctx, cfg.sliding_window))
    return int(total)


# ----------------------------------------------------------------------------- workers (project python)


def warm_pages(folder: Path) -> None:
    """Read the bundle's memory-mapped weights files once, so no timed step reads them from disk: llama.cpp's loader
    asks the kernel to read its mapped GGUF ahead (``MADV_WILLNEED``), and the engine run before this one (a 12 GB
    GGUF at 24 layers) may have pushed the bundle's pages out of a 24 GiB host's page cache."""
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


def worker_bundle(a, ps) -> dict:
    import torch

    from neffbuild.runtime.bundle.reader import open_bundle
    from neffbuild.serve.engine import Engine
    from neffbuild.serve.parts import LocalPrefill, Request
    from neffbuild.serve.rank import open_rank

    torch.set_num_threads(1)
    session = open_rank(open_bundle(Path(a.model), preload=True))
    warm_pages(Path(a.model) / "weights")

    def run(b, new):
        reqs = [Request(str(r), p, new, 0, index=r) for r, p in enumerate(ps[:b])]
        engine = Engine(session.stepper, session.block_manager(), LocalPrefill(session.prefill, session.kv_caches))
        t0 = time.perf_counter()
        with torch.no_grad():
            engine.run(reqs)
        return time.perf_counter() - t0, [r.tokens for r in sorted(reqs, key=lambda r: r.index)]

    return run


def worker_hf(a, ps) -> dict:
    import torch
    import transformers

    torch.set_num_threads(1)
    model = transformers.GptOssForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None

    def run(b, new):
        ids = torch.tensor(ps[:b])
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0)
            secs = time.perf_counter() - t0
        return secs, out[:, ids.shape[1]:].tolist()

    return run


def worker(a) -> None:
    import resource

    sys.path.insert(0, str(HERE))
    from real_width_peers import _timed

    ps = json.loads(Path(a.prompts).read_text())
    run = (worker_bundle if a.worker == "bundle" else worker_hf)(a, ps)
    result = _timed(run, a.batches, a.new, 1)
    print(json.dumps({"batches": result, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


# ----------------------------------------------------------------------------- one engine, the report


def run_engine(name: str, a, work: Path, ckpts: dict, setup: dict, bw: float) -> dict | str:
    """One round of one engine in its own process: the worker's JSON, or a line saying why it was skipped."""
    argv = prepare(name, a, work, ckpts, setup)
    if isinstance(argv, str):
        return argv
    before = os.getloadavg()[0]
    doc = last_json(argv, work / f"{name}.log", plugin=ENGINES[name][1] == "vllm-plugin")
    doc["load"] = f"{before:.1f}-{os.getloadavg()[0]:.1f}"
    doc["copy_bandwidth"] = bw  # this run's figure, kept with the round (a later --report divides by it)
    with open(work / f"{name}.jsonl", "a") as f:  # each round as it lands: a run cut short keeps what it measured
        f.write(json.dumps(doc) + "\n")
    return doc


def prepare(name: str, a, work: Path, ckpts: dict, setup: dict) -> list[str] | str:
    """An engine's set-up (its bundle compiled, its GGUF converted and quantized): the argv of its round, or a line
    saying why it is skipped."""
    kind, runner, _ = ENGINES[name]
    ckpt = ckpts[kind]
    common = ["--prompts", str(work / "prompts.json"), "--batches", ",".join(map(str, a.batches)),
              "--new", str(a.new)]
    if runner == "bundle":
        path, secs = build_bundle(name, ckpt, work, a)
        setup.setdefault(name, {"compile_s": round(secs, 1)})
        argv = [sys.executable, __file__, "--worker", "bundle", "--model", str(path), *common]
    elif runner == "hf":
        argv = [sys.executable, __file__, "--worker", "hf", "--model", str(ckpt), *common]
    elif runner == "llama":
        if not LLAMA_PY.is_file():
            return f"skipped: {LLAMA_PY} is absent; install it with " + INSTALL.format(what="creates .venv-llama")
        if not Path(CONVERTER).is_file():
            return f"skipped: llama.cpp's converter {CONVERTER} is absent (LLAMA_CONVERTER=...; benchmarks/peers.sh)"
        ft38 = work / f"real-width-{kind}-ft38.gguf"
        if name == "llama-ft38" and ft38.is_file():  # quantized in an earlier round or run
            gguf = ft38
            setup.setdefault(name, {"convert_s": 0.0, "quantize_s": 0.0})
        else:
            gguf, secs = gguf_for(kind, ckpt, work)
            setup.setdefault(name, {"convert_s": round(secs, 1)})
        if name == "llama-ft38" and gguf != ft38:
            gguf, secs = quantized(gguf, work)
            setup[name]["quantize_s"] = round(secs, 1)
            if "llama-mxfp4" not in a.engines.split(","):  # the converter's GGUF was only a step (disk)
                (work / f"real-width-{kind}.gguf").unlink()
        flags = ["--flash", "--kv", "f16"] if kind == "mxfp4" else ["--kv", "f16"]
        argv = [str(LLAMA_PY), str(HERE / "real_width_peers.py"), "llama", "--model", str(gguf), *common, *flags]
    else:
        if not VLLM_PY.is_file():
            return f"skipped: {VLLM_PY} is absent; install it with tools/vllm_venv.sh (" + \
                INSTALL.format(what="uses it") + ")"
        model, extra = str(ckpt), []
        if runner == "vllm-plugin":  # the bundle-mxfp4 bundle, started as `inspect --vllm-config` says
            path, _ = build_bundle("bundle-mxfp4", ckpt, work, a)
            printed = subprocess.run([sys.executable, "-m", "neffbuild.cli.main", "inspect", str(path),
                                      "--vllm-config", "--json"], capture_output=True, text=True, env=env(),
                                     check=True).stdout
            doc = json.loads(printed)
            engine_args = dict(doc["engine_args"], max_num_seqs=max(a.batches))
            model = doc["model"]
            extra = ["--engine-args", json.dumps({"engine_args": engine_args,
                                                  "additional_config": doc["additional_config"]})]
        argv = [str(VLLM_PY), str(HERE / "real_width_peers.py"), "vllm", "--model", model, *common, *extra]
    return argv


def prepare_all(names: list[str], a, work: Path, ckpts: dict, setup: dict) -> None:
    """``--prepare``: every engine's set-up, one line each. A bundle whose weights file is byte for byte an earlier
    one's (the manifests' digests agree: the int8 forms quantize at run time) then shares that file (a hard link),
    as soon as it is built: the real depth needs one 14 GB weights file, not one a form, and the disk that the GGUFs
    take next (a 24-layer run filled a 63 GB disk when the links waited for the end); ``--no-rebuild`` keeps them so."""
    first: dict[str, Path] = {}
    for n in names:
        t0 = time.perf_counter()
        got = prepare(n, a, work, ckpts, setup)
        print(f"{n}: " + (got if isinstance(got, str) else f"ready in {time.perf_counter() - t0:.0f} s"), flush=True)
        bundle = work / "out" / f"real-width-{n}-0.1.0"
        if ENGINES[n][1] != "bundle" or not (bundle / "manifest.json").is_file():
            continue
        entry = json.loads((bundle / "manifest.json").read_text())["files"].get("weights/model.safetensors")
        weights = bundle / "weights" / "model.safetensors"
        if entry is None:
            continue
        same = first.setdefault(entry["sha256"], weights)
        if same != weights and not same.samefile(weights):
            tmp = weights.with_name(weights.name + ".link")
            os.link(same, tmp)
            os.replace(tmp, weights)
            print(f"{n}: its weights are {same.parent.parent.name}'s byte for byte: one file, linked", flush=True)


def kept_reference(work: Path, a, docs: dict) -> list | None:
    """bundle-mxfp4's last round kept in WORKDIR, for the int8 engines' agreement when this run has no bundle-mxfp4
    of its own: None unless it covers this run's batches with ``--new`` tokens (the prompts are WORKDIR's too)."""
    ran = docs.get("bundle-mxfp4")
    path = work / "bundle-mxfp4.jsonl"
    if not any(n in docs for n in INT8_ENGINES) or (isinstance(ran, list) and ran) or not path.is_file():
        return None
    last = json.loads(path.read_text().splitlines()[-1])
    fits = all(str(b) in last["batches"] and len(last["batches"][str(b)]["tokens"]) == b
               and all(len(t) == a.new for t in last["batches"][str(b)]["tokens"]) for b in a.batches)
    return [last] if fits else None


def agreement(rx: list, ry: list, b: int) -> float:
    """The fraction of the generated tokens before the first difference (the last rounds', batch ``b``)."""
    tx, ty = rx[-1]["batches"][str(b)]["tokens"], ry[-1]["batches"][str(b)]["tokens"]
    same = sum(next((i for i, (p, q) in enumerate(zip(u, v, strict=True)) if p != q), len(u))
               for u, v in zip(tx, ty, strict=True))
    return same / sum(map(len, tx))


def report(a, docs: dict, cfg, bw: float, kept: list | None = None) -> list[str]:
    ctx = a.prompt + a.new // 2  # the mean context of the decode steps
    lines = ["| engine | batch | decode tokens/s | step | bytes per step | GB/s read | of copy bandwidth | "
             "peak RSS | load average (start-end) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, runs in docs.items():
        if isinstance(runs, str):
            lines.append(f"| {name} | - | {runs} | | | | | | |")
            continue
        for b in a.batches:
            secs = sorted(s for r in runs for s in r["batches"][str(b)]["decode_s"])
            med = secs[len(secs) // 2]
            step = med / (a.new - 1)
            nbytes = step_bytes(cfg, ENGINES[name][2], b, ctx)
            rss = max(r["peak_rss_mb"] for r in runs)
            run_bw = runs[-1].get("copy_bandwidth", bw)
            lines.append(f"| {name} | {b} | {b * (a.new - 1) / med:.2f} | {step * 1e3:.1f} ms | "
                         f"{nbytes / 1e9:.3f} GB | {nbytes / step / 1e9:.2f} | {nbytes / step / run_bw:.0%} | "
                         f"{rss / 1024:.1f} GiB | {runs[-1]['load']} |")
    lines += ["", "| pair | batch | token agreement (before the first difference) |", "|---|---|---|"]
    done = {k: v for k, v in docs.items() if not isinstance(v, str)}
    pairs = list(itertools.combinations(done.items(), 2))
    if kept:
        pairs += [((x, rx), ("bundle-mxfp4 (kept in WORKDIR)", kept)) for x, rx in done.items() if x in INT8_ENGINES]
    for (x, rx), (y, ry) in pairs:
        for b in a.batches:
            lines.append(f"| {x} / {y} | {b} | {agreement(rx, ry, b):.2f} |")
    return lines


def plot(path: Path, a, docs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = {k: v for k, v in docs.items() if not isinstance(v, str)}
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(a.batches)
    for j, b in enumerate(a.batches):
        tps = [b * (a.new - 1) / sorted(s for r in v for s in r["batches"][str(b)]["decode_s"])[len(v) // 2]
               for v in done.values()]
        ax.bar([i + j * width for i in range(len(done))], tps, width, label=f"batch {b}")
    ax.set_xticks([i + width * (len(a.batches) - 1) / 2 for i in range(len(done))], list(done), rotation=20)
    ax.set_ylabel("decode tokens/s (one thread)")
    loads = [float(x) for v in done.values() for r in v for x in r["load"].split("-")]  # the runs' own
    ax.set_title(f"GPT-OSS-20B width, {a.layers} layers, {a.prompt}-token prompts, {a.new} new "
                 f"(load average {min(loads, default=0):.1f}-{max(loads, default=0):.1f})")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def bandwidth(recorded: dict | None) -> float:
    """The copy bandwidth to divide by: measured now, or (``--report``) the figure the runs recorded with their
    rounds, since a report may run on a busy host."""
    from neffbuild.bench.bytes import copy_bandwidth

    if recorded is None:
        bw = copy_bandwidth()
        print(f"copy bandwidth {bw / 1e9:.2f} GB/s ({load()})", flush=True)
        return bw
    bws = sorted({r["copy_bandwidth"] for v in recorded.values() for r in v if "copy_bandwidth" in r})
    print(f"copy bandwidth of the runs: {', '.join(f'{x / 1e9:.2f}' for x in bws) or 'not recorded'} GB/s")
    return bws[-1] if bws else copy_bandwidth()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--prompt", type=int, default=400)
    ap.add_argument("--new", type=int, default=200)
    ap.add_argument("--ctx", type=int, default=1024, help="max_model_len and the bundle's one context bucket")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds (one process per engine and round)")
    ap.add_argument("--engines", default=DEFAULT, help=f"comma-separated, of: {', '.join(ENGINES)}")
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--tiny", action="store_true", help="toy dimensions: checks the pipeline, measures nothing")
    ap.add_argument("--report", action="store_true", help="run nothing: the tables from WORKDIR/*.jsonl")
    ap.add_argument("--no-rebuild", action="store_true",
                    help="take the bundles in WORKDIR/out as they are (built by --prepare from this tree): at the real "
                         "depth a rebuild writes a second copy of a 14 GB bundle before it replaces the first")
    ap.add_argument("--prepare", action="store_true",
                    help="the set-up only (checkpoint, bundles, GGUFs; on a busy host if need be), then exit: the "
                         "measuring run later finds them in WORKDIR")
    ap.add_argument("--worker", choices=["bundle", "hf"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    names = [n.strip() for n in a.engines.split(",") if n.strip()]
    bad = [n for n in names if n not in ENGINES]
    if bad:
        print(f"--engines: unknown {bad}; known: {', '.join(ENGINES)}", file=sys.stderr)
        raise SystemExit(2)
    if a.prompt + a.new > a.ctx:
        print(f"--prompt + --new ({a.prompt + a.new}) exceeds --ctx {a.ctx}", file=sys.stderr)
        raise SystemExit(2)
    from benchmarks._common import machine
    from benchmarks.real_width_ckpt import config

    work = a.workdir or Path(tempfile.mkdtemp(prefix="real-width-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # The dense copy only where an engine reads it (at 24 layers it alone is ~38 GB): else the MXFP4 folder alone,
    # a shard a layer, random blocks and scales (real_width_ckpt.py --mxfp4-only)
    dense = any(ENGINES[n][0] == "bf16" for n in names)
    doc = last_json([sys.executable, str(HERE / "real_width_ckpt.py"), str(work / "ckpt"), "--layers",
                     str(a.layers)] + (["--tiny"] if a.tiny else []) + ([] if dense else ["--mxfp4-only"]),
                    work / "ckpt.log")
    ckpts = {k: Path(doc[k]) for k in ("mxfp4", "bf16") if k in doc}
    print(f"checkpoints ({a.layers} layers) ready in {time.perf_counter() - t0:.0f} s: {work / 'ckpt'}", flush=True)
    cfg = config(a.layers, a.tiny)
    (work / "prompts.json").write_text(json.dumps(prompts(max(a.batches), a.prompt, cfg.vocab_size)))
    docs, setup = {n: [] for n in names}, {}
    if a.report:
        docs = {n: [json.loads(ln) for ln in (work / f"{n}.jsonl").read_text().splitlines()]
                for n in names if (work / f"{n}.jsonl").is_file()}
    if a.prepare:
        return prepare_all(names, a, work, ckpts, setup)
    bw = bandwidth(docs if a.report else None)
    for rnd in range(0 if a.report else a.rounds):
        for n in names:
            if isinstance(docs[n], str):
                continue
            try:
                got = run_engine(n, a, work, ckpts, setup, bw)
            except RuntimeError as exc:
                got = f"failed: {exc}"
            docs[n] = got if isinstance(got, str) else docs[n] + [got]
            print(f"round {rnd}: {n}: " + (got if isinstance(got, str) else
                                           f"done in {got['wall_s']:.0f} s (load average {got['load']})"),
                  flush=True)
    width = "TOY dimensions (--tiny: a pipeline check)" if a.tiny else "GPT-OSS-20B width"
    rounds = max((len(v) for v in docs.values() if not isinstance(v, str)), default=0) if a.report else a.rounds
    lines = [f"machine: {machine()}; copy bandwidth {bw / 1e9:.2f} GB/s; one thread per engine; "
             f"{a.layers} layers at {width}; {a.prompt}-token prompts, {a.new} new tokens, greedy; "
             f"up to {rounds} round(s) an engine; medians", ""] + report(a, docs, cfg, bw,
                                                                         kept_reference(work, a, docs))
    print("\n".join(lines))
    (work / "real_width.json").write_text(json.dumps({"runs": docs, "setup": setup, "copy_bandwidth": bw,
                                                      "table": lines}, indent=1))
    print(f"\nset-up (s): {json.dumps(setup)}; JSON: {work / 'real_width.json'}")
    if a.plot:
        plot(a.plot, a, docs)


if __name__ == "__main__":
    main()
