"""Cache keys do not depend on where the checkout lives: torch.export's readable graph names each
node's source file by absolute path, and two checkouts (a developer's tree, a CI runner's) must
share keys for a shared remote cache (docs/remote-cache.md). Traces one tiny module; compiles nothing."""

from __future__ import annotations

from pathlib import Path

import torch

from neffbuild.compiler.cache import cache_key, portable_graph_text

ROOT = Path(__file__).resolve().parent.parent


class _Tiny(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.silu(x) + 1


class _Other(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.silu(x) * 2


def _text(module) -> str:
    ep = torch.export.export(module, (torch.ones(2),), strict=False)
    return ep.graph_module.print_readable(print_output=False, include_stride=True, include_device=True)


def test_two_checkouts_share_a_key_and_other_code_does_not():
    here = _text(_Tiny())
    assert f"# File: {ROOT}/tests/test_portable_key.py:" in here  # the format the key normalises
    there = here.replace(str(ROOT), "/ci/runner/checkout")
    assert portable_graph_text(here) == portable_graph_text(there, roots=("/ci/runner/checkout",))
    assert str(ROOT) not in portable_graph_text(here) and "# File: tests/test_portable_key.py:" in \
        portable_graph_text(here)
    assert cache_key(here, [], {"backend": "x"}) == cache_key(portable_graph_text(there, ("/ci/runner/checkout",)),
                                                              [], {"backend": "x"})
    assert cache_key(here, [], {"backend": "x"}) != cache_key(_text(_Other()), [], {"backend": "x"})


def test_site_packages_paths_are_cut_at_site_packages():
    a = "# File: /home/a/.venv/lib/python3.11/site-packages/torch/nn/f.py:7 in forward, code: y\n"
    b = "# File: /opt/ci/venv/lib/python3.11/site-packages/torch/nn/f.py:7 in forward, code: y\n"
    assert portable_graph_text(a, ()) == portable_graph_text(b, ()) == \
        "# File: torch/nn/f.py:7 in forward, code: y\n"
    assert portable_graph_text(a.replace(":7", ":8"), ()) != portable_graph_text(a, ())  # lines still count
