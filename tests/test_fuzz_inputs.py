"""Seeded, time-bounded fuzzing of the third hostile-input round: what the CLI reads (request files, key
files, remote URLs, output paths) and what the runtime API is handed (KV buffers, devices, groups, requests).

Every property: a clean result or the project's typed error (InvalidInput / StepInputError / SignatureError
in-process; exit 0, 1 or 2 and no traceback from the CLI, one JSON document with ``--json``), never another
exception, a signal or a hang. Hypothesis runs derandomised (a fixed seed: the same examples every run) with
a bounded example count, and each property stops drawing work once its time budget is spent, so the module
stays in the fast tier (a few seconds to tens of seconds on 2 cores). Compiles nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neffbuild.errors import InvalidInput, StepInputError
from tests.helpers import cli

BUDGET_S = 15.0  # per property: examples drawn after it do nothing (a bounded run whatever the host's load)


def fuzz(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


class Budget:
    def __init__(self, seconds: float = BUDGET_S):
        self.end = time.monotonic() + seconds

    @property
    def spent(self) -> bool:
        return time.monotonic() > self.end


_BUDGETS: dict[str, Budget] = {}


def budget(name: str) -> Budget:
    return _BUDGETS.setdefault(name, Budget())


# -- request files: text that looks like requests, and text that does not

nasty_text = st.sampled_from(["\u2028", "\u2029", "\x85", "\x1b[31m", "\n", "\r", "\x00", "\ud800", "\udfff", "é",
                              "\t", "\x7f", "\u200b", "\ufeff"])
ids = st.one_of(st.text(max_size=12), st.lists(nasty_text, min_size=1, max_size=3).map("".join), st.integers(),
                st.none(), st.just("x" * 300))
tokens = st.one_of(st.integers(-3, 300), st.sampled_from([2**63, -(2**63), 10**30]), st.floats(), st.booleans(),
                   st.text(max_size=3), st.none())
request = st.fixed_dictionaries({}, optional={
    "id": ids, "prompt_ids": st.one_of(st.lists(tokens, max_size=5), tokens, st.dictionaries(st.text(max_size=2),
                                                                                              tokens, max_size=2)),
    "max_new_tokens": tokens, "arrival": tokens, "extra": tokens})


def _line(doc) -> str:
    return json.dumps(doc, ensure_ascii=False)


raw_lines = st.one_of(
    request.map(_line),
    st.integers(1, 3000).map(lambda d: '{"prompt_ids": ' + "[" * d + "]" * d + "}"),
    st.integers(1, 6000).map(lambda n: '{"prompt_ids": [' + "9" * n + "]}"),
    st.sampled_from(['{"prompt_ids": [1], "prompt_ids": [2]}', "[]", "null", '"x"', "{", "", "   ", "\u2028",
                     '{"id": "a\\u2028b", "prompt_ids": [1]}', '{"id": "\\ud800", "prompt_ids": [1]}',
                     '{"prompt_ids": [1], "max_new_tokens": 1e400}', '{"prompt_ids": [NaN]}']),
    st.text(max_size=40),
)


@fuzz(150)
@given(st.lists(raw_lines, min_size=0, max_size=6), st.sampled_from(["\n", "\r\n", "\u2028", "\x0c"]))
def test_fuzz_request_files(tmp_path_factory, lines, sep):
    from neffbuild.serve.requests import load_requests

    if budget("requests").spent:
        return
    path = tmp_path_factory.mktemp("req") / "r.jsonl"
    path.write_bytes(sep.join(lines).encode("utf-8", "surrogatepass"))
    try:
        reqs = load_requests(path, 4)
    except InvalidInput as exc:
        assert str(exc).startswith("--requests") and len(str(exc)) < 2000
        return
    for r in reqs:  # what parsed is what the engine may echo and run
        assert isinstance(r.id, str) and r.id.isprintable() and r.prompt and r.max_new_tokens >= 1
        assert all(type(t) is int and t >= 0 for t in r.prompt)


@fuzz(25)
@given(st.lists(raw_lines, min_size=1, max_size=3))
def test_fuzz_generate_request_files_cli(tmp_path_factory, lines):
    """The CLI over the same files: exit 1 or 2, one JSON document on stdout, no traceback."""
    if budget("generate-cli").spent:
        return
    folder = tmp_path_factory.mktemp("gen")
    path = folder / "r.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass"))
    res = cli("generate", str(folder), "--requests", str(path), "--json")
    assert res.returncode in (1, 2) and res.unhandled is None and "Traceback" not in res.stderr, res.stderr
    json.loads(res.stdout)  # one document


# -- key files: bytes that are not keys, special files, folders

key_bytes = st.one_of(st.binary(max_size=300), st.sampled_from([
    b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n",
    b"-----BEGIN EC PRIVATE KEY-----\n" + b"A" * 64 + b"\n-----END EC PRIVATE KEY-----\n",
    b"-----BEGIN RSA PRIVATE KEY-----\nMIIB\n-----END RSA PRIVATE KEY-----\n", b"\xff" * 70000]))


@fuzz(60)
@given(key_bytes, st.sampled_from(["file", "folder", "fifo", "link", "missing"]))
def test_fuzz_key_files(tmp_path_factory, data, kind):
    from neffbuild.bundle.signing import load_private_key
    from neffbuild.compiler.entry_sig import load_trusted
    from neffbuild.runtime.bundle.model_sig import load_trusted_keys

    if budget("keys").spent:
        return
    folder = tmp_path_factory.mktemp("key")
    path = folder / "k.pem"
    if kind == "file":
        path.write_bytes(data)
    elif kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        (folder / "target").write_bytes(data)
        path.symlink_to(folder / "target")
    for load in (lambda: load_trusted_keys([path]), lambda: load_private_key(path), lambda: load_trusted([path])):
        with contextlib.suppress(InvalidInput):
            load()


# -- remote URLs: parsing never raises anything but InvalidInput

urls = st.one_of(st.text(max_size=40), st.text(max_size=30).map(lambda t: "s3://" + t),
                 st.from_regex(r"s3://[a-z0-9.\-]{0,70}(/[^\s]{0,40})?", fullmatch=True),
                 st.sampled_from(["s3://b/p/sha256:" + "a" * 64, "s3://b/p/sha256:xyz", "s3://b/p/..", "s3://b/",
                                  "s3:///x", "s3://B/x", "s3://b/p/\x00", "s3://b/p/\u2028", "s3://" + "b" * 70]))


@fuzz(300)
@given(urls)
def test_fuzz_remote_urls(url):
    from neffbuild import s3
    from neffbuild.bundle.remote import parse_ref
    from neffbuild.compiler.remote_tier import open_tier

    if budget("urls").spent:
        return
    for parse in (lambda: s3.parse_url(url), lambda: parse_ref(url), lambda: open_tier(url)):
        with contextlib.suppress(InvalidInput):
            parse()


# -- output paths: whatever is at the name, only a clean refusal or a write of a regular file we own

@fuzz(80)
@given(st.sampled_from(["absent", "file", "folder", "link", "dangling", "fifo", "in-bundle", "no-parent"]),
       st.sampled_from([b"", b"x", b"\x00" * 10]))
def test_fuzz_output_paths(tmp_path_factory, kind, data):
    from neffbuild.fsutil import output_problem, write_output

    if budget("outputs").spent:
        return
    folder = tmp_path_factory.mktemp("out")
    victim = folder / "victim"
    victim.write_bytes(b"keep")
    path = folder / "o.png"
    if kind == "file":
        path.write_bytes(b"old")
    elif kind == "folder":
        path.mkdir()
    elif kind == "link":
        path.symlink_to(victim)
    elif kind == "dangling":
        path.symlink_to(folder / "nothing")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "in-bundle":
        for f in ("manifest.json", "manifest.sha256"):
            (folder / f).write_text("x")
    elif kind == "no-parent":
        path = folder / "missing" / "o.png"
    why = output_problem(path, "--out")
    assert why is None or why.startswith("--out ")
    try:
        write_output(path, data, "--out")
        assert why is None and path.read_bytes() == data and not path.is_symlink()
    except InvalidInput:
        assert why is not None or kind in ("fifo",)
    assert victim.read_bytes() == b"keep" and not (folder / "nothing").exists()


# -- the runtime API: buffers, devices, groups, requests

def _layout():
    from neffbuild.runtime.kv.cache import KVLayout

    return KVLayout(2, 12, 2, 16, 16)


def _buffer(kind: str, shape, dtype):
    import numpy as np

    if kind == "torch":
        return torch.empty(shape, dtype=dtype)
    if kind == "shared":
        return torch.empty(shape, dtype=dtype).share_memory_()
    if kind == "numpy":
        return torch.from_numpy(np.zeros(shape, dtype=np.float32))
    if kind == "bytes":
        return torch.frombuffer(bytes(4 * int(np.prod(shape))), dtype=torch.float32).view(shape)
    if kind == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    if kind == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            return torch.empty(shape, dtype=dtype)
    if kind == "mkldnn":
        return torch.zeros(shape).to_mkldnn()
    if kind == "strided":
        return torch.empty((*shape[:-1], 2 * shape[-1]), dtype=dtype)[..., ::2]
    if kind == "sparse":
        return torch.zeros(shape).to_sparse()
    return [[0.0]]


@fuzz(120)
@given(st.lists(st.sampled_from(["torch", "shared", "numpy", "bytes", "meta", "fake", "mkldnn", "strided",
                                 "sparse", "list"]), min_size=0, max_size=3),
       st.sampled_from([torch.float32, torch.float16, torch.int8]),
       st.sampled_from(["exact", "short", "wide"]), st.sampled_from(["cpu", "meta", "cuda"]))
def test_fuzz_kv_buffers(kinds, dtype, shape_kind, device):
    import warnings

    from neffbuild.runtime.kv.cache import check_kv_buffers

    if budget("buffers").spent:
        return
    layout = _layout()
    shape = list(layout.buffer_shape)
    shape[1] += {"exact": 0, "short": -3, "wide": 5}[shape_kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bufs = [_buffer(k, tuple(shape), dtype) for k in kinds]
    try:
        out = check_kv_buffers(bufs, layout, device)
    except StepInputError:
        return
    assert all(type(b) is torch.Tensor and b.untyped_storage().resizable() for b in out)  # torch's own memory
    assert device == "cpu" and shape_kind == "exact" and dtype == layout.dtype


@fuzz(200)
@given(st.one_of(st.text(max_size=12), st.sampled_from(["cpu", "cpu:0", "meta", "cuda", "cuda:7", "neuron:0", "mps",
                                                        "xla", "cpu:-1", "privateuseone"]), st.integers(), st.none(),
                 st.floats()),
       st.sampled_from([{"backend": "inductor", "device": "cpu"}, {"backend": "inductor", "device": "cuda"},
                        {"backend": "neuron"}, {"backend": "inductor"}]))
def test_fuzz_devices(device, toolchain):
    from neffbuild.runtime.bundle.loaders import device_problem

    if budget("devices").spent:
        return
    why = device_problem(toolchain, device)
    assert why is None or isinstance(why, str)
    if why is None and toolchain.get("backend") == "inductor":
        assert torch.device(device).type == torch.device(toolchain.get("device", "cpu")).type


@fuzz(100)
@given(st.one_of(st.none(), st.text(max_size=8), st.integers(), st.floats(), st.lists(st.integers(), max_size=2),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.just(object())))
def test_fuzz_groups(group):
    from neffbuild.runtime.step.checks import check_group

    if budget("groups").spent:
        return
    try:
        check_group(group)
    except StepInputError:
        assert group is not None
        return
    assert group is None


api_tokens = st.one_of(st.integers(-5, 300), st.floats(), st.booleans(), st.none(), st.text(max_size=2))


@fuzz(200)
@given(st.lists(st.tuples(ids, st.one_of(st.lists(api_tokens, max_size=4), api_tokens), api_tokens, api_tokens),
                min_size=0, max_size=4))
def test_fuzz_engine_requests(rows):
    from neffbuild.serve.parts import Request
    from neffbuild.serve.requests import check_fields

    if budget("engine").spent:
        return
    reqs = [Request(rid, prompt, new, arrival) for rid, prompt, new, arrival in rows]
    try:
        check_fields(reqs, 256, 512)
    except InvalidInput:
        return
    for r in reqs:
        assert all(type(t) is int and 0 <= t < 256 for t in r.prompt) and type(r.max_new_tokens) is int
        assert r.max_new_tokens >= 1 and len(r.prompt) + r.max_new_tokens <= 512


@pytest.mark.parametrize("args", [["pull", "s3://b/x/y-0.1.0", "{d}"], ["cache", "remote", "check", "s3://b/p"],
                                  ["push", "{d}", "s3://b/p"], ["pull", "s3://b/x/sha256:zz", "{d}"]])
def test_remote_commands_on_a_closed_endpoint_are_clean(tmp_path, monkeypatch, args):
    """A remote that is down: each command ends quickly with exit 1 or 2 and no traceback (moto is not needed)."""
    from tests.s3_server import closed_endpoint

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", closed_endpoint())
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAUSERATALL00")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-secret")
    t0 = time.monotonic()
    res = cli(*[a.format(d=tmp_path) for a in args])
    assert res.returncode in (1, 2) and res.unhandled is None and "Traceback" not in res.stderr, res.stderr
    assert time.monotonic() - t0 < 60
