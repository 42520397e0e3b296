"""Request lists for the engine: a JSON-lines request file, or prompts that all arrive at step 0.

One JSON object per line: ``{"id": str, "prompt_ids": [int], "max_new_tokens": int,
"arrival": int}`` (``arrival``: the decode step at which the request may join, default 0;
``max_new_tokens`` defaults to the command's ``--max-new-tokens``; ``id`` defaults to the request's
index among the file's requests, and a default id that equals another line's id is refused naming
both lines). Blank lines are skipped and not counted: at most ``MAX_REQUESTS`` requests.
Every problem is an ``InvalidInput`` naming the file, the line number and the field, raised
before anything runs. ``check_requests`` then checks them against the bundle (vocabulary,
``max_model_len``); the engine applies the same rules to requests handed to it directly
(``check_fields``), so the API and the CLI refuse alike.

The file is read as a regular file of at most ``MAX_BYTES`` (never a FIFO or a device) and split
on ``\n`` only (a U+2028 inside a string is part of the string, not a line break). A key given
twice, nesting past what the JSON reader allows and integers of thousands of digits are refused;
an id is printable text (no control characters, escapes or lone surrogates: ids are echoed).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from neffbuild.errors import InvalidInput
from neffbuild.fsutil import no_duplicate_keys, read_regular
from neffbuild.serve.parts import Request

FIELDS = ("id", "prompt_ids", "max_new_tokens", "arrival")
MAX_REQUESTS = 100_000  # records: blank lines and the final newline are not requests
MAX_BYTES = 256 * 1024 * 1024  # 100,000 requests of ~300 token ids each, with room
MAX_ID = 200
MAX_ARRIVAL = 10**6


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_line(text: str, where: str, default_new: int, index: int) -> Request:
    """One line of a request file -> Request; InvalidInput naming ``where`` (file:line) and the field."""
    try:
        doc = json.loads(text, object_pairs_hook=no_duplicate_keys, parse_int=_small_int)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"{where}: not a JSON object ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise InvalidInput(f"{where}: nested too deeply to be a request") from None
    except ValueError as exc:  # a key given twice, an integer of too many digits
        raise InvalidInput(f"{where}: {str(exc)[:120]}") from None
    if not isinstance(doc, dict):
        raise InvalidInput(f"{where}: must be a JSON object with {', '.join(FIELDS)}, got {type(doc).__name__}")
    unknown = sorted(set(doc) - set(FIELDS))
    if unknown:
        raise InvalidInput(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(FIELDS)})")
    r = Request(doc.get("id", str(index)), doc.get("prompt_ids"), doc.get("max_new_tokens", default_new),
                doc.get("arrival", 0), index=index)
    why = field_problem(r)
    if why:
        raise InvalidInput(f"{where}: {why}")
    r.prompt = list(r.prompt)
    return r


def _small_int(text: str) -> int:
    if len(text.lstrip("-")) > 30:  # far past any token id or count; int() of 4,300+ digits raises anyway
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def field_problem(r: Request) -> str | None:
    """Why a request's own fields are malformed (the file's rules, for the API too), or None."""
    rid, ids, new, arrival = r.id, r.prompt, r.max_new_tokens, r.arrival
    if not isinstance(rid, str) or not rid or len(rid) > MAX_ID or not rid.isprintable():
        return (f"field 'id' must be a non-empty printable string (at most {MAX_ID} characters, no control "
                f"characters), got {ascii(rid)[:80]}")
    if not isinstance(ids, (list, tuple)) or not ids or not all(_int(t) and t >= 0 for t in ids):
        return "field 'prompt_ids' must be a non-empty list of token ids (ints >= 0)"
    if not _int(new) or new < 1:
        return f"field 'max_new_tokens' must be an int >= 1, got {ascii(new)[:40]}"
    if not _int(arrival) or not 0 <= arrival <= MAX_ARRIVAL:
        return f"field 'arrival' must be an int in [0, {MAX_ARRIVAL}] (a decode step), got {ascii(arrival)[:40]}"
    return None


def check_fields(reqs, vocab: int | None, max_model_len: int) -> None:
    """What ``Engine.run`` checks of requests handed to it directly: the file's rules, then the bundle's
    (InvalidInput naming the request and the field)."""
    if not isinstance(reqs, (list, tuple)) or not all(isinstance(r, Request) for r in reqs):
        raise InvalidInput("Engine.run: requests must be a list of serve.parts.Request")
    for r in reqs:
        why = field_problem(r)
        if why:
            raise InvalidInput(f"request {ascii(r.id)[:80]}: {why}")
    check_requests(reqs, vocab, max_model_len, what="Engine.run")


def load_requests(path: str | Path, default_new: int) -> list[Request]:
    """Every request of a JSON-lines file, in file order (duplicate ids refused)."""
    p = Path(path)
    try:
        lines = read_regular(p, "--requests", MAX_BYTES).decode("utf-8").split("\n")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"--requests {p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    records = [(n, text) for n, text in enumerate((line.removesuffix("\r") for line in lines), start=1)
               if text.strip()]
    if len(records) > MAX_REQUESTS:
        raise InvalidInput(f"--requests {p}: {len(records)} requests, at most {MAX_REQUESTS} (one per line; "
                           "split the file)")
    reqs, seen = [], {}
    for n, text in records:
        r = parse_line(text, f"--requests {p}:{n}", default_new, len(reqs))
        if r.id in seen:
            how = "" if "id" in json.loads(text) else " (its default: the request's index; give the line an 'id')"
            raise InvalidInput(f"--requests {p}:{n}: field 'id': {r.id!r}{how} repeats line {seen[r.id]}'s id")
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
        bad = [t for t in r.prompt if not 0 <= t < vocab] if vocab is not None else []
        if bad:
            raise InvalidInput(f"{what}: request {r.id!r}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(r.prompt) + r.max_new_tokens > max_model_len:
            raise InvalidInput(f"{what}: request {r.id!r}: prompt of {len(r.prompt)} tokens + {r.max_new_tokens} new "
                               f"tokens exceeds the bundle's max_model_len {max_model_len}")
