"""A step batch an engine keeps from step to step, checked where it changes (issue 25).

In plain decode most steps run the same requests over the same block tables as the step
before, each one position further on. ``Stepper.plan`` checks everything native code will
touch (runtime/step_checks.py); on CPU that check runs right after the artifact, with the
interpreter's caches cold, and re-reads every row although only the tokens and positions
moved. ``KeptBatch`` checks a kept batch where its values are made instead:

- the first step over a batch (or any step after its tables were written) runs the whole
  check; when it passes, the Stepper *vouches* for the batch: it records the check's
  parameters and the table buffer's write count, and how many steps every row can still
  move on one position before it leaves the columns its tables hold (``slack``);
- ``advance_greedy(logits)``: plain greedy decode's next step, made here: each row's token is
  the argmax of its logits (the ids themselves checked: one per row, below the vocab, as the
  artifact's ``[R, 1, vocab]`` logits give) and its position moves on one; a step of slack is used;
- the next ``plan`` reads the verdict in place: two comparisons.

A verdict holds only while the table buffer was not written since (a row written anew
invalidates it) and only for the Stepper that gave it (its parameters, by identity). Rows
change through ``advance_greedy`` only (any other change: a new ``KeptBatch``, which the next
step checks whole): ``tokens`` and ``num_computed`` are the lists the artifact's inputs are
built from, and a value stored into them directly is not seen by the check (the same contract
as ``TableBuffer``'s views; the engine keeps it). tests/test_fuzz.py holds ``advance_greedy``
to the rule-by-rule reference.
"""

from __future__ import annotations

from neffbuild.errors import StepInputError
from neffbuild.runtime.block_tables import BlockTables


class KeptBatch:
    """StepBatch's fields (tokens, num_computed, block_tables), moved on in place and checked as they move."""

    __slots__ = ("block_tables", "num_computed", "ok_at", "ok_for", "slack", "tokens")

    def __init__(self, tokens: list[list[int]], num_computed: list[int], block_tables):
        self.tokens, self.num_computed, self.block_tables = tokens, num_computed, block_tables
        self.ok_at, self.ok_for = -1, None  # the table buffer's writes at the verdict, and whose check gave it
        self.slack = 0  # greedy steps (one position each) every row can still take inside its tables' blocks

    def vouch(self, params: tuple) -> None:
        """Called by the Stepper when its whole check (``step_ok``) passed: the batch is good for ``params`` at
        these tables, and for ``slack`` more one-position steps."""
        tables = self.block_tables
        if type(tables) is not BlockTables or tables.verdict is None or tables.verdict_at != tables.buffer.writes:
            return
        self.ok_at, self.ok_for = tables.verdict_at, params
        _, _, bs, _, mml = params
        first_null, _, s_end = tables.verdict  # (a sliding run's start only recedes behind a growing row)
        slack, cols = 1 << 62, tables.num_cols
        for i, n in enumerate(self.num_computed):
            # The next step runs position n + 1 (one token): it stays live while (n + 1 + s) // bs < the row's
            # block columns (first null column, or the end of the sliding run, within the view's width: a row
            # written wider holds blocks past it), and below max_model_len.
            end = first_null[i] if s_end is None or s_end[i] > first_null[i] else s_end[i]
            end = end if end < cols else cols
            s = min(end * bs, mml) - n - 1
            slack = s if s < slack else slack
        self.slack = slack if slack > 0 else 0

    def vouched(self, params: tuple) -> bool:
        """The verdict holds: given for ``params`` and no table row written since."""
        return self.ok_for is params and self.ok_at == self.block_tables.buffer.writes

    def advance_greedy(self, logits) -> list[list[int]]:
        """Plain greedy decode: row i := [argmax of ``logits[i, 0]``], one position on; returns those rows ``[R][1]``.
        The verdict survives while every row is one id below the vocab (``[R, 1, V <= vocab]`` logits: no shape
        read, the ids themselves are looked at) and slack is left."""
        try:
            ids = logits.argmax(-1).tolist()
        except (AttributeError, TypeError, IndexError, RuntimeError) as exc:
            self.ok_for = None
            raise StepInputError(f"KeptBatch.advance_greedy: logits must be the step's [R, 1, vocab] tensor "
                                 f"({type(exc).__name__}: {exc})") from None
        computed = self.num_computed
        if type(ids) is not list or len(ids) != len(computed):
            self.ok_for = None
            raise StepInputError(f"KeptBatch.advance_greedy: logits for {len(ids) if type(ids) is list else 0} "
                                 f"rows, the batch has {len(computed)}; pass the StepOutput's logits of this "
                                 f"batch's step")
        params = self.ok_for
        keep = params is not None and self.slack > 0
        top = params[1] if keep else 0
        for i, row in enumerate(ids):
            computed[i] += 1
            if keep and (type(row) is not list or len(row) != 1 or row[0] >= top):
                keep = False
        self.tokens = ids
        if keep:
            self.slack -= 1
        else:
            self.ok_for = None
        return ids
