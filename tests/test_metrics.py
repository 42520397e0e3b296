"""Serving metrics land in the engine's prometheus_client registry; the text format is the fallback."""

import subprocess
import sys

from prometheus_client import CollectorRegistry, generate_latest

from neffbuild.runtime.step.metrics import StepMetrics
from tests.conftest import ROOT


def test_counters_land_in_the_engines_registry():
    registry = CollectorRegistry()
    a, b = StepMetrics(registry), StepMetrics(registry)  # two decoders, one engine registry
    a.record("decode_b4", 4, 1)
    b.record("decode_b4", 4, 3)
    b.record("decode_b1", 1, 0)
    text = generate_latest(registry).decode()
    assert 'neffbuild_neff_execution_count_total{bucket="decode_b4"} 2.0' in text
    assert "neffbuild_batch_rows_total 9.0" in text and "neffbuild_batch_padding_rows_total 4.0" in text
    assert f"neffbuild_batch_padding_ratio {4 / 9}" in text
    assert 'neffbuild_neff_execution_count{bucket="decode_b4"} 1' in a.text()  # per decoder, text format


def test_text_format_without_prometheus_client():
    code = ("import sys; sys.modules['prometheus_client'] = None\n"
            "from neffbuild.runtime.step.metrics import StepMetrics\n"
            "m = StepMetrics(); m.record('decode_b2', 2, 1); print(m.text())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr
    assert 'neffbuild_neff_execution_count{bucket="decode_b2"} 1' in out.stdout
    assert "neffbuild_batch_padding_ratio 0.500000" in out.stdout
