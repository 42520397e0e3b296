"""Run in the vLLM venv by benchmarks/vllm_spec.py: one engine (``vllm.LLM``), warmed up, then each request file
submitted at once and timed. Prints one JSON line: per file the generated tokens, seconds, and vLLM's
spec-decode counters used by that file (drafts, draft tokens, accepted tokens).

    python vllm_spec_worker.py --settings S.json --requests R.json [R2.json ...] [--no-spec] [--native CHECKPOINT]
"""

import argparse
import json
import time


def counters(llm) -> dict:
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_") and hasattr(metric, "value"):
            name = metric.name.removeprefix("vllm:spec_decode_")
            out[name] = out.get(name, 0) + metric.value
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--settings", required=True)
    p.add_argument("--requests", required=True, nargs="+")
    p.add_argument("--no-spec", action="store_true")
    p.add_argument("--native")
    a = p.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(a.settings) as f:
        settings = json.load(f)
    kw = dict(settings["engine_args"], model=settings["model"], additional_config=settings["additional_config"],
              seed=0, disable_log_stats=False)
    if a.native:  # vLLM alone on the checkpoint, the same engine arguments and the bundle's draft folder
        kw.update(model=a.native, additional_config={})
        kw.pop("load_format")
    if a.no_spec:
        kw.pop("speculative_config", None)
    llm = LLM(**kw)

    def run(reqs):
        prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in reqs]
        params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False)
                  for r in reqs]
        before = counters(llm)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        after = counters(llm)
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds,
                "spec": {k: after[k] - before.get(k, 0) for k in after}}

    runs = []
    for path in a.requests:
        with open(path) as f:
            reqs = json.load(f)
        run([dict(r, max_tokens=4) for r in reqs])  # warm-up: first-call costs of this batch shape
        runs.append(run(reqs))
    print(json.dumps({"runs": runs}), flush=True)


if __name__ == "__main__":
    main()
