"""The CPU family's storage codecs and per-element accessors, resolved when a kernel is typed.

bfloat16/float16 as uint16 bits (encode/decode, bit-exact with ml_dtypes/NumPy casts), the
state accessor (``load_state``/``store_state``: float storage as is, uint16 storage as
bfloat16), the working-copy writer and the pruning-mask store. All inline into the kernels.
"""

from __future__ import annotations

import warnings

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core.errors import NumbaIRAssumptionWarning
from numba.extending import intrinsic, overload
from numba.core import cgutils
from numba.np.numpy_support import as_dtype

from ._jit import JIT

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
        # an unordered compare of x with itself: one vcmpunordps, where testing the bits
        # (abs, then an unsigned compare AVX2 has only as max + equal) took three
        isnan = builder.fcmp_unordered("uno", args[0], args[0])
        return builder.trunc(builder.select(isnan, quiet, rounded), ir.IntType(16))

    return types.uint16(types.float32), codegen


def _f16_encode_bits(x):
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


def has_f16c(context) -> bool:
    """Whether the target the kernels are compiled for has F16C (every x86 CPU since 2012 does)."""
    features = getattr(context.codegen(), "_tm_features", "") or ""
    return "+f16c" in features.split(",")


# float16: with F16C, LLVM's own fptrunc to half, one packed vcvtps2ph per vector (round to
# nearest even, overflow to inf, subnormals rounded as NumPy does). The hardware quiets a
# signalling NaN where NumPy keeps it signalling (npy_floatbits_to_halfbits: the payload's top
# bits, +1 if they are all 0), so such lanes are set back with a select. Without F16C (an AOT
# build for a generic x86-64, another architecture) the integer code above, NumPy's algorithm.
@intrinsic
def f16_encode(typingctx, x):
    """float32 -> float16 bits (uint16), bit for bit as NumPy's ``astype(np.float16)``."""
    def codegen(context, builder, signature, args):
        if not has_f16c(context):
            return context.compile_internal(builder, _f16_encode_bits, signature, args)
        i16, i32 = ir.IntType(16), ir.IntType(32)
        c16 = lambda v: ir.Constant(i16, v)  # noqa: E731
        c32 = lambda v: ir.Constant(i32, v)  # noqa: E731
        h = builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), i16)
        u = builder.bitcast(args[0], i32)
        isnan = builder.icmp_unsigned(">", builder.and_(u, c32(0x7FFFFFFF)), c32(0x7F800000))
        signalling = builder.and_(isnan, builder.icmp_unsigned("==", builder.and_(u, c32(0x400000)), c32(0)))
        kept = builder.and_(h, c16(0xFDFF))
        empty = builder.icmp_unsigned("==", builder.and_(kept, c16(0x3FF)), c16(0))
        kept = builder.or_(kept, builder.zext(empty, i16))
        return builder.select(signalling, kept, h)

    return types.uint16(types.float32), codegen


@njit(inline="always", **JIT)
def store_working(wb, pb, kind):
    """``wb = lowp(pb)`` for one piece (``kind``: LP_BF16 or LP_F16).

    Optimizer kernels call it right after updating a piece, while it is still in cache:
    a separate loop keeps the update loop free of the conversion. Both loops are packed on
    AVX2 and AVX-512 (tests/kernels/test_vectorised.py).
    """
    if kind == 1:
        for i in range(pb.size):
            wb[i] = bf16_encode(pb[i])
    elif kind == 2:
        for i in range(pb.size):
            wb[i] = f16_encode(pb[i])


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


# -- zeroing the gradient in the update pass ---------------------------------------------------


# -- gradients read where they lie ------------------------------------------------------------
#
# ``grad_ptrs`` (the kernels' keyword, see arraytrain.kernels.interface): None, the gradient is
# the flat buffer ``g``; or an int64 array with one address per piece, of the gradient's element
# at the piece's start, wherever that gradient lies (a torch ``.grad`` tensor, a NumPy array of
# the dict path), contiguous and of ``g``'s dtype. Resolved when the kernel is typed: with None
# the slice is ``g[a:b]``, instruction for instruction the loop it was.


@intrinsic
def _pointer(typingctx, address, like):
    """``address`` (an int) as a pointer to ``like``'s elements (jitted code only)."""
    sig = types.CPointer(like.dtype)(address, like)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


def grad_slice(g, grad_ptrs, j, lo, a, b):
    """Elements ``[a, b)`` of piece ``j`` (which starts at ``lo``) of the gradient: ``g[a:b]``, or
    read where it lies through ``grad_ptrs[j]`` (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


@overload(grad_slice, inline="always", jit_options=JIT)
def _grad_slice(g, grad_ptrs, j, lo, a, b):
    if isinstance(grad_ptrs, types.NoneType):
        return lambda g, grad_ptrs, j, lo, a, b: g[a:b]
    size = as_dtype(g.dtype).itemsize

    def impl(g, grad_ptrs, j, lo, a, b):
        return carray(_pointer(grad_ptrs[j] + (a - lo) * size, g), (b - a,))
    return impl


def grad_fill(zero_grad):
    """The kernels' ``zero_grad`` argument: 0 (the value each gradient element is overwritten
    with once read) when the gradient is zeroed in the update pass, None when it is kept."""
    return 0 if zero_grad else None


def clear_grad(gb, i, fill):
    """``gb[i] = fill`` after ``gb[i]`` was read; nothing when ``fill`` is None (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


# Resolved when the kernel is typed, like piece_mask/store_masked: ``None`` compiles to a loop
# without the store, a number to an unconditional one. A runtime bool inside the element loop
# is an if-converted, masked store (``vmaskmovps`` on AVX2, microcoded on AMD's cores, and
# issued with an all-false mask when the flag is off); with bfloat16 state it cost the AVX2
# loops up to 2x. A bool still works (the old runtime flag) for a caller of the jitted twins.
@overload(clear_grad, inline="always", jit_options=JIT)
def _clear_grad(gb, i, fill):
    if isinstance(fill, types.NoneType):
        return lambda gb, i, fill: None
    if isinstance(fill, types.Boolean):
        def runtime(gb, i, fill):
            if fill:
                gb[i] = 0
        return runtime

    def impl(gb, i, fill):
        gb[i] = fill
    return impl


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
warnings.filterwarnings(  # the same check, for the 8-bit accessors below (inlined the same way)
    "ignore", message=r"variable '_state_(open|close|step|scratch)__locals__impl.*' is not in scope",
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


# -- 8-bit state (arraytrain.lowbit) -----------------------------------------------------------
#
# An 8-bit slot reaches a kernel as arraytrain.kernels.interface.Q8 (a named tuple of arrays and ints);
# every other slot as an array. A kernel walks each piece in steps of ``state_step`` elements:
# the whole piece for an array (one step, the loop as before) and for a parameter whose 8-bit
# slot is kept in float32, one block of 256 for an 8-bit parameter. Per step,
# ``state_open`` gives the float values the element loop reads and writes through
# load_state/store_state: the array's slice; the float32 side array's slice; or, for 8-bit,
# the block decoded into ``tmp`` (a 256-float scratch, in L1). ``state_close`` then encodes
# the block from ``tmp``: its absmax as the largest |x| bits (an integer max, which a NaN wins,
# and which vectorises where a NaN-propagating float max would not), and each code from the
# codebook's bucket table. The element loops are the float32 loops, unchanged.

QBLOCK = 256


@intrinsic
def abs_bits(typingctx, x):
    """float32 -> its bits with the sign cleared (uint32): magnitudes that order as integers, NaN above inf."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        return builder.and_(builder.bitcast(args[0], i32), ir.Constant(i32, 0x7FFFFFFF))

    return types.uint32(types.float32), codegen


@intrinsic
def umax32(typingctx, a, b):
    """max of two uint32, as one unsigned compare and select (vpmaxud)."""
    def codegen(context, builder, signature, args):
        return builder.select(builder.icmp_unsigned(">", args[0], args[1]), args[0], args[1])

    return types.uint32(types.uint32, types.uint32), codegen


@intrinsic
def bits_as_f32(typingctx, u):
    """uint32 bits -> float32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def q8_bucket(typingctx, q, shift, bias, nb):
    """The codebook table's index for float32 ``q``: ``sign*nb + clip((|bits| >> shift) - bias, 0, nb - 1)``, in 32-bit lanes."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        c = lambda v: ir.Constant(i32, v)  # noqa: E731
        sh, bi, n = (builder.trunc(a, i32) for a in args[1:])
        u = builder.bitcast(args[0], i32)
        sign = builder.lshr(u, c(31))
        k = builder.sub(builder.lshr(builder.and_(u, c(0x7FFFFFFF)), sh), bi)
        k = builder.select(builder.icmp_signed("<", k, c(0)), c(0), k)
        top = builder.sub(n, c(1))
        k = builder.select(builder.icmp_signed(">", k, top), top, k)
        return builder.add(builder.mul(sign, n), k)

    return types.uint32(types.float32, types.int64, types.int64, types.int64), codegen


@intrinsic
def q8_pick(typingctx, q, entry, shift):
    """The code of ``q`` from its bucket's table ``entry`` (``threshold << 8 | code``): ``code``,
    moved one towards larger magnitude where ``q``'s low ``shift`` bits reach the threshold."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        c = lambda v: ir.Constant(i32, v)  # noqa: E731
        u = builder.bitcast(args[0], i32)
        e = args[1]
        sh = builder.trunc(args[2], i32)
        low = builder.and_(u, builder.sub(builder.shl(c(1), sh), c(1)))
        moved = builder.zext(builder.icmp_unsigned(">=", low, builder.lshr(e, c(8))), i32)
        # one code up for q >= 0, down for q < 0 (the negative half's codes fall as |q| grows)
        sign = builder.lshr(u, c(31))
        step = builder.select(builder.icmp_unsigned("==", sign, c(0)), moved, builder.sub(c(0), moved))
        code = builder.add(builder.and_(e, c(255)), step)
        return builder.trunc(code, ir.IntType(8))

    return types.uint8(types.float32, types.int32, types.int64), codegen


def _features(context) -> list:
    return (getattr(context.codegen(), "_tm_features", "") or "").split(",")


def has_avx2(context) -> bool:
    """Whether the target the kernels are compiled for has AVX2 (its 8-lane gathers)."""
    return "+avx2" in _features(context)


def has_avx512(context) -> bool:
    """Whether the target has AVX-512F (16-lane vectors, two-table permutes)."""
    return "+avx512f" in _features(context)


def _splat(builder, value, vt):
    i32 = ir.IntType(32)
    undef = ir.Constant(vt, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(i32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(i32, vt.count), [0] * vt.count))


def _x86(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _vec(vt, values):
    et = vt.element
    return ir.Constant(vt, [ir.Constant(et, float(v) if isinstance(et, ir.FloatType) else int(v)) for v in values])


def _halves(builder, v, i32):
    lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, 8), list(range(8))))
    hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, 8), list(range(8, 16))))
    return lo, hi


def _picked(builder, u, base, sh, bi, nb, lanes):
    """The exact codes (``<lanes x i32>``) of the float32 bits ``u`` from the bucket table at
    ``base``: the table lookup as 8-lane ``vpgatherdd``s (two for 16 lanes)."""
    i8, i32 = ir.IntType(8), ir.IntType(32)
    vt = ir.VectorType(i32, lanes)
    c = lambda v: ir.Constant(vt, [v] * lanes)  # noqa: E731
    sh, bi, nb = (_splat(builder, x, vt) for x in (sh, bi, nb))
    sign = builder.lshr(u, c(31))
    k = builder.sub(builder.lshr(builder.and_(u, c(0x7FFFFFFF)), sh), bi)
    k = builder.select(builder.icmp_signed("<", k, c(0)), c(0), k)
    top = builder.sub(nb, c(1))
    k = builder.select(builder.icmp_signed(">", k, top), top, k)
    idx = builder.add(builder.mul(sign, nb), k)
    v8 = ir.VectorType(i32, 8)
    parts = _halves(builder, idx, i32) if lanes == 16 else (idx,)
    got = [_x86(builder, "llvm.x86.avx2.gather.d.d.256", v8,
                [ir.Constant(v8, [0] * 8), base, p, ir.Constant(v8, [-1] * 8), ir.Constant(i8, 4)]) for p in parts]
    e = got[0] if lanes == 8 else builder.shuffle_vector(got[0], got[1], ir.Constant(vt, list(range(16))))
    low = builder.and_(u, builder.sub(builder.shl(c(1), sh), c(1)))
    moved = builder.zext(builder.icmp_unsigned(">=", low, builder.lshr(e, c(8))), vt)
    step = builder.select(builder.icmp_unsigned("==", sign, c(0)), moved, builder.sub(c(0), moved))
    return builder.add(builder.and_(e, c(255)), step)


# The arithmetic encoder (AVX-512 targets). A dynamic map's positive values come in seven
# decades of 2**i (signed) or 2**(i+1) (unsigned) evenly spaced means, then 1.0; so a q's code
# is its class's first code plus ``floor(|q| * S - O)`` (the decision bounds of a decade fall
# at whole numbers of that linear coordinate), and no table lookup is needed. The classes: 0
# below the first bound (the code of 0), 1-7 the decades, 8 above the last bound (1.0's code,
# and NaN's: its top code); each a row of 16-entry tables read by one permute. The class is
# read from |q|'s binary exponent (a 32-entry table, one two-table permute: no binade holds two
# class edges) and one compare with the class's upper edge. Where the coordinate lies within
# DELTA of a whole number (a decision bound, up to float32 rounding of the map), the lane's
# code comes from the bucket table instead (a gather, for about 3 elements in 100,000): the
# encoder's codes equal nearest_codes bit for bit. That was checked over every float32 in
# [-1.125, 1.125] for both maps (no code differs outside the flagged lanes; the largest
# distance of a real bound from its whole number is 1.5e-5), and again over every float32 in
# [-1, 1] once the class's first code moved into the offsets; tests/kernels/test_vectorised.py
# checks every bound's 64 neighbours on each side. Negative q count the bounds <= |q| (ties go
# to the larger magnitude, the lower code): |q| is moved up one ulp. A NaN or infinite q lands
# in class 8, whose coordinate is NaN: the truncation's integer indefinite (0x80000000, read as
# unsigned by the clamp) gives the class's last code, and no lane is flagged. The rows S, O
# and hi are read for the exponent's class and for the next one, and picked by the edge
# compare: three more permutes (8 per 16 codes), but the multiply-add no longer waits for the
# compare. With the flags collected per block (q8_encode_lanes) that took the encoder from 0.20
# to 0.18-0.19 ns per code (one core, blocks in L2, in one process); with the compare first and
# a branch per 16 codes, neither change alone gained. On AVX2 targets (8 lanes, no two-table
# permute) the arithmetic measured slower than the gather below, so they keep the gather.
_DELTA = 1e-4
_EXP0 = 96  # the exponent table covers 2**-31 .. 2**0; anything smaller is below the first edge


def _arith_constants(qmap) -> dict:
    """The arithmetic encoder's tables for one dynamic map (see above)."""
    f32 = np.float32
    bounds = ((qmap[:-1] + qmap[1:]) / f32(2)).astype(f32)
    pos = bounds[bounds > 0]
    vals = qmap[qmap > 0].astype(np.float64)
    decade = np.floor(np.log10(vals) + 1e-9).astype(int)[:-1]  # the top value, 1.0, apart
    edges, S, O, base, top = [pos[0]], [0.0], [-0.5], [0], [0]  # class 0: below the first bound (q ~ 0)
    for i, dd in enumerate(sorted(set(decade))):
        first = int(np.nonzero(decade == dd)[0][0])
        n = int((decade == dd).sum())
        if i:
            edges.append(pos[first])
        S.append(n / (0.9 * 10.0 ** (dd + 1)))
        O.append(0.1 * n / 0.9)
        base.append(first + 1)
        top.append(n - 1)
        coord = pos[first + 1 : first + n] * f32(S[-1]) - f32(O[-1])
        if n > 1 and np.abs(coord - np.arange(1, n)).max() > _DELTA / 4:
            raise AssertionError("dynamic map: a decade is not evenly spaced")
    edges = np.array(edges + [pos[-1]], f32)
    if edges.size != 8 or base[-1] + top[-1] + 1 != pos.size or np.any(edges[1:] < 2 * edges[:-1]):
        raise AssertionError("dynamic map: unexpected decade structure")
    S, O, base, top = S + [0.0], O + [-0.5], base + [pos.size], top + [0]  # class 8: above the last bound
    lowest = [sum(1 for e in edges if e < 2.0 ** (k + _EXP0 - 127)) for k in range(32)]
    pad = 16 - len(S)
    # the offsets take DELTA and the class's first code: floor(|q| * S - O) is the code itself
    # (below hi = the class's last code), so one permute (hi) stands for two (first code, count)
    return dict(zero=int((bounds <= 0).sum()), edges=np.concatenate([edges, np.full(8, np.inf, f32)]),
                S=S + [0.0] * pad, O=[o - _DELTA - b for o, b in zip(O, base)] + [0.0] * pad,
                hi=[b + t for b, t in zip(base, top)] + [0] * pad, lowest=lowest)


_ARITH = {}


def _arith(signed: bool) -> dict:
    if signed not in _ARITH:
        from ...lowbit import SIGNED_MAP, UNSIGNED_MAP

        _ARITH[signed] = _arith_constants(SIGNED_MAP if signed else UNSIGNED_MAP)
    return _ARITH[signed]


def _emit_arith(builder, u, signed, lanes=16):
    """Codes (``<16 x i32>``) of the float32 bits ``u`` and the lanes to take from the table instead."""
    i16, i32, f = ir.IntType(16), ir.IntType(32), ir.FloatType()
    vi, vf = ir.VectorType(i32, lanes), ir.VectorType(f, lanes)
    c = lambda v: ir.Constant(vi, [v] * lanes)  # noqa: E731
    cf = lambda v: ir.Constant(vf, [float(np.float32(v))] * lanes)  # noqa: E731
    s, un = _arith(True), _arith(False)

    def table(key, vt, part=slice(0, 16), shift=0):  # both maps' table, picked by the runtime ``signed``
        return builder.select(signed, _vec(vt, (list(s[key][shift:]) + [0] * shift)[part]),
                              _vec(vt, (list(un[key][shift:]) + [0] * shift)[part]))

    sign = builder.lshr(u, c(31))
    a = builder.bitcast(builder.add(builder.and_(u, c(0x7FFFFFFF)), sign), vf)  # one ulp up for q < 0
    # the two-table permute reads the index's low 5 bits: exponents 96..127 are 0..31, and
    # NaN/inf (255) is 31 like 1.0; anything below 2**-31 is raised to exponent 96 first
    bits = builder.bitcast(a, vi)
    e = builder.lshr(builder.select(builder.icmp_unsigned("<", bits, c(_EXP0 << 23)), c(_EXP0 << 23), bits), c(23))
    d = _x86(builder, "llvm.x86.avx512.vpermi2var.d.512", vi,
             [table("lowest", vi), e, table("lowest", vi, slice(16, 32))])
    perm_f = lambda t: _x86(builder, "llvm.x86.avx512.permvar.sf.512", vf, [t, d])  # noqa: E731
    perm_i = lambda t: _x86(builder, "llvm.x86.avx512.permvar.si.512", vi, [t, d])  # noqa: E731
    up = builder.fcmp_ordered("<", perm_f(table("edges", vf)), a)

    def row(key, perm, vt):  # the class's row: d's, or the next class's above d's upper edge
        return builder.select(up, perm(table(key, vt, shift=1)), perm(table(key, vt)))

    # the class's first code plus the coordinate plus DELTA (all folded into the offsets), in
    # one fused multiply-add: a lane is flagged when that lies within 2 * DELTA above a whole
    # number, and otherwise truncates to the code (float32 error below 3e-5 up to 255)
    t = _x86(builder, "llvm.fma.v16f32", vf, [a, row("S", perm_f, vf), builder.fneg(row("O", perm_f, vf))])
    # the hardware truncation (0x80000000 for NaN): LLVM's fptosi would make a NaN lane poison
    j = _x86(builder, "llvm.x86.avx512.mask.cvttps2dq.512", vi, [t, c(0), ir.Constant(i16, -1), ir.Constant(i32, 4)])
    near = builder.fcmp_ordered("<", builder.fsub(t, builder.sitofp(j, vf)), cf(2 * _DELTA))
    hi = row("hi", perm_i, vi)
    m = builder.select(builder.icmp_unsigned("<", j, hi), j, hi)
    zero = builder.select(signed, c(s["zero"]), c(un["zero"]))
    neg = builder.icmp_unsigned("!=", sign, c(0))
    code = builder.select(neg, builder.sub(zero, builder.select(builder.icmp_unsigned("<", m, zero), m, zero)),
                          builder.add(zero, m))
    return code, near


# The encoder's loop, written in vector IR: LLVM's cost model prices a gather as the scalar
# loads it replaces on AMD cores and on Haswell, so a numba loop that indexes the table stays
# scalar (1.6 ns per element measured on a Zen 5 core). AVX-512 targets: 16 lanes of the
# arithmetic encoder, the flagged lanes re-read from the table. AVX2 targets: 8 lanes, the
# table read with one vpgatherdd. Returns where the scalar tail starts (0 on a target without
# AVX2: the whole block through the scalar loop).
@intrinsic
def q8_encode_lanes(typingctx, vals, codes, r, table, shift, bias, nb, signed):
    """Codes of ``vals[i] * r`` for the first ``L * (n // L)`` elements; returns that count."""
    sig = types.intp(vals, codes, types.float32, table, types.int64, types.int64, types.int64, types.boolean)

    def codegen(context, builder, signature, args):
        intp = context.get_value_type(types.intp)
        lanes = 16 if has_avx512(context) else 8 if has_avx2(context) else 0
        if not lanes:
            return ir.Constant(intp, 0)
        i8, i32 = ir.IntType(8), ir.IntType(32)
        vi, vf, vb = ir.VectorType(i32, lanes), ir.VectorType(ir.FloatType(), lanes), ir.VectorType(i8, lanes)
        va = context.make_array(signature.args[0])(context, builder, args[0])
        ca = context.make_array(signature.args[1])(context, builder, args[1])
        ta = context.make_array(signature.args[3])(context, builder, args[3])
        base = builder.bitcast(ta.data, i8.as_pointer())
        sh, bi, nbs = (builder.trunc(a, i32) for a in args[4:7])
        signed = _splat(builder, args[7], ir.VectorType(ir.IntType(1), lanes))
        r = _splat(builder, args[2], vf)
        n = builder.and_(va.nitems, ir.Constant(intp, -lanes))
        i16 = ir.IntType(16)

        def lanes_at(i):
            x = builder.load(builder.bitcast(cgutils.gep_inbounds(builder, va.data, i), vf.as_pointer()), align=4)
            return builder.bitcast(builder.fmul(x, r), vi)

        def store(i, code):
            builder.store(builder.trunc(code, vb), builder.bitcast(cgutils.gep_inbounds(builder, ca.data, i), vb.as_pointer()),
                          align=1)

        if lanes == 8:
            with cgutils.for_range_slice(builder, ir.Constant(intp, 0), n, ir.Constant(intp, lanes)) as (i, _):
                store(i, _picked(builder, lanes_at(i), base, sh, bi, nbs, 8))
            return n
        # the flagged lanes are collected over the block, without a branch in the loop (see the
        # encoder's note above); the rare block that has any is walked again and its flagged
        # lanes read from the table
        flags = cgutils.alloca_once_value(builder, ir.Constant(i16, 0))
        with cgutils.for_range_slice(builder, ir.Constant(intp, 0), n, ir.Constant(intp, lanes)) as (i, _):
            code, near = _emit_arith(builder, lanes_at(i), signed)
            store(i, code)
            builder.store(builder.or_(builder.load(flags), builder.bitcast(near, i16)), flags)
        with builder.if_then(builder.icmp_unsigned("!=", builder.load(flags), ir.Constant(i16, 0)), likely=False):
            with cgutils.for_range_slice(builder, ir.Constant(intp, 0), n, ir.Constant(intp, lanes)) as (i, _):
                u = lanes_at(i)
                code, near = _emit_arith(builder, u, signed)
                with builder.if_then(builder.icmp_unsigned("!=", builder.bitcast(near, i16), ir.Constant(i16, 0))):
                    store(i, builder.select(near, _picked(builder, u, base, sh, bi, nbs, 16), code))
        return n

    return sig, codegen


def has_vbmi(context) -> bool:
    """Whether the target has AVX-512 VBMI (byte permutes over two registers: 128 entries)."""
    return "+avx512vbmi" in _features(context)


def _byte_planes(qmap) -> list:
    """The map's float32 values as 4 byte planes of 4 x 64 bytes (plane k: byte k of each value)."""
    b = np.ascontiguousarray(qmap, np.float32).view(np.uint8).reshape(256, 4)
    return [[b[64 * m : 64 * (m + 1), k] for m in range(4)] for k in range(4)]


def _emit_decode_vbmi(builder, context, ca, ta, am, n, qmap):
    """The 64-lane byte-plane decode loop for one map (constants): per plane two 128-entry byte
    permutes and a select on the code's top bit, then two rounds of two-register byte/word
    shuffles that interleave the planes into 64 float32."""
    from numba.core import cgutils as cg

    intp = context.get_value_type(types.intp)
    i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
    vb, vw, vf = ir.VectorType(i8, 64), ir.VectorType(i16, 32), ir.VectorType(ir.FloatType(), 16)
    planes = [[ir.Constant(vb, [ir.Constant(i8, int(x)) for x in part]) for part in plane] for plane in _byte_planes(qmap)]
    pairs8 = lambda lo: ir.Constant(ir.VectorType(i32, 64), [x for j in range(lo, lo + 32) for x in (j, j + 64)])  # noqa: E731
    pairs16 = lambda lo: ir.Constant(ir.VectorType(i32, 32), [x for j in range(lo, lo + 16) for x in (j, j + 32)])  # noqa: E731
    with cg.for_range_slice(builder, ir.Constant(intp, 0), n, ir.Constant(intp, 64)) as (i, _):
        code = builder.load(builder.bitcast(cg.gep_inbounds(builder, ca.data, i), vb.as_pointer()), align=1)
        top = builder.icmp_signed("<", code, ir.Constant(vb, [0] * 64))
        p = [builder.select(top, _x86(builder, "llvm.x86.avx512.vpermi2var.qi.512", vb, [t[2], code, t[3]]),
                            _x86(builder, "llvm.x86.avx512.vpermi2var.qi.512", vb, [t[0], code, t[1]])) for t in planes]
        words = [builder.bitcast(builder.shuffle_vector(p[a], p[a + 1], pairs8(lo)), vw) for a in (0, 2) for lo in (0, 32)]
        for q, (lo01, hi23, lo) in enumerate(((words[0], words[2], 0), (words[0], words[2], 16),
                                              (words[1], words[3], 0), (words[1], words[3], 16))):
            value = builder.bitcast(builder.shuffle_vector(lo01, hi23, pairs16(lo)), vf)
            at = builder.add(i, ir.Constant(intp, 16 * q))
            builder.store(builder.fmul(value, am), builder.bitcast(cg.gep_inbounds(builder, ta.data, at), vf.as_pointer()),
                          align=4)


# The decoder on AVX-512 targets, in vector IR. With VBMI (Ice Lake, Zen 4 and later): 64 codes
# at a time through byte planes of the map, about 30 instructions per 64 values (the map is
# a constant per signedness, so the loop is emitted once for each). Without VBMI: the 256-entry
# map as 8 two-table permutes (32 entries each, by the code's low 5 bits) and a select on each of
# the top 3 bits, 16 lanes at a time (1.06 ms against the numba loop's 1.91 ms for 1e7 codes on
# one Zen 5 core). AVX2 targets keep the numba loop (scalar): an 8-lane vgatherdps measured
# slower there (2.46 ms against 2.0 ms, compiled for haswell on the same core).
@intrinsic
def q8_decode_lanes(typingctx, cb, am, qmap, tmp, signed):
    """``tmp[i] = qmap[cb[i]] * am`` for the first elements (a multiple of the lanes); returns their count."""
    sig = types.intp(cb, types.float32, qmap, tmp, types.boolean)

    def codegen(context, builder, signature, args):
        intp = context.get_value_type(types.intp)
        if not has_avx512(context):
            return ir.Constant(intp, 0)
        i8, i32 = ir.IntType(8), ir.IntType(32)
        ca = context.make_array(signature.args[0])(context, builder, args[0])
        qa = context.make_array(signature.args[2])(context, builder, args[2])
        ta = context.make_array(signature.args[3])(context, builder, args[3])
        if has_vbmi(context):
            from ...lowbit import SIGNED_MAP, UNSIGNED_MAP

            vf = ir.VectorType(ir.FloatType(), 16)
            am = _splat(builder, args[1], vf)
            n = builder.and_(ca.nitems, ir.Constant(intp, -64))
            with builder.if_else(args[4]) as (when_signed, when_unsigned):
                with when_signed:
                    _emit_decode_vbmi(builder, context, ca, ta, am, n, SIGNED_MAP)
                with when_unsigned:
                    _emit_decode_vbmi(builder, context, ca, ta, am, n, UNSIGNED_MAP)
            return n
        vi, vf, vb = ir.VectorType(i32, 16), ir.VectorType(ir.FloatType(), 16), ir.VectorType(i8, 16)
        c = lambda v: ir.Constant(vi, [v] * 16)  # noqa: E731
        rows = [builder.load(builder.bitcast(cgutils.gep_inbounds(builder, qa.data, ir.Constant(intp, 16 * k)),
                                             vf.as_pointer()), align=4) for k in range(16)]
        am = _splat(builder, args[1], vf)
        n = builder.and_(ca.nitems, ir.Constant(intp, -16))
        with cgutils.for_range_slice(builder, ir.Constant(intp, 0), n, ir.Constant(intp, 16)) as (i, _):
            code = builder.zext(builder.load(builder.bitcast(cgutils.gep_inbounds(builder, ca.data, i), vb.as_pointer()),
                                             align=1), vi)
            v = [_x86(builder, "llvm.x86.avx512.vpermi2var.ps.512", vf, [rows[2 * k], code, rows[2 * k + 1]])
                 for k in range(8)]
            for bit in (32, 64, 128):
                on = builder.icmp_unsigned("!=", builder.and_(code, c(bit)), c(0))
                v = [builder.select(on, v[k + 1], v[k]) for k in range(0, len(v), 2)]
            builder.store(builder.fmul(v[0], am), builder.bitcast(cgutils.gep_inbounds(builder, ta.data, i), vf.as_pointer()),
                          align=4)
        return n

    return sig, codegen


@njit(inline="always", **JIT)
def q8_decode_block(cb, am, qmap, tmp, signed):
    """``tmp[i] = qmap[cb[i]] * am``: a block's float32 values from its codes (``signed``: the signed map)."""
    for i in range(q8_decode_lanes(cb, am, qmap, tmp, signed), cb.size):
        tmp[i] = qmap[cb[i]] * am


@njit(inline="always", **JIT)
def q8_encode_block(vals, cb, table, shift, bias, nb, signed):
    """Encode a block's float32 ``vals`` into ``cb`` (``signed``: the signed map); returns the block's absmax."""
    m = np.uint32(0)
    for i in range(vals.size):
        m = umax32(m, abs_bits(vals[i]))
    am = bits_as_f32(m)
    r = np.float32(1.0) / am if am > 0 else np.float32(0.0)
    for i in range(q8_encode_lanes(vals, cb, r, table, shift, bias, nb, signed), vals.size):
        q = vals[i] * r
        cb[i] = q8_pick(q, table[q8_bucket(q, shift, bias, nb)], shift)
    return am


# -- float8 state (arraytrain.lowbit, codec "float8") -------------------------------------------
#
# A float8 slot reaches a kernel as arraytrain.kernels.interface.F8 (Q8's layout, its own tuple
# type, so a kernel compiles the float8 codec only where a slot is float8). Both directions are
# written in LLVM IR without fast-math flags (the kernels' own flags allow contraction and
# reciprocal approximations; the codec must equal the reference bit for bit): no table, no
# gather, so the loops vectorise on AVX2 as on AVX-512. The format (e4m3, or e5m2 with ``wide``)
# is a runtime flag of the slot, but ``state_open``/``state_close`` branch on it once per block,
# so each format's loops compile with its constants (a runtime flag left selects in the loops and
# spilled their constants). Decode through float16 (F16C's packed convert), encode with the
# float32 adder doing the rounding: with both, AdamW's kernel went from 2.27 to 1.77 ns per
# element on one AVX2 core.


@intrinsic
def f8_code(typingctx, y, inv, wide):
    """The float8 code (e4m3, or e5m2 with ``wide``) of the float32 product ``y * inv`` (finite and
    at most a little above the format's largest value): round to nearest even, as ml_dtypes'
    cast. The rounding is the float32 adder's: ``|q| + c``, with ``c`` the power of two whose
    last place is the format's step in ``|q|``'s binade (``2**(e + 20 | 21)``, ``e`` the exponent
    of ``|q|``, and at least that of the smallest normal, where the subnormals' fixed step
    applies), is ``c`` plus ``|q|`` rounded to that step; the difference of the two bit patterns
    counts the steps, and ``c``'s exponent gives the binade's first code. So the normal and the
    subnormal codes come out of the same instructions (an integer max the only compare),
    checked against ml_dtypes over every float32 below the overflow."""
    def codegen(context, builder, signature, args):
        u = builder.bitcast(builder.fmul(args[0], args[1]), ir.IntType(32))
        return builder.trunc(_f8_signed(builder, u, _f8_rne(builder, u, args[2])), ir.IntType(8))

    return types.uint8(types.float32, types.float32, types.boolean), codegen


def _i32(v: int):
    """An i32 constant of the uint32 ``v``."""
    return ir.Constant(ir.IntType(32), v - (1 << 32) if v >= 1 << 31 else v)


def _f8_rne(builder, u, wide):
    """f8_code's magnitude code (i32) of the float32 bits ``u`` (``wide``: an i1)."""
    i32, f = ir.IntType(32), ir.FloatType()
    pick = lambda a, b: builder.select(wide, _i32(b), _i32(a))  # noqa: E731
    sh = pick(20, 21)  # 23 - the mantissa bits
    lowest = pick(0x3C800000 + (20 << 23), 0x38800000 + (21 << 23))  # c for the smallest normal's binade
    first = pick(141 << 3, 134 << 2)  # (c's exponent field - first) << mantissa bits: the binade's first code
    a = builder.and_(u, _i32(0x7FFFFFFF))
    cb = builder.add(builder.and_(a, _i32(0x7F800000)), builder.shl(sh, _i32(23)))
    cb = builder.select(builder.icmp_unsigned(">", cb, lowest), cb, lowest)
    t = builder.bitcast(builder.fadd(builder.bitcast(a, f), builder.bitcast(cb, f)), i32)
    return builder.add(builder.sub(t, cb), builder.sub(builder.lshr(cb, sh), first))


def _f8_signed(builder, u, code):
    """``code`` with the sign of the float32 bits ``u``."""
    return builder.or_(code, builder.and_(builder.lshr(u, _i32(24)), _i32(0x80)))


@intrinsic
def f8_code_sr(typingctx, y, inv, pos, i, key):
    """The e5m2 code of the float32 product ``y * inv`` stochastically rounded, as
    :func:`arraytrain.lowbit.sr_codes`: the bits of ``|q|`` (below e5m2's normal range those of
    ``|q| + 2**-14``, a float32 addition, where the step is 2**-16 on both sides) plus 21 bits of noise
    (``((pos + i) ^ key) * 0x85EBCA77 >> 11``, 32-bit arithmetic; ``pos + i`` the element's position
    in its parameter, ``i`` the loop's index, so that the vector loop counts in 32 bits; ``key``
    :func:`arraytrain.lowbit.sr_key`'s), shifted by 21 and rebiased (4 codes less for the shifted
    ones), at most the largest finite code."""
    def codegen(context, builder, signature, args):
        i32, f = ir.IntType(32), ir.FloatType()
        u = builder.bitcast(builder.fmul(args[0], args[1]), i32)
        a = builder.and_(u, _i32(0x7FFFFFFF))
        sub = builder.icmp_unsigned("<", a, _i32(0x38800000))
        shifted = builder.bitcast(builder.fadd(builder.bitcast(a, f), ir.Constant(f, 2.0 ** -14)), i32)
        a = builder.select(sub, shifted, a)
        at = builder.add(builder.trunc(args[2], i32), builder.trunc(args[3], i32))
        noise = builder.lshr(builder.mul(builder.xor(at, builder.trunc(args[4], i32)), _i32(0x85EBCA77)), _i32(11))
        up = builder.sub(builder.lshr(builder.add(a, noise), _i32(21)),
                         builder.select(sub, _i32((112 << 2) + 4), _i32(112 << 2)))
        up = builder.select(builder.icmp_unsigned(">", up, _i32(0x7B)), _i32(0x7B), up)
        return builder.trunc(_f8_signed(builder, u, up), ir.IntType(8))

    return types.uint8(types.float32, types.float32, types.int64, types.int64, types.int64), codegen


def _f8_value_bits(builder, k, wide):
    """float8 ``code`` (i8) -> (float32 value, no F16C): the exponent and mantissa bits moved into
    place and the exponent rebiased; subnormal codes ``mantissa * 2**-9 | 2**-16``; e4m3's 0x7F,
    e5m2's 0x7D-0x7F NaN (0x7FC00000), e5m2's 0x7C infinity; the sign or-ed in."""
    i32, f = ir.IntType(32), ir.FloatType()
    c = lambda v: ir.Constant(i32, v)  # noqa: E731
    sh, rebias = builder.select(wide, c(21), c(20)), builder.select(wide, c(112), c(120))
    k = builder.zext(k, i32)
    mag = builder.and_(k, c(0x7F))
    normal = builder.bitcast(builder.add(builder.shl(mag, sh), builder.shl(rebias, c(23))), f)
    tiny = builder.select(wide, ir.Constant(f, 2.0 ** -16), ir.Constant(f, 2.0 ** -9))
    sub = builder.fmul(builder.sitofp(mag, f), tiny)
    v = builder.select(builder.icmp_unsigned("<", mag, builder.select(wide, c(4), c(8))), sub, normal)
    nan = builder.select(wide, builder.icmp_unsigned(">", mag, c(0x7C)), builder.icmp_unsigned("==", mag, c(0x7F)))
    inf = builder.and_(wide, builder.icmp_unsigned("==", mag, c(0x7C)))
    v = builder.select(inf, builder.bitcast(c(0x7F800000), f), v)
    v = builder.select(nan, builder.bitcast(c(0x7FC00000), f), v)
    return builder.bitcast(builder.or_(builder.bitcast(v, i32), builder.shl(builder.and_(k, c(0x80)), c(24))), f)


def _f8_value_f16c(builder, k, wide):
    """float8 ``code`` (i8) -> (its value * 2**-8 for e4m3, its value for e5m2, as float32) through
    float16, which holds every float8 value of both formats exactly: e5m2's code is float16's top
    byte (the same bias, subnormals, infinities); e4m3's magnitude shifted one place less, so the
    float16 is the value * 2**-8 (the caller multiplies by 2**8, exactly) and its subnormals are
    float16 subnormals, which F16C's convert widens exactly whatever MXCSR's DAZ says. NaN codes
    (e4m3's 0x7F, e5m2's 0x7D-0x7F) become float16 0x7E00, float32 0x7FC00000 as ml_dtypes gives,
    with the code's sign."""
    i16 = ir.IntType(16)
    c = lambda v: ir.Constant(i16, v)  # noqa: E731
    h = builder.shl(builder.zext(k, i16), c(8))
    if wide:
        nan = builder.icmp_unsigned(">", builder.and_(h, c(0x7FFF)), c(0x7C00))
    else:
        h = builder.and_(builder.ashr(h, c(1)), c(0xBF80))
        nan = builder.icmp_unsigned("==", builder.and_(h, c(0x7FFF)), c(0x3F80))
    h = builder.select(nan, builder.or_(builder.and_(h, c(0x8000)), c(0x7E00)), h)
    return builder.fpext(builder.bitcast(h, ir.HalfType()), ir.FloatType())


def _literal_bool(ty):
    """The value of a boolean literal type, else None."""
    return ty.literal_value if isinstance(ty, types.BooleanLiteral) else None


@intrinsic(prefer_literal=True)
def f8_value(typingctx, code, scale, wide):
    """The value of float8 ``code`` (e4m3, or e5m2 with ``wide``) times ``scale``, as the reference's
    ``map[code] * scale``: one float32 rounding. With F16C and the format a literal (the kernels
    compile each format's loop on its own): through float16 (``_f8_value_f16c``; e4m3's value
    times 2**8 first, exact, so that any scale, even one no encoder gives, rounds as the map's
    value times it); otherwise the integer decode (``_f8_value_bits``)."""
    literal = _literal_bool(wide)

    def codegen(context, builder, signature, args):
        if literal is not None and has_f16c(context):
            v = _f8_value_f16c(builder, args[0], literal)
            if not literal:
                v = builder.fmul(v, ir.Constant(ir.FloatType(), 256.0))
            return builder.fmul(v, args[1])
        return builder.fmul(_f8_value_bits(builder, args[0], args[2]), args[1])

    return types.float32(types.uint8, types.float32, wide), codegen


@intrinsic
def exact_div(typingctx, a, b):
    """float32 ``a / b``, correctly rounded (an ``fdiv`` without the kernels' reciprocal flags)."""
    def codegen(context, builder, signature, args):
        return builder.fdiv(args[0], args[1])

    return types.float32(types.float32, types.float32), codegen


@njit(inline="always", **JIT)
def f8_decode_block(cb, scale, tmp, wide):
    """``tmp[i]``: the value of float8 code ``cb[i]`` (e4m3, or e5m2 with ``wide``) times the block's ``scale``."""
    for i in range(cb.size):
        tmp[i] = f8_value(cb[i], scale, wide)


@njit(inline="always", **JIT)
def _f8_block_scale(vals, cb, wide):
    """A block's ``(inv, scale)`` as :func:`arraytrain.lowbit.float8_encode` forms them: ``inv`` the
    factor to the format's largest value and ``scale`` its inverse; a block holding a NaN or an
    infinity (scale NaN, codes 0x7F) or only magnitudes below ``F8_TINY`` (scale 0, zeros) gets its
    codes here, and ``inv`` 0."""
    m = np.uint32(0)
    for i in range(vals.size):
        m = umax32(m, abs_bits(vals[i]))
    if m >= np.uint32(0x7F800000):  # a NaN or an infinity: a NaN block
        for i in range(vals.size):
            cb[i] = np.uint8(0x7F)
        return np.float32(0.0), bits_as_f32(np.uint32(0x7FC00000))
    am = bits_as_f32(m)
    if am < np.float32(2.0 ** -111):  # (lowbit.F8_TINY) stored as zeros
        for i in range(vals.size):
            cb[i] = f8_code(vals[i], np.float32(0.0), wide)
        return np.float32(0.0), np.float32(0.0)
    top = np.float32(57344.0) if wide else np.float32(448.0)  # (lowbit.F8_TOP)
    return exact_div(top, am), exact_div(am, top)


@njit(inline="always", **JIT)
def f8_encode_block(vals, cb, wide):
    """Encode a block's float32 ``vals`` into float8 codes ``cb`` (e4m3, or e5m2 with ``wide``) as
    :func:`arraytrain.lowbit.float8_encode`; returns the block's scale."""
    inv, scale = _f8_block_scale(vals, cb, wide)
    if inv != 0.0:
        for i in range(vals.size):
            cb[i] = f8_code(vals[i], inv, wide)
    return scale


@njit(inline="always", **JIT)
def f8_encode_block_sr(vals, cb, pos, key):
    """:func:`f8_encode_block` in e5m2 with stochastic rounding (:func:`f8_code_sr`; ``pos`` the
    position of ``vals[0]`` in its parameter), as :func:`arraytrain.lowbit.sr_codes`."""
    inv, scale = _f8_block_scale(vals, cb, True)
    if inv != 0.0:
        for i in range(vals.size):
            cb[i] = f8_code_sr(vals[i], inv, pos, i, key)
    return scale


def state_step(a, seg, n):
    """Elements per step of a piece of ``n`` elements of segment ``seg`` (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


def state_scratch(a):
    """The scratch block ``state_open`` decodes into: 256 float32 for an 8-bit slot (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


def state_open(a, seg, lo, hi, tmp):
    """The float values of elements ``[lo, hi)`` of a slot, to read and write (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


def state_close(a, seg, lo, hi, vals):
    """Store back what ``state_open`` gave, after the element loop (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


def _is_q8(a):
    """A block-quantized slot (8-bit or float8: a tuple)."""
    return isinstance(a, types.BaseTuple)


def _is_f8(a):
    from ..interface import F8

    return isinstance(a, types.BaseNamedTuple) and issubclass(a.instance_class, F8)


def _is_e5m2(a):
    """A float8 slot's format, from its type (:class:`arraytrain.kernels.interface.F8E5M2`): each
    slot's codec compiled in its one format."""
    from ..interface import F8E5M2

    return a.instance_class is F8E5M2


@overload(state_step, inline="always", jit_options=JIT)
def _state_step(a, seg, n):
    if _is_q8(a):
        def impl(a, seg, n):
            return QBLOCK if a.quant[seg] else max(n, 1)
        return impl
    return lambda a, seg, n: max(n, 1)


@overload(state_scratch, inline="always", jit_options=JIT)
def _state_scratch(a):
    if _is_q8(a):
        return lambda a: np.empty(QBLOCK, np.float32)
    return lambda a: a[:0]


@overload(state_open, inline="always", jit_options=JIT)
def _state_open(a, seg, lo, hi, tmp):
    if _is_f8(a):
        wide = _is_e5m2(a)  # (the format's loop compiled with its constants)

        def impl(a, seg, lo, hi, tmp):
            off, b = a.offset[seg], a.base[seg]
            if a.quant[seg]:
                vals = tmp[: hi - lo]
                f8_decode_block(a.codes[lo:hi], a.aux[b + (lo - off) // QBLOCK], vals, wide)
                return vals
            return a.aux[b + lo - off : b + hi - off]
        return impl
    if _is_q8(a):
        def impl(a, seg, lo, hi, tmp):
            off, b = a.offset[seg], a.base[seg]
            if a.quant[seg]:
                vals = tmp[: hi - lo]
                q8_decode_block(a.codes[lo:hi], a.aux[b + (lo - off) // QBLOCK], a.qmap, vals, a.qmap[0] < 0)
                return vals
            return a.aux[b + lo - off : b + hi - off]
        return impl
    return lambda a, seg, lo, hi, tmp: a[lo:hi]


@overload(state_close, inline="always", jit_options=JIT)
def _state_close(a, seg, lo, hi, vals):
    if _is_f8(a) and _is_e5m2(a):
        def impl(a, seg, lo, hi, vals):
            if a.quant[seg]:  # (stochastic rounding: the element's place and the step's salt)
                sc = f8_encode_block_sr(vals, a.codes[lo:hi], lo - a.offset[seg] + a.start[seg],
                                        (a.salt ^ ((seg * 0x27D4EB2F) & 0xFFFFFFFF)) & 0xFFFFFFFF)
                k = a.base[seg] + (lo - a.offset[seg]) // QBLOCK
                scale = a.aux[k : k + 1]  # (a one-element view: see the 8-bit close below)
                scale[0] = sc
        return impl
    if _is_f8(a):
        def impl(a, seg, lo, hi, vals):
            if a.quant[seg]:
                sc = f8_encode_block(vals, a.codes[lo:hi], False)
                k = a.base[seg] + (lo - a.offset[seg]) // QBLOCK
                scale = a.aux[k : k + 1]
                scale[0] = sc
        return impl
    if _is_q8(a):
        def impl(a, seg, lo, hi, vals):
            if a.quant[seg]:
                am = q8_encode_block(vals, a.codes[lo:hi], a.table, a.shift, a.bias, a.nb, a.qmap[0] < 0)
                # through a one-element view: a store straight into ``a.aux[k]`` was dropped
                # inside a prange loop (numba 0.68's parfor lowering of a tuple member)
                k = a.base[seg] + (lo - a.offset[seg]) // QBLOCK
                scale = a.aux[k : k + 1]
                scale[0] = am
        return impl
    return lambda a, seg, lo, hi, vals: None
