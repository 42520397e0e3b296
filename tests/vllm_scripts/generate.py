"""Run in the vLLM venv (tests/vllm_helpers.py): greedy generation through ``vllm.LLM``, with or without a bundle.

    python generate.py --model CKPT --requests R.json [--bundle B] [--num-blocks N] ...
    R.json: [{"prompt": [token ids], "max_tokens": n}, ...]

Prints one JSON line: every request's tokens, in order, and the plugin's report (None when no bundle; with one,
VLLM_ALLOW_INSECURE_SERIALIZATION=1: neffbuild.vllm.model.report; ``reports``: every worker's, one per TP rank).
With a bundle, vLLM starts on the bundle folder itself (``--model`` is ignored): the settings ``neffbuild inspect
--vllm-config`` prints.
"""

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--requests", required=True)
    p.add_argument("--bundle")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    a = p.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {"model": a.model, "dtype": a.dtype, "kv_cache_dtype": a.kv_cache_dtype, "skip_tokenizer_init": True,
          "enforce_eager": True,
          "max_model_len": a.max_model_len, "block_size": a.block_size, "num_gpu_blocks_override": a.num_blocks,
          "max_num_seqs": a.max_num_seqs, "seed": 0,
          "tensor_parallel_size": a.tensor_parallel_size}
    if a.bundle:
        kw.update(model=a.bundle, load_format="dummy", additional_config={"neffbuild": {"bundle": a.bundle}})
    start = time.perf_counter()
    llm = LLM(**kw)
    loaded = time.perf_counter() - start
    with open(a.requests) as f:
        reqs = json.load(f)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False)
              for r in reqs]
    times = []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    report, reports = None, []
    if a.bundle:
        from neffbuild.vllm.model import report as report_of

        reports = llm.apply_model(report_of)  # one per worker (TP rank)
        report = reports[0]
    doc = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "report": report, "reports": reports,
           "load_s": loaded, "generate_s": times}
    print(json.dumps(doc), flush=True)


if __name__ == "__main__":
    main()
