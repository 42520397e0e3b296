"""What the step API checks before native code touches anything. Thin: torch only.

A compiled artifact trusts its inputs: a block id outside the pool aborts the process inside
an OpenMP region, a token id >= vocab runs a C++ bounds check, a KV buffer of the wrong size
is written past its end. So everything an artifact will read or write is checked here first,
as plain Python on the engine's values plus a few reductions over the block-table columns the
step can reach (never the pool, never columns beyond ``max_model_len``):

- ``tokens``: integral ids in ``[0, vocab)``, 1 or 1+k per row; ``num_computed``: integral, >= 0;
- ``block_tables``: int tensors on the CPU, ``[R, W]``; every id the graph can read in
  ``[0, num_blocks)`` (0 is the null block, masked by the kernels); every column that holds a
  live position (the context and the tokens written now) in ``[1, num_blocks)`` for the
  full-attention group, the written columns for the sliding group; wide enough for them;
- KV buffers (``Stepper(kv_caches=...)``): the bundle's shape, dtype and device, contiguous, real;
- EAGLE3 draft rows: the same token and table rules, aux states ``[n, A]`` float32 with A
  from the bundle (never from the caller's tensor), positions below ``max_model_len``.

``step_problem`` returns a message (the step API raises it on every DP rank together, after
the one collective); the others raise ``StepInputError`` themselves. It runs on every step, so
it is two paths: ``step_ok``, one pass over the rows for the usual step (plain ints, tables up
to ``LIST_LIMIT`` ids: a few us, under 1% of the tiny model's step), which only ever says yes;
and ``_step_reference``, rule by rule, for everything else and for the message. The fuzz holds
the first to the second (tests/test_fuzz.py).
"""

from __future__ import annotations

import operator
from itertools import repeat

import torch

from neffbuild.errors import StepInputError, short_repr
from neffbuild.runtime.kv.blocks import FULL_GROUP, SLIDING_GROUP
from neffbuild.runtime.kv.tables import BlockTables

_INT_DTYPES = frozenset((torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8))
_BIG = BIG = 2**62  # above any vocab: the token bound when the bundle names none
_LONG = torch.int64  # what engines pass: checked by identity before the set
_WHERE = {g: f"step: block_tables[{g!r}]" for g in (FULL_GROUP, SLIDING_GROUP)}
LIST_LIMIT = 4096  # tables up to this many ids are checked as Python lists (a few us); larger ones with torch


def _index(v) -> int | None:
    """An integral value as int (int, numpy or 0-d torch integers), else None (floats, "3", bools)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, torch.Tensor) and (v.dim() != 0 or v.dtype not in _INT_DTYPES):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def model_dims(artifacts) -> tuple[int | None, int | None]:
    """(vocab, aux width of the EAGLE3 draft input) from a Bundle, or the eager module's config."""
    vocab, aux = getattr(artifacts, "vocab_size", None), getattr(artifacts, "aux_hidden_size", None)
    if vocab is None:
        module = getattr(artifacts, "module", None) or getattr(artifacts, "target", None)
        cfg = getattr(module, "cfg", None)
        vocab = getattr(cfg, "vocab_size", None)
        hidden = getattr(cfg, "hidden_size", None)
        aux = 3 * hidden if aux is None and isinstance(hidden, int) else aux
    return vocab, aux


def _token_problem(where: str, row, vocab: int | None) -> str | None:
    for t in row:
        v = _index(t)
        if v is None or v < 0 or (vocab is not None and v >= vocab):
            return (f"{where} holds {short_repr(t)}; token ids must be integers in [0, {vocab})"
                    if vocab is not None else f"{where} holds {short_repr(t)}; token ids must be integers >= 0")
    return None


def table_problem(where: str, table, R: int) -> str | None:
    """Why ``table`` is not an [R, W] integer tensor on the CPU, or None."""
    if not isinstance(table, torch.Tensor):
        return f"{where} must be a torch.Tensor [R, W], got {type(table).__name__}"
    if table.dtype not in _INT_DTYPES:
        return f"{where} must hold integer block ids, got dtype {table.dtype}"
    if not table.is_cpu:
        return f"{where} must be on the CPU (the step builds its inputs there), got device {table.device}"
    if table.dim() != 2 or table.shape[0] != R or (R and table.shape[1] == 0):
        return f"{where} must be [R={R}, W>=1], got {list(table.shape)}"
    return None


def _live_min(table: torch.Tensor, lo: list[int], hi: list[int]) -> int:
    """Smallest id in ``table[r, lo[r]:hi[r]]`` over all rows (_BIG where every range is empty)."""
    top = max(hi, default=0)
    if top == 0:
        return _BIG
    if len(set(lo)) == 1 and min(hi) == top:  # every row the same columns (one request, or equal lengths)
        return int(table[:, lo[0]:top].min()) if top > lo[0] else _BIG
    cols = torch.arange(top)
    live = (cols >= torch.tensor(lo)[:, None]) & (cols < torch.tensor(hi)[:, None])
    return int(torch.where(live, table[:, :top], _BIG).min())


def ids_problem(where: str, table: torch.Tensor, *, num_blocks: int, block_size: int, max_cols: int,
                live_lo: list[int], live_hi: list[int], positions: list[tuple[int, int]]) -> str | None:
    """Block ids the graph can read in [0, num_blocks); live columns [live_lo, live_hi) never the null block."""
    if table.shape[1] < max(live_hi, default=0):
        r = max(range(len(live_hi)), key=live_hi.__getitem__)
        return (f"{where} is {table.shape[1]} columns wide; request {r} runs position {positions[r][1]} "
                f"(block size {block_size}) and needs {live_hi[r]} columns")
    if table.numel() <= LIST_LIMIT:  # the usual decode table: plain Python on its values is cheapest
        return _ids_problem_small(where, table.tolist(), num_blocks, block_size, max_cols, live_lo, live_hi)
    reach = table[:, :max_cols]
    if reach.numel():
        lo, hi = torch.aminmax(reach)
        if int(lo) < 0 or int(hi) >= num_blocks:
            bad = int(lo) if int(lo) < 0 else int(hi)
            return f"{where} holds block id {bad}; block ids must be in [0, {num_blocks}) (the KV pool)"
    if _live_min(table, live_lo, live_hi) < 1:
        for r, (a, b) in enumerate(zip(live_lo, live_hi, strict=True)):
            row = table[r, a:b].tolist()
            if 0 in row:
                return _null_message(where, r, a + row.index(0), block_size, num_blocks)
    return None


def _null_message(where: str, r: int, c: int, block_size: int, num_blocks: int) -> str:
    return (f"{where}: request {r} has the null block (0) in column {c}, which holds live positions "
            f"{c * block_size}..{c * block_size + block_size - 1} (its context or this step's tokens); "
            f"give every live position a block in [1, {num_blocks})")


def _ids_problem_small(where, rows: list, num_blocks, block_size, max_cols, live_lo, live_hi) -> str | None:
    for r, row in enumerate(rows):
        reach = row[:max_cols] if len(row) > max_cols else row
        lo, hi = min(reach), max(reach)
        if lo < 0 or hi >= num_blocks:
            bad = lo if lo < 0 else hi
            return f"{where} holds block id {bad}; block ids must be in [0, {num_blocks}) (the KV pool)"
        a, b = live_lo[r], live_hi[r]
        if b > a and min(row[a:b]) < 1:
            return _null_message(where, r, a + row[a:b].index(0), block_size, num_blocks)
    return None


def step_problem(batch, *, k: int, vocab: int | None, layout, max_model_len: int) -> str | None:
    """Why a step is malformed, or None (checked before the collective so every rank learns of it). The Stepper
    calls ``step_ok`` itself first (one call less on every step) and this only when that says no."""
    tokens, computed, tables = batch.tokens, batch.num_computed, batch.block_tables
    if step_ok(tokens, computed, tables, k, vocab, layout.block_size, layout.num_blocks, max_model_len):
        return None
    return _step_reference(tokens, computed, tables, k=k, vocab=vocab, layout=layout, max_model_len=max_model_len)


_SEQ = (list, tuple)


def step_ok(tokens, computed, tables, k, vocab, bs, num_blocks, mml) -> bool:
    """True only for a step the reference below accepts: plain lists of ints and, as tables, a TableBuffer's view
    (runtime/kv/tables.py: ids range-checked when written, each row's blocks' columns known, so a row costs a
    few int compares) or a dict of tensors up to ``LIST_LIMIT`` ids (``_dict_ok``): the engine's usual decode step,
    in one pass over the rows. Anything else (numpy or tensor scalars, an idle rank, big tables, any doubt) is
    False, and the reference decides and words the message; the fuzz checks that this never accepts what the
    reference refuses (tests/test_fuzz.py)."""
    if type(tokens) not in _SEQ or type(computed) not in _SEQ:
        return False
    if type(tables) is not BlockTables:
        return type(tables) is dict and _dict_ok(tokens, computed, tables, k, vocab, bs, num_blocks, mml)
    R = len(tokens)
    if not R or len(computed) != R or tables.num_cols > -(-mml // bs):  # wider than the graph reads: the
        return False  # columns beyond may hold anything, which the rows' id range does not tell apart
    got = tables.verdict if tables.verdict_at == tables.buffer.writes and tables.verdict_for == (R, num_blocks) \
        else tables.checked(R, num_blocks)  # the kept verdict read in place: a call costs ~3 us after the artifact
    if got is None:
        return False
    first_null, s_start, s_end = got
    q2, top, width = 1 + k, _BIG if vocab is None else vocab, tables.num_cols
    # The token and position rules below are _dict_ok's, repeated on purpose: a helper call per row costs more
    # than this whole row after the artifact ran (docs/benchmarks.md); the fuzz holds both to the reference.
    for r in range(R):
        toks, n = tokens[r], computed[r]
        if type(toks) not in _SEQ or type(n) is not int or n < 0:
            return False
        q = len(toks)
        if q < 1 or q > q2:  # 1 + d tokens, d = 0..k drafts (a with-spec step pads the rest)
            return False
        for t in toks:
            if type(t) is not int or t < 0 or t >= top:
                return False
        last = (n + q if n + q < mml else mml) - 1  # the last live position (none when n >= max_model_len)
        h = last // bs + 1 if last >= n else 0  # live columns: [0, h) full, [n // bs, h) sliding
        if h > width or h > first_null[r]:
            return False
        if s_start is not None:
            a = n // bs
            if h > a and (a < s_start[r] or h > s_end[r]):
                return False
    return True


def _dict_ok(tokens, computed, tables, k, vocab, bs, num_blocks, mml) -> bool:
    """``step_ok`` for tables handed as a dict of tensors: ids scanned as Python lists (small tables) or by one
    aminmax, then the null block looked for in each row's live columns."""
    R = len(tokens)
    sliding = tables.get(SLIDING_GROUP)
    if not R or len(computed) != R or len(tables) != (1 if sliding is None else 2):  # an unknown group, a None
        return False
    cols = -(-mml // bs)  # the columns the graph can read
    full = _rows(tables.get(FULL_GROUP), R, cols, num_blocks)
    slid = _NO_TABLE if sliding is None else _rows(sliding, R, cols, num_blocks)
    if full is None or slid is None:
        return False
    (frows, fscan, width), (srows, sscan, swidth) = full, slid
    width = swidth if swidth < width else width
    q2, top = 1 + k, _BIG if vocab is None else vocab
    for toks, n, frow, srow in zip(tokens, computed, frows, srows, strict=False):  # R rows; a repeat for no rows
        if type(toks) not in _SEQ or type(n) is not int or n < 0:
            return False
        q = len(toks)
        if q < 1 or q > q2:  # 1 + d tokens, d = 0..k drafts (a with-spec step pads the rest)
            return False
        for t in toks:
            if type(t) is not int or t < 0 or t >= top:
                return False
        last = (n + q if n + q < mml else mml) - 1  # the last live position (none when n >= max_model_len)
        h = last // bs + 1 if last >= n else 0  # live columns: [0, h) full, [n // bs, h) sliding
        if h > width:
            return False
        if frow is not None:  # the null block only outside the live columns
            if fscan:
                if max(frow) >= num_blocks:
                    return False
                lo = min(frow)
                if lo < 1 and (lo < 0 or (h and min(frow[:h]) < 1)):
                    return False
            elif h and min(frow[:h]) < 1:
                return False
        if srow is not None:
            a = n // bs
            if sscan:
                if max(srow) >= num_blocks:
                    return False
                lo = min(srow)
                if lo < 1 and (lo < 0 or (h > a and min(srow[a:h]) < 1)):
                    return False
            elif h > a and min(srow[a:h]) < 1:
                return False
    return True


_PY_IDS = 32  # tables up to this many ids are scanned in Python; larger ones with one aminmax (~2 us)
_NO_TABLE = (repeat(None), False, _BIG)


def _rows(t, R: int, cols: int, num_blocks: int):
    """(rows, scan, W) of an [R, W >= 1] int CPU tensor of at most LIST_LIMIT ids, else None.

    rows: each row's ids as a list cut to ``cols`` columns, to scan whole in Python (``scan``); or, for a
    table over ``_PY_IDS`` ids whose reachable ids one aminmax found in [0, num_blocks), the rows for their
    live columns only (not ``scan``), or no rows at all (a repeat of None) when none of them is 0."""
    # Cheapest reads first (t.shape builds a torch.Size, ~0.5 us; ndim, numel and an ``is`` on the dtype ~0.1 us).
    if type(t) is not torch.Tensor or not t.is_cpu or t.ndim != 2 or (t.dtype is not _LONG and
                                                                     t.dtype not in _INT_DTYPES):
        return None
    n = t.numel()
    if not 0 < n <= LIST_LIMIT:  # R rows of W >= 1 ids, R * W <= LIST_LIMIT
        return None
    if n <= _PY_IDS:
        rows = t.tolist()
        if len(rows) != R:
            return None
        width = len(rows[0])
        return (rows if width <= cols else [row[:cols] for row in rows]), True, width
    width = t.shape[1]
    if t.shape[0] != R:
        return None
    lo, hi = torch.aminmax(t if width <= cols else t[:, :cols])
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= num_blocks:
        return None
    return (repeat(None) if lo else t.tolist()), False, width


def _step_reference(tokens, computed, tables, *, k: int, vocab: int | None, layout, max_model_len: int) -> str | None:
    """The full check, rule by rule, with the message for the first rule broken (``step_ok``'s reference)."""
    if not hasattr(tokens, "__len__") or not hasattr(computed, "__len__") or \
            not all(hasattr(t, "__len__") and not isinstance(t, (str, bytes)) for t in tokens):
        return "step: tokens must be a list of token-id lists and num_computed a list of integers"
    R = len(tokens)
    if len(computed) != R:
        return f"step: {len(computed)} num_computed values for {R} token rows"
    bad = [r for r, t in enumerate(tokens) if not 1 <= len(t) <= 1 + k]
    if bad:
        return f"step: rows {bad[:5]} run {len(tokens[bad[0]])} tokens; must be 1 to 1+k ({1 + k}): the next token " \
            "and up to k drafts"
    ns = []
    for r, n in enumerate(computed):
        v = _index(n)
        if v is None or v < 0:
            return f"step: num_computed[{r}] is {short_repr(n)}; num_computed must be integers >= 0"
        ns.append(v)
    for r, row in enumerate(tokens):
        why = _token_problem(f"step: tokens[{r}]", row, vocab)
        if why:
            return why
    if not hasattr(tables, "items") or (R and FULL_GROUP not in tables):
        got = sorted(map(str, tables)) if hasattr(tables, "keys") else type(tables).__name__
        return f"step: block_tables lacks the {FULL_GROUP!r} group (got {got})"
    for g, t in tables.items():
        if g not in (FULL_GROUP, SLIDING_GROUP):
            return f"step: block_tables has an unknown KV group {g!r}; groups are {FULL_GROUP!r} and {SLIDING_GROUP!r}"
        why = table_problem(_WHERE[g], t, R)
        if why:
            return why
    if not R:  # an idle DP rank: its (empty) tables are still handed to the graph as padding rows
        return None
    bs = layout.block_size
    # Live positions per row: [n, n + len(tokens)) below max_model_len (beyond it plan() raises ShapeNotCovered).
    last = [min(n + len(t), max_model_len) - 1 for n, t in zip(ns, tokens, strict=True)]
    hi = [p // bs + 1 if p >= n else 0 for n, p in zip(ns, last, strict=True)]
    positions = list(zip(ns, last, strict=True))
    max_cols = -(-max_model_len // bs)
    common = {"num_blocks": layout.num_blocks, "block_size": bs, "max_cols": max_cols, "live_hi": hi,
              "positions": positions}
    why = ids_problem(_WHERE[FULL_GROUP], tables[FULL_GROUP], live_lo=[0] * R, **common)
    if why is None and SLIDING_GROUP in tables:  # the sliding group holds only the window: its written columns
        lo = [min(n // bs, h) for n, h in zip(ns, hi, strict=True)]
        why = ids_problem(_WHERE[SLIDING_GROUP], tables[SLIDING_GROUP], live_lo=lo, **common)
    return why


def check_group(group) -> None:
    """``Stepper(group=...)``: None (one rank) or a torch.distributed ProcessGroup; StepInputError otherwise."""
    import torch.distributed as dist

    if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise StepInputError(f"group must be a torch.distributed ProcessGroup of the DP ranks or None, got "
                             f"{type(group).__name__} {short_repr(group)}")


def draft_problem(rows, full_table, *, k: int, vocab: int | None, aux_width: int | None, layout,
                  max_model_len: int, max_computed) -> tuple[str | None, int]:
    """Why an EAGLE3 draft call is malformed (or None), and max_computed as an int."""
    mc = _index(max_computed)
    if mc is None or mc < 0:
        return f"draft: max_computed is {short_repr(max_computed)}; must be an integer >= 0", 0
    if not isinstance(rows, (list, tuple)) or not rows:
        return "draft: rows must be a non-empty list of (tokens, aux, first position)", mc
    R, q = len(rows), 1 + k
    why = table_problem("draft: full_table", full_table, R)
    if why:
        return why, mc
    firsts, lasts = [], []
    for r, row in enumerate(rows):
        if not isinstance(row, (tuple, list)) or len(row) != 3:
            return f"draft: rows[{r}] must be (tokens, aux, first position)", mc
        toks, aux, first = row
        if not hasattr(toks, "__len__") or not 1 <= len(toks) <= q:
            return f"draft: rows[{r}] has {short_repr(toks)} tokens; the draft graph takes 1..{q} verified rows", mc
        why = _token_problem(f"draft: rows[{r}] tokens", toks, vocab)
        if why:
            return why, mc
        n = len(toks)
        if not isinstance(aux, torch.Tensor) or aux.dtype != torch.float32 or aux.device.type != "cpu":
            return f"draft: rows[{r}] aux must be a float32 CPU tensor [{n}, {aux_width}]", mc
        if aux_width is not None and tuple(aux.shape) != (n, aux_width):
            return f"draft: rows[{r}] aux is {list(aux.shape)}, must be [{n}, {aux_width}] (n tokens x 3 hidden)", mc
        f = _index(first)
        if f is None or f < 0:
            return f"draft: rows[{r}] first position is {short_repr(first)}; must be an integer >= 0", mc
        if f + n > mc:
            return (f"draft: rows[{r}] writes positions {f}..{f + n - 1}, beyond max_computed {mc} "
                    "(the largest num_computed after acceptance)"), mc
        if f + n > max_model_len:
            return f"draft: rows[{r}] writes position {f + n - 1}, max_model_len is {max_model_len}", mc
        firsts.append(f)
        lasts.append(f + n - 1)
    bs = layout.block_size
    hi = [p // bs + 1 for p in lasts]
    why = ids_problem("draft: full_table", full_table, num_blocks=layout.num_blocks, block_size=bs,
                      max_cols=-(-max_model_len // bs), live_lo=[0] * R, live_hi=hi,
                      positions=list(zip(firsts, lasts, strict=True)))
    return why, mc
