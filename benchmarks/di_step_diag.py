"""Why a DI decode step costs more: plain steps with a KVIngest registered over the same KV, then closed.

    PYTHONPATH=. .venv/bin/python benchmarks/di_step_diag.py BUNDLE   (try UCX_MEM_EVENTS=no too)
"""

from __future__ import annotations

import gc
import statistics
import sys

from neffbuild import registry
from neffbuild.runtime.bundle.reader import open_bundle
from neffbuild.runtime.di.ingest import KVIngest
from neffbuild.serve.engine import Engine
from neffbuild.serve.parts import LocalPrefill, Request
from neffbuild.serve.rank import open_rank

PROMPTS = [[(7 * i + 3 * n) % 250 + 1 for i in range(n)] for n in [40] * 4]


def step_ms(session) -> float:
    xs = []
    for _ in range(3):
        engine = Engine(session.stepper, session.block_manager(), LocalPrefill(session.prefill, session.kv_caches))
        engine.run([Request(str(n), list(p), 24, index=n) for n, p in enumerate(PROMPTS)])
        xs.append(sum(engine.stats.step_seconds) / len(engine.stats.plans))
    return round(statistics.median(xs) * 1e3, 3)


def main() -> None:
    bundle = open_bundle(sys.argv[1])
    session = open_rank(bundle)
    for label in bundle.labels:
        bundle.artifact(label)
    print("plain, no agent:", step_ms(session), "ms/step", flush=True)
    cfg = session.config
    of = registry.arch_of(cfg).get("kv_buffer_of_layer")
    kv = KVIngest("diag", [session.stepper.kv_caches[of(i)] for i in range(cfg.num_hidden_layers)],
                  total_heads=cfg.num_key_value_heads)
    print("plain, agent registered over the KV:", step_ms(session), "ms/step", flush=True)
    kv.close()
    print("plain, agent closed:", step_ms(session), "ms/step", flush=True)
    del kv
    gc.collect()
    print("plain, agent gone:", step_ms(session), "ms/step", flush=True)


if __name__ == "__main__":
    main()
