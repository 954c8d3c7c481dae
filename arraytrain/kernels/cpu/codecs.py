"""The CPU family's storage codecs and per-element accessors, resolved when a kernel is typed.

bfloat16/float16 as uint16 bits (encode/decode, bit-exact with ml_dtypes/NumPy casts), the
state accessor (``load_state``/``store_state``: float storage as is, uint16 storage as
bfloat16), the working-copy writer and the pruning-mask store. All inline into the kernels.
"""

from __future__ import annotations

import warnings

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.errors import NumbaIRAssumptionWarning
from numba.extending import intrinsic, overload
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


# -- 8-bit state (arraytrain.state8) -----------------------------------------------------------
#
# An 8-bit slot reaches a kernel as arraytrain.state8.Q8 (a named tuple of arrays and ints);
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


def has_avx2(context) -> bool:
    """Whether the target the kernels are compiled for has AVX2 (its 8-lane gathers)."""
    features = getattr(context.codegen(), "_tm_features", "") or ""
    return "+avx2" in features.split(",")


def _splat(builder, value, vt):
    i32 = ir.IntType(32)
    undef = ir.Constant(vt, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(i32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(i32, vt.count), [0] * vt.count))


# The encoder's table lookup is a gather. LLVM's cost model prices a gather as the scalar
# loads it replaces on AMD cores and on Haswell, so a numba loop that indexes the table stays
# scalar (1.6 ns per element measured on a Zen 5 core, 6x the rest of the step). The loop is
# written here in vector IR instead, 8 lanes per iteration with one vpgatherdd (AVX2, so the
# same code for an AVX2 and an AVX-512 target); it returns where the scalar tail starts (0 on
# a target without AVX2: the whole block through the scalar loop).
@intrinsic
def q8_encode_lanes(typingctx, vals, codes, r, table, shift, bias, nb):
    """Codes of ``vals[i] * r`` for the first ``8 * (n // 8)`` elements; returns that count."""
    sig = types.intp(vals, codes, types.float32, table, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        from numba.core import cgutils

        intp = context.get_value_type(types.intp)
        if not has_avx2(context):
            return ir.Constant(intp, 0)
        i8, i32 = ir.IntType(8), ir.IntType(32)
        v8i32, v8f, v8i8 = ir.VectorType(i32, 8), ir.VectorType(ir.FloatType(), 8), ir.VectorType(i8, 8)
        c = lambda v: ir.Constant(v8i32, [v] * 8)  # noqa: E731
        va = context.make_array(signature.args[0])(context, builder, args[0])
        ca = context.make_array(signature.args[1])(context, builder, args[1])
        ta = context.make_array(signature.args[3])(context, builder, args[3])
        sh, bi, nbs = (builder.trunc(a, i32) for a in args[4:7])
        r8, sh8, bi8, nb8 = _splat(builder, args[2], v8f), _splat(builder, sh, v8i32), _splat(builder, bi, v8i32), \
            _splat(builder, nbs, v8i32)
        top8 = builder.sub(nb8, c(1))
        lowmask8 = builder.sub(builder.shl(c(1), sh8), c(1))
        gather = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v8i32, [v8i32, i8.as_pointer(), v8i32, v8i32, i8]),
            "llvm.x86.avx2.gather.d.d.256")
        base = builder.bitcast(ta.data, i8.as_pointer())
        n8 = builder.and_(va.nitems, ir.Constant(intp, -8))
        with cgutils.for_range_slice(builder, ir.Constant(intp, 0), n8, ir.Constant(intp, 8)) as (i, _):
            x = builder.load(builder.bitcast(cgutils.gep_inbounds(builder, va.data, i), v8f.as_pointer()), align=4)
            u = builder.bitcast(builder.fmul(x, r8), v8i32)
            sign = builder.lshr(u, c(31))
            k = builder.sub(builder.lshr(builder.and_(u, c(0x7FFFFFFF)), sh8), bi8)
            k = builder.select(builder.icmp_signed("<", k, c(0)), c(0), k)
            k = builder.select(builder.icmp_signed(">", k, top8), top8, k)
            e = builder.call(gather, [c(0), base, builder.add(builder.mul(sign, nb8), k), c(-1), ir.Constant(i8, 4)])
            moved = builder.zext(builder.icmp_unsigned(">=", builder.and_(u, lowmask8), builder.lshr(e, c(8))), v8i32)
            step = builder.select(builder.icmp_unsigned("==", sign, c(0)), moved, builder.sub(c(0), moved))
            code = builder.trunc(builder.add(builder.and_(e, c(255)), step), v8i8)
            builder.store(code, builder.bitcast(cgutils.gep_inbounds(builder, ca.data, i), v8i8.as_pointer()), align=1)
        return n8

    return sig, codegen


@njit(inline="always", **JIT)
def q8_decode_block(cb, am, qmap, tmp):
    """``tmp[i] = qmap[cb[i]] * am``: a block's float32 values from its codes."""
    for i in range(cb.size):
        tmp[i] = qmap[cb[i]] * am


@njit(inline="always", **JIT)
def q8_encode_block(vals, cb, table, shift, bias, nb):
    """Encode a block's float32 ``vals`` into ``cb``; returns the block's absmax."""
    m = np.uint32(0)
    for i in range(vals.size):
        m = umax32(m, abs_bits(vals[i]))
    am = bits_as_f32(m)
    r = np.float32(1.0) / am if am > 0 else np.float32(0.0)
    for i in range(q8_encode_lanes(vals, cb, r, table, shift, bias, nb), vals.size):
        q = vals[i] * r
        cb[i] = q8_pick(q, table[q8_bucket(q, shift, bias, nb)], shift)
    return am


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
    return isinstance(a, types.BaseTuple)


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
    if _is_q8(a):
        def impl(a, seg, lo, hi, tmp):
            off, b = a.offset[seg], a.base[seg]
            if a.quant[seg]:
                vals = tmp[: hi - lo]
                q8_decode_block(a.codes[lo:hi], a.aux[b + (lo - off) // QBLOCK], a.qmap, vals)
                return vals
            return a.aux[b + lo - off : b + hi - off]
        return impl
    return lambda a, seg, lo, hi, tmp: a[lo:hi]


@overload(state_close, inline="always", jit_options=JIT)
def _state_close(a, seg, lo, hi, vals):
    if _is_q8(a):
        def impl(a, seg, lo, hi, vals):
            if a.quant[seg]:
                am = q8_encode_block(vals, a.codes[lo:hi], a.table, a.shift, a.bias, a.nb)
                # through a one-element view: a store straight into ``a.aux[k]`` was dropped
                # inside a prange loop (numba 0.68's parfor lowering of a tuple member)
                k = a.base[seg] + (lo - a.offset[seg]) // QBLOCK
                scale = a.aux[k : k + 1]
                scale[0] = am
        return impl
    return lambda a, seg, lo, hi, vals: None
