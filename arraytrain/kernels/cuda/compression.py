r"""CUDA compression kernels: the same names, signatures and bits as :mod:`arraytrain.kernels.cpu.compression`.

The math is defined by :mod:`arraytrain.kernels.reference.compression`; every kernel
here gives the reference's bits (the float64 L1 sums of :func:`sign_encode` are added in
another fixed order, which can move the float32 scale by one ulp in rare cases, as the
numba family's order can). Arrays are CuPy arrays on one device; ``block``, ``key``,
``k``, ``factor`` are host scalars. Nothing is read back to the host except where a
size must be known there (none of these kernels needs one: top-k's threshold, its
counts and the random-k set all stay on the device).

Counter RNG: :data:`COUNTER_RNG` is :func:`arraytrain.kernels.counter_rng.uniform` as
a device function (splitmix64 of ``key + (i + 1) * phi``, top 53 bits), the same
numbers on every device, so a stochastic payload encoded by one family decodes with
the other.

Rounding: products that feed a comparison or a subtraction are formed with
``__dmul_rn`` (never contracted into an FMA), so ``t - floor(t)`` and ``u * s < |x|``
see the same rounded product as NumPy does.

* :func:`topk`: a radix select on the magnitude bits, 8 bits per pass (4 passes over
  ``x`` for float32, 8 for float64), each pass a 256-bin histogram of the elements
  that share the prefix chosen so far (shared-memory integer atomics: exact in any
  order) and a one-thread choice of the next digit, all on the device; then a count
  pass and a write pass per chunk that compact the selection in index order with a
  block-wide ballot scan. Ties at the threshold go to the lowest indices, NaN ranks
  above every number (its magnitude bits are the largest).
* :func:`randk_indices`: Floyd's sample without a serial loop. Draw ``j`` is ``t_j``;
  a value below ``n - k`` is in the sample iff some ``t_j`` hits it, and an index
  ``x >= n - k`` is in it iff ``t_x == x``, some later draw hits it, or ``t_x`` was
  already in the sample before step ``x`` (a short chain of lookups of each value's
  first hit, ``first[v] = min{j : t_j = v}``, built with ``atomicMin``). The sample
  goes into an ``n``-bit bitmap, read out in order through per-word popcounts.
  Memory: ``4 n`` bytes for ``first`` and ``n / 8`` for the bitmap.
* :func:`int8_encode`: one warp per block of ``block`` elements (absmax, then codes).
* :func:`sign_encode` / :func:`ternary_encode`: per-piece float64 partials (pieces of
  at most :data:`PIECE` elements inside one block, one warp each, a fixed lane order
  and shuffle tree), combined per block in piece order; bits and codes by separate
  element-wise kernels.
"""

from __future__ import annotations

import numpy as np

from ..interface import INV127
from .core import THREADS, Source, cupy, launch
from .reductions import grid

# Elements per piece of the sign / ternary block reductions (one warp each: 64 per lane).
PIECE = 2048
# Elements per block of top-k's count and write passes (16 ballot tiles of 256).
TOPK_CHUNK = 4096
WARPS = THREADS // 32

COUNTER_RNG = r"""
typedef unsigned long long u64;
// arraytrain.kernels.counter_rng.uniform: a double in [0, 1) for element i of draw key
__device__ __forceinline__ double counter_uniform(u64 key, u64 i) {
    u64 z = key + (i + 1ull) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z = z ^ (z >> 31);
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}
"""

_FLOATS = ("float", "double")
_INDEX = ("u32", "i64")

SOURCE = Source(COUNTER_RNG + r"""
// -- magnitude keys: the bits of |x| as an unsigned integer (NaN above +inf) ----------------
__device__ __forceinline__ u64 mag_key(float x) { return (u64)(__float_as_uint(x) & 0x7FFFFFFFu); }
__device__ __forceinline__ u64 mag_key(double x) { return (u64)__double_as_longlong(x) & 0x7FFFFFFFFFFFFFFFull; }

// warp-level float64 reductions in a fixed shuffle tree (the result in lane 0)
template <bool MAX>
__device__ __forceinline__ double warp_reduce(double x) {
    for (int o = 16; o > 0; o >>= 1) {
        const double y = __shfl_down_sync(0xffffffffu, x, o);
        x = MAX ? fmax(x, y) : x + y;
    }
    return x;
}

// -- top-k -----------------------------------------------------------------------------------
// sel = [prefix, mask, need]: the digits chosen so far, which bits they cover, and how many of
// the elements sharing them are still to be taken. hist: 256 u64 bins (zero on entry).
template <typename T>
__global__ void arraytrain_topk_hist(const T* __restrict__ x, i64 n, int shift, const u64* __restrict__ sel,
                                     u64* __restrict__ hist) {
    __shared__ unsigned int h[256];
    for (int b = threadIdx.x; b < 256; b += blockDim.x) h[b] = 0u;
    __syncthreads();
    const u64 prefix = sel[0], mask = sel[1];
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += stride) {
        const u64 key = mag_key(x[i]);
        if ((key & mask) == prefix) atomicAdd(&h[(int)((key >> shift) & 255ull)], 1u);
    }
    __syncthreads();
    for (int b = threadIdx.x; b < 256; b += blockDim.x)
        if (h[b]) atomicAdd(&hist[b], (u64)h[b]);
}

// One thread: the digit holding the need-th largest of the prefix's elements; hist zeroed again.
__global__ void arraytrain_topk_choose(u64* __restrict__ sel, u64* __restrict__ hist, int shift) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const u64 need = sel[2];
    u64 above = 0;
    int b = 255;
    for (; b > 0; --b) {  // bin 0 holds the rest when no higher bin reaches need
        if (above + hist[b] >= need) break;
        above += hist[b];
    }
    sel[0] |= (u64)b << shift;
    sel[1] |= 255ull << shift;
    sel[2] = need - above;
    for (int j = 0; j < 256; ++j) hist[j] = 0;
}

// Per chunk: elements above the threshold key, and equal to it, into counts[2 * (chunk + 1) + {0, 1}].
template <typename T>
__global__ void arraytrain_topk_count(const T* __restrict__ x, i64 n, i64 chunk, const u64* __restrict__ sel,
                                      i64* __restrict__ counts) {
    const i64 lo = blockIdx.x * chunk, hi = min(lo + chunk, n);
    const u64 t = sel[0];
    double above = 0.0, eq = 0.0;  // exact: at most `chunk` per block
    for (i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const u64 key = mag_key(x[i]);
        above += (double)(key > t);
        eq += (double)(key == t);
    }
    above = block_reduce<false>(above);
    eq = block_reduce<false>(eq);
    if (threadIdx.x == 0) {
        counts[2 * ((i64)blockIdx.x + 1)] = (i64)above;
        counts[2 * ((i64)blockIdx.x + 1) + 1] = (i64)eq;
    }
}

// Exclusive block-wide counts of two flags (ballots per warp, warp totals in shared memory).
// Called by every thread of the block (it synchronises).
__device__ __forceinline__ void block_scan2(bool a, bool e, int& a_pre, int& e_pre, int& a_tot, int& e_tot) {
    __shared__ int wa[32], we[32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    const unsigned ma = __ballot_sync(0xffffffffu, a), me = __ballot_sync(0xffffffffu, e);
    const unsigned lt = (1u << lane) - 1u;
    a_pre = __popc(ma & lt);
    e_pre = __popc(me & lt);
    if (lane == 0) { wa[wid] = __popc(ma); we[wid] = __popc(me); }
    __syncthreads();
    a_tot = 0; e_tot = 0;
    for (int w = 0; w < nw; ++w) {
        if (w < wid) { a_pre += wa[w]; e_pre += we[w]; }
        a_tot += wa[w]; e_tot += we[w];
    }
    __syncthreads();  // wa, we are rewritten by the next call
}

// Writes the selection in index order: element i goes to (elements above before i) +
// min(equal elements before i, need); equal elements are taken while fewer than need precede.
// offs: exclusive per-chunk offsets [above, equal].
template <typename T, typename I>
__global__ void arraytrain_topk_write(const T* __restrict__ x, i64 n, i64 chunk, const u64* __restrict__ sel,
                                      const i64* __restrict__ offs, I* __restrict__ idx_out, T* __restrict__ val_out) {
    const i64 lo = blockIdx.x * chunk, hi = min(lo + chunk, n);
    const u64 t = sel[0];
    const i64 need = (i64)sel[2];
    i64 a_run = offs[2 * (i64)blockIdx.x], e_run = offs[2 * (i64)blockIdx.x + 1];
    for (i64 base = lo; base < hi; base += blockDim.x) {  // uniform: every thread runs each tile
        const i64 i = base + threadIdx.x;
        T xi = (T)0;
        bool a = false, e = false;
        if (i < hi) {
            xi = x[i];
            const u64 key = mag_key(xi);
            a = key > t;
            e = key == t;
        }
        int a_pre, e_pre, a_tot, e_tot;
        block_scan2(a, e, a_pre, e_pre, a_tot, e_tot);
        const i64 eq_before = e_run + e_pre;
        if (a || (e && eq_before < need)) {
            const i64 pos = a_run + a_pre + min(eq_before, need);
            idx_out[pos] = (I)i;
            val_out[pos] = xi;
        }
        a_run += a_tot;
        e_run += e_tot;
    }
}

// -- random-k: Floyd's sample in parallel ------------------------------------------------------
__device__ __forceinline__ i64 floyd_draw(u64 key, i64 j) {
    const i64 t = (i64)(counter_uniform(key, (u64)j) * (double)(j + 1));
    return t < j ? t : j;
}

// first[v] = min over draws j with t_j == v of (j - (n - k)); 0xFFFFFFFF where no draw hits v.
__global__ void arraytrain_randk_first(i64 n, i64 k, u64 key, unsigned int* __restrict__ first) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 o = blockIdx.x * (i64)blockDim.x + threadIdx.x; o < k; o += stride) {
        const i64 j = n - k + o;
        atomicMin(&first[floyd_draw(key, j)], (unsigned int)o);
    }
}

// The sample as an n-bit bitmap (zero on entry): every draw below n - k, and each index
// x >= n - k that Floyd's step x (or a later hit) inserts.
__global__ void arraytrain_randk_mark(i64 n, i64 k, u64 key, const unsigned int* __restrict__ first,
                                      u64* __restrict__ words) {
    const i64 m = n - k, stride = (i64)gridDim.x * blockDim.x;
    for (i64 o = blockIdx.x * (i64)blockDim.x + threadIdx.x; o < k; o += stride) {
        const i64 x = m + o;
        const i64 tx = floyd_draw(key, x);
        if (tx < m) atomicOr(&words[tx >> 6], 1ull << (tx & 63));
        // x is in the sample iff a draw hits it (t_x == x included: hits are at steps >= x),
        // or t_x was in the sample before step x: y in S before step j is, for y < m, a hit
        // before j; for y >= m, a hit of y before j, or (recursively) t_y in S before step y.
        bool in = first[x] != 0xFFFFFFFFu;
        i64 y = tx, j = x;
        while (!in) {
            if (y < m) { in = first[y] < (unsigned int)(j - m); break; }
            if (first[y] < (unsigned int)(j - m)) { in = true; break; }
            j = y;
            y = floyd_draw(key, y);  // < j: t_y == y would be a hit at step y, found above
        }
        if (in) atomicOr(&words[x >> 6], 1ull << (x & 63));
    }
}

__global__ void arraytrain_bitmap_count(const u64* __restrict__ words, i64 nwords, i64* __restrict__ counts) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 w = blockIdx.x * (i64)blockDim.x + threadIdx.x; w < nwords; w += stride)
        counts[w + 1] = __popcll(words[w]);
}

__global__ void arraytrain_bitmap_write(const u64* __restrict__ words, i64 nwords, const i64* __restrict__ offs,
                                        i64* __restrict__ out) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 w = blockIdx.x * (i64)blockDim.x + threadIdx.x; w < nwords; w += stride) {
        u64 v = words[w];
        i64 o = offs[w];
        while (v) {
            const int b = __ffsll((long long)v) - 1;
            out[o++] = w * 64 + b;
            v &= v - 1ull;
        }
    }
}

// -- gather, scatter ---------------------------------------------------------------------------
template <typename T, typename I>
__global__ void arraytrain_gather(const T* __restrict__ x, const I* __restrict__ idx, i64 k, T* __restrict__ out) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 j = blockIdx.x * (i64)blockDim.x + threadIdx.x; j < k; j += stride) out[j] = x[(i64)idx[j]];
}

// out is zeroed before this launch
template <typename T, typename I>
__global__ void arraytrain_scatter(const I* __restrict__ idx, const T* __restrict__ values, i64 k, T factor,
                                   T* __restrict__ out) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 j = blockIdx.x * (i64)blockDim.x + threadIdx.x; j < k; j += stride)
        out[(i64)idx[j]] = values[j] * factor;
}

// -- int8 blockwise: one warp per block ----------------------------------------------------------
template <typename T>
__global__ void arraytrain_int8_encode(const T* __restrict__ x, i64 n, i64 block, i64 nblocks, u64 key,
                                       int stochastic, int shared, T c127, signed char* __restrict__ codes,
                                       T* __restrict__ scales) {
    const int lane = threadIdx.x & 31;
    const i64 b = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= nblocks) return;  // a whole warp leaves together
    const i64 lo = b * block, hi = min(lo + block, n);
    T scale;
    if (shared) {  // the scale is given (the group's), read by every lane
        scale = scales[b];
    } else {  // uniform across the warp: every lane shuffles
        T amax = (T)0;
        for (i64 i = lo + lane; i < hi; i += 32) {
            const T a = fabs(x[i]);
            amax = a > amax ? a : amax;
        }
        for (int o = 16; o > 0; o >>= 1) {
            const T y = __shfl_xor_sync(0xffffffffu, amax, o);
            amax = y > amax ? y : amax;  // max is exact: every lane ends with the same value
        }
        scale = amax * c127;
        if (lane == 0) scales[b] = scale;
    }
    const double inv = scale > (T)0 ? (double)((T)1 / scale) : 0.0;
    for (i64 i = lo + lane; i < hi; i += 32) {
        const double t = __dmul_rn((double)x[i], inv);
        double q;
        if (stochastic) {
            const double f = floor(t);
            q = counter_uniform(key, (u64)i) < t - f ? f + 1.0 : f;
        } else {
            q = rint(t);  // ties to even, as np.rint
        }
        codes[i] = (signed char)fmin(fmax(q, -127.0), 127.0);
    }
}

template <typename T>
__global__ void arraytrain_int8_decode(const signed char* __restrict__ codes, const T* __restrict__ scales,
                                       i64 block, i64 n, T* __restrict__ out) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = (T)codes[i] * scales[i / block];
}

// -- per-block float64 reductions of |x| for sign (sum) and ternary (max) --------------------------
// Block b is cut into spb = ceil(block / piece) pieces; piece p = b * spb + s covers
// [b * block + s * piece, min(b * block + (s + 1) * piece, (b + 1) * block, n)). One warp per piece.
template <typename T, bool MAX>
__global__ void arraytrain_piece_reduce(const T* __restrict__ x, i64 n, i64 block, i64 piece, i64 spb,
                                        i64 npieces, double* __restrict__ part) {
    const int lane = threadIdx.x & 31;
    const i64 p = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
    if (p >= npieces) return;
    const i64 b = p / spb, s = p - b * spb;
    const i64 lo = b * block + s * piece;
    const i64 hi = min(min(lo + piece, (b + 1) * block), n);
    double acc = 0.0;
    for (i64 i = lo + lane; i < hi; i += 32) {
        const double a = fabs((double)x[i]);
        acc = MAX ? fmax(acc, a) : acc + a;
    }
    acc = warp_reduce<MAX>(acc);
    if (lane == 0) part[p] = acc;
}

// One warp per block: its pieces combined in order; sign: sum / count as float32; ternary: the
// maximum as float32, rounded up where float32 rounds it down (so that |x_i| <= s_b).
template <bool MAX>
__global__ void arraytrain_block_scales(const double* __restrict__ part, i64 spb, i64 n, i64 block, i64 nblocks,
                                        float* __restrict__ scales) {
    const int lane = threadIdx.x & 31;
    const i64 b = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= nblocks) return;
    double acc = 0.0;
    for (i64 s = lane; s < spb; s += 32) acc = MAX ? fmax(acc, part[b * spb + s]) : acc + part[b * spb + s];
    acc = warp_reduce<MAX>(acc);
    if (lane == 0) {
        if (MAX) {
            float s32 = (float)acc;
            if ((double)s32 < acc) s32 = nextafterf(s32, __int_as_float(0x7f800000));
            scales[b] = s32;
        } else {
            const i64 count = min(block, n - b * block);
            scales[b] = (float)(acc / (double)count);
        }
    }
}

// -- sign: 8 signs per byte, element 8j + t in bit t of byte j -------------------------------------
template <typename T>
__global__ void arraytrain_sign_bits(const T* __restrict__ x, i64 n, i64 nbytes, unsigned char* __restrict__ bits) {
    const int lane = threadIdx.x & 31;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    // the loop bound is rounded up to whole warps so that every lane takes part in the ballot
    const i64 end = (n + 31) & ~(i64)31;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < end; i += stride) {
        const bool on = i < n && x[i] >= (T)0;  // -0.0 counts as +, NaN as -
        const unsigned m = __ballot_sync(0xffffffffu, on);
        if (lane < 4) {
            const i64 j = ((i - lane) >> 3) + lane;  // lane 0's element starts this warp's 4 bytes
            if (j < nbytes) bits[j] = (unsigned char)(m >> (8 * lane));
        }
    }
}

template <typename T>
__global__ void arraytrain_sign_decode(const unsigned char* __restrict__ bits, const float* __restrict__ scales,
                                       i64 block, i64 n, T* __restrict__ out) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += stride) {
        const T s = (T)scales[i / block];
        out[i] = ((bits[i >> 3] >> (i & 7)) & 1) ? s : -s;
    }
}

// -- ternary: 4 codes per byte, element 4j + t in bits 2t, 2t + 1 of byte j ------------------------
template <typename T>
__global__ void arraytrain_ternary_codes(const T* __restrict__ x, i64 n, i64 block, u64 key,
                                         const float* __restrict__ scales, i64 nbytes,
                                         unsigned char* __restrict__ codes) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 j = blockIdx.x * (i64)blockDim.x + threadIdx.x; j < nbytes; j += stride) {
        unsigned int v = 0;
        for (int t = 0; t < 4; ++t) {
            const i64 i = 4 * j + t;
            if (i >= n) break;  // the last byte's padding is 0
            const double s = (double)scales[i / block];
            const double xi = (double)x[i];
            const bool keep = __dmul_rn(counter_uniform(key, (u64)i), s) < fabs(xi);
            v |= (unsigned int)(keep ? (xi < 0.0 ? 2 : 1) : 0) << (2 * t);
        }
        codes[j] = (unsigned char)v;
    }
}

template <typename T>
__global__ void arraytrain_ternary_decode(const unsigned char* __restrict__ codes, const float* __restrict__ scales,
                                          i64 block, i64 n, T* __restrict__ out) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += stride) {
        const unsigned int v = (codes[i >> 2] >> (2 * (i & 3))) & 3u;
        const T s = (T)scales[i / block];
        out[i] = v == 1u ? s : (v == 2u ? -s : (T)0);
    }
}
""", [f"arraytrain_topk_{k}<{t}>" for k in ("hist", "count") for t in _FLOATS]
   + ["arraytrain_topk_choose"]
   + [f"arraytrain_topk_write<{t},{i}>" for t in _FLOATS for i in _INDEX]
   + ["arraytrain_randk_first", "arraytrain_randk_mark", "arraytrain_bitmap_count", "arraytrain_bitmap_write"]
   + [f"arraytrain_{k}<{t},{i}>" for k in ("gather", "scatter") for t in _FLOATS for i in _INDEX]
   + [f"arraytrain_{k}<{t}>" for k in ("int8_encode", "int8_decode", "sign_bits", "sign_decode",
                                        "ternary_codes", "ternary_decode") for t in _FLOATS]
   + [f"arraytrain_piece_reduce<{t},{m}>" for t in _FLOATS for m in ("false", "true")]
   + [f"arraytrain_block_scales<{m}>" for m in ("false", "true")])

_ITYPE = {np.dtype(np.uint32): "u32", np.dtype(np.int64): "i64"}
_NONE = 0xFFFFFFFF  # randk's "no draw hits this value"


def _t(dtype) -> str:
    return {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}[np.dtype(dtype)]


def _warps(count: int) -> int:
    """Blocks for one warp per item."""
    return -(-int(count) // WARPS)


def _index(idx):
    """An index array as the kernels take it (uint32 or int64)."""
    return idx if idx.dtype in _ITYPE else idx.astype(np.int64)


# -- top-k -------------------------------------------------------------------------------------


def topk(x, idx_out, val_out, *, k):
    """The ``k`` largest ``|x_i|``, ties to the lowest index; see :func:`arraytrain.kernels.reference.compression.topk`.

    Radix select on the magnitude bits, 8 at a time, entirely on the device (no host read),
    then the selection compacted in index order: ``2 + bits / 8`` passes over ``x``.
    """
    n, k = int(x.size), int(k)
    if k <= 0:
        return
    cp, t = cupy(), _t(x.dtype)
    state = cp.zeros(3 + 256, dtype=cp.uint64)  # [prefix, mask, need] then the 256-bin histogram
    state[2] = k
    sel, hist = state[:3], state[3:]
    bits = 8 * x.dtype.itemsize
    hist_fn = SOURCE.function(f"arraytrain_topk_hist<{t}>")
    choose_fn = SOURCE.function("arraytrain_topk_choose")
    for shift in range(bits - 8, -1, -8):
        launch(hist_fn, grid(n), (x, np.int64(n), np.int32(shift), sel, hist))
        launch(choose_fn, 1, (sel, hist, np.int32(shift)))
    nch = -(-n // TOPK_CHUNK)
    counts = cp.zeros(2 * (nch + 1), dtype=cp.int64)
    launch(SOURCE.function(f"arraytrain_topk_count<{t}>"), nch, (x, np.int64(n), np.int64(TOPK_CHUNK), sel, counts))
    offs = cp.cumsum(counts.reshape(nch + 1, 2), axis=0)  # integer: exact; row c = chunk c's offsets
    launch(SOURCE.function(f"arraytrain_topk_write<{t},{_ITYPE[idx_out.dtype]}>"), nch,
           (x, np.int64(n), np.int64(TOPK_CHUNK), sel, offs, idx_out, val_out))


# -- random-k, gather, scatter -------------------------------------------------------------------


def randk_indices(*, n, k, key):
    """Floyd's sample of ``k`` of ``n``, sorted (int64, on the device); see the reference.

    The same set as the serial algorithm, found in parallel (see the module docstring);
    ``4 n + n / 8`` bytes of scratch.
    """
    n, k = int(n), int(k)
    cp = cupy()
    out = cp.empty(k, dtype=cp.int64)
    if k == 0:
        return out
    if k >= _NONE:
        raise ValueError(f"k: the CUDA random-k takes fewer than 2**32 - 1 indices, got {k}")
    first = cp.full(n, _NONE, dtype=cp.uint32)
    nwords = -(-n // 64)
    words = cp.zeros(nwords, dtype=cp.uint64)
    args = (np.int64(n), np.int64(k), np.uint64(key))
    launch(SOURCE.function("arraytrain_randk_first"), grid(k), (*args, first))
    launch(SOURCE.function("arraytrain_randk_mark"), grid(k), (*args, first, words))
    counts = cp.zeros(nwords + 1, dtype=cp.int64)
    launch(SOURCE.function("arraytrain_bitmap_count"), grid(nwords), (words, np.int64(nwords), counts))
    offs = cp.cumsum(counts)
    launch(SOURCE.function("arraytrain_bitmap_write"), grid(nwords), (words, np.int64(nwords), offs, out))
    return out


def gather(x, idx, out):
    """``out = x[idx]``."""
    idx = _index(idx)
    launch(SOURCE.function(f"arraytrain_gather<{_t(x.dtype)},{_ITYPE[idx.dtype]}>"), grid(idx.size),
           (x, idx, np.int64(idx.size), out))


def scatter(idx, values, out, *, factor):
    """``out = 0``, then ``out[idx] = values * factor`` (math in ``out``'s dtype)."""
    idx = _index(idx)
    out.fill(0)
    launch(SOURCE.function(f"arraytrain_scatter<{_t(out.dtype)},{_ITYPE[idx.dtype]}>"), grid(idx.size),
           (idx, values.astype(out.dtype, copy=False), np.int64(idx.size), out.dtype.type(factor), out))


# -- int8 blockwise --------------------------------------------------------------------------------


def int8_encode(x, codes, scales, *, block, key, stochastic, shared=False):
    """Blockwise absmax int8, one warp per block; see :func:`arraytrain.kernels.reference.compression.int8_encode`."""
    n, nblocks = int(x.size), int(scales.size)
    if n == 0:
        return
    launch(SOURCE.function(f"arraytrain_int8_encode<{_t(x.dtype)}>"), _warps(nblocks),
           (x, np.int64(n), np.int64(block), np.int64(nblocks), np.uint64(key), np.int32(bool(stochastic)),
            np.int32(bool(shared)), x.dtype.type(INV127), codes, scales))


def int8_decode(codes, scales, out, *, block):
    """``out_i = codes_i * scale_b``."""
    launch(SOURCE.function(f"arraytrain_int8_decode<{_t(out.dtype)}>"), grid(out.size),
           (codes, scales.astype(out.dtype, copy=False), np.int64(block), np.int64(out.size), out))


# -- sign and ternary ------------------------------------------------------------------------------


def _block_scales(x, block, scales, use_max: bool):
    """float32 ``scales``: per-block L1 mean (sum) or rounded-up maximum of ``|x|``, float64 partials."""
    cp, n, nblocks = cupy(), int(x.size), int(scales.size)
    piece = min(PIECE, int(block))
    spb = -(-int(block) // piece)
    npieces = nblocks * spb
    part = cp.empty(max(npieces, 1), dtype=cp.float64)
    m = "true" if use_max else "false"
    launch(SOURCE.function(f"arraytrain_piece_reduce<{_t(x.dtype)},{m}>"), _warps(npieces),
           (x, np.int64(n), np.int64(block), np.int64(piece), np.int64(spb), np.int64(npieces), part))
    launch(SOURCE.function(f"arraytrain_block_scales<{m}>"), _warps(nblocks),
           (part, np.int64(spb), np.int64(n), np.int64(block), np.int64(nblocks), scales))


def sign_encode(x, bits, scales, *, block):
    """Scaled sign: bits (one ballot per 32 elements) and per-block float64 L1 means as float32."""
    n = int(x.size)
    if n == 0:
        return
    _block_scales(x, block, scales, False)
    launch(SOURCE.function(f"arraytrain_sign_bits<{_t(x.dtype)}>"), grid(n),
           (x, np.int64(n), np.int64(bits.size), bits))


def sign_decode(bits, scales, out, *, block):
    """``out_i = +-scale_b`` from bit ``i``."""
    launch(SOURCE.function(f"arraytrain_sign_decode<{_t(out.dtype)}>"), grid(out.size),
           (bits, scales.astype(np.float32, copy=False), np.int64(block), np.int64(out.size), out))


def ternary_encode(x, codes, scales, *, block, key):
    """TernGrad, two passes (block maxima, then codes); see :func:`arraytrain.kernels.reference.compression.ternary_encode`."""
    n = int(x.size)
    if n == 0:
        return
    _block_scales(x, block, scales, True)
    launch(SOURCE.function(f"arraytrain_ternary_codes<{_t(x.dtype)}>"), grid(codes.size),
           (x, np.int64(n), np.int64(block), np.uint64(key), scales, np.int64(codes.size), codes))


def ternary_decode(codes, scales, out, *, block):
    """``out_i = s_b * {0, +1, -1}[code_i]``."""
    launch(SOURCE.function(f"arraytrain_ternary_decode<{_t(out.dtype)}>"), grid(out.size),
           (codes, scales.astype(np.float32, copy=False), np.int64(block), np.int64(out.size), out))
