"""The step room: the per-step API serving engines call, stateless about requests.

It owns the ``Stepper`` (``stepper.py``: plan -> one DP collective -> trimmed metadata ->
artifact), the bucket math shared with the grid (``buckets.py``), dispatch and the one label
format (``dispatch.py``), every step input native code touches checked first (``checks.py``),
the table of step inputs (``inputs.py``), attention metadata (``attn_metadata.py``), the EAGLE3
draft call's inputs (``draft_inputs.py``), the DP sync (``dp_sync.py``), the step counters
(``metrics.py``) and the needed_seq histogram (``histogram.py``). It leaves out block
allocation (``runtime.kv``), sampling and prefill (``serve/``).
"""
