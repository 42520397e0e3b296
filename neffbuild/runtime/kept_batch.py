"""A step batch an engine keeps from step to step, checked row by row when it changes (issue 25).

In plain decode most steps run the same requests over the same block tables as the step
before, each one position further on. ``Stepper.plan`` checks everything native code will
touch (runtime/step_checks.py); on CPU that check runs right after the artifact, with the
interpreter's caches cold, and re-reads every row although only the tokens and positions
moved. ``KeptBatch`` moves that check to where the values are made:

- the first step over a batch (or any step after its tables were written) runs the whole
  check; when it passes, the Stepper *vouches* for the batch: it records the check's
  parameters and the table buffer's write count;
- ``advance(i, tokens, num_computed)`` sets row ``i`` and checks that row at once against
  the same rules ``step_ok`` applies (integral token ids in ``[0, vocab)``, 1 or 1+k of them,
  an integral position >= 0 whose live columns hold blocks in the kept tables' verdict);
  a row it cannot vouch for drops the verdict, and the next step runs the whole check,
  which words the problem;
- the next ``plan`` then reads the verdict in place: two comparisons.

A verdict holds only while the table buffer was not written since (``BlockTables``: a row
written anew invalidates it) and only for the Stepper that gave it (its parameters, by
identity). Rows change through ``advance`` only: ``tokens`` and ``num_computed`` are the
lists the artifact's inputs are built from, and a value stored into them directly is not
seen by the check (the same contract as ``TableBuffer``'s views; the engine keeps it).
tests/test_fuzz.py holds ``advance`` to the rule-by-rule reference.
"""

from __future__ import annotations

from neffbuild.runtime.block_tables import BlockTables

_SEQ = (list, tuple)


class KeptBatch:
    """``StepBatch``'s fields (``tokens``, ``num_computed``, ``block_tables``), advanced in place, checked per row."""

    __slots__ = ("block_tables", "num_computed", "ok_at", "ok_for", "tokens")

    def __init__(self, tokens: list[list[int]], num_computed: list[int], block_tables):
        self.tokens, self.num_computed, self.block_tables = tokens, num_computed, block_tables
        self.ok_at, self.ok_for = -1, None  # the table buffer's writes at the verdict, and whose check gave it

    def vouch(self, params: tuple) -> None:
        """Called by the Stepper when its whole check passed: the batch is good for ``params`` at these tables."""
        tables = self.block_tables
        if type(tables) is BlockTables and tables.verdict is not None and tables.verdict_at == tables.buffer.writes:
            self.ok_at, self.ok_for = tables.verdict_at, params

    def vouched(self, params: tuple) -> bool:
        """The verdict holds: given for ``params`` and no table row written since."""
        return self.ok_for is params and self.ok_at == self.block_tables.buffer.writes

    def advance(self, i: int, tokens: list[int], num_computed: int) -> None:
        """Row ``i`` := ``tokens`` at ``num_computed``; the verdict survives only if the row passes ``step_ok``'s
        rules (the Stepper's parameters: k, vocab, block size, pool, max_model_len)."""
        self.tokens[i], self.num_computed[i] = tokens, num_computed
        params = self.ok_for
        if params is None:
            return
        tables = self.block_tables
        if self.ok_at != tables.buffer.writes:  # tables written since: the next step checks everything
            self.ok_for = None
            return
        k, vocab, bs, _, mml = params
        n = num_computed
        ok = type(tokens) in _SEQ and type(n) is int and n >= 0 and (len(tokens) == 1 or len(tokens) == 1 + k)
        if ok:
            for t in tokens:
                if type(t) is not int or t < 0 or t >= vocab:
                    ok = False
                    break
        if ok:
            first_null, s_start, s_end = tables.verdict
            q = len(tokens)
            last = (n + q if n + q < mml else mml) - 1  # the last live position (none when n >= max_model_len)
            h = last // bs + 1 if last >= n else 0  # live columns: [0, h) full, [n // bs, h) sliding
            if h > first_null[i]:  # (never past the row's width: the verdict's rows are the view's width)
                ok = False
            elif s_start is not None:
                a = n // bs
                ok = h <= a or (s_start[i] <= a and h <= s_end[i])
        if not ok:
            self.ok_for = None
