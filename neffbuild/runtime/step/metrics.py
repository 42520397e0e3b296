"""Serving metrics in the engine's own Prometheus registry, through ``prometheus_client`` when installed.

Serving engines (vLLM among them) export through ``prometheus_client``; counters recorded here land
in the registry the engine passes (default: the library's global ``REGISTRY``), so one scrape of
the engine shows them. Without the library nothing is registered and ``text`` (the Prometheus text
format written by hand) is the fallback a caller can serve itself. ``prometheus_client`` is imported
lazily, like nixl: importing the runtime stays cheap.

  neffbuild_neff_execution_count_total{bucket="decode_b4"}   artifact executions per batch bucket
  neffbuild_batch_rows_total / neffbuild_batch_padding_rows_total   rows run / padding rows run
  neffbuild_batch_padding_ratio                            padding rows / rows, since start
"""

from __future__ import annotations

import threading
from collections import Counter

_LOCK = threading.Lock()
_COLLECTORS: dict[int, tuple] = {}  # id(registry) -> the collectors registered there (once per registry)


def _collectors(registry):
    """The collectors in ``registry`` (created on first use), or None without prometheus_client."""
    try:
        import prometheus_client as prom
    except ImportError:
        return None
    registry = prom.REGISTRY if registry is None else registry
    with _LOCK:
        found = _COLLECTORS.get(id(registry))
        if found is None:
            found = (prom.Counter("neffbuild_neff_execution_count", "Executions of a compiled decode artifact.",
                                  ["bucket"], registry=registry),
                     prom.Counter("neffbuild_batch_rows", "Batch rows run (live + padding).", registry=registry),
                     prom.Counter("neffbuild_batch_padding_rows", "Padding rows run.", registry=registry),
                     prom.Gauge("neffbuild_batch_padding_ratio", "Padding rows / rows run.", registry=registry),
                     [0, 0])  # rows, padding rows since start (for the ratio)
            _COLLECTORS[id(registry)] = found
        return found


class StepMetrics:
    """Per-decoder counts (for ``text``) mirrored into a prometheus_client registry when available."""

    def __init__(self, registry=None):
        self.executions: Counter[str] = Counter()
        self.padding_rows = 0
        self.total_rows = 0
        self._prom = _collectors(registry)

    def record(self, bucket: str, batch: int, padding: int) -> None:
        self.executions[bucket] += 1
        self.padding_rows += padding
        self.total_rows += batch
        if self._prom is not None:
            executions, rows, pad_rows, ratio, totals = self._prom
            executions.labels(bucket=bucket).inc()
            rows.inc(batch)
            pad_rows.inc(padding)
            with _LOCK:
                totals[0] += batch
                totals[1] += padding
                ratio.set(totals[1] / totals[0] if totals[0] else 0.0)

    def text(self) -> str:
        """This decoder's counts in the Prometheus text format (the fallback exposition)."""
        lines = ["# TYPE neffbuild_neff_execution_count counter"]
        lines += [f'neffbuild_neff_execution_count{{bucket="{k}"}} {v}' for k, v in sorted(self.executions.items())]
        ratio = self.padding_rows / self.total_rows if self.total_rows else 0.0
        lines += ["# TYPE neffbuild_batch_padding_ratio gauge", f"neffbuild_batch_padding_ratio {ratio:.6f}"]
        return "\n".join(lines) + "\n"
