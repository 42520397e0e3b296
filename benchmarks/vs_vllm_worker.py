"""One side of benchmarks/vs_vllm.py, run by the vLLM venv's python: decode tokens/s of one vLLM engine.

    .venv-vllm/bin/python benchmarks/vs_vllm_worker.py --model CKPT --engine-args JSON [--bundle B] ...

Per batch size: a 1-token generation (prefill + first token) and the full generation of the same prompts,
``--rounds`` times; decode seconds = the difference, for B x (new - 1) tokens. Prints one JSON line.
"""

import argparse
import json
import random
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--engine-args", required=True)
    p.add_argument("--bundle")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--prompt-len", type=int, default=400)
    p.add_argument("--new", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    a = p.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {"model": a.model, "skip_tokenizer_init": True, "seed": 0, **json.loads(a.engine_args)}  # the bundle
    # folder as the model when serving one (the printed settings: --load-format dummy), else the checkpoint
    if a.bundle:
        kw["additional_config"] = {"neffbuild": {"bundle": a.bundle}}
    llm = LLM(**kw)

    def plugin_report():
        """The plugin's report from the worker; None for vLLM's own GPT-OSS (VLLM_PLUGINS="": no plugin)."""
        if not a.bundle:
            return None
        from neffbuild.vllm.model import worker_report

        return worker_report(llm)

    rng = random.Random(0)
    batches = [int(b) for b in a.batches.split(",")]
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(a.vocab) for _ in range(a.prompt_len)])
               for _ in range(max(batches))]

    def run(n, tokens):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts[:n], params, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    run(max(batches), 4)  # warm-up: every code path once
    result = {}
    for n in batches:
        decode, tokens = [], None
        before = plugin_report()
        for _ in range(a.rounds):
            first, _ = run(n, 1)
            full, tokens = run(n, a.new)
            decode.append(full - first)
        result[str(n)] = {"decode_s": decode, "tokens": tokens, "plugin": _delta(before, plugin_report())}
    report = plugin_report()
    print(json.dumps({"batches": result, "report": report}), flush=True)


def _delta(before, after):
    """The plugin's decode forwards and seconds (its forward, Stepper.run) between two reports, or None."""
    if not before or not after or "steps" not in after:
        return None
    steps = sum(after["steps"].values()) - sum(before["steps"].values())
    return {"steps": steps, **{k: after["seconds"].get(k, 0.0) - before["seconds"].get(k, 0.0)
                               for k in ("forward", "run")}}


if __name__ == "__main__":
    main()
