r"""Trend kernels for gradient prediction, numba-jitted: the same names and signatures
as :mod:`arraytrain.kernels.reference.trend`.

A prediction is :math:`\hat g_i = \sum_k c_k h_{k,i} + r_i` over an ``(H, n)``
ring ``h`` of recorded gradients, with host-computed least-squares weights
``c`` (float64) and the correction ``r``. One pass over the flat buffer in
blocks of ``BLOCK`` elements (``prange`` over blocks, serial twin below
``SERIAL_BELOW`` elements, as every kernel in :mod:`.cpu`).

Accumulation dtype: the weights of an extrapolated line have mixed signs and
magnitudes above 1 (evaluating the line ahead of the last record), so the
weighted sum cancels; it is accumulated in float64 per block (a block-sized
float64 scratch, one slot at a time so the inner loop stays a contiguous,
vectorisable axpy) and rounded once to the storage dtype. The correction
update ``g - trend`` is a cancellation too and is formed from the float64
trend. The ring is passed flat (``H * n``) so every slot slice is a
contiguous 1-D array.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._jit import BLOCK, JIT, pick, twins


@njit(inline="always", **JIT)
def _trend(hist, n, c, lo, hi):
    """``sum_k c[k] * hist[k, lo:hi]`` in float64 (slots with a zero weight are skipped)."""
    acc = np.zeros(hi - lo, dtype=np.float64)
    for k in range(c.size):
        ck = c[k]
        if ck != 0.0:
            hk = hist[k * n + lo : k * n + hi]
            for i in range(acc.size):
                acc[i] += ck * np.float64(hk[i])
    return acc


def _predict(hist, n, c, corr, out):
    for b in prange((n + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        hi = min(lo + BLOCK, n)
        acc = _trend(hist, n, c, lo, hi)
        ob, rb = out[lo:hi], corr[lo:hi]
        for i in range(acc.size):
            ob[i] = acc[i] + np.float64(rb[i])


_PREDICT = twins(_predict)


def trend_predict(hist, c, corr, out):
    """``out = sum_k c[k] * hist[k] + corr``; see :func:`arraytrain.kernels.reference.trend.trend_predict`."""
    n = out.size
    pick(_PREDICT, n)(hist.reshape(-1), n, np.ascontiguousarray(c, dtype=np.float64), corr, out)


def _correct(hist, n, c, corr, g, slot, beta, beta_c):
    for b in prange((n + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        hi = min(lo + BLOCK, n)
        acc = _trend(hist, n, c, lo, hi)
        # the trend is complete for this block before its slot is overwritten
        rb, gb, sb = corr[lo:hi], g[lo:hi], hist[slot * n + lo : slot * n + hi]
        for i in range(acc.size):
            gi = gb[i]
            rb[i] = beta * np.float64(rb[i]) + beta_c * (np.float64(gi) - acc[i])
            sb[i] = gi


_CORRECT = twins(_correct)


def trend_correct(hist, c, corr, g, *, slot, beta):
    """Correction update fused with recording ``g``; see :func:`arraytrain.kernels.reference.trend.trend_correct`."""
    n = g.size
    beta = float(beta)
    pick(_CORRECT, n)(hist.reshape(-1), n, np.ascontiguousarray(c, dtype=np.float64), corr, g, int(slot),
                       beta, 1.0 - beta)
