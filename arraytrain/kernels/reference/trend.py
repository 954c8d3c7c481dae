r"""Reference trend kernels: slow, obviously correct NumPy, the oracle of :mod:`.trend`.

Same names and signatures as :mod:`arraytrain.kernels.cpu.trend`. The history is an
``(H, n)`` ring of recorded gradients; the host computes the weights ``c`` of
the least-squares line through the recorded steps evaluated at the step to
predict (:func:`arraytrain.phase.predict.trend_weights`), so a prediction is the
weighted sum

.. math::  \hat g_i = \sum_k c_k\, h_{k,i} + r_i

with ``r`` the correction. Math in float64, rounded once to the storage dtype.
"""

from __future__ import annotations

import numpy as np


def _trend(hist, c):
    """``sum_k c[k] * hist[k]`` in float64, slots added in order, slots with ``c[k] == 0`` skipped."""
    acc = np.zeros(hist.shape[1], dtype=np.float64)
    for k in range(hist.shape[0]):
        if c[k] != 0.0:
            acc += float(c[k]) * hist[k].astype(np.float64)
    return acc


def trend_predict(hist, c, corr, out):
    """``out = sum_k c[k] * hist[k] + corr``."""
    out[...] = _trend(hist, c) + corr.astype(np.float64)


def trend_correct(hist, c, corr, g, *, slot, beta):
    r"""Correction update fused with recording ``g`` into ring slot ``slot``.

    ``corr = beta * corr + (1 - beta) * (g - sum_k c[k] * hist[k])``, the trend
    read before ``hist[slot]`` is overwritten with ``g``.
    """
    trend = _trend(hist, c)
    beta = float(beta)
    corr[...] = beta * corr.astype(np.float64) + (1.0 - beta) * (g.astype(np.float64) - trend)
    hist[slot] = g
