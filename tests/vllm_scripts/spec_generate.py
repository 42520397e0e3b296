"""Run in the vLLM venv (tests/vllm_helpers.py): greedy generation through ``vllm.LLM`` started with exactly the
settings ``neffbuild inspect BUNDLE --vllm-config --json`` prints (EAGLE3: its ``--speculative-config``).

    python spec_generate.py --settings S.json --requests R.json [R2.json ...] [--no-spec] [--num-speculative-tokens K]
                            [--native CHECKPOINT] [--warmup]
    R.json: [{"prompt": [token ids], "max_tokens": n}, ...]

Prints one JSON line: per request file (each submitted at once, one file after the other on the same engine)
every request's tokens, the generate call's seconds and vLLM's speculative-decoding counters before and after it
(drafts, accepted drafts: cumulative), then the plugin's report. ``--warmup`` first runs each file's prompts for 4
tokens (first-call costs out of the timing: benchmarks/vllm_spec.py). ``--no-spec`` leaves
``speculative_config`` out (the same bundle without speculation); ``--num-speculative-tokens`` changes its k (a
start-up refusal, on stderr); ``--native`` runs vLLM alone (no plugin settings) on the original checkpoint with
the same engine arguments and the bundle's draft folder: vLLM's own EAGLE3 (its report then says the plugin is
not enabled).
"""

import argparse
import json
import time


def spec_counters(llm) -> dict:
    """vLLM's spec-decode counters (num_drafts, num_draft_tokens, num_accepted_tokens) from its metrics."""
    out = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if metric.name.startswith("vllm:spec_decode_") and hasattr(metric, "value"):
            out[name] = out.get(name, 0) + metric.value
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--settings", required=True)
    p.add_argument("--requests", required=True, nargs="+")
    p.add_argument("--no-spec", action="store_true")
    p.add_argument("--num-speculative-tokens", type=int)
    p.add_argument("--native")
    p.add_argument("--warmup", action="store_true")
    a = p.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(a.settings) as f:
        settings = json.load(f)
    kw = dict(settings["engine_args"], model=settings["model"], additional_config=settings["additional_config"],
              seed=0, disable_log_stats=False)
    if a.native:
        kw.update(model=a.native, additional_config={})
        kw.pop("load_format")  # the bundle's settings say "dummy": the plugin's weights come from the bundle
    if a.no_spec:
        kw.pop("speculative_config", None)
    elif a.num_speculative_tokens is not None:
        kw["speculative_config"] = dict(kw["speculative_config"], num_speculative_tokens=a.num_speculative_tokens)
    llm = LLM(**kw)
    runs = []
    for path in a.requests:
        with open(path) as f:
            reqs = json.load(f)
        prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in reqs]
        params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False)
                  for r in reqs]
        if a.warmup:
            llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
                                   for _ in reqs], use_tqdm=False)
        before, start = spec_counters(llm), time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        runs.append({"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds,
                     "spec_before": before, "spec": spec_counters(llm)})
    from neffbuild.vllm.model import worker_report

    doc = {"runs": runs, "report": worker_report(llm)}
    print(json.dumps(doc), flush=True)


if __name__ == "__main__":
    main()
