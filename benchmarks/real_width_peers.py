"""The peers' side of benchmarks/real_width.py, run by each peer's own python (no neffbuild import).

    PY real_width_peers.py convert  --converter VENDOR/convert_hf_to_gguf.py CKPT OUT.gguf --outtype auto
    PY real_width_peers.py quantize IN.gguf OUT.gguf [--ftype 38]
    PY real_width_peers.py llama    --model X.gguf --prompts P.json --batches 1,4 --new 200 [--flash] [--kv f16]
    PY real_width_peers.py vllm     --model CKPT   --prompts P.json --batches 1,4 --new 200 [--dtype bfloat16]
    PY real_width_peers.py vllm     --model BUNDLE --engine-args JSON --prompts P.json ...   (the neffbuild plugin)

``convert`` runs llama.cpp's own converter; a checkpoint without tokenizer files takes its
"no vocab" path (tokenizer model ``none``) plus the ``vocab_size`` key, so the GGUF knows the
unembedding's width. ``quantize`` runs llama.cpp's own quantizer (``llama_model_quantize``) on that GGUF: file
type 38, ``MXFP4_MOE``, is the form the published gpt-oss GGUFs ship (experts MXFP4, the other 2-D weights
Q8_0, the router f32). ``llama`` drives llama.cpp's C API through llama-cpp-python's bindings: the
high-level ``Llama`` object runs one sequence, so batch B is B sequences of one context
(``n_seq_max = B``), one ``llama_decode`` of B tokens a step, greedy argmax over each row of logits.
``vllm`` runs ``vllm.LLM`` in-process (V1 multiprocessing off, so peak RSS is the engine's); with
``--engine-args`` (what ``neffbuild inspect BUNDLE --vllm-config --json`` prints: the bundle folder as the
model, the plugin's section) it serves a bundle through the neffbuild plugin.

Per batch size: a warm-up, then ``--rounds`` times a 1-token and a full generation of the same
prompts; decode seconds = the difference. Prints one JSON line: decode seconds, tokens, peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import runpy
import sys
import time
from pathlib import Path


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def convert(a) -> None:
    vendor = Path(a.converter).resolve().parent
    sys.path[:0] = [str(vendor), str(vendor / "gguf-py")]
    import conversion.gpt_oss as gpt_oss

    def no_vocab(self):  # random checkpoint: no tokenizer files
        self._set_vocab_none()
        self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])

    gpt_oss.GptOssModel.set_vocab = no_vocab
    sys.argv = [str(a.converter), str(a.ckpt), "--outfile", str(a.out), "--outtype", a.outtype]
    t0 = time.perf_counter()
    runpy.run_path(str(a.converter), run_name="__main__")
    print(json.dumps({"gguf": str(a.out), "seconds": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb()}))


def quantize(a) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = a.ftype
    params.nthread = os.cpu_count() or 1
    t0 = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(str(a.src).encode(), str(a.out).encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({a.src}, file type {a.ftype}) returned {rc}")
    print(json.dumps({"gguf": str(a.out), "seconds": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb()}))


def _timed(run, batches, new, rounds) -> dict:
    run(max(batches), 2)  # warm-up: every code path once
    result = {}
    for b in batches:
        decode, tokens = [], None
        for _ in range(rounds):
            first, _ = run(b, 1)
            full, tokens = run(b, new)
            decode.append(full - first)
        result[str(b)] = {"decode_s": decode, "tokens": tokens}
    return result


def llama(a, prompts) -> dict:
    import ctypes

    import llama_cpp as L
    import numpy as np

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(a.model.encode(), mp)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    if n_vocab <= 0:
        n_vocab = a.vocab  # no-vocab GGUF: the vocab_size key sized the unembedding
    bmax = max(a.batches)
    per_seq = len(prompts[0]) + a.new + 64
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = per_seq * bmax, 512, 512, bmax
    cp.n_threads = cp.n_threads_batch = 1
    cp.flash_attn_type = 1 if a.flash else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
    kv = {"f32": 0, "f16": 1}[a.kv]  # ggml_type
    cp.type_k = cp.type_v = kv
    cp.kv_unified = False
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(512, 0, bmax)

    def fill(entries):  # [(token, pos, seq, want_logits)]
        batch.n_tokens = len(entries)
        for i, (tok, pos, seq, want) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, int(want)
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")

    def argmax(i):
        ptr = L.llama_get_logits_ith(ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                                   shape=(n_vocab,))))

    def run(b, new):
        L.llama_memory_clear(mem, True)
        t0 = time.perf_counter()
        nxt = []
        for s in range(b):
            p = prompts[s]
            for c in range(0, len(p), 512):
                chunk = p[c:c + 512]
                fill([(t, c + j, s, c + j == len(p) - 1) for j, t in enumerate(chunk)])
            nxt.append(argmax(len(p) - 1 - (len(p) - 1) // 512 * 512))
        out = [[t] for t in nxt]
        pos = len(prompts[0])
        for _ in range(new - 1):
            fill([(out[s][-1], pos, s, True) for s in range(b)])
            for s in range(b):
                out[s].append(argmax(s))
            pos += 1
        return time.perf_counter() - t0, out

    return _timed(run, a.batches, a.new, a.rounds)


def vllm(a, prompts) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if a.engine_args:  # the plugin: exactly the printed settings, plus the batch size and the prompt budget
        doc = json.loads(a.engine_args)
        kw = dict(doc["engine_args"], additional_config=doc["additional_config"], max_num_batched_tokens=2048)
        llm = LLM(model=a.model, seed=0, **kw)
    else:
        llm = LLM(model=a.model, skip_tokenizer_init=True, seed=0, dtype=a.dtype, enforce_eager=True,
                  max_model_len=1024, max_num_seqs=max(a.batches), max_num_batched_tokens=2048)
    reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def run(b, new):
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate(reqs[:b], params, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    return _timed(run, a.batches, a.new, a.rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert")
    c.add_argument("--converter", required=True)
    c.add_argument("ckpt")
    c.add_argument("out")
    c.add_argument("--outtype", default="auto")
    q = sub.add_parser("quantize")
    q.add_argument("src")
    q.add_argument("out")
    q.add_argument("--ftype", type=int, default=38, help="llama_ftype (38: MXFP4_MOE)")
    for name in ("llama", "vllm"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--prompts", required=True)
        p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
        p.add_argument("--new", type=int, default=200)
        p.add_argument("--rounds", type=int, default=1)
        p.add_argument("--vocab", type=int, default=201088)
        p.add_argument("--flash", action="store_true")
        p.add_argument("--kv", default="f16", choices=["f16", "f32"])
        p.add_argument("--dtype", default="bfloat16")
        p.add_argument("--engine-args", help="vllm: the plugin's printed settings as JSON (engine_args, "
                                             "additional_config)")
    a = ap.parse_args()
    if a.cmd == "convert":
        return convert(a)
    if a.cmd == "quantize":
        return quantize(a)
    prompts = json.loads(Path(a.prompts).read_text())
    result = (llama if a.cmd == "llama" else vllm)(a, prompts)
    print(json.dumps({"batches": result, "peak_rss_mb": peak_rss_mb()}), flush=True)


if __name__ == "__main__":
    main()
