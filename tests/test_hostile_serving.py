"""Hostile serving input, fourth round: a KV buffer released under the Stepper, NaN weights, ``--check``'s near-tie
rule (serve/check.py), one JSON document per ``generate`` and request files counted by records.

Each case ends in a clean error (or a stated verdict), never a crash or a silent wrong answer."""

import json
import struct
import time

import pytest
import torch

from neffbuild.errors import InvalidInput, StepInputError
from neffbuild.runtime import StepBatch, Stepper
from neffbuild.runtime.bundle.reader import open_bundle
from neffbuild.runtime.kv.cache import KVGuard
from neffbuild.serve import check
from neffbuild.serve.parts import Request
from neffbuild.serve.requests import MAX_REQUESTS, load_requests
from tests.helpers import cli, strict_json, tampered

# -- KV buffers released after the Stepper took them ------------------------------------------------------------

RELEASES = [  # (id, what the engine does to its buffer after building the Stepper)
    ("storage-released", lambda b: b.untyped_storage().resize_(0)),
    ("storage-shrunk", lambda b: b.untyped_storage().resize_(64)),
    ("set-to-another-tensor", lambda b: b.set_(torch.zeros(16))),
    ("tensor-resized", lambda b: b.resize_(2, 3)),
    ("swapped-for-a-fresh-buffer", lambda b: b.set_(torch.zeros_like(b))),
]


def _good_batch():
    full = torch.arange(1, 9).reshape(2, 4)
    return StepBatch([[5], [7]], [20, 40], {"full": full, "sliding": full + 8})


@pytest.mark.parametrize("release", [c[1] for c in RELEASES], ids=[c[0] for c in RELEASES])
def test_a_kv_buffer_released_after_construction_is_a_step_input_error(built, release):
    bundle = open_bundle(built.bundle)
    kv = [torch.zeros(b.shape, dtype=b.dtype) for b in Stepper(bundle).kv_caches]
    step = Stepper(bundle, kv_caches=kv)
    assert step.step(_good_batch()).logits.shape[0] == 2  # runs while the buffers are intact
    release(kv[0])
    with pytest.raises(StepInputError, match=r"kv_caches\[0\]: its memory changed after the Stepper took it"):
        step.step(_good_batch())  # before the check: SIGSEGV in the artifact (it writes the freed pages)


def test_the_per_step_kv_check_stays_under_one_percent_of_the_tiny_step(built):
    """Measured in one run: the tiny bundle's step, and the guard's check on the same buffers."""
    step = Stepper(open_bundle(built.bundle))
    batch = _good_batch()
    for _ in range(3):
        step.step(batch)
    steps = []
    for _ in range(15):
        t0 = time.perf_counter()
        step.step(batch)
        steps.append(time.perf_counter() - t0)
    n, per_check = 2000, float("inf")
    for _ in range(5):  # the best of five batches: the check's own cost, not the shared host's noise
        t0 = time.perf_counter()
        for _ in range(n):
            step.kv_guard.check()
        per_check = min(per_check, (time.perf_counter() - t0) / n)
    median = sorted(steps)[len(steps) // 2]
    print(f"step {median * 1e6:.0f} us, KV check {per_check * 1e6:.2f} us ({per_check / median:.3%})")
    assert per_check < 0.01 * median


def test_the_guard_passes_buffers_written_in_place():
    kv = [torch.zeros(2, 4, 2, 16, 8)]
    guard = KVGuard(kv)
    kv[0][0, 1] += 3.0  # what every step does: writes, never reallocates
    kv[0].zero_()
    guard.check()


# -- NaN weights: generate refuses them as verify does ----------------------------------------------------------

def _poison(src, dest, name="embed"):
    """A copy of bundle ``src`` whose tensor ``name`` starts with a NaN, its checksums rewritten to match (what only
    the finiteness check can catch)."""
    def edit(root, m):
        path = root / m["weights"]["file"]
        raw = bytearray(path.read_bytes())
        (n,) = struct.unpack("<Q", raw[:8])
        meta = json.loads(raw[8:8 + n])[name]
        at = 8 + n + meta["data_offsets"][0]
        raw[at:at + 4] = struct.pack("<f", float("nan")) if meta["dtype"] == "F32" else b"\xc0\x7f\xc0\x7f"
        path.write_bytes(bytes(raw))
        return [m["weights"]["file"]]

    return tampered(src, dest, edit)


def test_generate_refuses_nan_weights_as_verify_does(built, tmp_path):
    bundle = _poison(built.bundle, tmp_path / "nan-bundle")
    gen = cli("generate", str(bundle), "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--json")
    assert gen.returncode == 1, gen.stdout
    doc = strict_json(gen.stdout)
    assert "embed" in doc["error"]["message"] and "NaN or infinite" in doc["error"]["message"], doc
    assert "tokens" not in doc
    assert "NaN or infinite" in cli("verify", str(bundle)).stderr  # the same check


# -- --check's rule: identical, or a first difference within the dtype's near-tie tolerance ----------------------

VOCAB = 16


def _row(top_token: int, top: float, **others: float) -> torch.Tensor:
    """Constructed reference logits: ``top`` at ``top_token``, ``others`` as {"t<id>": value}, -10 elsewhere."""
    row = torch.full((VOCAB,), -10.0)
    row[top_token] = top
    for key, value in others.items():
        row[int(key[1:])] = value
    return row


def _verdict(bundle_tokens, ref_tokens, rows, dtype):
    rec = check.Recorder([bundle_tokens])
    r = Request("r", [1], len(ref_tokens), index=0)
    for k, row in enumerate(rows):
        rec.record(r, k, row)
    return check.judge("r", bundle_tokens, ref_tokens, rec.positions[0], dtype)


JUDGE_CASES = [  # (id, bundle tokens, reference tokens, reference rows, dtype, ok, near_tie)
    ("identical", [3, 4], [3, 4], [_row(3, 5.0), _row(4, 5.0)], "reduced", True, None),
    ("bf16-near-tie", [3, 9], [3, 4], [_row(3, 5.0), _row(4, 4.0, t9=3.9)], "reduced", True, True),
    ("bf16-real-difference", [3, 9], [3, 4], [_row(3, 5.0), _row(4, 4.0, t9=1.0)], "reduced", False, False),
    ("bf16-small-top2-but-bundle-token-far-down", [3, 9], [3, 4], [_row(3, 5.0), _row(4, 4.0, t2=3.99, t9=-3.0)],
     "reduced", False, False),
    ("f32-same-gap-is-a-real-difference", [3, 9], [3, 4], [_row(3, 5.0), _row(4, 4.0, t9=3.9)], "float32", False,
     False),
    ("f32-rounding-tie", [9], [4], [_row(4, 4.0, t9=4.0 - 1e-5)], "float32", True, True),
    ("first-token-differs", [9, 1], [4, 2], [_row(4, 7.0, t9=6.8), _row(2, 1.0)], "reduced", True, True),
]


@pytest.mark.parametrize("bundle,ref,rows,dtype,ok,near", [c[1:] for c in JUDGE_CASES], ids=[c[0] for c in JUDGE_CASES])
def test_check_passes_identical_tokens_and_near_ties_only(bundle, ref, rows, dtype, ok, near):
    v = _verdict(bundle, ref, rows, dtype)
    assert v["ok"] is ok and v.get("near_tie") is near, v
    if near is not None:
        assert v["agreed"] == next(i for i, (a, b) in enumerate(zip(bundle, ref, strict=True)) if a != b)
        assert (v["margin"] <= v["tolerance"]) is near
        assert ("near-tie at token" in check.describe(v)) is near and f"agreed for {v['agreed']} tokens" in \
            check.describe(v)


def test_tolerance_scales_with_the_logits_and_the_dtype():
    assert check.tolerance("reduced", 8.0) == 0.5 and check.tolerance("reduced", 0.1) == 2.0**-4
    assert check.tolerance("float32", -20.0) == pytest.approx(2e-3)
    assert check.precision({"w": torch.zeros(2)}, "float32") == "float32"
    assert check.precision({"w": torch.zeros(2, dtype=torch.bfloat16)}, "float32") == "reduced"
    assert check.precision({"w": torch.zeros(2), "blocks": torch.zeros(2, dtype=torch.uint8)}, "bfloat16") == "reduced"


def test_generate_check_json_is_one_document_with_the_verdict(built):
    gen = cli("generate", str(built.bundle), "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--check", "--json")
    assert gen.returncode == 0, gen.stderr
    doc = strict_json(gen.stdout)  # one document: a second would not parse
    assert doc["check"]["ok"] and doc["check"]["precision"] == "float32" and doc["check"]["differences"] == []


# -- request files: records, not lines; ids that collide name both lines ----------------------------------------

def _line(i):
    return json.dumps({"id": f"r{i}", "prompt_ids": [1]})


REQUEST_CASES = [  # (id, file text, None for accepted (count) or the error's needle)
    ("exactly-the-limit-newline-terminated", "".join(_line(i) + "\n" for i in range(MAX_REQUESTS)), MAX_REQUESTS),
    ("blank-lines-are-not-requests", "\n\n" + _line(0) + "\n\n  \n" + _line(1) + "\n\n", 2),
    ("one-over-the-limit", "".join(_line(i) + "\n" for i in range(MAX_REQUESTS + 1)),
     f"{MAX_REQUESTS + 1} requests, at most {MAX_REQUESTS}"),
    ("default-id-collides-with-an-explicit-one", '{"id": "1", "prompt_ids": [1]}\n{"prompt_ids": [2]}\n',
     ":2: field 'id': '1' (its default: the request's index; give the line an 'id') repeats line 1's id"),
    ("explicit-id-collides-with-a-default-one", '{"prompt_ids": [1]}\n\n{"id": "0", "prompt_ids": [2]}\n',
     ":3: field 'id': '0' repeats line 1's id"),
]


@pytest.mark.parametrize("text,want", [c[1:] for c in REQUEST_CASES], ids=[c[0] for c in REQUEST_CASES])
def test_request_files_count_records_and_name_both_lines_of_a_collision(tmp_path, text, want):
    path = tmp_path / "reqs.jsonl"
    path.write_text(text)
    if isinstance(want, int):
        assert len(load_requests(path, 4)) == want
        return
    with pytest.raises(InvalidInput) as err:
        load_requests(path, 4)
    assert want in str(err.value)


def test_random_request_files_parse_or_fail_cleanly(tmp_path):
    """Fixed-seed fuzz: random mixes of valid, blank, id-less and malformed lines; an InvalidInput or requests
    whose ids are unique and whose count is the non-blank lines'."""
    import random

    rng = random.Random(54)
    pieces = ['{"id": "a", "prompt_ids": [1]}', '{"prompt_ids": [3, 4]}', "", "   ", '{"id": "0", "prompt_ids": [2]}',
              '{"id": "b", "prompt_ids": []}', "{", '{"id": "c", "prompt_ids": [5], "max_new_tokens": 2}', "\r"]
    outcomes = set()
    for n in range(200):
        lines = [rng.choice(pieces) for _ in range(rng.randint(0, 8))]
        path = tmp_path / f"f{n}.jsonl"
        path.write_text("\n".join(lines) + rng.choice(["", "\n"]))
        try:
            reqs = load_requests(path, 3)
        except InvalidInput as err:
            assert str(err).startswith(f"--requests {path}"), err
            outcomes.add("refused")
            continue
        assert len(reqs) == sum(bool(line.strip()) for line in lines)
        assert len({r.id for r in reqs}) == len(reqs)
        outcomes.add("read")
    assert outcomes == {"read", "refused"}
