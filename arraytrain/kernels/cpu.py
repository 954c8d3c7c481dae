"""CPU kernels, numba-jitted: the same names and signatures as ``reference``.

Every kernel is one pass over a flat 1-D buffer, split into fixed blocks of
``BLOCK`` elements that numba's ``prange`` hands to its threads. Buffers up to
``SERIAL_BELOW`` elements run a serial twin of the same code: a parallel launch
costs more than it saves there, and a small step leaves the cores to BLAS.

Loop shape: each block works on slices (``pb = p[lo:hi]``) indexed from 0,
so numba can drop its negative-index wraparound check and LLVM vectorises
the inner loop (sqrt and division included).

Floating-point rules: ``fastmath`` is restricted to flags that keep NaN/Inf
semantics (no ``nnan``/``ninf``), so non-finite detection stays exact. Scalars
arrive already cast to the storage dtype by the caller, so float32 buffers get
float32 math (8 lanes per AVX2 vector) and float64 buffers float64 math.
Sums of squares are accumulated in float64 per fixed piece and the pieces
added in order: the bits do not depend on the number of threads.

Kernels compile lazily on first call (``cache=True`` keeps the machine code on
disk for later processes); importing this module compiles nothing.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..threads import start_numba_threads

FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}
# error_model="numpy": IEEE division (x/0 -> inf) instead of Python's
# ZeroDivisionError check, whose branch stops LLVM from vectorising the loops.
JIT = dict(fastmath=FASTMATH, error_model="numpy", cache=True)
BLOCK = 1 << 14
SERIAL_BELOW = 1 << 16


def _twins(fn):
    """Compile ``fn`` twice: parallel (prange over blocks) and serial.

    Both dispatchers share the Python source; the serial one treats ``prange``
    as ``range``. ``fn.__qualname__`` differs per twin so their on-disk caches
    do not collide.
    """
    par = njit(parallel=True, **JIT)(fn)
    ser_fn = type(fn)(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__, fn.__closure__)
    ser_fn.__qualname__ = fn.__qualname__ + "_serial"
    ser = njit(parallel=False, **JIT)(ser_fn)
    return par, ser


def _pick(pair, n):
    if n < SERIAL_BELOW:
        return pair[1]
    start_numba_threads()  # idempotent: numba's pool starts under arraytrain's policy (arraytrain.threads)
    return pair[0]


# -- accumulate / scale ----------------------------------------------------------------


def _accumulate(acc, g, w, overwrite):
    n = acc.size
    for b in prange((n + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        hi = min(lo + BLOCK, n)
        ab, gb = acc[lo:hi], g[lo:hi]
        if overwrite:
            for i in range(ab.size):
                ab[i] = w * gb[i]
        else:
            for i in range(ab.size):
                ab[i] += w * gb[i]


_ACCUMULATE = _twins(_accumulate)


def accumulate(acc, g, w, overwrite):
    """``acc = w * g`` if ``overwrite`` else ``acc += w * g`` (math in ``acc``'s dtype)."""
    _pick(_ACCUMULATE, acc.size)(acc, g, acc.dtype.type(w), bool(overwrite))


def _scale(x, s):
    n = x.size
    for b in prange((n + BLOCK - 1) // BLOCK):
        xb = x[b * BLOCK : min(b * BLOCK + BLOCK, n)]
        for i in range(xb.size):
            xb[i] *= s


_SCALE = _twins(_scale)


def scale(x, s):
    """``x *= s``."""
    _pick(_SCALE, x.size)(x, x.dtype.type(s))


# -- reductions -------------------------------------------------------------------------


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


_ALL_FINITE = _twins(_all_finite)


def all_finite(x):
    """True when no element is NaN or +-Inf."""
    return bool(_pick(_ALL_FINITE, x.size)(x))


def _sumsq(x, pieces, nseg):
    npieces = pieces.shape[0]
    part = np.empty(npieces, dtype=np.float64)
    for j in prange(npieces):
        xb = x[pieces[j, 0] : pieces[j, 1]]
        s = 0.0
        for i in range(xb.size):
            xi = np.float64(xb[i])
            s += xi * xi
        part[j] = s
    per_seg = np.zeros(nseg, dtype=np.float64)
    total = 0.0
    for j in range(npieces):  # fixed order: thread-count independent
        per_seg[pieces[j, 2]] += part[j]
        total += part[j]
    return total, per_seg


_SUMSQ = _twins(_sumsq)


def sumsq(x, pieces, nseg):
    """``(total, per_segment)`` sums of squares in float64, one pass.

    A NaN or Inf element makes the total non-finite (squares are >= 0, so no
    cancellation can hide it). For float16/float32 storage a non-finite total
    can only come from such an element; for float64 it may also be an
    overflow of finite values, which the caller resolves.
    """
    total, per_seg = _pick(_SUMSQ, x.size)(x, pieces, nseg)
    return float(total), per_seg


def _max_abs(x, pieces):
    npieces = pieces.shape[0]
    part = np.zeros(npieces, dtype=np.float64)
    for j in prange(npieces):
        xb = x[pieces[j, 0] : pieces[j, 1]]
        best = 0.0
        for i in range(xb.size):
            best = max(best, abs(np.float64(xb[i])))
        part[j] = best
    best = 0.0
    for j in range(npieces):
        best = max(best, part[j])
    return best


_MAX_ABS = _twins(_max_abs)


def max_abs(x, pieces):
    """Largest |element| over the pieces, for finite input (rescales a norm that overflowed)."""
    return float(_pick(_MAX_ABS, x.size)(x, pieces))


def _sumsq_scaled(x, pieces, nseg, inv):
    npieces = pieces.shape[0]
    part = np.empty(npieces, dtype=np.float64)
    for j in prange(npieces):
        xb = x[pieces[j, 0] : pieces[j, 1]]
        s = 0.0
        for i in range(xb.size):
            xi = np.float64(xb[i]) * inv
            s += xi * xi
        part[j] = s
    per_seg = np.zeros(nseg, dtype=np.float64)
    total = 0.0
    for j in range(npieces):
        per_seg[pieces[j, 2]] += part[j]
        total += part[j]
    return total, per_seg


_SUMSQ_SCALED = _twins(_sumsq_scaled)


def sumsq_scaled(x, pieces, nseg, inv):
    """Like :func:`sumsq` but of ``x * inv``: an overflow-safe second pass."""
    total, per_seg = _pick(_SUMSQ_SCALED, x.size)(x, pieces, nseg, float(inv))
    return float(total), per_seg


# -- optimizers -------------------------------------------------------------------------


def _sgd(p, g, buf, gscale, lr, wd, momentum, damp_c, nesterov, first, zero_grad):
    n = p.size
    has_buf = momentum != 0
    for b in prange((n + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        hi = min(lo + BLOCK, n)
        pb, gb = p[lo:hi], g[lo:hi]
        bb = buf[lo:hi] if has_buf else buf
        for i in range(pb.size):
            pi = pb[i]
            d = gscale * gb[i] + wd * pi
            if has_buf:
                bi = d if first else momentum * bb[i] + damp_c * d
                bb[i] = bi
                d = d + momentum * bi if nesterov else bi
            pb[i] = pi - lr * d
            if zero_grad:
                gb[i] = 0


_SGD = _twins(_sgd)


def sgd_step(p, g, buf, gscale, lr, weight_decay, momentum, dampening, nesterov, first, zero_grad):
    """Fused SGD update; see :func:`arraytrain.kernels.reference.sgd_step`."""
    t = p.dtype.type
    _pick(_SGD, p.size)(
        p, g, buf, t(gscale), t(lr), t(weight_decay), t(momentum), t(1.0 - dampening),
        bool(nesterov), bool(first), bool(zero_grad),
    )


def _adam(p, g, m, v, vmax, gscale, step_size, beta1c, beta2, beta2c, eps, inv_bc2, l2, decay, amsgrad, zero_grad):
    n = p.size
    for b in prange((n + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        hi = min(lo + BLOCK, n)
        pb, gb, mb, vb = p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi]
        xb = vmax[lo:hi] if amsgrad else vmax
        for i in range(pb.size):
            pi = pb[i]
            d = gscale * gb[i] + l2 * pi
            mi = mb[i]
            mi = mi + beta1c * (d - mi)
            vi = beta2 * vb[i] + beta2c * d * d
            mb[i] = mi
            vb[i] = vi
            if amsgrad:
                vi = max(xb[i], vi)
                xb[i] = vi
            pb[i] = pi * decay - step_size * mi / (np.sqrt(vi) * inv_bc2 + eps)
            if zero_grad:
                gb[i] = 0


_ADAM = _twins(_adam)


def adam_step(p, g, m, v, vmax, gscale, step_size, beta1, beta2, eps, bc2_sqrt, l2, decay, amsgrad, zero_grad):
    """Fused Adam/AdamW update; see :func:`arraytrain.kernels.reference.adam_step`."""
    t = p.dtype.type
    _pick(_ADAM, p.size)(
        p, g, m, v, vmax, t(gscale), t(step_size), t(1.0 - beta1), t(beta2), t(1.0 - beta2),
        t(eps), t(1.0 / bc2_sqrt), t(l2), t(decay), bool(amsgrad), bool(zero_grad),
    )
