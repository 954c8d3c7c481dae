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

import warnings

import numpy as np
from numba import njit, prange, types
from numba.core.errors import NumbaIRAssumptionWarning
from numba.extending import intrinsic, overload
from numba.np.numpy_support import as_dtype
from llvmlite import ir

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
    return piece_totals(part, pieces, nseg)


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
    return piece_totals(part, pieces, nseg)


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


# bfloat16 in LLVM IR, 32-bit lanes throughout: written with numba's integer operators, the
# codec's uint32 arithmetic is promoted to 64 bits and the loops vectorise at half width;
# measured on AdamW at 1e7 (one thread), bfloat16 moments went from 1.45x slower than
# float32 moments to 1.2x faster.
@intrinsic
def bf16_decode(typingctx, h):
    """bfloat16 bits (uint16) -> float32: the bits shifted into the high half."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        u = builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16))
        return builder.bitcast(u, ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def bf16_encode(typingctx, x):
    """float32 -> bfloat16 bits, round to nearest even; a NaN stays a quiet NaN (a select, not a branch)."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        c = lambda v: ir.Constant(i32, v)  # noqa: E731
        u = builder.bitcast(args[0], i32)
        hi = builder.lshr(u, c(16))
        rounded = builder.lshr(builder.add(builder.add(u, c(0x7FFF)), builder.and_(hi, c(1))), c(16))
        quiet = builder.or_(hi, c(0x40))
        isnan = builder.icmp_unsigned(">", builder.and_(u, c(0x7FFFFFFF)), c(0x7F800000))
        return builder.trunc(builder.select(isnan, quiet, rounded), ir.IntType(16))

    return types.uint16(types.float32), codegen


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


# -- pruning masks ----------------------------------------------------------------------------


def piece_mask(mask, lo, hi):
    """``mask[lo:hi]``, or None when ``mask`` is None (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


def store_masked(pb, i, x, kb):
    """``pb[i] = x``, or exactly 0 where the piece mask ``kb[i] == 0`` (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


# Resolved when the kernel is typed, as load_state/store_state: with ``mask=None`` both
# vanish and the update loop is the unmasked one, instruction for instruction.
@overload(piece_mask, inline="always", jit_options=JIT)
def _piece_mask(mask, lo, hi):
    if isinstance(mask, types.NoneType):
        return lambda mask, lo, hi: None
    return lambda mask, lo, hi: mask[lo:hi]


@overload(store_masked, inline="always", jit_options=JIT)
def _store_masked(pb, i, x, kb):
    if isinstance(kb, types.NoneType):
        def impl(pb, i, x, kb):
            pb[i] = x
        return impl
    zero = as_dtype(pb.dtype).type(0)

    # not a product: a pruned weight is an exact +0 whatever the update computed (a
    # product keeps NaN and gives -0). The store pair becomes a select, so the loop still
    # vectorises; a ternary here trips numba's SSA self-check (NumbaIRAssumptionWarning)
    # when inlined into Adafactor's loops.
    def impl(pb, i, x, kb):
        pb[i] = x
        if kb[i] == 0:
            pb[i] = zero
    return impl


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
#   * ``mask`` (last argument, default None): a uint8 array of the params' flat size, 1 = keep,
#     0 = pruned. Pruned weights are written as exactly 0 by the update itself
#     (``store_masked(pb, i, new, kb)``, so ``store_working`` sees them), and stay 0 whatever
#     momentum or weight decay say: each step is projected onto the pruned pattern; moments,
#     norms and trust ratios are formed as without a mask. ``piece_mask``/``store_masked`` are
#     resolved at typing time, so ``mask=None`` compiles to the unmasked loop. The select sits
#     in the update loop rather than in a second loop over the piece after it: measured on
#     AdamW at 1e7 float32, the second loop cost 1.5-2x the step (the piece is re-read from
#     L2 after p, g, m, v went through), the select ~1.05x.


def _sgd(p, g, buf, pieces, gscale, lr, wd, momentum, damp_c, nesterov, first, w, wkind, zero_grad, mask):
    has_buf = momentum != 0
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        lr_j, wd_j = lr[seg], wd[seg]
        pb, gb = p[lo:hi], g[lo:hi]
        bb = buf[lo:hi] if has_buf else buf
        kb = piece_mask(mask, lo, hi)
        for i in range(pb.size):
            pi = pb[i]
            d = gscale * gb[i] + wd_j * pi
            if has_buf:
                bi = store_state(bb, i, d if first else momentum * load_state(bb, i) + damp_c * d)
                d = d + momentum * bi if nesterov else bi
            store_masked(pb, i, pi - lr_j * d, kb)
            if zero_grad:
                gb[i] = 0
        if w is not None:
            store_working(w[lo:hi], pb, wkind)


_SGD = _twins(_sgd)


def seg_array(a, dtype):
    """A per-segment hyperparameter as a contiguous array of the storage dtype."""
    return np.ascontiguousarray(a, dtype=dtype)


def sgd_step(p, g, buf, pieces, gscale, lr, weight_decay, momentum, dampening, nesterov, first, w, wkind, zero_grad,
             mask=None):
    """Fused SGD update; see :func:`arraytrain.kernels.reference.sgd_step`."""
    t = p.dtype.type
    _pick(_SGD, p.size)(
        p, g, buf, pieces, t(gscale), seg_array(lr, p.dtype), seg_array(weight_decay, p.dtype), t(momentum),
        t(1.0 - dampening), bool(nesterov), bool(first), w, int(wkind), bool(zero_grad), mask,
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
# Inlined at numba-IR level: as calls, the bfloat16 Adam step measured 2.5-3.5x slower
# (the loop no longer vectorises). Inlining an overload that returns a value trips a
# pedantic SSA self-check in numba 0.68 (NumbaIRAssumptionWarning "... is not in scope");
# the generated code is correct (tests compare it with the reference), so only that
# message, for these two functions, is silenced.
warnings.filterwarnings(
    "ignore", message=r"variable '_(load|store)_state__locals__impl.*' is not in scope",
    category=NumbaIRAssumptionWarning,
)
@overload(load_state, inline="always", jit_options=JIT)
def _load_state(a, i):
    if a.dtype == types.uint16:
        return lambda a, i: bf16_decode(a[i])
    return lambda a, i: a[i]


@overload(store_state, inline="always", jit_options=JIT)
def _store_state(a, i, x):
    if a.dtype == types.uint16:
        def impl(a, i, x):
            h = bf16_encode(np.float32(x))
            a[i] = h
            return bf16_decode(h)
    else:
        def impl(a, i, x):
            a[i] = x
            return x
    return impl


def _adam(p, g, m, v, vmax, pieces, gscale, step_size, beta1c, beta2, beta2c, eps, inv_bc2, l2, decay,
          amsgrad, w, wkind, zero_grad, mask):
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        ss, l2_j, dec = step_size[seg], l2[seg], decay[seg]
        pb, gb, mb, vb = p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi]
        xb = vmax[lo:hi] if amsgrad else vmax
        kb = piece_mask(mask, lo, hi)
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
            store_masked(pb, i, pi * dec - ss * mi / (np.sqrt(vi) * inv_bc2 + eps), kb)
            if zero_grad:
                gb[i] = 0
        if w is not None:
            store_working(w[lo:hi], pb, wkind)


_ADAM = _twins(_adam)


def adam_step(p, g, m, v, vmax, pieces, gscale, step_size, beta1, beta2, eps, bc2_sqrt, l2, decay, amsgrad,
              w, wkind, zero_grad, mask=None):
    """Fused Adam/AdamW update; see :func:`arraytrain.kernels.reference.adam_step`."""
    t = p.dtype.type
    _pick(_ADAM, p.size)(
        p, g, m, v, vmax, pieces, t(gscale), seg_array(step_size, p.dtype), t(1.0 - beta1), t(beta2),
        t(1.0 - beta2), t(eps), t(1.0 / bc2_sqrt), seg_array(l2, p.dtype), seg_array(decay, p.dtype),
        bool(amsgrad), w, int(wkind), bool(zero_grad), mask,
    )


# -- adagrad, rmsprop, lion, lamb ---------------------------------------------------------


def _adagrad(p, g, s, pieces, gscale, clr, wd, eps, w, wkind, zero_grad, mask):
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        clr_j, wd_j = clr[seg], wd[seg]
        pb, gb, sb = p[lo:hi], g[lo:hi], s[lo:hi]
        kb = piece_mask(mask, lo, hi)
        for i in range(pb.size):
            pi = pb[i]
            d = gscale * gb[i] + wd_j * pi
            si = store_state(sb, i, load_state(sb, i) + d * d)
            store_masked(pb, i, pi - clr_j * (d / (np.sqrt(si) + eps)), kb)
            if zero_grad:
                gb[i] = 0
        if w is not None:
            store_working(w[lo:hi], pb, wkind)


_ADAGRAD = _twins(_adagrad)


def adagrad_step(p, g, sum_sq, pieces, gscale, clr, weight_decay, eps, w, wkind, zero_grad, mask=None):
    """Fused Adagrad update; see :func:`arraytrain.kernels.reference.adagrad_step`."""
    t = p.dtype.type
    _pick(_ADAGRAD, p.size)(
        p, g, sum_sq, pieces, t(gscale), seg_array(clr, p.dtype), seg_array(weight_decay, p.dtype), t(eps),
        w, int(wkind), bool(zero_grad), mask,
    )


def _rmsprop(p, g, sq, gavg, buf, pieces, gscale, lr, wd, alpha, alpha_c, eps, momentum, centered, use_momentum,
             w, wkind, zero_grad, mask):
    # one template: ``centered`` and ``use_momentum`` select the variant (the unused
    # slots arrive as empty arrays and are never indexed)
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        lr_j, wd_j = lr[seg], wd[seg]
        pb, gb, qb = p[lo:hi], g[lo:hi], sq[lo:hi]
        ab = gavg[lo:hi] if centered else gavg
        bb = buf[lo:hi] if use_momentum else buf
        kb = piece_mask(mask, lo, hi)
        for i in range(pb.size):
            pi = pb[i]
            d = gscale * gb[i] + wd_j * pi
            qi = store_state(qb, i, alpha * load_state(qb, i) + alpha_c * d * d)
            if centered:
                ai = load_state(ab, i)
                ai = store_state(ab, i, ai + alpha_c * (d - ai))
                qi = qi - ai * ai
            step = d / (np.sqrt(qi) + eps)
            if use_momentum:
                step = store_state(bb, i, momentum * load_state(bb, i) + step)
            store_masked(pb, i, pi - lr_j * step, kb)
            if zero_grad:
                gb[i] = 0
        if w is not None:
            store_working(w[lo:hi], pb, wkind)


_RMSPROP = _twins(_rmsprop)


def rmsprop_step(p, g, square_avg, grad_avg, momentum_buffer, pieces, gscale, lr, weight_decay, alpha, eps,
                 momentum, centered, w, wkind, zero_grad, mask=None):
    """Fused RMSprop update; see :func:`arraytrain.kernels.reference.rmsprop_step`."""
    t = p.dtype.type
    _pick(_RMSPROP, p.size)(
        p, g, square_avg, grad_avg, momentum_buffer, pieces, t(gscale), seg_array(lr, p.dtype),
        seg_array(weight_decay, p.dtype), t(alpha), t(1.0 - alpha), t(eps), t(momentum), bool(centered),
        bool(momentum > 0), w, int(wkind), bool(zero_grad), mask,
    )


def _lion(p, g, m, pieces, gscale, lr, decay, b1, b1c, b2, b2c, w, wkind, zero_grad, mask):
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        lr_j, dec = lr[seg], decay[seg]
        pb, gb, mb = p[lo:hi], g[lo:hi], m[lo:hi]
        kb = piece_mask(mask, lo, hi)
        for i in range(pb.size):
            d = gscale * gb[i]
            mi = load_state(mb, i)
            # np.sign keeps NaN (a NaN gradient is not silently turned into a zero step)
            c = np.sign(b1 * mi + b1c * d)
            store_state(mb, i, b2 * mi + b2c * d)
            store_masked(pb, i, pb[i] * dec - lr_j * c, kb)
            if zero_grad:
                gb[i] = 0
        if w is not None:
            store_working(w[lo:hi], pb, wkind)


_LION = _twins(_lion)


def lion_step(p, g, m, pieces, gscale, lr, weight_decay, b1, b2, w, wkind, zero_grad, mask=None):
    """Fused Lion update; see :func:`arraytrain.kernels.reference.lion_step`."""
    t = p.dtype.type
    lr = np.asarray(lr, np.float64)
    decay = 1.0 - lr * np.asarray(weight_decay, np.float64)
    _pick(_LION, p.size)(
        p, g, m, pieces, t(gscale), seg_array(lr, p.dtype), seg_array(decay, p.dtype), t(b1), t(1.0 - b1),
        t(b2), t(1.0 - b2), w, int(wkind), bool(zero_grad), mask,
    )


def _lamb(p, g, m, v, pieces, gscale, lr, wd, b1c, b2, b2c, inv_bc1, inv_bc2, eps, eps_root, w, wkind,
          zero_grad, mask):
    npieces = pieces.shape[0]
    nseg = lr.size
    psq = np.empty(npieces, dtype=np.float64)
    usq = np.empty(npieces, dtype=np.float64)
    # pass 1: moments, and float64 sums of squares of p and of the update u per piece
    for j in prange(npieces):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        wd_j = wd[seg]
        pb, gb, mb, vb = p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi]
        sp = 0.0
        su = 0.0
        for i in range(pb.size):
            pi = pb[i]
            d = gscale * gb[i]
            mi = load_state(mb, i)
            mi = store_state(mb, i, mi + b1c * (d - mi))
            vi = store_state(vb, i, b2 * load_state(vb, i) + b2c * d * d)
            u = (mi * inv_bc1) / (np.sqrt(vi * inv_bc2 + eps_root) + eps) + wd_j * pi
            p64 = np.float64(pi)
            u64 = np.float64(u)
            sp += p64 * p64
            su += u64 * u64
            if zero_grad:
                gb[i] = 0
        psq[j] = sp
        usq[j] = su
    pn = piece_totals(psq, pieces, nseg)[1]
    un = piece_totals(usq, pieces, nseg)[1]
    ratio = np.ones(nseg, dtype=np.float64)
    step = np.empty_like(lr)
    for s in range(nseg):
        pn_s, un_s = np.sqrt(pn[s]), np.sqrt(un[s])
        if not (pn_s == 0.0 or un_s == 0.0):
            ratio[s] = pn_s / un_s
        step[s] = lr[s] * ratio[s]  # rounded to the storage dtype
    # pass 2: recompute u from the stored moments (p is unchanged so far) and apply it
    for j in prange(npieces):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        wd_j, st = wd[seg], step[seg]
        pb, mb, vb = p[lo:hi], m[lo:hi], v[lo:hi]
        kb = piece_mask(mask, lo, hi)
        for i in range(pb.size):
            pi = pb[i]
            u = (load_state(mb, i) * inv_bc1) / (np.sqrt(load_state(vb, i) * inv_bc2 + eps_root) + eps) + wd_j * pi
            store_masked(pb, i, pi - st * u, kb)
        if w is not None:
            store_working(w[lo:hi], pb, wkind)
    return ratio


_LAMB = _twins(_lamb)


def lamb_step(p, g, m, v, pieces, gscale, lr, weight_decay, beta1, beta2, eps, eps_root, bc1, bc2, w, wkind,
              zero_grad, mask=None):
    """Fused LAMB update, returns the per-parameter trust ratios (float64).

    See :func:`arraytrain.kernels.reference.lamb_step`.
    """
    t = p.dtype.type
    return _pick(_LAMB, p.size)(
        p, g, m, v, pieces, t(gscale), seg_array(lr, p.dtype), seg_array(weight_decay, p.dtype), t(1.0 - beta1),
        t(beta2), t(1.0 - beta2), t(1.0 / bc1), t(1.0 / bc2), t(eps), t(eps_root), w, int(wkind), bool(zero_grad), mask,
    )


# -- adafactor, sophia, sam -------------------------------------------------------------
#
# Adafactor (torch.optim.Adafactor's form). A parameter with >= 2 dims is factored over its
# last two dims (B leading "batch" matrices of R x C); others keep a full second moment.
# Geometry tables (built once per layout by arraytrain.optim._adafactor, int64):
#   segs    (nseg, 9): [p_off, numel, factored, B, R, C, row_off, col_off, var_off]
#   rows    (K, 4):    [p_start, C, row_index, seg]          one per matrix row (B*R per segment)
#   cols    (Q, 5):    [p_start, R, C, width, col_index]      one per block of <= _AF_COLS columns
#   batches (NB, 2):   [row_index, R]                         one per matrix, first row and rows
# Passes over the flat buffers per step (g: the gradient, p: the parameters):
#   1. rows   (factored): g and p read once; float64 row sums of g^2 -> row_var EMA, and the
#                         float64 row sums of p^2 for the parameter RMS.
#   2. cols   (factored): g read once by column blocks (rows in order, so the float64 column
#                         sums do not depend on the thread count) -> col_var EMA.
#   3. rscale (tiny, per matrix): row_var / max(mean(row_var), eps1).
#   4. stats  (every piece): factored pieces read g for the float64 sum of U^2; unfactored
#                         pieces read p, g, variance, write the variance EMA and sum p^2, U^2.
#   host:     alpha = max(eps2, RMS(p)) * rho_t, step = alpha / max(1, RMS(U) / d).
#   5. apply  (every piece): p = p * (1 - lr*wd) - step * U, U recomputed from the statistics.
# The clipping denominator needs all of U before any element moves, so U is formed twice
# (passes 4 and 5); the column sums could share pass 1 only through per-thread partial
# column buffers, traded here for one more read of g and sums that need no merge.

_AF_COLS = 256


def _af_rows(p, g, row, rows, gscale, beta2c, psq_rows):
    for k in prange(rows.shape[0]):
        a, c, ri = rows[k, 0], rows[k, 1], rows[k, 2]
        pb, gb = p[a : a + c], g[a : a + c]
        sg = 0.0
        sp = 0.0
        for i in range(c):
            gi = np.float64(gscale * gb[i])
            pi = np.float64(pb[i])
            sg += gi * gi
            sp += pi * pi
        r = row[ri]
        row[ri] = r + beta2c * (sg / c - r)
        psq_rows[k] = sp


_AF_ROWS = _twins(_af_rows)


def _af_cols(g, col, cols, gscale, beta2c):
    for q in prange(cols.shape[0]):
        a, nr, c, width, ci = cols[q, 0], cols[q, 1], cols[q, 2], cols[q, 3], cols[q, 4]
        acc = np.zeros(width, dtype=np.float64)
        for r in range(nr):
            gb = g[a + r * c : a + r * c + width]
            for i in range(width):
                gi = np.float64(gscale * gb[i])
                acc[i] += gi * gi
        cb = col[ci : ci + width]
        for i in range(width):
            x = cb[i]
            cb[i] = x + beta2c * (acc[i] / nr - x)


_AF_COLS_PAIR = _twins(_af_cols)


def _af_rscale(row, batches, eps1, rscale):
    for b in prange(batches.shape[0]):
        r0, nr = batches[b, 0], batches[b, 1]
        rb = row[r0 : r0 + nr]
        s = 0.0
        for i in range(nr):
            s += np.float64(rb[i])
        m = s / nr
        m = eps1 if m < eps1 else m  # NaN-propagating clamp (torch's clamp_(min=eps1))
        sb = rscale[r0 : r0 + nr]
        for i in range(nr):
            sb[i] = rb[i] / m


_AF_RSCALE = _twins(_af_rscale)


def _af_stats(p, g, col, var, rscale, pieces, segs, gscale, beta2c, eps1sq, psq_part, usq_part):
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        off = segs[seg, 0]
        su = 0.0
        sp = 0.0
        if segs[seg, 2]:
            nr, c, ro, co = segs[seg, 4], segs[seg, 5], segs[seg, 6], segs[seg, 7]
            e, end = lo - off, hi - off
            while e < end:
                k = e // c
                c0 = e - k * c
                c1 = min(c, c0 + end - e)
                rs = rscale[ro + k]
                gb = g[off + k * c + c0 : off + k * c + c1]
                cb = col[co + (k // nr) * c + c0 : co + (k // nr) * c + c1]
                for i in range(c1 - c0):
                    v = rs * cb[i]
                    v = eps1sq if v < eps1sq else v
                    u = np.float64(gscale * gb[i] / np.sqrt(v))
                    su += u * u
                e += c1 - c0
        else:
            vo = segs[seg, 8] + lo - off
            pb, gb, vb = p[lo:hi], g[lo:hi], var[vo : vo + hi - lo]
            for i in range(pb.size):
                gi = gscale * gb[i]
                x = vb[i]
                v = x + beta2c * (gi * gi - x)
                vb[i] = v
                v = eps1sq if v < eps1sq else v
                u = np.float64(gi / np.sqrt(v))
                pi = np.float64(pb[i])
                su += u * u
                sp += pi * pi
        usq_part[j] = su
        psq_part[j] = sp


_AF_STATS = _twins(_af_stats)


def _af_apply(p, g, col, var, rscale, pieces, segs, gscale, eps1sq, step, decay, w, wkind, zero_grad, mask):
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        off = segs[seg, 0]
        ss, dec = step[seg], decay[seg]
        if segs[seg, 2]:
            nr, c, ro, co = segs[seg, 4], segs[seg, 5], segs[seg, 6], segs[seg, 7]
            e, end = lo - off, hi - off
            while e < end:
                k = e // c
                c0 = e - k * c
                c1 = min(c, c0 + end - e)
                rs = rscale[ro + k]
                a = off + k * c
                pb, gb = p[a + c0 : a + c1], g[a + c0 : a + c1]
                kb = piece_mask(mask, a + c0, a + c1)
                cb = col[co + (k // nr) * c + c0 : co + (k // nr) * c + c1]
                for i in range(c1 - c0):
                    v = rs * cb[i]
                    v = eps1sq if v < eps1sq else v
                    store_masked(pb, i, pb[i] * dec - ss * (gscale * gb[i] / np.sqrt(v)), kb)
                    if zero_grad:
                        gb[i] = 0
                e += c1 - c0
        else:
            vo = segs[seg, 8] + lo - off
            pb, gb, vb = p[lo:hi], g[lo:hi], var[vo : vo + hi - lo]
            kb = piece_mask(mask, lo, hi)
            for i in range(pb.size):
                v = vb[i]
                v = eps1sq if v < eps1sq else v
                store_masked(pb, i, pb[i] * dec - ss * (gscale * gb[i] / np.sqrt(v)), kb)
                if zero_grad:
                    gb[i] = 0
        if w is not None:
            store_working(w[lo:hi], p[lo:hi], wkind)


_AF_APPLY = _twins(_af_apply)


def _seg_totals(part, pieces, nseg, extra, extra_seg):
    """Per-segment float64 totals of per-piece (and per-row) partial sums, in a fixed order."""
    out = np.zeros(nseg, dtype=np.float64)
    np.add.at(out, pieces[:, 2], part)  # unbuffered, in index order: thread-count independent
    if extra is not None:
        np.add.at(out, extra_seg, extra)
    return out


def adafactor_step(p, g, row, col, var, pieces, segs, rows, cols, batches, gscale, rho, decay, beta2c, eps1, eps2,
                   d, w, wkind, zero_grad, mask=None):
    """Fused Adafactor update (five passes, see above); see :func:`arraytrain.kernels.reference.adafactor_step`."""
    t = p.dtype.type
    n = p.size
    gs, b2c = t(gscale), t(beta2c)
    nseg = segs.shape[0]
    psq_rows = np.empty(rows.shape[0], dtype=np.float64)
    rscale = np.empty(row.size, dtype=p.dtype)
    if rows.shape[0]:
        _pick(_AF_ROWS, n)(p, g, row, rows, gs, b2c, psq_rows)
        _pick(_AF_COLS_PAIR, n)(g, col, cols, gs, b2c)
        _pick(_AF_RSCALE, row.size)(row, batches, float(eps1), rscale)
    psq_part = np.empty(pieces.shape[0], dtype=np.float64)
    usq_part = np.empty(pieces.shape[0], dtype=np.float64)
    eps1sq = t(eps1 * eps1)
    _pick(_AF_STATS, n)(p, g, col, var, rscale, pieces, segs, gs, b2c, eps1sq, psq_part, usq_part)
    psq = _seg_totals(psq_part, pieces, nseg, psq_rows, rows[:, 3])
    usq = _seg_totals(usq_part, pieces, nseg, None, None)
    step = adafactor_step_size(psq, usq, segs[:, 1], rho, eps2, d)
    _pick(_AF_APPLY, n)(p, g, col, var, rscale, pieces, segs, gs, eps1sq, seg_array(step, p.dtype),
                        seg_array(decay, p.dtype), w, int(wkind), bool(zero_grad), mask)


def adafactor_step_size(psq, usq, numel, rho, eps2, d):
    """``max(eps2, RMS(p)) * rho / max(1, RMS(U) / d)`` per segment, in float64.

    ``max`` as torch's Python ``max(constant, x)``: a NaN ``x`` gives the constant
    (``np.fmax``); the NaN still reaches the parameters through ``U``.
    """
    size = np.maximum(np.asarray(numel, np.float64), 1.0)
    alpha = np.fmax(eps2, np.sqrt(psq / size)) * np.asarray(rho, np.float64)
    return alpha / np.fmax(1.0, np.sqrt(usq / size) / d)


# Sophia ------------------------------------------------------------------------------------


def _sophia(p, g, m, h, pieces, gscale, lr, decay, beta1, beta1c, rho, eps, one, w, wkind, zero_grad, mask):
    for j in prange(pieces.shape[0]):
        lo, hi, seg = pieces[j, 0], pieces[j, 1], pieces[j, 2]
        lr_j, dec = lr[seg], decay[seg]
        pb, gb, mb, hb = p[lo:hi], g[lo:hi], m[lo:hi], h[lo:hi]
        kb = piece_mask(mask, lo, hi)
        for i in range(pb.size):
            mi = beta1 * mb[i] + beta1c * (gscale * gb[i])
            mb[i] = mi
            den = rho * hb[i]
            den = eps if den < eps else den  # NaN-propagating max(rho*h, eps) > 0
            # sign(m) * min(|m| / den, 1) == clip(m / den, -1, 1) for den > 0; NaN stays NaN
            r = mi / den
            r = one if r > one else r
            r = -one if r < -one else r
            store_masked(pb, i, pb[i] * dec - lr_j * r, kb)
            if zero_grad:
                gb[i] = 0
        if w is not None:
            store_working(w[lo:hi], pb, wkind)


_SOPHIA = _twins(_sophia)


def sophia_step(p, g, m, h, pieces, gscale, lr, decay, beta1, rho, eps, w, wkind, zero_grad, mask=None):
    """Fused SophiaG update; see :func:`arraytrain.kernels.reference.sophia_step`."""
    t = p.dtype.type
    _pick(_SOPHIA, p.size)(
        p, g, m, h, pieces, t(gscale), seg_array(lr, p.dtype), seg_array(decay, p.dtype), t(beta1),
        t(1.0 - beta1), t(rho), t(eps), t(1.0), w, int(wkind), bool(zero_grad), mask,
    )


# SAM -----------------------------------------------------------------------------------------


def _sam_perturb(p, g, backup, pieces, scale, adaptive, zero_grad, mask):
    for j in prange(pieces.shape[0]):
        lo, hi = pieces[j, 0], pieces[j, 1]
        pb, gb, bb = p[lo:hi], g[lo:hi], backup[lo:hi]
        kb = piece_mask(mask, lo, hi)
        for i in range(pb.size):
            pi = pb[i]
            bb[i] = pi
            e = scale * gb[i]
            if adaptive:
                e = e * (pi * pi)
            store_masked(pb, i, pi + e, kb)
            if zero_grad:
                gb[i] = 0


_SAM_PERTURB = _twins(_sam_perturb)


def sam_perturb(p, g, backup, pieces, scale, adaptive, zero_grad, mask=None):
    """``backup = p; p += scale * (p^2 if adaptive) * g``, pruned weights 0.

    See :func:`arraytrain.kernels.reference.sam_perturb`.
    """
    _pick(_SAM_PERTURB, p.size)(p, g, backup, pieces, p.dtype.type(scale), bool(adaptive), bool(zero_grad), mask)


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


_SUMSQ_PRODUCT = _twins(_sumsq_product)


def sumsq_product(x, y, pieces, nseg):
    """``(total, per_segment)`` float64 sums of ``(x*y)^2`` over the pieces (ASAM's norm), one pass."""
    total, per_seg = _pick(_SUMSQ_PRODUCT, x.size)(x, y, pieces, nseg)
    return float(total), per_seg
