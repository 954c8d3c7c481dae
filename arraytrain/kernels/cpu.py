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
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from ..backend import LP_BF16, LP_F16, LP_NONE  # noqa: F401  (kinds of working copies)
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


# -- low-precision storage ----------------------------------------------------------------
#
# numba cannot read float16 (and NumPy has no bfloat16), so low-precision arrays reach the
# kernels as uint16 bit patterns: bfloat16 state slots, and bfloat16/float16 working copies of
# the weights. Math is float32; conversions are bit-exact round-to-nearest-even, the same
# rounding as ml_dtypes/NumPy casts (the reference kernels use those casts).



@intrinsic
def _u32_as_f32(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return types.float32(types.uint32), codegen


@intrinsic
def _f32_as_u32(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return types.uint32(types.float32), codegen


@njit(inline="always", **JIT)
def bf16_decode(h):
    return _u32_as_f32(np.uint32(h) << np.uint32(16))


@njit(inline="always", **JIT)
def bf16_encode(x):
    u = _f32_as_u32(np.float32(x))
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet = (u >> np.uint32(16)) | np.uint32(0x40)  # NaN stays a quiet NaN (a select, not a branch)
    return np.uint16(quiet if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else rounded)


@njit(inline="always", **JIT)
def f16_encode(x):
    # NumPy's npy_floatbits_to_halfbits: round to nearest even, overflow to +-inf,
    # gradual underflow through the subnormals.
    f = _f32_as_u32(np.float32(x))
    sgn = (f & np.uint32(0x80000000)) >> np.uint32(16)
    fexp = f & np.uint32(0x7F800000)
    if fexp >= np.uint32(0x47800000):
        if fexp == np.uint32(0x7F800000) and (f & np.uint32(0x007FFFFF)) != 0:
            sig = np.uint32(0x7C00) + ((f & np.uint32(0x007FFFFF)) >> np.uint32(13))
            if sig == np.uint32(0x7C00):
                sig += np.uint32(1)
            return np.uint16(sgn + sig)
        return np.uint16(sgn + np.uint32(0x7C00))
    if fexp <= np.uint32(0x38000000):
        if fexp < np.uint32(0x33000000):
            return np.uint16(sgn)
        e = fexp >> np.uint32(23)
        sig = (np.uint32(0x00800000) + (f & np.uint32(0x007FFFFF))) >> (np.uint32(113) - e)
        if (sig & np.uint32(0x3FFF)) != np.uint32(0x1000) or (f & np.uint32(0x7FF)) != 0:
            sig += np.uint32(0x1000)
        return np.uint16(sgn + (sig >> np.uint32(13)))
    hexp = (fexp - np.uint32(0x38000000)) >> np.uint32(13)
    sig = f & np.uint32(0x007FFFFF)
    if (sig & np.uint32(0x3FFF)) != np.uint32(0x1000):
        sig += np.uint32(0x1000)
    return np.uint16(sgn + (sig >> np.uint32(13)) + hexp)


@njit(inline="always", **JIT)
def store_working(wb, pb, kind):
    """``wb = lowp(pb)`` for one piece (``kind``: LP_BF16 or LP_F16).

    Optimizer kernels call it right after updating a piece, while it is still in cache:
    a separate loop keeps the update loop free of the conversion's branches.
    """
    if kind == 1:
        for i in range(pb.size):
            wb[i] = bf16_encode(pb[i])
    elif kind == 2:
        for i in range(pb.size):
            wb[i] = f16_encode(pb[i])


def _cast_working(w, p, pieces, kind):
    for j in prange(pieces.shape[0]):
        lo, hi = pieces[j, 0], pieces[j, 1]
        store_working(w[lo:hi], p[lo:hi], kind)


_CAST_WORKING = _twins(_cast_working)


def cast_working(w, p, pieces, kind):
    """``w = lowp(p)``: (re)build a low-precision working copy (uint16 bits) from float32 params."""
    _pick(_CAST_WORKING, p.size)(w, p, pieces, int(kind))


# -- optimizers -------------------------------------------------------------------------
#
# Convention shared by every optimizer kernel (and by its reference twin):
#   * the loop runs over ``pieces`` (rows ``[start, stop, segment]`` of the Layout), so a
#     piece belongs to one parameter and per-parameter hyperparameters arrive as arrays
#     indexed by segment (``lr[seg]``, ``wd[seg]`` ...): name-pattern overrides cost one
#     load per piece, not a launch per group. Padding is never touched.
#   * ``gscale`` multiplies the gradient (clip factor, accumulation mean, loss-scale unscale).
#   * ``w``/``wkind``: a low-precision working copy (uint16 bits, ``wkind`` LP_BF16 or
#     LP_F16) of the new weights, written per piece while it is in cache; ``w=None`` when
#     there is none, which numba prunes at compile time (an always-false runtime flag
#     measured 1.5x slower: the dead conversion code spoiled the update loop).
#   * ``zero_grad`` zeroes the gradient in the same pass.


def _sgd(p, g, buf, pieces, gscale, lr, wd, momentum, damp_c, nesterov, first, w, wkind, zero_grad):
    has_buf = momentum != 0
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        lr_j, wd_j = lr[seg], wd[seg]
        pb, gb = p[lo:hi], g[lo:hi]
        bb = buf[lo:hi] if has_buf else buf
        for i in range(pb.size):
            pi = pb[i]
            d = gscale * gb[i] + wd_j * pi
            if has_buf:
                bi = d if first else momentum * bb[i] + damp_c * d
                bb[i] = bi
                d = d + momentum * bi if nesterov else bi
            pb[i] = pi - lr_j * d
            if zero_grad:
                gb[i] = 0
        if w is not None:
            store_working(w[lo:hi], pb, wkind)


_SGD = _twins(_sgd)


def seg_array(a, dtype):
    """A per-segment hyperparameter as a contiguous array of the storage dtype."""
    return np.ascontiguousarray(a, dtype=dtype)


def sgd_step(p, g, buf, pieces, gscale, lr, weight_decay, momentum, dampening, nesterov, first, w, wkind, zero_grad):
    """Fused SGD update; see :func:`arraytrain.kernels.reference.sgd_step`."""
    t = p.dtype.type
    _pick(_SGD, p.size)(
        p, g, buf, pieces, t(gscale), seg_array(lr, p.dtype), seg_array(weight_decay, p.dtype), t(momentum),
        t(1.0 - dampening), bool(nesterov), bool(first), w, int(wkind), bool(zero_grad),
    )


def load_state(a, i):
    """Read a state element: float storage as is, uint16 storage as bfloat16 bits."""
    raise NotImplementedError("only callable from jitted code")


def store_state(a, i, x):
    """Write a state element and return the value as stored (rounded for bfloat16 storage).

    Returning the value (rather than reading it back) keeps the loop free of
    store-then-load pairs that would stop LLVM from vectorising it.
    """
    raise NotImplementedError("only callable from jitted code")


# Compile-time dispatch on the storage type: each kernel specialises per state dtype.
@overload(load_state, inline="always", jit_options=JIT)
def _load_state(a, i):
    if a.dtype == types.uint16:
        return lambda a, i: bf16_decode(a[i])
    return lambda a, i: a[i]


@overload(store_state, inline="always", jit_options=JIT)
def _store_state(a, i, x):
    if a.dtype == types.uint16:
        def impl(a, i, x):
            h = bf16_encode(x)
            a[i] = h
            return bf16_decode(h)
    else:
        def impl(a, i, x):
            a[i] = x
            return x
    return impl


def _adam(p, g, m, v, vmax, pieces, gscale, step_size, beta1c, beta2, beta2c, eps, inv_bc2, l2, decay,
          amsgrad, w, wkind, zero_grad):
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        ss, l2_j, dec = step_size[seg], l2[seg], decay[seg]
        pb, gb, mb, vb = p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi]
        xb = vmax[lo:hi] if amsgrad else vmax
        for i in range(pb.size):
            pi = pb[i]
            d = gscale * gb[i] + l2_j * pi
            mi = load_state(mb, i)
            mi = mi + beta1c * (d - mi)
            vi = beta2 * load_state(vb, i) + beta2c * d * d
            # continue from the stored values, so a low-precision state is what the update sees
            mi = store_state(mb, i, mi)
            vi = store_state(vb, i, vi)
            if amsgrad:
                vi = store_state(xb, i, max(load_state(xb, i), vi))
            pb[i] = pi * dec - ss * mi / (np.sqrt(vi) * inv_bc2 + eps)
            if zero_grad:
                gb[i] = 0
        if w is not None:
            store_working(w[lo:hi], pb, wkind)


_ADAM = _twins(_adam)


def adam_step(p, g, m, v, vmax, pieces, gscale, step_size, beta1, beta2, eps, bc2_sqrt, l2, decay, amsgrad,
              w, wkind, zero_grad):
    """Fused Adam/AdamW update; see :func:`arraytrain.kernels.reference.adam_step`."""
    t = p.dtype.type
    _pick(_ADAM, p.size)(
        p, g, m, v, vmax, pieces, t(gscale), seg_array(step_size, p.dtype), t(1.0 - beta1), t(beta2),
        t(1.0 - beta2), t(eps), t(1.0 / bc2_sqrt), seg_array(l2, p.dtype), seg_array(decay, p.dtype),
        bool(amsgrad), w, int(wkind), bool(zero_grad),
    )
