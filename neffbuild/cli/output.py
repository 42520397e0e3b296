"""Machine-readable output: the ``--json`` option every read command shares, and standard JSON only.

``json_option`` marks the command's context so that ``cli/main.py`` prints errors as one JSON
document too. ``echo_json`` never writes ``NaN``/``Infinity`` (not JSON): non-finite floats become
strings, and anything JSON cannot hold becomes its (shortened) text.
"""

from __future__ import annotations

import json
import math

import click

MAX_TEXT = 200


def _mark(ctx: click.Context, _param, value: bool) -> bool:
    if value:
        ctx.meta["json_errors"] = True
    return value


def json_option(help_text: str):
    """``--json``: print one JSON document on stdout, errors included."""
    return click.option("--json", "as_json", is_flag=True, is_eager=True, expose_value=True, callback=_mark,
                        help=help_text)


def shorten(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text)} characters)"


def plain(obj, depth: int = 0):
    """A copy of obj made of standard JSON values only (bounded depth; cycles cannot reach here)."""
    if depth > 64:
        return "<nested too deeply>"
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return obj if abs(obj) < 10**18 else shorten(str(obj), 40)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {str(k): plain(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v, depth + 1) for v in obj]
    return shorten(str(obj))


def dumps(doc, **kw) -> str:
    return json.dumps(plain(doc), allow_nan=False, sort_keys=True, **kw)


def echo_json(doc) -> None:
    click.echo(dumps(doc))


def error_doc(exc: Exception, exit_code: int) -> dict:
    """The one error shape of every ``--json`` command (validation problems included when there are any)."""
    doc = {"ok": False, "error": {"kind": type(exc).__name__, "message": str(exc), "exit_code": exit_code}}
    problems = getattr(exc, "problems", None)
    if problems is not None:
        doc.update(valid=False, errors=[p.to_json() for p in problems], warnings=list(getattr(exc, "warnings", [])))
    return doc


def keep_native_output_off_stdout() -> None:
    """Under ``--json`` stdout carries one JSON document: point file descriptor 1 at stderr for whatever
    native libraries (UCX, NIXL, compilers) and child processes print, and keep Python's own
    ``sys.stdout`` on the real stdout. Only in a real process (a test runner's captured stdout is left as is)."""
    import os
    import sys

    try:
        if sys.stdout.fileno() != 1:
            return
    except (AttributeError, OSError, ValueError):
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(saved, "w", buffering=1, encoding=sys.stdout.encoding, errors="replace")
