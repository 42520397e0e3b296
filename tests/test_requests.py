"""Request files and requests handed to the Engine API: one set of rules, typed errors (no compile).

The file is read as a bounded regular file and split on newlines only; the engine applies the file's
rules (ids, token ids, counts) to requests given to it directly, so the API never runs a negative
token as another id or a zero-token request.
"""

from __future__ import annotations

import json
import os

import pytest

from neffbuild.errors import InvalidInput
from neffbuild.serve.parts import Request
from neffbuild.serve.requests import check_fields, load_requests


def _file(tmp_path, text: str):
    path = tmp_path / "reqs.jsonl"
    path.write_text(text, encoding="utf-8")
    return path


FILE_CASES = [  # (id, file text, needle)
    ("nested-50000", '{"prompt_ids": ' + "[" * 50_000 + "]" * 50_000 + "}\n", "nested too deeply"),
    ("int-5000-digits", '{"prompt_ids": [' + "9" * 5000 + "]}\n", "digits"),
    ("lone-surrogate-id", '{"id": "\\ud800", "prompt_ids": [1]}\n', "printable"),
    ("newline-in-id", '{"id": "a\\nb", "prompt_ids": [1]}\n', "printable"),
    ("ansi-escape-id", '{"id": "\\u001b[31mred", "prompt_ids": [1]}\n', "printable"),
    ("duplicate-key", '{"prompt_ids": [1], "prompt_ids": [2]}\n', "duplicate key"),
    ("negative-token", '{"prompt_ids": [-1]}\n', "ints >= 0"),
    ("zero-new", '{"prompt_ids": [1], "max_new_tokens": 0}\n', "max_new_tokens"),
    ("float-token", '{"prompt_ids": [1.5]}\n', "prompt_ids"),
    ("not-utf8", None, "not UTF-8"),
]


@pytest.mark.parametrize("text,needle", [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES])
def test_request_file_quirks_are_one_clean_error(tmp_path, text, needle):
    path = tmp_path / "reqs.jsonl"
    if text is None:
        path.write_bytes(b'{"prompt_ids": [1], "id": "\xff"}\n')
    else:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
    with pytest.raises(InvalidInput) as err:
        load_requests(path, 4)
    assert needle in str(err.value) and "--requests" in str(err.value)


def test_u2028_inside_a_string_does_not_split_the_line(tmp_path):
    path = _file(tmp_path, '{"id": "a\u2028b", "prompt_ids": [1]}\r\n{"id": "c", "prompt_ids": [2]}\n')
    with pytest.raises(InvalidInput, match=r"reqs\.jsonl:1: field 'id'"):  # one line, refused for its id
        load_requests(path, 4)
    ok = _file(tmp_path, '{"id": "x", "prompt_ids": [1, 2]}\r\n\n{"id": "y\u00e9", "prompt_ids": [3]}\n')
    assert [(r.id, r.prompt) for r in load_requests(ok, 4)] == [("x", [1, 2]), ("y\u00e9", [3])]


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder", "too-big"])
def test_request_file_must_be_a_bounded_regular_file(tmp_path, kind, monkeypatch):
    path = tmp_path / "reqs"
    if kind == "fifo":
        os.mkfifo(path)  # a reader that opened it blocking would wait forever for a writer
    elif kind == "dev-zero":
        path = "/dev/zero"
    elif kind == "folder":
        path.mkdir()
    else:
        from neffbuild.serve import requests

        monkeypatch.setattr(requests, "MAX_BYTES", 64)
        path.write_text(json.dumps({"prompt_ids": list(range(40))}) + "\n")
    with pytest.raises(InvalidInput, match="--requests"):
        load_requests(path, 4)


API_CASES = [  # (id, request, needle)
    ("negative-token", Request("a", [-5], 2), "prompt_ids"),
    ("float-token", Request("a", [1.0], 2), "prompt_ids"),
    ("bool-token", Request("a", [True], 2), "prompt_ids"),
    ("zero-new", Request("a", [1], 0), "max_new_tokens"),
    ("negative-new", Request("a", [1], -3), "max_new_tokens"),
    ("token-past-vocab", Request("a", [256], 2), "outside the vocabulary"),
    ("too-long", Request("a", [1] * 500, 20), "max_model_len"),
    ("id-not-str", Request(7, [1], 2), "field 'id'"),
    ("empty-prompt", Request("a", [], 2), "prompt_ids"),
]


@pytest.mark.parametrize("req,needle", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_engine_api_applies_the_request_rules(req, needle):
    with pytest.raises(InvalidInput, match="request") as err:
        check_fields([req], 256, 512)
    assert needle in str(err.value)


def test_engine_run_refuses_before_any_step(tiny_recipe):
    from neffbuild.models.gpt_oss.weights import model_weights
    from neffbuild.runtime.kv.layout import KVLayout
    from neffbuild.runtime.step.dispatch import Grid
    from neffbuild.serve.engine import Engine
    from neffbuild.serve.parts import LocalPrefill
    from neffbuild.serve.rank import eager_artifacts, serving_rank

    cfg = tiny_recipe.model.config
    weights = model_weights(cfg, None, 0)
    layout = KVLayout(cfg.num_kv_buffers, 80, cfg.num_key_value_heads, 16, cfg.head_dim)
    session = serving_rank(cfg, weights, eager_artifacts(cfg, weights, Grid((1, 2), (128,), 512), layout, 8))
    steps = []
    engine = Engine(session.stepper, session.block_manager(), LocalPrefill(session.prefill, session.stepper.kv_caches),
                    on_step=lambda plan, out: steps.append(plan))
    for bad in (Request("n", [-1], 2), Request("z", [1, 2], 0), Request("v", [cfg.vocab_size], 2), "notarequest"):
        with pytest.raises(InvalidInput):
            engine.run([bad])
    assert steps == []
    assert [len(r.tokens) for r in engine.run([Request("ok", [1, 2, 3], 2)])] == [2]


def test_a_long_run_prints_progress_on_stderr(capsys):
    from neffbuild.serve.run import progress

    reqs = [Request(str(n), [1], 2) for n in range(3)]
    quiet = progress(reqs, every_s=3600)
    quiet(None, None)
    assert capsys.readouterr().err == ""  # a short run prints nothing
    hook = progress(reqs, every_s=0)
    reqs[0].tokens = [5, 6]
    hook(None, None)
    err = capsys.readouterr().err
    assert "1/3 requests done, 1 decode steps" in err


def test_plan_of_a_big_grid_prints_progress(capsys, monkeypatch):
    from neffbuild.cli import plan_cmd

    monkeypatch.setattr("time.monotonic", iter([0.0, 6.0, 7.0, 13.0]).__next__)
    hook = plan_cmd._progress(every_s=5)
    for n in range(3):
        hook(n, 2048)
    assert capsys.readouterr().err.splitlines() == ["plan: keyed 0/2048 targets (6 s)",
                                                    "plan: keyed 2/2048 targets (13 s)"]
