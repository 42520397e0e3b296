"""Dense linears of the decode graphs and of eager prefill: ``x @ weight.T`` in the form the host runs fastest.

A bfloat16 CPU graph traced for AOTInductor calls the native ``neffbuild::bf16_linear`` (``native_on``); eager code
on a host whose oneDNN has no fast bf16 matmul widens many-row products to float32 (``compute_dtype``); everything
else, other backends' graphs included, is the plain matmul.
"""

from __future__ import annotations

import torch

from neffbuild.kernels.moe import compute_dtype, native_on, traced

EAGER_WIDEN_ROWS = 16  # rows from which an eager bf16 linear runs in float32 where bf16 matmuls are slow (``linear``)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T. A bfloat16 CPU graph traced for AOTInductor calls ``neffbuild::bf16_linear``
    (runtime/native.py; ``native_on``): float32 sums rounded to bf16 as the matmul's are, at the weights' read
    bandwidth, where oneDNN's bf16 GEMV reads slower (and, without AVX-512, computes at about 10 GFLOP/s)."""
    if native_on() and x.dtype == weight.dtype == torch.bfloat16:
        return rows_op(torch.ops.neffbuild.bf16_linear, x, weight)
    if x.shape[:-1].numel() >= EAGER_WIDEN_ROWS and not traced(x):  # a few rows (eager decode) ask nothing
        cdt = compute_dtype(x)
        if cdt != x.dtype:
            # eager prefill on a host without fast bf16 matmuls: the weights widened exactly (a copy of each, once a
            # chunk), float32 sums rounded to bf16 as bf16_linear's are; 400 rows of GPT-OSS-20B's qkv and o took
            # ~2 s a layer in bf16 there (docs/benchmarks.md "Real width"); a few rows read fewer bytes as bf16
            return (x.to(cdt) @ weight.to(cdt).t()).to(x.dtype)
    return x @ weight.t()


def rows_op(op, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``op`` (a native [M, K] x [N, K] op) on x [..., K]."""
    return op(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], -1)
