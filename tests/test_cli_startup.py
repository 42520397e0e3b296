"""The commands that read a bundle or a recipe without running anything import no torch.

``import torch`` is ~3 CPU-seconds a process (2-core AVX2 host, 2026-12-08): `inspect`, `inspect --vllm-config` (what a
user runs before every `vllm serve`), `diff` and `validate` took 2.8-3.5 s, nearly all of it that import; without it
they take 0.3-0.4 s. The manifest is read by runtime/bundle/manifest_file.py (standard library only) and a
checkpoint's safetensors headers are checked by the library through numpy, not torch (recipe/gate_rules.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

CODE = """
import json, sys
from click.testing import CliRunner
from neffbuild.cli.main import _register, cli
_register()
out = {}
for args in json.loads(sys.argv[1]):
    r = CliRunner().invoke(cli, args)
    out[" ".join(args[:1] + [a for a in args[1:] if a.startswith("-")])] = [r.exit_code, r.output[:400]]
out["torch imported"] = "torch" in sys.modules
print(json.dumps(out))
"""


@pytest.mark.slow
def test_inspect_diff_and_validate_import_no_torch(built):
    bundle = str(built.bundle)
    commands = [["inspect", bundle], ["inspect", bundle, "--json"], ["inspect", bundle, "--vllm-config"],
                ["diff", bundle, bundle], ["validate", str(built.recipe)]]
    res = subprocess.run([sys.executable, "-c", CODE, json.dumps(commands)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(res.stdout)
    for name, (code, output) in ((k, v) for k, v in doc.items() if k != "torch imported"):
        assert code == 0, f"{name}: exit {code}\n{output}"
    assert "valid (" in doc["validate"][1] and "vllm serve" in doc["inspect --vllm-config"][1]
    assert doc["torch imported"] is False, "a read-only command imported torch"
