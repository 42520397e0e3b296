"""Greedy sampling and the acceptance of drafts: what the engine makes of a step's logits.

``greedy`` takes every row's argmax in one torch call and hands plain lists back (the rest of
a step is Python). ``accept`` is speculative decoding's greedy rule: the longest prefix of the
drafts equal to the target's argmax, then the target's own token (the bonus), cut at what the
request still asks for. Without drafts it is the argmax alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def greedy(logits: torch.Tensor) -> list[list[int]]:
    """Each row's argmax per query position: ``[R][q]`` token ids from logits ``[R, q, vocab]``."""
    return logits.argmax(-1).tolist()


def accept(drafts: Sequence[int], target: Sequence[int], remaining: int) -> tuple[list[int], int]:
    """(tokens emitted, drafts accepted) for one row: ``target`` is its argmax at each position the step ran
    (``1 + k`` with drafts; 1 when the step ran without them, its drafts then unused); ``remaining`` (>= 1) the
    tokens the request still asks for."""
    n = min(len(drafts), len(target) - 1)
    if not n:
        return [target[0]], 0
    a = 0
    while a < n and drafts[a] == target[a]:
        a += 1
    return (list(drafts[:a]) + [target[a]])[:remaining], a
