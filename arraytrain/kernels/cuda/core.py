"""The machinery of the CUDA kernel family: CuPy, compiled modules, chunk tables, launches.

Kernel sources are module-level constants of the sibling modules, compiled lazily
by NVRTC through ``cupy.RawModule`` (one module per template instance, memoised per
device; CuPy also keeps the compiled code in its on-disk kernel cache). Every source
starts with :data:`HEADER`, which holds what all kernels share: the storage codecs
(bfloat16 state and bfloat16/float16 working copies as uint16 bits, bit-exact with the
CPU family's), the state accessors, the per-segment value accessor and the block
reductions.

Launch geometry is fixed by the layout alone, never by timing: element-wise kernels run
one block of :data:`THREADS` threads per chunk of at most :data:`CHUNK` elements (a chunk
lies inside one parameter, so per-parameter values are read once per block, as torch's
multi-tensor-apply does), and reductions add float64 per-chunk partials per segment in a
fixed tree order, so their bits do not change from run to run.
"""

from __future__ import annotations

import os
import weakref

import numpy as np

from ...errors import BackendUnavailableError, HyperparameterError

THREADS = 256
# Elements per block in element-wise kernels: 16 per thread, and ~2.4e4 blocks at 1e8
# elements (>> 132 SMs x 8). Reductions take whole pieces (<= 2**14 elements, 64 per
# thread): each block ends in a tree reduction, which a longer chunk amortises.
CHUNK = 4096
REDUCE_CHUNK = 1 << 14
# nvcc/NVRTC options shared by every module: C++17, IEEE division and square root (the
# defaults; fast-math would flush denormals and approximate sqrt).
OPTIONS = ("-std=c++17",)

HEADER = r"""
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// -- storage codecs: round to nearest even, the same bits as the CPU family -------------
__device__ __forceinline__ float bf16_decode(u16 h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ u16 bf16_encode(float x) {
    u32 u = __float_as_uint(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((u >> 16) | 0x40u);  // NaN stays a quiet NaN
    return (u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
// float16 bits, round to nearest even (cvt.rn.f16.f32's result, in integer steps the CPU executor
// runs too): a NaN stays a quiet NaN of its sign, from 65520 up infinity, below 2^-14 the
// subnormals' fixed step 2^-24 (the float adder rounds |x| + 0.5, whose last place it is).
__device__ __forceinline__ u16 f16_encode(float x) {
    const u32 u = __float_as_uint(x), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (u16)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
    if (a >= 0x477FF000u) return (u16)(sign | 0x7C00u);
    if (a < 0x38800000u) return (u16)(sign | (__float_as_uint(__fadd_rn(__uint_as_float(a), 0.5f)) - 0x3F000000u));
    return (u16)(sign | ((a + 0xFFFu + ((a >> 13) & 1u) - 0x38000000u) >> 13));
}

// -- state accessors: float/double storage as is, u16 storage as bfloat16 bits ----------
template <typename S> struct state;
template <> struct state<float> {
    __device__ __forceinline__ static float load(const float* a, i64 i) { return a[i]; }
    __device__ __forceinline__ static float store(float* a, i64 i, float x) { a[i] = x; return x; }
};
template <> struct state<double> {
    __device__ __forceinline__ static double load(const double* a, i64 i) { return a[i]; }
    __device__ __forceinline__ static double store(double* a, i64 i, double x) { a[i] = x; return x; }
};
template <> struct state<u16> {
    __device__ __forceinline__ static float load(const u16* a, i64 i) { return bf16_decode(a[i]); }
    // returns the value as stored, so the update continues from the rounded state
    __device__ __forceinline__ static float store(u16* a, i64 i, float x) {
        u16 h = bf16_encode(x); a[i] = h; return bf16_decode(h);
    }
};

// -- 8-bit state (arraytrain.lowbit): bitsandbytes' blockwise dynamic quantization ---------
// An 8-bit slot reaches a kernel as a pointer to its descriptor `q8` in device memory (built
// from arraytrain.kernels.interface.Q8 by the launchers: 8 pointers, 4 ints and a salt, 88 bytes). Per segment:
// quant[seg] != 0: one uint8 code per element (codes[i], at the flat offsets) and one float32
// absmax per block of Q8_BLOCK elements counted from the parameter's first element
// (aux[base[seg] + (i - offset[seg]) / Q8_BLOCK]), value = qmap[code] * absmax; else the
// segment's float32 values in the side array (aux[base[seg] + i - offset[seg]]).
// `codec`: 0 the dynamic map (its bucket `table`), 1 float8 e4m3 codes with a float32 scale
// per block (arraytrain.kernels.interface.F8; qmap the e4m3 values, no table), 2 the same in
// e5m2 (slots never negative): decoding is qmap[code] * scale alike. An e5m2 slot is encoded with
// stochastic rounding (f8_code_sr): `start[seg]` the position in its parameter of the segment's
// first element held here, `salt` the step's key (arraytrain.lowbit.sr_salt); null and 0 otherwise.
#define Q8_BLOCK 256
struct q8 {
    unsigned char* codes; float* aux; const i64* base; const unsigned char* quant; const i64* offset;
    const float* qmap; const int* table; int shift, bias, nb, codec; const i64* start; unsigned long long salt;
};
static_assert(sizeof(q8) == 88, "q8: the launchers write 11 eight-byte words");
template <typename S> struct is_q8 { static constexpr bool value = false; };
template <> struct is_q8<q8> { static constexpr bool value = true; };

// The largest of every thread's u32 in the block (all threads must call it; blockDim.x a
// multiple of 32). Two barriers: the partials are free again when it returns.
__device__ __forceinline__ u32 block_umax(u32 u) {
    __shared__ u32 q8_part[32];
#if __CUDA_ARCH__ >= 800
    u = __reduce_max_sync(0xffffffffu, u);
#else
    for (int o = 16; o > 0; o >>= 1) u = max(u, __shfl_xor_sync(0xffffffffu, u, o));
#endif
    if ((threadIdx.x & 31) == 0) q8_part[threadIdx.x >> 5] = u;
    __syncthreads();
    u = q8_part[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) u = max(u, q8_part[w]);
    __syncthreads();
    return u;
}

// The code of float32 q from the codebook's bucket table (arraytrain.lowbit.Codebook): the
// bucket of q's bits (sign, exponent, top mantissa bits) holds `threshold << 8 | code`; the
// code moves one towards larger magnitude where q's low `shift` bits reach the threshold.
// The same integer steps as the CPU family's q8_bucket/q8_pick, so the same codes for the
// same q (a NaN takes the top code of its sign's half: 255 for +NaN, 0 for -NaN).
__device__ __forceinline__ unsigned char q8_code(float q, const int* table, int shift, int bias, int nb) {
    const u32 u = __float_as_uint(q);
    const u32 sign = u >> 31;
    int k = (int)((u & 0x7FFFFFFFu) >> shift) - bias;
    k = k < 0 ? 0 : (k > nb - 1 ? nb - 1 : k);
    const u32 e = (u32)__ldg(table + sign * (u32)nb + (u32)k);
    const u32 moved = (u & ((1u << shift) - 1u)) >= (e >> 8) ? 1u : 0u;
    return (unsigned char)((e & 255u) + (sign ? 0u - moved : moved));
}

// The float8 code (e4m3, or e5m2 with `wide`) of the float32 product y * inv (finite, at most a
// little above the format's largest value), round to nearest even: the CPU family's f8_code, step
// for step. The adder rounds: |q| + c, with c the power of two whose last place is the format's
// step in |q|'s binade (2^(e + 20 | 21), at least the smallest normal's binade, where the
// subnormals' fixed step applies); the bit patterns' difference counts the steps and c's exponent
// gives the binade's first code.
__device__ __forceinline__ unsigned char f8_code(float y, float inv, bool wide) {
    const u32 sh = wide ? 21u : 20u;
    const u32 u = __float_as_uint(__fmul_rn(y, inv));
    const u32 a = u & 0x7FFFFFFFu;
    const u32 c = max((a & 0x7F800000u) + (sh << 23), wide ? 0x38800000u + (21u << 23) : 0x3C800000u + (20u << 23));
    const u32 t = __float_as_uint(__fadd_rn(__uint_as_float(a), __uint_as_float(c)));
    return (unsigned char)((t - c + (c >> sh) - (wide ? (134u << 2) : (141u << 3))) | ((u >> 24) & 0x80u));
}

// The e5m2 code of y * inv stochastically rounded (arraytrain.lowbit.sr_codes; the CPU family's
// f8_code_sr): the bits of |q| (below e5m2's normal range those of |q| + 2^-14, where the step is
// 2^-16 on both sides) plus 21 bits of noise, the top bits of (pos ^ key) * 0x85EBCA77
// (pos the element's position in its parameter, key the slot's salt mixed with the segment),
// shifted by 21 and rebiased (4 codes less for the shifted ones), at most the top finite code 0x7B.
__device__ __forceinline__ unsigned char f8_code_sr(float y, float inv, i64 pos, u32 key) {
    const u32 u = __float_as_uint(__fmul_rn(y, inv));
    u32 a = u & 0x7FFFFFFFu;
    const bool sub = a < 0x38800000u;
    if (sub) a = __float_as_uint(__fadd_rn(__uint_as_float(a), 0x1p-14f));
    const u32 noise = (((u32)pos ^ key) * 0x85EBCA77u) >> 11;
    const u32 up = min(((a + noise) >> 21) - (sub ? (112u << 2) + 4u : (112u << 2)), 0x7Bu);
    return (unsigned char)(up | ((u >> 24) & 0x80u));
}

// -- a state slot inside a kernel: slot<S> M(m, seg); M.load(i), M.store(i, x), M.close(i, live) --
// float/double/u16 storage: the state accessor above, close() does nothing.
template <typename S> struct slot {
    S* a;
    __device__ __forceinline__ slot(const S* a_, int) : a(const_cast<S*>(a_)) {}
    __device__ __forceinline__ auto load(i64 i) const { return state<S>::load(a, i); }
    template <typename X> __device__ __forceinline__ auto store(i64 i, X x) { return state<S>::store(a, i, x); }
    __device__ __forceinline__ void close(i64, bool) {}
};
// 8-bit storage. load decodes (a float32 product, never contracted into what follows, as the
// CPU family's decode stores it); store keeps this thread's new value in `x` and returns it
// (the update goes on with the float value; side-array segments are written at once);
// close(i, live), reached by every thread of the block once per Q8_BLOCK elements after the
// element loop's body, encodes the block from the kept values: absmax = the largest |x| as
// bits (a NaN wins), r = 1/absmax (0 where absmax is 0 or NaN), code(x * r). Lanes past the
// chunk's end keep x = 0, which never raises the max. Read before written: a block's codes
// and absmax are read in the body, written after close's first barrier.
template <> struct slot<q8> {
    unsigned char* codes; float* aux; const float* qmap; const int* table;
    i64 off, first; int shift, bias, nb, codec; u32 key; bool quant; float x;
    __device__ __forceinline__ slot(const q8* d, int seg)
        : codes(nullptr), aux(nullptr), qmap(nullptr), table(nullptr), off(0), first(0), shift(0), bias(0), nb(0),
          codec(0), key(0), quant(false), x(0.0f) {
        if (d == nullptr) return;  // a slot this configuration lacks (never read, stored or closed)
        codes = d->codes; qmap = d->qmap; table = d->table;
        shift = d->shift; bias = d->bias; nb = d->nb; codec = d->codec;
        aux = d->aux + d->base[seg];
        off = d->offset[seg];
        quant = d->quant[seg] != 0;
        if (codec == 2) {  // e5m2: the stochastic rounding's place and key (arraytrain.lowbit.sr_key)
            first = d->start[seg] - off;
            key = (u32)d->salt ^ ((u32)seg * 0x27D4EB2Fu);
        }
    }
    // i - off >= 0: a chunk lies inside its segment, so >> 8 is the block index
    __device__ __forceinline__ float load(i64 i) const {
        return quant ? __fmul_rn(__ldg(qmap + codes[i]), aux[(i - off) >> 8]) : aux[i - off];
    }
    __device__ __forceinline__ float store(i64 i, float v) {
        if (quant) x = v; else aux[i - off] = v;
        return v;
    }
    __device__ __forceinline__ void close(i64 i, bool live) {
        if (!quant) return;  // one segment per chunk: the same branch for the whole block
        if (codec != 0) { close_float8(i, live); return; }  // the slot's codec: the same branch everywhere
        const float am = __uint_as_float(block_umax(__float_as_uint(x) & 0x7FFFFFFFu));
        const float r = am > 0.0f ? __fdiv_rn(1.0f, am) : 0.0f;
        if (live) codes[i] = q8_code(__fmul_rn(x, r), table, shift, bias, nb);
        if (threadIdx.x == 0) aux[(i - off) >> 8] = am;  // thread 0's element starts the block
        x = 0.0f;
    }
    // float8 (arraytrain.lowbit.float8_encode; codec 1 e4m3, 2 e5m2): the largest |x| as bits; not
    // finite: a NaN block (scale NaN, codes 0x7F); below 2^-111: zeros (scale 0); else the codes of
    // x * (top / largest) and the scale largest / top (top 448 | 57344).
    __device__ __forceinline__ void close_float8(i64 i, bool live) {
        const bool wide = codec == 2;
        const u32 m = block_umax(__float_as_uint(x) & 0x7FFFFFFFu);
        float scale;
        if (m >= 0x7F800000u) {
            if (live) codes[i] = 0x7F;
            scale = __uint_as_float(0x7FC00000u);
        } else {
            const float am = __uint_as_float(m), top = wide ? 57344.0f : 448.0f;
            const bool tiny = am < 0x1p-111f;
            const float inv = tiny ? 0.0f : __fdiv_rn(top, am);
            if (live) codes[i] = wide && !tiny ? f8_code_sr(x, inv, i + first, key) : f8_code(x, inv, wide);
            scale = tiny ? 0.0f : __fdiv_rn(am, top);
        }
        if (threadIdx.x == 0) aux[(i - off) >> 8] = scale;
        x = 0.0f;
    }
};

// -- the per-element epilogue: mask, working copy ---------------------------------------
// WK: 0 no working copy, 1 bfloat16, 2 float16 (uint16 bits). MASK: a uint8 keep-mask.
template <typename T, int WK, bool MASK>
__device__ __forceinline__ void store_param(T* p, u16* w, const unsigned char* mask, i64 i, T x) {
    if (MASK) { if (mask[i] == 0) x = (T)0; }  // a pruned weight is an exact +0, NaN or not
    p[i] = x;
    if (WK == 1) w[i] = bf16_encode((float)x);
    if (WK == 2) w[i] = f16_encode((float)x);
}

// A per-segment hyperparameter: an array indexed by segment, or one value for all
// (a null pointer): no host-to-device copy when every parameter shares the value.
template <typename T>
__device__ __forceinline__ T seg_value(const T* a, T a0, int seg) { return a ? a[seg] : a0; }

// -- the chunk table: rows [start, stop, segment] ------------------------------------
struct chunk { i64 lo, hi; int seg; };
__device__ __forceinline__ chunk load_chunk(const i64* chunks) {
    const i64* c = chunks + 3 * (i64)blockIdx.x;
    chunk r; r.lo = c[0]; r.hi = c[1]; r.seg = (int)c[2];
    return r;
}

// -- block reductions in a fixed order (deterministic bits) -------------------------------
template <bool MAX>
__device__ __forceinline__ double combine(double a, double b) { return MAX ? fmax(a, b) : a + b; }

template <bool MAX>
__device__ double block_reduce(double x) {
    __shared__ double warp_part[32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) x = combine<MAX>(x, __shfl_down_sync(0xffffffffu, x, o));
    if (lane == 0) warp_part[wid] = x;
    __syncthreads();
    x = (threadIdx.x < nw) ? warp_part[threadIdx.x] : 0.0;
    if (wid == 0)
        for (int o = 16; o > 0; o >>= 1) x = combine<MAX>(x, __shfl_down_sync(0xffffffffu, x, o));
    __syncthreads();  // warp_part may be reused by a second reduction in the same kernel
    return x;         // valid in thread 0
}
"""

_cupy = None


def cupy():
    """CuPy, imported on first use; a clear error naming the extra when it is missing.

    With ``ARRAYTRAIN_CUDA=cpu``: :mod:`.on_cpu`, the executor of these sources on the CPU
    (device arrays are NumPy arrays, every kernel runs on the host), which stands for CuPy.
    """
    global _cupy
    if _cupy is None:
        mode = os.environ.get("ARRAYTRAIN_CUDA", "")
        if mode not in ("", "cpu"):
            raise HyperparameterError(f"ARRAYTRAIN_CUDA={mode!r}: 'cpu' (the CUDA sources executed on the CPU) "
                                      "or unset")
        if mode == "cpu":
            from . import on_cpu

            _cupy = on_cpu
            return _cupy
        try:
            import cupy as cp
        except ImportError:
            raise BackendUnavailableError(
                "the CUDA backend needs CuPy: pip install 'arraytrain[cuda12]' or 'arraytrain[cuda13]' "
                "(matching your CUDA driver)"
            ) from None
        _cupy = cp
    return _cupy


def device():
    """The current device as a cache key: CuPy's device id, or the CPU executor's (never confused)."""
    cp = cupy()
    return cp.__name__, cp.cuda.Device().id


class Source:
    """One CUDA source (a module constant) and the template instances it may be asked for.

    ``instances`` lists every name expression (``"arraytrain_x<float,0>"``) the
    launchers use, so that the build check compiles exactly what can run.
    """

    def __init__(self, code: str, instances):
        self.code = HEADER + code
        self.instances = tuple(instances)
        self._functions, self._modules = {}, {}

    def function(self, expr: str):
        """The compiled kernel for ``expr`` on the current device (compiled on first use)."""
        if expr not in self.instances:
            raise KeyError(f"{expr!r} is not a declared instance of this source")
        key = (expr, device())
        fn = self._functions.get(key)
        if fn is None:
            cp = cupy()
            # NVRTC compiles the instance asked for; the CPU executor every declared instance at once
            # (one run of the host compiler per source, a tenth of the time of one per instance)
            whole = getattr(cp, "COMPILES_WHOLE_SOURCES", False)
            mod = self._modules.get(key[1]) if whole else None
            if mod is None:
                mod = cp.RawModule(code=self.code, options=OPTIONS, name_expressions=self.instances if whole else (expr,))
                if whole:
                    self._modules[key[1]] = mod
            fn = self._functions[key] = mod.get_function(expr)
        return fn


def ctype(dtype) -> str:
    return {np.dtype(np.float32): "float", np.dtype(np.float64): "double", np.dtype(np.uint16): "u16"}[np.dtype(dtype)]


# Kernel launches and device-to-host reads since import (the benchmark reports them per step).
counters = {"launches": 0, "syncs": 0}


def launch(fn, blocks: int, args) -> None:
    if blocks > 0:
        counters["launches"] += 1
        fn((int(blocks),), (THREADS,), tuple(args))


def to_host(a) -> np.ndarray:
    """A device array read back to the host: a synchronisation, counted."""
    counters["syncs"] += 1
    return a.get()


# -- chunk tables, one per (pieces table, device), kept on the device ----------------------


class Chunks:
    """The layout's pieces cut into blocks of at most :data:`CHUNK` elements.

    ``table``: (C, 3) int64 ``[start, stop, segment]`` on the device, ``count`` = C.
    :meth:`seg_ranges` gives each segment's range of chunks (a segment's chunks are
    consecutive), for the per-parameter reductions.
    """

    def __init__(self, pieces: np.ndarray, size: int = CHUNK):
        rows = []
        for lo, hi, seg in np.asarray(pieces).tolist():
            for a in range(lo, hi, size):
                rows.append((a, min(a + size, hi), seg))
        self._host = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        self.count = self._host.shape[0]
        self.table = cupy().asarray(self._host)
        self._ranges = {}
        self._scratch = {}

    def host_rows(self) -> np.ndarray:
        """The table's rows on the host (read-only)."""
        out = self._host.view()
        out.flags.writeable = False
        return out

    def seg_ranges(self, nseg: int):
        """``(seg_lo, seg_hi)`` int64 device arrays of ``nseg`` segments."""
        hit = self._ranges.get(nseg)
        if hit is None:
            segs, cp = self._host[:, 2], cupy()
            s = np.arange(nseg)
            hit = self._ranges[nseg] = (cp.asarray(np.searchsorted(segs, s, side="left").astype(np.int64)),
                                        cp.asarray(np.searchsorted(segs, s, side="right").astype(np.int64)))
        return hit

    def scratch(self, nseg: int):
        """``(part, out)``: float64 device buffers of the reductions, ``C`` and ``1 + nseg`` long.

        Reused by every reduction over this layout: launches on one stream run in order, and
        each result is read back (or consumed by the next launch) before the next reduction.
        Every element is written by each reduction, so they are never zeroed.
        """
        hit = self._scratch.get(nseg)
        if hit is None:
            cp = cupy()
            hit = self._scratch[nseg] = (cp.empty(max(self.count, 1), cp.float64), cp.empty(1 + nseg, cp.float64))
        return hit

    def gate(self):
        """The device gate buffer ``[scale, skip]`` (float64), reused like :meth:`scratch`."""
        if "gate" not in self._scratch:
            self._scratch["gate"] = cupy().empty(2, cupy().float64)
        return self._scratch["gate"]


_chunk_cache: dict = {}


def chunks_for(pieces: np.ndarray, size: int = CHUNK) -> Chunks:
    """The device chunk table of a Layout's ``pieces`` (built once per layout, chunk size and device)."""
    key = (id(pieces), device(), size)
    hit = _chunk_cache.get(key)
    if hit is not None and hit[0]() is pieces:
        return hit[1]
    table = Chunks(pieces, size)
    _chunk_cache[key] = (weakref.ref(pieces, lambda _r, k=key: _chunk_cache.pop(k, None)), table)
    return table


class DeviceScale:
    """A gradient scale formed on the device: ``sign * gate[0]``, and ``gate[1] != 0`` skips the update.

    The engine's CUDA path passes this as an optimizer's ``gscale``: the clip factor
    over the loss scale comes from the norm pass without a host round trip, and a
    non-finite gradient stops every update kernel before it writes anything (torch's
    fused kernels take ``found_inf`` and ``grad_scale`` pointers the same way).
    ``-scale`` is the scale of ``maximize``.
    """

    __slots__ = ("gate", "sign")

    def __init__(self, gate, sign: float = 1.0):
        self.gate, self.sign = gate, float(sign)

    def __neg__(self) -> "DeviceScale":
        return DeviceScale(self.gate, -self.sign)


def seg_arg(values, dtype):
    """A per-segment hyperparameter as (device array or null pointer, scalar): null when all are equal."""
    a = np.asarray(values, np.float64).reshape(-1)
    t = np.dtype(dtype).type
    if a.size == 0:
        return NULL, t(0)
    if np.all(a == a[0]):
        return NULL, t(a[0])
    return cupy().asarray(a.astype(dtype)), t(0)


NULL = np.uint64(0)  # a null pointer argument: CuPy packs an 8-byte zero


def ptr(a):
    """A kernel pointer argument: the array, or a null pointer for an absent or empty one."""
    return a if a is not None and a.size else NULL


def probe() -> bool:
    """True when a CUDA device runs a tiny kernel here (CuPy imports without a GPU)."""
    try:
        cp = cupy()
        x = cp.arange(4, dtype=cp.float32)
        return float((x * 2).sum().get()) == 12.0
    except Exception:
        return False


def refuse_grad_ptrs(grad_ptrs) -> None:
    """Gradients read where they lie (``grad_ptrs``) are the CPU families' alone: the CUDA kernels read
    the flat gradient buffer (the engine copies a CUDA gradient in)."""
    if grad_ptrs is not None:
        raise BackendUnavailableError("grad_ptrs: the CUDA kernels read the flat gradient buffer; gradients read "
                                      "where they lie are built for the CPU kernels only")
