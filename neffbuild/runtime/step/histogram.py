"""The needed_seq histogram: how much context each decode step needed, counted per value.

The runtime records one observation per decode step, the ``needed_seq`` it dispatched on
(after the DP sync, so every rank records the same value and one rank's histogram is the
deployment's). Serving code exports it as Prometheus text or as CSV with the header
``needed_seq,count``; ``neffbuild recommend`` reads the CSV back and chooses context
buckets from it. Exact counts are kept (one integer per distinct value, at most
``max_model_len`` of them), so nothing is lost before the recommendation.

Standard library only (the runtime must import cheaply).
"""

from __future__ import annotations

import csv
import io
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from neffbuild.errors import InvalidInput

CSV_HEADER = ("needed_seq", "count")
METRIC = "neffbuild_decode_needed_seq"
TILE = 128  # Prometheus bucket width: the attention tile, the granularity of context buckets


class NeededSeqHistogram:
    """Counts of decode steps per needed_seq. Not thread-safe; one per rank."""

    METRIC = METRIC  # the Prometheus name every engine exports it under

    @staticmethod
    def prometheus_edges(max_model_len: int) -> list[float]:
        """Bucket edges for a live Prometheus histogram of needed_seq: one per attention tile."""
        return [float(v) for v in range(TILE, max_model_len + 1, TILE)]

    def __init__(self, max_model_len: int | None = None, counts: Iterable[tuple[int, int]] = ()):
        self.max_model_len = max_model_len
        self.counts: Counter[int] = Counter()
        for value, n in counts:
            self.record(value, n)

    def record(self, needed_seq: int, n: int = 1) -> None:
        """Count ``n`` steps that needed ``needed_seq`` tokens of context."""
        self.counts[int(needed_seq)] += int(n)

    def merge(self, other: NeededSeqHistogram) -> None:
        self.counts.update(other.counts)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def rows(self) -> list[tuple[int, int]]:
        """(needed_seq, count) ascending, zero counts left out."""
        return [(v, n) for v, n in sorted(self.counts.items()) if n]

    # -- CSV
    def to_csv(self) -> str:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(CSV_HEADER)
        w.writerows(self.rows())
        return buf.getvalue()

    def write_csv(self, path: str | os.PathLike) -> Path:
        """Write the CSV in place: only a regular file or a new name in an existing folder, never into a
        bundle; anything else (a link, a device, a FIFO) is InvalidInput naming it (fsutil.write_output)."""
        from neffbuild.fsutil import write_output

        return write_output(path, self.to_csv(), "histogram")

    # -- Prometheus
    def boundaries(self) -> list[int]:
        """Bucket upper bounds: every multiple of 128 below max_model_len, then max_model_len.

        Without a max_model_len, multiples of 128 up to the largest value seen. Bounds at the
        tile are lossless for choosing context buckets (they are multiples of 128 too).
        """
        top = self.max_model_len or max(self.counts, default=TILE)
        return list(range(TILE, top, TILE)) + [top] if top % TILE else list(range(TILE, top + 1, TILE))

    def to_prometheus(self, name: str = METRIC) -> str:
        """Prometheus text exposition: a histogram with cumulative ``le`` buckets, _sum, _count."""
        lines = [f"# HELP {name} Context tokens (needed_seq) each decode step dispatched on, after DP sync.",
                 f"# TYPE {name} histogram"]
        rows = self.rows()
        for bound in self.boundaries():
            lines.append(f'{name}_bucket{{le="{bound}"}} {sum(n for v, n in rows if v <= bound)}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.total}')
        lines.append(f"{name}_sum {sum(v * n for v, n in rows)}")
        lines.append(f"{name}_count {self.total}")
        return "\n".join(lines) + "\n"


MAX_CSV_BYTES = 64 << 20  # a needed_seq,count row per context length: far below this


def read_csv(path: str | os.PathLike) -> NeededSeqHistogram:
    """Parse a ``needed_seq,count`` CSV; any malformed row raises InvalidInput naming the line."""
    from neffbuild.fsutil import read_regular

    try:
        text = read_regular(path, "histogram", MAX_CSV_BYTES).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"{path}: cannot read the histogram ({exc})") from None
    return parse_csv(text, str(path))


def parse_csv(text: str, source: str = "<histogram>") -> NeededSeqHistogram:
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None or not any(c.strip() for c in header):
        raise InvalidInput(f"{source}: empty file; expected a CSV with the header 'needed_seq,count' "
                           "(written by `neffbuild generate --histogram` or NeededSeqHistogram.write_csv)")
    cols = [c.strip() for c in header]
    missing = [c for c in CSV_HEADER if c not in cols]
    if missing:
        raise InvalidInput(f"{source}: line 1: missing column(s) {', '.join(missing)}; got header {','.join(cols)!r}, "
                           "expected 'needed_seq,count'")
    i_seq, i_count = cols.index("needed_seq"), cols.index("count")
    hist = NeededSeqHistogram()
    for line, row in enumerate(reader, start=2):
        if not any(c.strip() for c in row):
            continue
        if len(row) != len(cols):
            raise InvalidInput(f"{source}: line {line}: expected {len(cols)} fields, got {len(row)}: {','.join(row)!r}")
        seq = _int(row[i_seq], source, line, "needed_seq")
        count = _int(row[i_count], source, line, "count")
        if seq < 1:
            raise InvalidInput(f"{source}: line {line}: needed_seq {seq} must be >= 1 (a step sees at least one token)")
        if count < 0:
            raise InvalidInput(f"{source}: line {line}: count {count} must be >= 0")
        hist.record(seq, count)
    if hist.total == 0:
        raise InvalidInput(f"{source}: no decode steps recorded (every count is 0 or there are no rows)")
    return hist


def _int(text: str, source: str, line: int, column: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise InvalidInput(f"{source}: line {line}: {column} {text.strip()!r} is not an integer") from None
