"""Why a DI decode step costs more: plain steps with a KVIngest registered over the same KV, then closed.

    PYTHONPATH=. .venv/bin/python benchmarks/di_step_diag.py BUNDLE   (try UCX_MEM_EVENTS=no too)
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from neffbuild import registry
from neffbuild.runtime.bundle import open_bundle
from neffbuild.runtime.kv_ingest import KVIngest
from neffbuild.serve.greedy import greedy
from neffbuild.serve.session import open_session

path = sys.argv[1]
b = open_bundle(path); s = open_session(b)
for l in b.labels: b.artifact(l)
P = [[(7 * i + 3 * n) % 250 + 1 for i in range(n)] for n in [40] * 4]
def t(tag):
    xs = []
    for _ in range(3):
        g = greedy(s.stepper, s.prefill, s.block_manager(), P, 24)
        xs.append(g.decode_seconds / len(g.plans))
    print(tag, round(statistics.median(xs) * 1e3, 3), "ms/step", flush=True)
t("plain, no nixl")
cfg = s.config; of = registry.arch_of(cfg).get("kv_buffer_of_layer")
kv = KVIngest("diag", [s.stepper.kv_caches[of(i)] for i in range(cfg.num_hidden_layers)], total_heads=cfg.num_key_value_heads)
t("plain, agent registered over the KV")
kv.close()
t("plain, agent closed")
del kv
import gc; gc.collect()
t("plain, agent gone")
