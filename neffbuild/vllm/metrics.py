"""The plugin's counters, in the process that runs the model (vLLM's engine core), through prometheus_client.

vLLM's ``/metrics`` shows them when every vLLM process records into one multiprocess directory: start
``vllm serve`` with ``PROMETHEUS_MULTIPROC_DIR`` set to an empty folder (vLLM's own multiprocess mode; its
API server then collects every process's files, the engine core's included). The runtime's Stepper adds its
own counters to the same registry (``neffbuild_neff_execution_count{bucket}``, batch rows, padding).

  neffbuild_vllm_artifact_steps_total{label,rank} artifact steps by label (batch x context bucket; with EAGLE3
                                                the target_spec ``_s{1+k}``, target_nospec ``_s1`` and ``draft_``
                                                ones) and by the bundle rank of the worker (0 unsharded; an idle DP
                                                rank's steps count under the label it ran)
  neffbuild_vllm_step_digest{rank}              the rank's artifact labels so far, in order, as one number (a
                                                48-bit chain digest): equal on two ranks = the same labels, step
                                                for step
  neffbuild_vllm_forwards_total{kind}           model forwards: decode (all requests in decode) | prefill | mixed
                                                (prefill chunks beside one-token rows, which ran an artifact)
  neffbuild_vllm_decode_rows_total{path}        decode rows by path: artifact (every one-token row, in every forward)
  neffbuild_vllm_family_rows_total{family,rank} rows of the artifact steps by family (a spec step's rows, its
                                                target_nospec rows: on a DI decode instance one per transferred
                                                request, its first step; the draft calls' requests)
  neffbuild_decode_needed_seq                   histogram of each decode step's needed_seq (128-token buckets)

``snapshot()`` returns the same counts as a dict (in the plugin's report: neffbuild/vllm/model.py ``report``).
"""

from __future__ import annotations

import hashlib
from collections import Counter

from neffbuild.runtime import NeededSeqHistogram


class PluginMetrics:
    def __init__(self, max_model_len: int, rank: int = 0):
        self.rank = str(rank)
        self.digest = 0  # the chain digest of every artifact label this rank ran, in order (``artifact``)
        self.steps: Counter[str] = Counter()
        self.families: Counter[str] = Counter()  # the same steps by family (decode | target_spec | ... | draft)
        self.family_rows: Counter[str] = Counter()  # the rows (requests) those steps ran, by family
        self.forwards: Counter[str] = Counter()
        self.rows: Counter[str] = Counter()
        self.needed: Counter[int] = Counter()
        self.prefilled = 0  # prompt tokens through the bundle's eager prefill
        self.draft_prompt_kv: dict[int, tuple[float, float]] = {}  # EAGLE3: prompt span -> (sum, abs sum) (draft.py)
        self.time: Counter[str] = Counter()  # seconds spent, for the benchmark's split (not exported)
        try:
            import prometheus_client as prom
        except ImportError:
            self._prom = None
            return
        edges = NeededSeqHistogram.prometheus_edges(max_model_len)
        self._prom = (
            prom.Counter("neffbuild_vllm_artifact_steps", "Decode forwards run by a bundle artifact.",
                         ["label", "rank"]),
            prom.Counter("neffbuild_vllm_forwards", "Model forwards by kind (decode | prefill | mixed | idle).",
                         ["kind", "rank"]),
            prom.Counter("neffbuild_vllm_decode_rows", "Decode rows by path (artifact).", ["path", "rank"]),
            prom.Histogram(NeededSeqHistogram.METRIC, "needed_seq of each decode step (max computed + 1 + drafts).",
                           buckets=edges),
            prom.Gauge("neffbuild_vllm_step_digest", "Chain digest (48 bits) of the artifact labels this rank ran, in "
                       "order.", ["rank"], multiprocess_mode="all"),
            prom.Counter("neffbuild_vllm_family_rows", "Rows (requests) of the artifact steps by family.",
                         ["family", "rank"]),
        )
        self._children: dict[tuple[int, str], object] = {}  # each label's counter, looked up once (per step: 3)

    def _child(self, which: int, *values: str):
        child = self._children.get((which, values))
        if child is None:
            child = self._children[(which, values)] = self._prom[which].labels(*values)
        return child

    def forward(self, kind: str) -> None:
        self.forwards[kind] += 1
        if self._prom is not None:
            self._child(1, kind, self.rank).inc()

    def decode_rows(self, path: str, n: int) -> None:
        self.rows[path] += n
        if self._prom is not None:
            self._child(2, path, self.rank).inc(n)

    def prefill_tokens(self, n: int) -> None:
        """Prompt tokens the bundle's eager prefill ran (prompts and chunks of them)."""
        self.prefilled += n

    def artifact(self, label: str, needed_seq: int | None, family: str, rows: int = 0) -> None:
        """One artifact step of ``rows`` requests; ``needed_seq`` None for a draft step (the histogram is the
        target's decode steps)."""
        self.steps[label] += 1
        self.families[family] += 1
        self.family_rows[family] += rows
        self.digest = int.from_bytes(hashlib.sha256(f"{self.digest}:{label}".encode()).digest()[:6], "big")
        if needed_seq is not None:
            self.needed[needed_seq] += 1
        if self._prom is not None:
            self._child(0, label, self.rank).inc()
            self._child(4, self.rank).set(self.digest)  # 48 bits: exact as a float
            if needed_seq is not None:
                self._prom[3].observe(needed_seq)
            if rows:
                self._child(5, family, self.rank).inc(rows)

    def seconds(self, what: str, s: float) -> None:
        self.time[what] += s

    def snapshot(self) -> dict:
        return {"rank": int(self.rank), "step_digest": self.digest, "steps": dict(self.steps),
                "families": dict(self.families), "family_rows": dict(self.family_rows),
                "forwards": dict(self.forwards),
                "rows": dict(self.rows),
                "prefill_tokens": self.prefilled,
                "draft_prompt_kv": {str(k): list(v) for k, v in sorted(self.draft_prompt_kv.items())},
                "needed_seq": {str(k): v for k, v in sorted(self.needed.items())},
                "seconds": dict(self.time)}
