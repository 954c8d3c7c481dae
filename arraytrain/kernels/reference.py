"""Reference kernels: slow, obviously correct NumPy, the oracle of the tests.

Same names and signatures as :mod:`arraytrain.kernels.cpu`. Every function
works on 1-D arrays and trusts its inputs (the public layer validates). The
math is done in float64 and rounded once to the storage dtype, so the fast
kernels are compared against the most accurate value of the same formula.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..backend import LP_BF16, LP_F16, LP_NONE  # noqa: F401  (re-exported)

_LP_DTYPES = {LP_BF16: np.dtype(ml_dtypes.bfloat16), LP_F16: np.dtype(np.float16)}


def _f64(x):
    """float64 values of a float array, or of a uint16 array of bfloat16 bits."""
    x = np.asarray(x)
    if x.dtype == np.uint16:
        return x.view(ml_dtypes.bfloat16).astype(np.float64)
    return x.astype(np.float64)


def _store(dst, values):
    """Round ``values`` once to ``dst``'s storage (bfloat16 bits for uint16) and return what was stored."""
    if dst.dtype == np.uint16:
        # float64 -> float32 -> bfloat16: the fast kernels do float32 math, so their
        # input to the bfloat16 rounding is a float32
        dst[...] = np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    else:
        dst[...] = values
    return _f64(dst)


def _segments(pieces, n):
    """Segment index of every element covered by ``pieces`` (and the covered positions)."""
    idx = np.concatenate([np.arange(a, b) for a, b, _ in pieces]) if len(pieces) else np.zeros(0, np.int64)
    seg = np.concatenate([np.full(b - a, s) for a, b, s in pieces]) if len(pieces) else np.zeros(0, np.int64)
    return idx.astype(np.int64), seg.astype(np.int64)


def cast_working(w, p, pieces, kind):
    """``w = lowp(p)``: a low-precision working copy (uint16 bits) of float32 params."""
    idx, _ = _segments(pieces, p.size)
    w[idx] = np.asarray(p[idx], np.float32).astype(_LP_DTYPES[kind]).view(np.uint16)


def accumulate(acc, g, w, overwrite):
    """``acc = w * g`` if ``overwrite`` else ``acc += w * g``."""
    new = w * _f64(g) if overwrite else _f64(acc) + w * _f64(g)
    acc[...] = new


def scale(x, s):
    """``x *= s``."""
    x[...] = _f64(x) * s


def all_finite(x):
    """True when no element is NaN or +-Inf."""
    return bool(np.isfinite(x).all())


def sumsq(x, pieces, nseg):
    """``(total, per_segment)`` sums of squares over the pieces, in float64.

    Padding outside the pieces is not read. A NaN/Inf element makes the
    total non-finite; so may an overflow of huge float64 values.
    """
    per_seg = np.zeros(nseg, dtype=np.float64)
    for start, stop, seg in pieces:
        part = _f64(x[start:stop])
        per_seg[seg] += float(np.dot(part, part))
    return float(per_seg.sum()), per_seg


def max_abs(x, pieces):
    """Largest |element| over the pieces, for finite input (rescales a norm that overflowed)."""
    best = 0.0
    for start, stop, _ in pieces:
        if stop > start:
            best = max(best, float(np.max(np.abs(_f64(x[start:stop])))))
    return best


def sumsq_scaled(x, pieces, nseg, inv):
    """Like :func:`sumsq` but of ``x * inv``: an overflow-safe second pass."""
    per_seg = np.zeros(nseg, dtype=np.float64)
    for start, stop, seg in pieces:
        part = _f64(x[start:stop]) * inv
        per_seg[seg] += float(np.dot(part, part))
    return float(per_seg.sum()), per_seg


def sgd_step(p, g, buf, pieces, gscale, lr, weight_decay, momentum, dampening, nesterov, first, w, wkind, zero_grad):
    """SGD with momentum, dampening, Nesterov and L2 weight decay (torch.optim.SGD).

    Per element of segment ``s``: ``d = gscale*g + weight_decay[s]*p``; with momentum
    ``b = d`` on the first step, else ``b = momentum*b + (1 - dampening)*d``;
    ``d = d + momentum*b`` (Nesterov) or ``d = b``; then ``p -= lr[s]*d``. ``buf`` is
    ignored when momentum is 0. Only the elements covered by ``pieces`` are touched.
    ``w`` (uint16, or None): low-precision working copy of the new ``p`` (``wkind``).
    """
    i, s = _segments(pieces, p.size)
    lr, wd = np.asarray(lr, np.float64)[s], np.asarray(weight_decay, np.float64)[s]
    pp = _f64(p[i])
    d = gscale * _f64(g[i]) + wd * pp
    if momentum != 0.0:
        b = d if first else momentum * _f64(buf[i]) + (1.0 - dampening) * d
        d = d + momentum * b if nesterov else b
        buf[i] = b
    p[i] = pp - lr * d
    _finish(p, g, w, wkind, pieces, i, zero_grad)


def _finish(p, g, w, wkind, pieces, i, zero_grad):
    if w is not None:
        cast_working(w, p, pieces, wkind)
    if zero_grad:
        g[i] = 0


def adam_step(p, g, m, v, vmax, pieces, gscale, step_size, beta1, beta2, eps, bc2_sqrt, l2, decay, amsgrad,
              w, wkind, zero_grad):
    """Adam / AdamW (Kingma & Ba 2015; Loshchilov & Hutter 2019), torch's form.

    Per element of segment ``s``: ``d = gscale*g + l2[s]*p``; ``p *= decay[s]``
    (decoupled: ``1 - lr*wd``); ``m += (1 - beta1)*(d - m)``; ``v = beta2*v + (1 - beta2)*d^2``;
    AMSGrad: ``vmax = max(vmax, v)`` replaces ``v`` below;
    ``p -= step_size[s] * m / (sqrt(v)/bc2_sqrt + eps)`` with ``step_size = lr/(1 - beta1^t)``
    and ``bc2_sqrt = sqrt(1 - beta2^t)``. ``m``, ``v``, ``vmax`` may be uint16 arrays of
    bfloat16 bits (low-precision state): the update then continues from the rounded values.
    """
    i, s = _segments(pieces, p.size)
    pp = _f64(p[i])
    d = gscale * _f64(g[i]) + np.asarray(l2, np.float64)[s] * pp
    mm = _f64(m[i])
    mm = _store_at(m, i, mm + (1.0 - beta1) * (d - mm))
    vv = _store_at(v, i, beta2 * _f64(v[i]) + (1.0 - beta2) * d * d)
    if amsgrad:
        vv = _store_at(vmax, i, np.maximum(_f64(vmax[i]), vv))
    denom = np.sqrt(vv) / bc2_sqrt + eps
    p[i] = pp * np.asarray(decay, np.float64)[s] - np.asarray(step_size, np.float64)[s] * mm / denom
    _finish(p, g, w, wkind, pieces, i, zero_grad)


def _store_at(dst, i, values):
    """``dst[i] = values`` rounded to the storage; returns the stored values as float64."""
    out = np.empty(len(i), dst.dtype)
    stored = _store(out, values)
    dst[i] = out
    return stored
