"""Request lists for the engine: a JSON-lines request file, or prompts that all arrive at step 0.

One JSON object per line: ``{"id": str, "prompt_ids": [int], "max_new_tokens": int,
"arrival": int}`` (``arrival``: the decode step at which the request may join, default 0;
``max_new_tokens`` defaults to the command's ``--max-new-tokens``). Blank lines are skipped.
Every problem is an ``InvalidInput`` naming the file, the line number and the field, raised
before anything runs. ``check_requests`` then checks them against the bundle (vocabulary,
``max_model_len``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from neffbuild.errors import InvalidInput
from neffbuild.serve.parts import Request

FIELDS = ("id", "prompt_ids", "max_new_tokens", "arrival")
MAX_LINES = 100_000


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_line(text: str, where: str, default_new: int, index: int) -> Request:
    """One line of a request file -> Request; InvalidInput naming ``where`` (file:line) and the field."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"{where}: not a JSON object ({exc.msg} at column {exc.colno})") from None
    if not isinstance(doc, dict):
        raise InvalidInput(f"{where}: must be a JSON object with {', '.join(FIELDS)}, got {type(doc).__name__}")
    unknown = sorted(set(doc) - set(FIELDS))
    if unknown:
        raise InvalidInput(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(FIELDS)})")
    rid = doc.get("id", str(index))
    if not isinstance(rid, str) or not rid or len(rid) > 200:
        raise InvalidInput(f"{where}: field 'id' must be a non-empty string (at most 200 characters), got {rid!r}")
    ids = doc.get("prompt_ids")
    if not isinstance(ids, list) or not ids or not all(_int(t) and t >= 0 for t in ids):
        raise InvalidInput(f"{where}: field 'prompt_ids' must be a non-empty list of token ids (ints >= 0)")
    new = doc.get("max_new_tokens", default_new)
    if not _int(new) or new < 1:
        raise InvalidInput(f"{where}: field 'max_new_tokens' must be an int >= 1, got {new!r}")
    arrival = doc.get("arrival", 0)
    if not _int(arrival) or not 0 <= arrival <= 10**6:
        raise InvalidInput(f"{where}: field 'arrival' must be an int in [0, 1000000] (a decode step), got {arrival!r}")
    return Request(rid, list(ids), new, arrival, index=index)


def load_requests(path: str | Path, default_new: int) -> list[Request]:
    """Every request of a JSON-lines file, in file order (duplicate ids refused)."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"--requests {p}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    if len(lines) > MAX_LINES:
        raise InvalidInput(f"--requests {p}: {len(lines)} lines, at most {MAX_LINES}")
    reqs, seen = [], {}
    for n, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        r = parse_line(text, f"--requests {p}:{n}", default_new, len(reqs))
        if r.id in seen:
            raise InvalidInput(f"--requests {p}:{n}: field 'id': {r.id!r} repeats line {seen[r.id]}")
        seen[r.id] = n
        reqs.append(r)
    if not reqs:
        raise InvalidInput(f"--requests {p}: no requests (one JSON object per line)")
    return reqs


def from_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Request]:
    """``--prompt-ids``: every prompt arrives at step 0 (ids "0", "1", ...)."""
    return [Request(str(n), list(p), max_new_tokens, 0, index=n) for n, p in enumerate(prompts)]


def check_requests(reqs: Sequence[Request], vocab: int, max_model_len: int, what: str = "--prompt-ids") -> None:
    """Token ids inside the vocabulary and prompt + new tokens within max_model_len (else exit 2)."""
    for r in reqs:
        bad = [t for t in r.prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidInput(f"{what}: request {r.id!r}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(r.prompt) + r.max_new_tokens > max_model_len:
            raise InvalidInput(f"{what}: request {r.id!r}: prompt of {len(r.prompt)} tokens + {r.max_new_tokens} new "
                               f"tokens exceeds the bundle's max_model_len {max_model_len}")
