"""One exception hierarchy for everything a user can see.

The CLI maps these to exit codes in one place (``cli/main.py``): an ``InvalidInput``
exits 2, any other ``NeffbuildError`` exits 1. The validation primitives every checker shares
(recipe, model config, manifest schema) live here too: ``Problem``, ``short_repr`` and
``did_you_mean``. This module imports only the standard library.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass


class NeffbuildError(Exception):
    """Base of every error meant for a user: the message names the thing and the fix."""

    exit_code = 1


class InvalidInput(NeffbuildError):
    """Bad input from the user (recipe, flag, file): exit code 2."""

    exit_code = 2


class _NoValue:
    def __repr__(self) -> str:
        return "<missing>"


_NO_VALUE = _NoValue()
NO_VALUE = _NO_VALUE


@dataclass(frozen=True)
class Problem:
    """One validation finding: dotted path, the rule it broke, and the offending value (if one is shown)."""

    path: str
    message: str
    value: object = NO_VALUE

    def __str__(self) -> str:
        if self.value is _NO_VALUE:
            return f"{self.path}: {self.message}"
        return f"{self.path}: got {short_repr(self.value)}, {self.message}"

    def to_json(self) -> dict:
        """Plain JSON: a short scalar value as itself, anything else as its shortened text."""
        value = None if self.value is _NO_VALUE else self.value
        simple = value is None or isinstance(value, (bool, str, int, float))
        if not simple or len(short_repr(value)) != len(_safe_repr(value)) or _non_finite(value):
            value = short_repr(value)
        return {"path": self.path, "value": value, "message": self.message}


def _non_finite(value) -> bool:
    return isinstance(value, float) and (value in (float("inf"), float("-inf")) or value != value)


def _safe_repr(value) -> str:
    try:
        return repr(value)
    except (ValueError, RecursionError):  # ints over 4300 digits, self-referencing containers
        return f"<{type(value).__name__}>"


def short_repr(value, limit: int = 80) -> str:
    """repr of a value cut to a readable length (a whole file echoed back helps nobody)."""
    text = _safe_repr(value)
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text)} characters)"


def did_you_mean(word: object, choices) -> str:
    """``"; did you mean 'x'?"`` for the closest choice, or ``""`` when none is close."""
    hint = difflib.get_close_matches(str(word), sorted(str(c) for c in choices), n=1)
    return f"; did you mean {hint[0]!r}?" if hint else ""


class RecipeError(InvalidInput):
    """A recipe failed validation; carries every problem found, not just the first."""

    def __init__(self, source: str, problems: list[Problem], warnings: list[str] | None = None):
        self.source = source
        self.problems = list(problems)
        self.warnings = list(warnings or [])
        lines = [f"{source}: {len(self.problems)} problem(s)"] + [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


class ShapeNotCovered(NeffbuildError):
    """The runtime was asked for a shape no compiled artifact covers (fail closed)."""


class BackendUnavailable(NeffbuildError):
    """The requested compiler backend cannot run on this machine."""


class KVTransferError(NeffbuildError):
    """A disaggregated-inference KV transfer failed: handshake refused, pull failed or timed out."""


class NixlUnavailable(KVTransferError):
    """NIXL is not installed here; the message names the extra to install."""


class KVLayoutMismatch(KVTransferError):
    """A prefill rank's KV layout cannot feed this decode rank's (the message names both sides)."""


class PrefillWorkerLost(KVTransferError):
    """A prefill worker rank died or stopped answering while serving ``request`` (``generate`` exits 1)."""

    def __init__(self, request: str, message: str):
        self.request, self.detail = request, message
        super().__init__(f"request {request!r}: {message}")


class BuildFailed(NeffbuildError):
    """One or more targets failed to compile; the message lists them."""


class BundleError(NeffbuildError):
    """A bundle is malformed, corrupt or tampered with; the message names the file."""


class SignatureError(BundleError):
    """A bundle is unsigned, signed by an untrusted key, or differs from what was signed; names the file or key.

    ``paths``: the bundle files at fault (``model.sig`` itself for a key or format problem).
    """

    def __init__(self, message: str, paths: tuple[str, ...] = ("model.sig",)):
        self.paths = tuple(paths)
        super().__init__(message)


class IncompatibleBundle(BundleError):
    """A bundle is well formed but was built for another format or toolchain."""


class KVPoolExhausted(NeffbuildError):
    """The KV block pool has fewer free blocks than a request needs (engines queue or preempt)."""

    def __init__(self, needed: int, free: int, what: str = ""):
        self.needed, self.free = needed, free
        super().__init__(f"KV pool exhausted{' ' + what if what else ''}: needed {needed} blocks, {free} free; "
                         f"raise serving.num_blocks or serve fewer/shorter requests at once")


class StepInputError(NeffbuildError):
    """An engine handed the step API a malformed step (raised on every DP rank together)."""
