"""CUDA kernels: accumulate, scale, the reductions of the norm pass, working copies.

Same names and signatures as :mod:`arraytrain.kernels.cpu.reductions`; what the CPU family returns
as Python floats or NumPy arrays comes back the same way here, read from the device in
one transfer (that read is the norm pass's one device-to-host synchronisation).

Sums of squares: each piece of the layout (at most ``REDUCE_CHUNK`` elements, one parameter)
is reduced by one block into a float64 partial; one block per parameter then adds its
chunks' partials, and one block adds the parameters', each in a fixed tree order, so
the bits are the same on every run (they may differ from the CPU family's, which adds
per 2**14-element piece).
"""

from __future__ import annotations

import numpy as np

from .core import REDUCE_CHUNK, THREADS, Source, chunks_for, ctype, cupy, launch, refuse_grad_ptrs, to_host

_FLOATS = ("float", "double")

SOURCE = Source(r"""
template <typename TA, typename TG>
__global__ void arraytrain_accumulate(TA* __restrict__ acc, const TG* __restrict__ g, i64 n, TA w, int overwrite) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += stride)
        acc[i] = overwrite ? (TA)(w * g[i]) : (TA)(acc[i] + w * g[i]);
}

// One block per row (s, d, n) of the table: acc[d:d+n] (=|+=) w * src[s:s+n].
template <typename TA, typename TG>
__global__ void arraytrain_accumulate_packed(TA* __restrict__ acc, const TG* __restrict__ src,
                                             const i64* __restrict__ table, TA w, int overwrite) {
    const i64* r = table + 3 * (i64)blockIdx.x;
    const i64 s = r[0], d = r[1], n = r[2];
    for (i64 i = threadIdx.x; i < n; i += blockDim.x)
        acc[d + i] = overwrite ? (TA)(w * src[s + i]) : (TA)(acc[d + i] + w * src[s + i]);
}

template <typename T>
__global__ void arraytrain_scale(T* __restrict__ x, i64 n, T s) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += stride) x[i] *= s;
}

template <typename T>
__global__ void arraytrain_all_finite(const T* __restrict__ x, i64 n, int* __restrict__ bad) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    int b = 0;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += stride) b |= !isfinite((double)x[i]);
    if (__syncthreads_or(b) && threadIdx.x == 0) atomicOr(bad, 1);
}

// OP 0: x^2, 1: (x*inv)^2, 2: (x*y)^2, 3: |x| (max). One float64 partial per chunk.
template <typename T, int OP>
__global__ void arraytrain_chunk_reduce(const T* __restrict__ x, const T* __restrict__ y, double inv,
                                        const i64* __restrict__ chunks, double* __restrict__ part) {
    const chunk c = load_chunk(chunks);
    double acc = 0.0;
    // 4 elements a blockDim apart per thread and iteration: their loads are in flight together
    for (i64 base = c.lo + threadIdx.x; base < c.hi; base += 4 * (i64)blockDim.x) {
        #pragma unroll
        for (int k = 0; k < 4; ++k) {
            const i64 i = base + k * (i64)blockDim.x;
            if (i >= c.hi) break;
            double xi = (double)x[i];
            if (OP == 1) xi *= inv;
            if (OP == 2) xi *= (double)y[i];
            if (OP == 3) acc = fmax(acc, fabs(xi)); else acc += xi * xi;
        }
    }
    acc = block_reduce<OP == 3>(acc);
    if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

// One block per segment: out[1 + s] = the segment's chunk partials combined.
template <bool MAX>
__global__ void arraytrain_seg_reduce(const double* __restrict__ part, const i64* __restrict__ seg_lo,
                                      const i64* __restrict__ seg_hi, double* __restrict__ out) {
    const int s = blockIdx.x;
    double acc = 0.0;
    for (i64 j = seg_lo[s] + threadIdx.x; j < seg_hi[s]; j += blockDim.x) acc = combine<MAX>(acc, part[j]);
    acc = block_reduce<MAX>(acc);
    if (threadIdx.x == 0) out[1 + s] = acc;
}

// One block: out[0] = out[1..nseg] combined.
template <bool MAX>
__global__ void arraytrain_total_reduce(double* __restrict__ out, int nseg) {
    double acc = 0.0;
    for (int s = threadIdx.x; s < nseg; s += blockDim.x) acc = combine<MAX>(acc, out[1 + s]);
    acc = block_reduce<MAX>(acc);
    if (threadIdx.x == 0) out[0] = acc;
}

// The device gate from a norm pass's sums (one thread): gate[0] = clip factor / unscale as the
// host computes it (float64, same operations, same bits), gate[1] = 1 when the total is not
// finite (skip; the host then looks closer: a float64 overflow of finite values is not a skip).
__global__ void arraytrain_clip_gate(const double* __restrict__ sums, double unscale, double max_norm, double eps,
                                     double* __restrict__ gate) {
    const double total = sums[0];
    if (!isfinite(total)) { gate[0] = 0.0; gate[1] = 1.0; return; }
    double coef = 1.0;
    if (max_norm >= 0.0) {
        const double norm = sqrt(total) / unscale;
        if (eps == 0.0) coef = norm <= max_norm ? 1.0 : max_norm / norm;
        else { const double c = max_norm / (norm + eps); coef = c < 1.0 ? c : 1.0; }
    }
    gate[0] = coef / unscale;
    gate[1] = 0.0;
}

template <int WK>
__global__ void arraytrain_cast_working(u16* __restrict__ w, const float* __restrict__ p, const i64* __restrict__ chunks) {
    const chunk c = load_chunk(chunks);
    for (i64 i = c.lo + threadIdx.x; i < c.hi; i += blockDim.x)
        w[i] = WK == 1 ? bf16_encode(p[i]) : f16_encode(p[i]);
}
""", [f"arraytrain_accumulate{k}<{a},{g}>" for k in ("", "_packed") for a in _FLOATS for g in _FLOATS]
   + [f"arraytrain_scale<{t}>" for t in _FLOATS]
   + [f"arraytrain_all_finite<{t}>" for t in _FLOATS]
   + [f"arraytrain_chunk_reduce<{t},{op}>" for t in _FLOATS for op in range(4)]
   + [f"arraytrain_{k}_reduce<{m}>" for k in ("seg", "total") for m in ("false", "true")]
   + [f"arraytrain_cast_working<{k}>" for k in (1, 2)] + ["arraytrain_clip_gate"])

_GRID_CAP = 132 * 16  # grid-stride kernels: enough blocks to fill an H100 several times


def grid(n: int) -> int:
    return min(-(-n // (THREADS * 4)), _GRID_CAP)


def accumulate(acc, g, *, w, overwrite):
    """``acc = w * g`` if ``overwrite`` else ``acc += w * g`` (math in ``acc``'s dtype)."""
    fn = SOURCE.function(f"arraytrain_accumulate<{ctype(acc.dtype)},{ctype(g.dtype)}>")
    launch(fn, grid(acc.size), (acc, g, np.int64(acc.size), acc.dtype.type(w), np.int32(bool(overwrite))))


def accumulate_packed(acc, src, table, *, w, overwrite):
    """``acc[d:d+n] (=|+=) w * src[s:s+n]`` for each row ``(s, d, n)`` of the int64 device ``table``."""
    fn = SOURCE.function(f"arraytrain_accumulate_packed<{ctype(acc.dtype)},{ctype(src.dtype)}>")
    launch(fn, table.shape[0], (acc, src, table, acc.dtype.type(w), np.int32(bool(overwrite))))


def scale(x, *, factor):
    """``x *= factor``."""
    launch(SOURCE.function(f"arraytrain_scale<{ctype(x.dtype)}>"), grid(x.size),
           (x, np.int64(x.size), x.dtype.type(factor)))


def all_finite(x):
    """True when no element is NaN or +-Inf (reads a flag back: one synchronisation)."""
    cp = cupy()
    bad = cp.zeros(1, dtype=cp.int32)
    launch(SOURCE.function(f"arraytrain_all_finite<{ctype(x.dtype)}>"), grid(x.size), (x, np.int64(x.size), bad))
    return not bool(to_host(bad)[0])


def _reduce(op: int, x, y, inv, pieces, nseg):
    """float64 ``out``: ``out[0]`` the total, ``out[1:]`` per segment (a reused device buffer)."""
    ch = chunks_for(pieces, REDUCE_CHUNK)
    part, out = ch.scratch(nseg)
    if ch.count:
        launch(SOURCE.function(f"arraytrain_chunk_reduce<{ctype(x.dtype)},{op}>"), ch.count,
               (x, x if y is None else y, np.float64(inv), ch.table, part))
    seg_reduce(part, *ch.seg_ranges(nseg), nseg, out, op == 3)
    return out


def seg_reduce(part, seg_lo, seg_hi, nseg, out, use_max=False, total=True):
    """``out[1 + s]`` = ``part[seg_lo[s]:seg_hi[s]]`` combined; ``out[0]`` = all segments (fixed order)."""
    m = "true" if use_max else "false"
    launch(SOURCE.function(f"arraytrain_seg_reduce<{m}>"), nseg, (part, seg_lo, seg_hi, out))
    if total:
        launch(SOURCE.function(f"arraytrain_total_reduce<{m}>"), 1, (out, np.int32(nseg)))


def _split(out):
    host = to_host(out)  # one device-to-host transfer
    return float(host[0]), host[1:]


def sumsq(x, pieces, *, nseg, grad_ptrs=None):
    """``(total, per_segment)`` sums of squares in float64, one pass (see the CPU twin)."""
    refuse_grad_ptrs(grad_ptrs)
    return _split(_reduce(0, x, None, 1.0, pieces, nseg))


def max_abs(x, pieces, *, grad_ptrs=None):
    """Largest |element| over the pieces, for finite input (rescales a norm that overflowed)."""
    refuse_grad_ptrs(grad_ptrs)
    nseg = int(np.asarray(pieces)[:, 2].max()) + 1 if len(pieces) else 0
    return _split(_reduce(3, x, None, 1.0, pieces, nseg))[0]


def sumsq_gate(x, pieces, *, nseg, unscale, max_norm, eps):
    """The norm pass and the device gate, no synchronisation: ``(sums, gate)`` device arrays.

    ``sums`` = ``[total, per_segment...]`` sums of squares (read it with :func:`read_sums`);
    ``gate`` feeds the update kernels (see :class:`.core.DeviceScale`): the clip factor
    ``min(1, max_norm / (sqrt(total) / unscale + eps))`` over ``unscale``, or a skip when
    the total is not finite. ``max_norm=None``: no clipping.
    """
    out = _reduce(0, x, None, 1.0, pieces, nseg)
    ch = chunks_for(pieces, REDUCE_CHUNK)
    gate = ch.gate()
    launch(SOURCE.function("arraytrain_clip_gate"), 1, (out, np.float64(unscale),
                                                        np.float64(-1.0 if max_norm is None else max_norm),
                                                        np.float64(eps), gate))
    return out, gate


def read_sums(sums):
    """``(total, per_segment)`` of :func:`sumsq_gate`'s sums: the one device-to-host read."""
    return _split(sums)


def sumsq_scaled(x, pieces, *, nseg, inv, grad_ptrs=None):
    """Like :func:`sumsq` but of ``x * inv``: an overflow-safe second pass."""
    refuse_grad_ptrs(grad_ptrs)
    return _split(_reduce(1, x, None, float(inv), pieces, nseg))


def sumsq_product(x, y, pieces, *, nseg):
    """``(total, per_segment)`` float64 sums of ``(x*y)^2`` over the pieces (ASAM's norm), one pass."""
    return _split(_reduce(2, x, y, 1.0, pieces, nseg))


def cast_working(w, p, pieces, *, kind):
    """``w = lowp(p)``: (re)build a low-precision working copy (uint16 bits) from float32 params."""
    ch = chunks_for(pieces)
    launch(SOURCE.function(f"arraytrain_cast_working<{int(kind)}>"), ch.count, (w, p, ch.table))
