"""Muon's Newton-Schulz iteration on a matrix of a flat buffer: GEMMs on BLAS (NumPy) or cuBLAS (CuPy).

Shared by the CPU and CUDA kernel families (the reference family has its own float64 form).
"""

from __future__ import annotations

import numpy as np


def work_size(rows: int, cols: int) -> int:
    """Elements of scratch :func:`iterate` needs for a ``rows x cols`` matrix."""
    m = min(rows, cols)
    return rows * cols + 2 * m * m


def iterate(x, work, ns_coefficients, ns_steps, xp=np):
    """``ns_steps`` quintic steps on ``x`` (already divided by its norm); returns the array holding the result.

    ``x``: one ``rows x cols`` matrix, or a stack ``(k, rows, cols)`` of them iterated
    together (batched GEMMs: one launch per product for the whole stack on a GPU).
    ``work`` holds at least ``x.size + 2*k*min(rows, cols)**2`` elements of ``x``'s dtype
    (see :func:`work_size`, per matrix): the iterate ping-pongs between ``x`` and the first
    ``x.size``, and the Gram matrix ``A`` and the polynomial ``B = a I + b A + c A^2`` take
    one ``m x m`` block each per matrix, so one GEMM applies a step: ``X <- B X``, torch's
    ``a X + (b A + c A^2) X`` associated differently (one GEMM and no ``m x n`` pass fewer).
    A tall matrix (more rows than columns) is iterated as its transpose without a copy:
    ``A = x^T x``, ``x <- x B^T``. The math is in ``x``'s dtype (float32 GEMMs for float32
    parameters, where torch.optim.Muon iterates in bfloat16). ``xp``: NumPy, or CuPy for
    device arrays.
    """
    rows, cols = x.shape[-2:]
    lead = x.shape[:-2]
    k = x.size // (rows * cols) if x.size else 0
    t = x.dtype.type
    a, b, c = (t(v) for v in ns_coefficients)
    tall, m, n = rows > cols, min(rows, cols), x.size
    nxt = work[:n].reshape(x.shape)
    gram = work[n : n + k * m * m].reshape(*lead, m, m)
    poly = work[n + k * m * m : n + 2 * k * m * m].reshape(*lead, m, m)
    diagonal = poly.reshape(k, m * m)[:, :: m + 1]
    cur = x
    for _ in range(ns_steps):
        if tall:
            xp.matmul(cur.swapaxes(-1, -2), cur, out=gram)
        else:
            xp.matmul(cur, cur.swapaxes(-1, -2), out=gram)
        xp.matmul(gram, gram, out=poly)
        poly *= c
        gram *= b
        poly += gram
        diagonal += a
        if tall:
            xp.matmul(cur, poly.swapaxes(-1, -2), out=nxt)
        else:
            xp.matmul(poly, cur, out=nxt)
        cur, nxt = nxt, cur
    return cur
