"""CPU reductions and element-wise passes: accumulate, scale, the norm pass's sums, working copies.

Sums of squares are accumulated in float64 per fixed piece and the pieces added in order:
the bits do not depend on the number of threads.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._jit import BLOCK, JIT, pick, twins
from .codecs import grad_slice, store_working

# -- accumulate / scale ----------------------------------------------------------------


@njit(inline="always", **JIT)
def _write_scaled(ab, gb, w, overwrite):
    """``ab = w * gb`` or ``ab += w * gb`` over one block (shared by both accumulate kernels: same bits)."""
    if overwrite:
        for i in range(ab.size):
            ab[i] = w * gb[i]
    else:
        for i in range(ab.size):
            ab[i] += w * gb[i]


def _accumulate(acc, g, w, overwrite):
    n = acc.size
    for b in prange((n + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        hi = min(lo + BLOCK, n)
        _write_scaled(acc[lo:hi], g[lo:hi], w, overwrite)


_ACCUMULATE = twins(_accumulate)


def accumulate(acc, g, *, w, overwrite):
    """``acc = w * g`` if ``overwrite`` else ``acc += w * g`` (math in ``acc``'s dtype)."""
    pick(_ACCUMULATE, acc.size)(acc, g, acc.dtype.type(w), bool(overwrite))


def _accumulate_packed(acc, src, table, w, overwrite):
    for t in prange(table.shape[0]):
        s, d, n = table[t, 0], table[t, 1], table[t, 2]
        _write_scaled(acc[d : d + n], src[s : s + n], w, overwrite)


_ACCUMULATE_PACKED = twins(_accumulate_packed)


def accumulate_packed(acc, src, table, *, w, overwrite):
    """``acc[d:d+n] = w * src[s:s+n]`` (or ``+=``) for each row ``(s, d, n)`` of the int64 ``table``.

    Many small gradients packed back to back (the engine's dict path stages them with one
    ``np.concatenate``) written in one call; the arithmetic is :func:`accumulate`'s, so the
    bits are those of writing each gradient directly. Rows must not overlap in ``acc``.
    """
    if table.shape[0]:
        pick(_ACCUMULATE_PACKED, src.size)(acc, src, table, acc.dtype.type(w), bool(overwrite))


def _scale(x, s):
    n = x.size
    for b in prange((n + BLOCK - 1) // BLOCK):
        xb = x[b * BLOCK : min(b * BLOCK + BLOCK, n)]
        for i in range(xb.size):
            xb[i] *= s


_SCALE = twins(_scale)


def scale(x, *, factor):
    """``x *= factor``."""
    pick(_SCALE, x.size)(x, x.dtype.type(factor))


# -- reductions -------------------------------------------------------------------------


@njit(inline="always", **JIT)
def piece_totals(part, pieces, nseg):
    """``(total, per_segment)`` of per-piece float64 partial sums, added in piece order.

    The order is fixed, so the bits do not depend on how many threads formed the partials.
    """
    per_seg = np.zeros(nseg, dtype=np.float64)
    total = 0.0
    for j in range(part.size):
        per_seg[pieces[j, 2]] += part[j]
        total += part[j]
    return total, per_seg


def _all_finite(x):
    n = x.size
    nb = (n + BLOCK - 1) // BLOCK
    ok = np.zeros(nb, dtype=np.int64)
    for b in prange(nb):
        xb = x[b * BLOCK : min(b * BLOCK + BLOCK, n)]
        c = 0
        for i in range(xb.size):
            # an explicit comparison: false for NaN and +-Inf, never folded away
            c += abs(np.float64(xb[i])) <= 1.7976931348623157e308
        ok[b] = c
    return ok.sum() == n


_ALL_FINITE = twins(_all_finite)


def all_finite(x):
    """True when no element is NaN or +-Inf."""
    return bool(pick(_ALL_FINITE, x.size)(x))


def _sumsq(x, pieces, gp, nseg):
    npieces = pieces.shape[0]
    part = np.empty(npieces, dtype=np.float64)
    for j in prange(npieces):
        xb = grad_slice(x, gp, j, pieces[j, 0], pieces[j, 0], pieces[j, 1])
        s = 0.0
        for i in range(xb.size):
            xi = np.float64(xb[i])
            s += xi * xi
        part[j] = s
    return piece_totals(part, pieces, nseg)


_SUMSQ = twins(_sumsq)
#: The sum of squares' (parallel, serial) twins, which :func:`~arraytrain.kernels.cpu.optimizers.adam_checked`
#: calls inside its one compiled call.
SUMSQ_TWINS = _SUMSQ


def sumsq(x, pieces, *, nseg, grad_ptrs=None):
    """``(total, per_segment)`` sums of squares in float64, one pass.

    A NaN or Inf element makes the total non-finite (squares are >= 0, so no
    cancellation can hide it). For float16/float32 storage a non-finite total
    can only come from such an element; for float64 it may also be an
    overflow of finite values, which the caller resolves.
    """
    total, per_seg = pick(_SUMSQ, x.size)(x, pieces, grad_ptrs, nseg)
    return float(total), per_seg


def _max_abs(x, pieces, gp):
    npieces = pieces.shape[0]
    part = np.zeros(npieces, dtype=np.float64)
    for j in prange(npieces):
        xb = grad_slice(x, gp, j, pieces[j, 0], pieces[j, 0], pieces[j, 1])
        best = 0.0
        for i in range(xb.size):
            best = max(best, abs(np.float64(xb[i])))
        part[j] = best
    best = 0.0
    for j in range(npieces):
        best = max(best, part[j])
    return best


_MAX_ABS = twins(_max_abs)


def max_abs(x, pieces, *, grad_ptrs=None):
    """Largest |element| over the pieces, for finite input (rescales a norm that overflowed)."""
    return float(pick(_MAX_ABS, x.size)(x, pieces, grad_ptrs))


def _sumsq_scaled(x, pieces, gp, nseg, inv):
    npieces = pieces.shape[0]
    part = np.empty(npieces, dtype=np.float64)
    for j in prange(npieces):
        xb = grad_slice(x, gp, j, pieces[j, 0], pieces[j, 0], pieces[j, 1])
        s = 0.0
        for i in range(xb.size):
            xi = np.float64(xb[i]) * inv
            s += xi * xi
        part[j] = s
    return piece_totals(part, pieces, nseg)


_SUMSQ_SCALED = twins(_sumsq_scaled)


def sumsq_scaled(x, pieces, *, nseg, inv, grad_ptrs=None):
    """Like :func:`sumsq` but of ``x * inv``: an overflow-safe second pass."""
    total, per_seg = pick(_SUMSQ_SCALED, x.size)(x, pieces, grad_ptrs, nseg, float(inv))
    return float(total), per_seg


def _cast_working(w, p, pieces, kind):
    for j in prange(pieces.shape[0]):
        lo, hi = pieces[j, 0], pieces[j, 1]
        store_working(w[lo:hi], p[lo:hi], kind)


_CAST_WORKING = twins(_cast_working)


def cast_working(w, p, pieces, *, kind):
    """``w = lowp(p)``: (re)build a low-precision working copy (uint16 bits) from float32 params.

    Packed on AVX2 (F16C's vcvtps2ph for float16) and on AVX-512, see codecs.store_working.
    """
    pick(_CAST_WORKING, p.size)(w, p, pieces, int(kind))


def _sumsq_product(x, y, pieces, nseg):
    npieces = pieces.shape[0]
    part = np.empty(npieces, dtype=np.float64)
    for j in prange(npieces):
        lo, hi = pieces[j, 0], pieces[j, 1]
        xb, yb = x[lo:hi], y[lo:hi]
        s = 0.0
        for i in range(xb.size):
            v = np.float64(xb[i]) * np.float64(yb[i])
            s += v * v
        part[j] = s
    return piece_totals(part, pieces, nseg)


_SUMSQ_PRODUCT = twins(_sumsq_product)


def sumsq_product(x, y, pieces, *, nseg):
    """``(total, per_segment)`` float64 sums of ``(x*y)^2`` over the pieces (ASAM's norm), one pass."""
    total, per_seg = pick(_SUMSQ_PRODUCT, x.size)(x, y, pieces, nseg)
    return float(total), per_seg
