"""Reference reductions and element-wise passes (float64 math, one rounding to the storage)."""

from __future__ import annotations

import numpy as np

from ._common import LP_DTYPES, f64, gathered, segments

def accumulate(acc, g, *, w, overwrite):
    """``acc = w * g`` if ``overwrite`` else ``acc += w * g``."""
    new = w * f64(g) if overwrite else f64(acc) + w * f64(g)
    acc[...] = new


def accumulate_packed(acc, src, table, *, w, overwrite):
    """``acc[d:d+n] (=|+=) w * src[s:s+n]`` for each row ``(s, d, n)`` of ``table``: :func:`accumulate` per row."""
    for s, d, n in np.asarray(table, np.int64).reshape(-1, 3):
        if n:
            accumulate(acc[d : d + n], src[s : s + n], w=w, overwrite=overwrite)


def scale(x, *, factor):
    """``x *= factor``."""
    x[...] = f64(x) * factor


def all_finite(x):
    """True when no element is NaN or +-Inf."""
    return bool(np.isfinite(x).all())


def sumsq(x, pieces, *, nseg, grad_ptrs=None):
    """``(total, per_segment)`` sums of squares over the pieces, in float64.

    Padding outside the pieces is not read. A NaN/Inf element makes the
    total non-finite; so may an overflow of huge float64 values.
    """
    x = gathered(x, pieces, grad_ptrs)
    per_seg = np.zeros(nseg, dtype=np.float64)
    for start, stop, seg in pieces:
        part = f64(x[start:stop])
        per_seg[seg] += float(np.dot(part, part))
    return float(per_seg.sum()), per_seg


def max_abs(x, pieces, *, grad_ptrs=None):
    """Largest |element| over the pieces, for finite input (rescales a norm that overflowed)."""
    x = gathered(x, pieces, grad_ptrs)
    best = 0.0
    for start, stop, _ in pieces:
        if stop > start:
            best = max(best, float(np.max(np.abs(f64(x[start:stop])))))
    return best


def sumsq_scaled(x, pieces, *, nseg, inv, grad_ptrs=None):
    """Like :func:`sumsq` but of ``x * inv``: an overflow-safe second pass."""
    x = gathered(x, pieces, grad_ptrs)
    per_seg = np.zeros(nseg, dtype=np.float64)
    for start, stop, seg in pieces:
        part = f64(x[start:stop]) * inv
        per_seg[seg] += float(np.dot(part, part))
    return float(per_seg.sum()), per_seg


def sumsq_product(x, y, pieces, *, nseg):
    """``(total, per_segment)`` float64 sums of ``(x*y)^2`` over the pieces (ASAM's norm)."""
    per_seg = np.zeros(nseg, dtype=np.float64)
    for start, stop, seg in pieces:
        part = f64(x[start:stop]) * f64(y[start:stop])
        per_seg[seg] += float(np.dot(part, part))
    return float(per_seg.sum()), per_seg


def cast_working(w, p, pieces, *, kind):
    """``w = lowp(p)``: a low-precision working copy (uint16 bits) of float32 params."""
    idx, _ = segments(pieces, p.size)
    w[idx] = np.asarray(p[idx], np.float32).astype(LP_DTYPES[kind]).view(np.uint16)
