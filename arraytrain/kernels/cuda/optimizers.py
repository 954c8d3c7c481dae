"""CUDA optimizer kernels: the same names, signatures and math as :mod:`arraytrain.kernels.cpu.optimizers`.

One launch per step covers every parameter: a block per chunk of the layout (see
:mod:`.core`) reads its parameter's hyperparameters once. Variants are template
arguments of one kernel per optimizer (never near-copies): ``T`` the parameters'
float/double, ``S`` the state's storage (``T``, or ``u16`` bfloat16 bits), ``WK`` the
working copy (0 none, 1 bfloat16, 2 float16), ``MASK`` a pruning mask. The learning
rate and every step-dependent value are kernel arguments, so a schedule never
recompiles anything. Scalars are passed as NumPy scalars of the storage type. The
wrappers take the arguments of :mod:`arraytrain.kernels.interface` (arrays, then keywords,
every derived value formed by the optimizer) and only cast them, forming the complements
``1 - x`` and squares the kernels read.

LAMB's trust ratios are formed on the device (per-chunk float64 partials, then the
fixed-order per-parameter reduction of :mod:`.reductions`), so a LAMB step does not
synchronise with the host; its return value is a device array.
"""

from __future__ import annotations

import numpy as np

from ..interface import F8, LP_NONE, Q8, Q8_BLOCK, QUANTIZED
from . import reductions
from .core import (CHUNK, NULL, THREADS, DeviceScale, Source, chunks_for, ctype, cupy, device, launch, ptr,
                   refuse_grad_ptrs, seg_arg, to_host)

# the 8-bit loop gives each thread one element of a block: a block of threads is a block of state
assert THREADS == Q8_BLOCK and CHUNK % Q8_BLOCK == 0

# Shared head of every update loop; the per-optimizer body (one element ``i``) sits between
# OPEN and CLOSE. Each thread takes ILP elements a blockDim apart per outer iteration, in an
# unrolled inner loop, so their loads are in flight together (coalesced across the warp).
_OPEN = r"""
    const chunk c = load_chunk(chunks);
    for (i64 base = c.lo + threadIdx.x; base < c.hi; base += ILP * (i64)blockDim.x) {
      #pragma unroll
      for (int k = 0; k < ILP; ++k) {
        const i64 i = base + k * (i64)blockDim.x;
        if (i >= c.hi) break;
"""
_CLOSE = r"""
        if (zero_grad) g[i] = (T)0;
      }
    }
"""
_TAIL = "u16* __restrict__ w, int zero_grad, const unsigned char* __restrict__ mask"

# The loop head of the kernels with state slots (template argument ``S``). For float, double
# and u16 storage it is _OPEN's loop. For 8-bit state (S = q8, see core.HEADER) the chunk is
# walked one block of Q8_BLOCK (= THREADS) elements at a time, a thread per element, and the
# loop's trip count is the same for every thread of the block: the slots' close() after the
# body holds barriers (the block's absmax), which threads past the chunk's end reach too, with
# nothing to store. A chunk starts on a block boundary of its parameter (checked on the host).
_SOPEN = r"""
    const chunk c = load_chunk(chunks);
    constexpr bool Q8 = is_q8<S>::value;
    constexpr int UNROLL = Q8 ? 1 : ILP;
    for (i64 base = c.lo + (Q8 ? 0 : (i64)threadIdx.x); base < c.hi; base += UNROLL * (i64)blockDim.x) {
      #pragma unroll
      for (int k = 0; k < UNROLL; ++k) {
        const i64 i = base + (Q8 ? (i64)threadIdx.x : k * (i64)blockDim.x);
        const bool live = i < c.hi;
        if (!Q8 && !live) break;
        if (live) {
"""


def _sclose(closes: str = "", zero_grad: bool = True) -> str:
    """The end of a _SOPEN loop: the gradient zeroed, then ``closes`` (the slots' close() calls, each
    under a flag that is the same for the whole block), reached by every thread."""
    return (("          if (zero_grad) g[i] = (T)0;\n" if zero_grad else "") + "        }\n        " + closes
            + "\n      }\n    }\n")


# What every optimizer source shares after the common header: the unroll factor, the device
# gate and two NaN-keeping helpers.
_PRELUDE = r"""
#define ILP 4
// The device gate (the engine's CUDA path): gate[0] multiplies gscale (the clip factor over
// the loss scale, formed on the device from the norm pass), gate[1] != 0 (a non-finite
// gradient) makes the kernel return before touching anything. A null gate: gscale as given.
#define GATE_SKIP if (gate != nullptr && gate[1] != 0.0) return;
#define GATE_SCALE GATE_SKIP const T gscale = gate != nullptr ? (T)((double)gscale_ * gate[0]) : gscale_;
template <typename T> __device__ __forceinline__ T nan_max(T a, T b) { return (isnan(a) || isnan(b)) ? a + b : (a > b ? a : b); }
// sign that keeps NaN (np.sign)
template <typename T> __device__ __forceinline__ T sign_of(T x) { return x > (T)0 ? (T)1 : (x < (T)0 ? (T)-1 : x); }
"""

SOURCE = Source(_PRELUDE + r"""

template <typename T, typename S, int WK, bool MASK>
__global__ void arraytrain_sgd_step(T* __restrict__ p, T* __restrict__ g, S* __restrict__ buf,
        const i64* __restrict__ chunks, T gscale_, const double* __restrict__ gate, const T* __restrict__ lr, T lr0, const T* __restrict__ wd, T wd0,
        T momentum, T damp_c, int nesterov, int first, """ + _TAIL + r""") {
    GATE_SCALE
    const int seg = (int)chunks[3 * (i64)blockIdx.x + 2];
    const T lr_s = seg_value(lr, lr0, seg), wd_s = seg_value(wd, wd0, seg);
    const bool has_buf = momentum != (T)0;
    slot<S> B(buf, seg);
""" + _SOPEN + r"""
        const T pi = p[i];
        T d = gscale * g[i] + wd_s * pi;
        if (has_buf) {
            T bi = first ? d : momentum * (T)B.load(i) + damp_c * d;
            bi = B.store(i, bi);
            d = nesterov ? d + momentum * bi : bi;
        }
        store_param<T, WK, MASK>(p, w, mask, i, pi - lr_s * d);
""" + _sclose("if (has_buf) B.close(i, live);") + r"""
}

template <typename T, typename S, int WK, bool MASK>
__global__ void arraytrain_adam_step(T* __restrict__ p, T* __restrict__ g, S* __restrict__ m, S* __restrict__ v,
        S* __restrict__ vmax, const i64* __restrict__ chunks, T gscale_, const double* __restrict__ gate, const T* __restrict__ step_size, T step_size0,
        T beta1c, T beta2, T beta2c, T eps, T inv_bc2_sqrt, const T* __restrict__ l2, T l20, const T* __restrict__ decay,
        T decay0, int amsgrad, """ + _TAIL + r""") {
    GATE_SCALE
    const int seg = (int)chunks[3 * (i64)blockIdx.x + 2];
    const T ss = seg_value(step_size, step_size0, seg), l2_s = seg_value(l2, l20, seg), dec = seg_value(decay, decay0, seg);
    // without AMSGrad, vmax is never read, stored or closed (8-bit: it may be m's own descriptor)
    slot<S> M(m, seg), V(v, seg), X(vmax, seg);
""" + _SOPEN + r"""
        const T pi = p[i];
        const T d = gscale * g[i] + l2_s * pi;
        T mi = M.load(i);
        mi = mi + beta1c * (d - mi);
        T vi = beta2 * (T)V.load(i) + beta2c * d * d;
        // continue from the stored values, so a low-precision state is what the update sees
        mi = M.store(i, mi);
        vi = V.store(i, vi);
        if (amsgrad) vi = X.store(i, nan_max((T)X.load(i), vi));
        store_param<T, WK, MASK>(p, w, mask, i, pi * dec - ss * mi / (sqrt(vi) * inv_bc2_sqrt + eps));
""" + _sclose("M.close(i, live); V.close(i, live); if (amsgrad) X.close(i, live);") + r"""
}

template <typename T, typename S, int WK, bool MASK>
__global__ void arraytrain_adagrad_step(T* __restrict__ p, T* __restrict__ g, S* __restrict__ sum_sq,
        const i64* __restrict__ chunks, T gscale_, const double* __restrict__ gate, const T* __restrict__ clr, T clr0, const T* __restrict__ wd, T wd0,
        T eps, """ + _TAIL + r""") {
    GATE_SCALE
    const int seg = (int)chunks[3 * (i64)blockIdx.x + 2];
    const T clr_s = seg_value(clr, clr0, seg), wd_s = seg_value(wd, wd0, seg);
    slot<S> Q(sum_sq, seg);
""" + _SOPEN + r"""
        const T pi = p[i];
        const T d = gscale * g[i] + wd_s * pi;
        const T si = Q.store(i, (T)Q.load(i) + d * d);
        store_param<T, WK, MASK>(p, w, mask, i, pi - clr_s * (d / (sqrt(si) + eps)));
""" + _sclose("Q.close(i, live);") + r"""
}

template <typename T, typename S, int WK, bool MASK>
__global__ void arraytrain_rmsprop_step(T* __restrict__ p, T* __restrict__ g, S* __restrict__ sq, S* __restrict__ gavg,
        S* __restrict__ buf, const i64* __restrict__ chunks, T gscale_, const double* __restrict__ gate, const T* __restrict__ lr, T lr0,
        const T* __restrict__ wd, T wd0, T alpha, T alpha_c, T eps, T momentum, int centered, int use_momentum,
        """ + _TAIL + r""") {
    GATE_SCALE
    const int seg = (int)chunks[3 * (i64)blockIdx.x + 2];
    const T lr_s = seg_value(lr, lr0, seg), wd_s = seg_value(wd, wd0, seg);
    slot<S> Q(sq, seg), A(gavg, seg), B(buf, seg);  // A, B: null pointers where unused
""" + _SOPEN + r"""
        const T pi = p[i];
        const T d = gscale * g[i] + wd_s * pi;
        T qi = Q.store(i, alpha * (T)Q.load(i) + alpha_c * d * d);
        if (centered) {
            T ai = A.load(i);
            ai = A.store(i, ai + alpha_c * (d - ai));
            qi = qi - ai * ai;
        }
        T step = d / (sqrt(qi) + eps);
        if (use_momentum) step = B.store(i, momentum * (T)B.load(i) + step);
        store_param<T, WK, MASK>(p, w, mask, i, pi - lr_s * step);
""" + _sclose("Q.close(i, live); if (centered) A.close(i, live); if (use_momentum) B.close(i, live);") + r"""
}

template <typename T, typename S, int WK, bool MASK>
__global__ void arraytrain_lion_step(T* __restrict__ p, T* __restrict__ g, S* __restrict__ m,
        const i64* __restrict__ chunks, T gscale_, const double* __restrict__ gate, const T* __restrict__ lr, T lr0, const T* __restrict__ decay, T decay0,
        T beta1, T beta1c, T beta2, T beta2c, """ + _TAIL + r""") {
    GATE_SCALE
    const int seg = (int)chunks[3 * (i64)blockIdx.x + 2];
    const T lr_s = seg_value(lr, lr0, seg), dec = seg_value(decay, decay0, seg);
    slot<S> M(m, seg);
""" + _SOPEN + r"""
        const T d = gscale * g[i];
        const T mi = M.load(i);
        const T c = sign_of(beta1 * mi + beta1c * d);
        M.store(i, beta2 * mi + beta2c * d);
        store_param<T, WK, MASK>(p, w, mask, i, p[i] * dec - lr_s * c);
""" + _sclose("M.close(i, live);") + r"""
}

template <typename T, typename S, int WK, bool MASK>
__global__ void arraytrain_sophia_step(T* __restrict__ p, T* __restrict__ g, S* __restrict__ m, const S* __restrict__ h,
        const i64* __restrict__ chunks, T gscale_, const double* __restrict__ gate, const T* __restrict__ lr, T lr0, const T* __restrict__ decay, T decay0,
        T beta1, T beta1c, T rho_bs, T eps, """ + _TAIL + r""") {
    GATE_SCALE
    const int seg = (int)chunks[3 * (i64)blockIdx.x + 2];
    const T lr_s = seg_value(lr, lr0, seg), dec = seg_value(decay, decay0, seg);
""" + _OPEN + r"""
        const T mi = state<S>::store(m, i, beta1 * (T)state<S>::load(m, i) + beta1c * (gscale * g[i]));
        T den = rho_bs * (T)state<S>::load(h, i);
        den = den < eps ? eps : den;  // NaN-propagating max(rho_bs*h, eps)
        T r = mi / den;
        r = r > (T)1 ? (T)1 : r;
        r = r < (T)-1 ? (T)-1 : r;
        store_param<T, WK, MASK>(p, w, mask, i, p[i] * dec - lr_s * r);
""" + _CLOSE + r"""
}

template <typename T, bool MASK>
__global__ void arraytrain_sam_perturb(T* __restrict__ p, T* __restrict__ g, T* __restrict__ backup,
        const i64* __restrict__ chunks, T scale, int adaptive, int zero_grad, const unsigned char* __restrict__ mask) {
""" + _OPEN + r"""
        const T pi = p[i];
        backup[i] = pi;
        T e = scale * g[i];
        if (adaptive) e = e * (pi * pi);
        store_param<T, 0, MASK>(p, (u16*)0, mask, i, pi + e);
""" + _CLOSE + r"""
}

// LAMB pass 1: moments, and per-chunk float64 sums of squares of p and of the update u.
template <typename T, typename S>
__global__ void arraytrain_lamb_moments(const T* __restrict__ p, T* __restrict__ g, S* __restrict__ m, S* __restrict__ v,
        const i64* __restrict__ chunks, T gscale_, const double* __restrict__ gate, const T* __restrict__ wd, T wd0, T b1c, T b2, T b2c, T inv_bc1,
        T inv_bc2, T eps, T eps_root, int zero_grad, double* __restrict__ psq, double* __restrict__ usq) {
    GATE_SCALE
    const int seg = (int)chunks[3 * (i64)blockIdx.x + 2];
    const T wd_s = seg_value(wd, wd0, seg);
    slot<S> M(m, seg), V(v, seg);
    double sp = 0.0, su = 0.0;
    // each thread adds its elements in the same order as a plain strided loop (deterministic bits)
""" + _SOPEN + r"""
        const T pi = p[i];
        const T d = gscale * g[i];
        T mi = M.load(i);
        mi = M.store(i, mi + b1c * (d - mi));
        const T vi = V.store(i, b2 * (T)V.load(i) + b2c * d * d);
        const T u = (mi * inv_bc1) / (sqrt(vi * inv_bc2 + eps_root) + eps) + wd_s * pi;
        sp += (double)pi * (double)pi;
        su += (double)u * (double)u;
""" + _sclose("M.close(i, live); V.close(i, live);") + r"""
    sp = block_reduce<false>(sp);
    su = block_reduce<false>(su);
    if (threadIdx.x == 0) { psq[blockIdx.x] = sp; usq[blockIdx.x] = su; }
}

// LAMB: per-parameter trust ratio (1 when a norm is 0) and step lr * ratio, on the device.
template <typename T>
__global__ void arraytrain_lamb_ratio(const double* __restrict__ pn, const double* __restrict__ un,
        const T* __restrict__ lr, T lr0, int nseg, double* __restrict__ ratio, T* __restrict__ step, const double* __restrict__ gate) {
    GATE_SKIP
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= nseg) return;
    const double a = sqrt(pn[1 + s]), b = sqrt(un[1 + s]);
    const double r = (a == 0.0 || b == 0.0) ? 1.0 : a / b;
    ratio[s] = r;
    step[s] = (T)((double)seg_value(lr, lr0, s) * r);
}

// LAMB pass 2: recompute u from the stored moments (p is unchanged so far) and apply it.
template <typename T, typename S, int WK, bool MASK>
__global__ void arraytrain_lamb_apply(T* __restrict__ p, const S* __restrict__ m, const S* __restrict__ v,
        const i64* __restrict__ chunks, const T* __restrict__ wd, T wd0, const T* __restrict__ step, T inv_bc1,
        T inv_bc2, T eps, T eps_root, u16* __restrict__ w, const unsigned char* __restrict__ mask, const double* __restrict__ gate) {
    GATE_SKIP
    const chunk c = load_chunk(chunks);
    const T wd_s = seg_value(wd, wd0, c.seg), st = step[c.seg];
    // 8-bit moments are read back decoded (the codes pass 1 wrote, not the float values it formed)
    const slot<S> M(m, c.seg), V(v, c.seg);
    for (i64 base = c.lo + threadIdx.x; base < c.hi; base += ILP * (i64)blockDim.x) {
      #pragma unroll
      for (int k = 0; k < ILP; ++k) {
        const i64 i = base + k * (i64)blockDim.x;
        if (i >= c.hi) break;
        const T pi = p[i];
        const T u = ((T)M.load(i) * inv_bc1) / (sqrt((T)V.load(i) * inv_bc2 + eps_root) + eps) + wd_s * pi;
        store_param<T, WK, MASK>(p, w, mask, i, pi - st * u);
      }
    }
}

// -- Adafactor (torch.optim.Adafactor's form): the CPU family's five passes, same tables ----
// segs (S, 9): [p_off, numel, factored, B, R, C, row_off, col_off, var_off]
// rows (K, 4): [p_start, C, row_index, seg]; cols (Q, 5): [p_start, R, C, width, col_index];
// batches (NB, 2): [row_index, R]. Float64 sums, fixed orders.

// 1. one block per matrix row: row-variance EMA from the mean of G^2, and the row's sum of p^2
template <typename T>
__global__ void arraytrain_af_rows(const T* __restrict__ p, const T* __restrict__ g, T* __restrict__ row,
        const i64* __restrict__ rows, T gscale_, const double* __restrict__ gate, T beta2c, double* __restrict__ psq_rows) {
    GATE_SCALE
    const i64* r = rows + 4 * (i64)blockIdx.x;
    const i64 a = r[0], c = r[1], ri = r[2];
    double sg = 0.0, sp = 0.0;
    for (i64 i = threadIdx.x; i < c; i += blockDim.x) {
        const double gi = (double)(gscale * g[a + i]), pi = (double)p[a + i];
        sg += gi * gi;
        sp += pi * pi;
    }
    sg = block_reduce<false>(sg);
    sp = block_reduce<false>(sp);
    if (threadIdx.x == 0) {
        const double old = (double)row[ri];
        row[ri] = (T)(old + (double)beta2c * (sg / (double)c - old));
        psq_rows[blockIdx.x] = sp;
    }
}

// 2. one block per block of <= 256 columns: each thread adds its column down the rows in order
template <typename T>
__global__ void arraytrain_af_cols(const T* __restrict__ g, T* __restrict__ col, const i64* __restrict__ cols,
        T gscale_, const double* __restrict__ gate, T beta2c) {
    GATE_SCALE
    const i64* q = cols + 5 * (i64)blockIdx.x;
    const i64 a = q[0], nr = q[1], c = q[2], width = q[3], ci = q[4];
    for (i64 i = threadIdx.x; i < width; i += blockDim.x) {
        double acc = 0.0;
        for (i64 r = 0; r < nr; ++r) {
            const double gi = (double)(gscale * g[a + r * c + i]);
            acc += gi * gi;
        }
        const double old = (double)col[ci + i];
        col[ci + i] = (T)(old + (double)beta2c * (acc / (double)nr - old));
    }
}

// 3. one block per matrix: rscale = row / max(mean(row), eps1) (NaN-propagating clamp)
template <typename T>
__global__ void arraytrain_af_rscale(const T* __restrict__ row, const i64* __restrict__ batches, double eps1,
        T* __restrict__ rscale, const double* __restrict__ gate) {
    GATE_SKIP
    const i64 r0 = batches[2 * (i64)blockIdx.x], nr = batches[2 * (i64)blockIdx.x + 1];
    double s = 0.0;
    for (i64 i = threadIdx.x; i < nr; i += blockDim.x) s += (double)row[r0 + i];
    s = block_reduce<false>(s);
    __shared__ double mean;
    if (threadIdx.x == 0) { const double m = s / (double)nr; mean = m < eps1 ? eps1 : m; }
    __syncthreads();
    for (i64 i = threadIdx.x; i < nr; i += blockDim.x) rscale[r0 + i] = (T)((double)row[r0 + i] / mean);
}

// the second-moment estimate of element i of segment `seg` (factored or not), clamped at eps1^2
template <typename T>
__device__ __forceinline__ T af_variance(const i64* sg, i64 i, const T* col, const T* var, const T* rscale, T eps1sq) {
    const i64 off = sg[0];
    T v;
    if (sg[2]) {
        const i64 nr = sg[4], c = sg[5], e = i - off, k = e / c;
        v = rscale[sg[6] + k] * col[sg[7] + (k / nr) * c + (e - k * c)];
    } else {
        v = var[sg[8] + i - off];
    }
    return v < eps1sq ? eps1sq : v;
}

// 4. per chunk: unfactored variance EMA; float64 partial sums of U^2 (and of p^2 where unfactored)
template <typename T>
__global__ void arraytrain_af_stats(const T* __restrict__ p, const T* __restrict__ g, const T* __restrict__ col,
        T* __restrict__ var, const T* __restrict__ rscale, const i64* __restrict__ chunks, const i64* __restrict__ segs,
        T gscale_, const double* __restrict__ gate, T beta2c, T eps1sq, double* __restrict__ psq_part, double* __restrict__ usq_part) {
    GATE_SCALE
    const chunk c = load_chunk(chunks);
    const i64* sg = segs + 9 * (i64)c.seg;
    double su = 0.0, sp = 0.0;
    for (i64 i = c.lo + threadIdx.x; i < c.hi; i += blockDim.x) {
        const T gi = gscale * g[i];
        if (!sg[2]) {
            const i64 vi = sg[8] + i - sg[0];
            const T x = var[vi];
            var[vi] = x + beta2c * (gi * gi - x);
            const double pi = (double)p[i];
            sp += pi * pi;
        }
        const double u = (double)(gi / sqrt(af_variance(sg, i, col, var, rscale, eps1sq)));
        su += u * u;
    }
    su = block_reduce<false>(su);
    sp = block_reduce<false>(sp);
    if (threadIdx.x == 0) { usq_part[blockIdx.x] = su; psq_part[blockIdx.x] = sp; }
}

// per segment: step = max(eps2, RMS(p)) * rel_step / max(1, RMS(U) / d)   (fmax: max(c, NaN) = c)
template <typename T>
__global__ void arraytrain_af_step(const double* __restrict__ psq_chunks, const double* __restrict__ psq_rows,
        const double* __restrict__ usq, const i64* __restrict__ segs, const double* __restrict__ rel_step, double rel_step0,
        double eps2, double d, int nseg, T* __restrict__ step, const double* __restrict__ gate) {
    GATE_SKIP
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= nseg) return;
    const double size = fmax((double)segs[9 * (i64)s + 1], 1.0);
    const double alpha = fmax(eps2, sqrt((psq_chunks[1 + s] + psq_rows[1 + s]) / size)) * seg_value(rel_step, rel_step0, s);
    step[s] = (T)(alpha / fmax(1.0, sqrt(usq[1 + s] / size) / d));
}

// 5. per chunk: p = p * decay - step * U, U recomputed from the statistics
template <typename T, int WK, bool MASK>
__global__ void arraytrain_af_apply(T* __restrict__ p, T* __restrict__ g, const T* __restrict__ col,
        const T* __restrict__ var, const T* __restrict__ rscale, const i64* __restrict__ chunks,
        const i64* __restrict__ segs, T gscale_, const double* __restrict__ gate, T eps1sq, const T* __restrict__ step, const T* __restrict__ decay,
        T decay0, u16* __restrict__ w, int zero_grad, const unsigned char* __restrict__ mask) {
    GATE_SCALE
    const chunk c = load_chunk(chunks);
    const i64* sg = segs + 9 * (i64)c.seg;
    const T ss = step[c.seg], dec = seg_value(decay, decay0, c.seg);
    for (i64 i = c.lo + threadIdx.x; i < c.hi; i += blockDim.x) {
        const T v = af_variance(sg, i, col, var, rscale, eps1sq);
        store_param<T, WK, MASK>(p, w, mask, i, p[i] * dec - ss * (gscale * g[i] / sqrt(v)));
        if (zero_grad) g[i] = (T)0;
    }
}

// -- NAdam and RAdam: one template (see arraytrain.kernels.cpu.optimizers), Adam's moments, then
//    adaptive: p = p*decay - (a*d + b*m) * rect / (sqrt(v)*inv_bc2_sqrt + eps); else p = p*decay - b*m
template <typename T, typename S, int WK, bool MASK>
__global__ void arraytrain_nadam_radam_step(T* __restrict__ p, T* __restrict__ g, S* __restrict__ m, S* __restrict__ v,
        const i64* __restrict__ chunks, T gscale_, const double* __restrict__ gate, const T* __restrict__ a, T a0,
        const T* __restrict__ b, T b0, T beta1c, T beta2, T beta2c, T eps, T inv_bc2_sqrt, T rect,
        const T* __restrict__ l2, T l20, const T* __restrict__ decay, T decay0, int adaptive, """ + _TAIL + r""") {
    GATE_SCALE
    const int seg = (int)chunks[3 * (i64)blockIdx.x + 2];
    const T a_s = seg_value(a, a0, seg), b_s = seg_value(b, b0, seg), l2_s = seg_value(l2, l20, seg),
            dec = seg_value(decay, decay0, seg);
    slot<S> M(m, seg), V(v, seg);
""" + _SOPEN + r"""
        const T pi = p[i];
        const T d = gscale * g[i] + l2_s * pi;
        T mi = M.load(i);
        mi = M.store(i, mi + beta1c * (d - mi));
        const T vi = V.store(i, beta2 * (T)V.load(i) + beta2c * d * d);
        const T step = adaptive ? (a_s * d + b_s * mi) * rect / (sqrt(vi) * inv_bc2_sqrt + eps) : b_s * mi;
        store_param<T, WK, MASK>(p, w, mask, i, pi * dec - step);
""" + _sclose("M.close(i, live); V.close(i, live);") + r"""
}

template <typename T, typename S, int WK, bool MASK>
__global__ void arraytrain_adamax_step(T* __restrict__ p, T* __restrict__ g, S* __restrict__ m, S* __restrict__ u,
        const i64* __restrict__ chunks, T gscale_, const double* __restrict__ gate, const T* __restrict__ step_size,
        T step_size0, T beta1c, T beta2, T eps, const T* __restrict__ l2, T l20, """ + _TAIL + r""") {
    GATE_SCALE
    const int seg = (int)chunks[3 * (i64)blockIdx.x + 2];
    const T ss = seg_value(step_size, step_size0, seg), l2_s = seg_value(l2, l20, seg);
    slot<S> M(m, seg), U(u, seg);
""" + _SOPEN + r"""
        const T pi = p[i];
        const T d = gscale * g[i] + l2_s * pi;
        T mi = M.load(i);
        mi = M.store(i, mi + beta1c * (d - mi));
        const T ui = U.store(i, nan_max(beta2 * (T)U.load(i), fabs(d) + eps));  // torch.maximum
        store_param<T, WK, MASK>(p, w, mask, i, pi - ss * (mi / ui));
""" + _sclose("M.close(i, live); U.close(i, live);") + r"""
}

template <typename T, typename S, int WK, bool MASK>
__global__ void arraytrain_adadelta_step(T* __restrict__ p, T* __restrict__ g, S* __restrict__ sq, S* __restrict__ acc,
        const i64* __restrict__ chunks, T gscale_, const double* __restrict__ gate, const T* __restrict__ lr, T lr0,
        const T* __restrict__ wd, T wd0, T rho, T rho_c, T eps, """ + _TAIL + r""") {
    GATE_SCALE
    const int seg = (int)chunks[3 * (i64)blockIdx.x + 2];
    const T lr_s = seg_value(lr, lr0, seg), wd_s = seg_value(wd, wd0, seg);
    slot<S> Q(sq, seg), A(acc, seg);
""" + _SOPEN + r"""
        const T pi = p[i];
        const T d = gscale * g[i] + wd_s * pi;
        const T qi = Q.store(i, rho * (T)Q.load(i) + rho_c * d * d);
        const T ai = A.load(i);
        const T delta = sqrt(ai + eps) / sqrt(qi + eps) * d;
        A.store(i, rho * ai + rho_c * delta * delta);
        store_param<T, WK, MASK>(p, w, mask, i, pi - lr_s * delta);
""" + _sclose("Q.close(i, live); A.close(i, live);") + r"""
}
""", [])

# Which state storages each optimizer instantiates besides the parameters' own type: those in
# _BF16_STATE take bfloat16 (u16) and 8-bit (q8) state with float parameters.
_BF16_STATE = {"sgd", "adam", "adagrad", "rmsprop", "lion"}  # and LAMB (below); not Sophia, Adafactor
_ELEMENTWISE = ("sgd", "adam", "adagrad", "rmsprop", "lion", "sophia")
# NAdam and RAdam (one template), Adamax, Adadelta: element-wise, bfloat16 state offered
_BF16_STATE |= {"nadam_radam", "adamax", "adadelta"}
_ELEMENTWISE += ("nadam_radam", "adamax", "adadelta")


def _states(t: str, low: bool):
    """The state storages of parameters ``t``: its own, and with ``low`` bfloat16 and 8-bit for float."""
    return [t] + (["u16", "q8"] if low and t == "float" else [])


def _variants(t: str, bf16: bool):
    states = _states(t, bf16)
    wks = (0, 1, 2) if t == "float" else (0,)
    return [(s, wk, m) for s in states for wk in wks for m in ("false", "true")]


def _instances():
    out = []
    for t in ("float", "double"):
        for opt in _ELEMENTWISE:
            out += [f"arraytrain_{opt}_step<{t},{s},{wk},{m}>" for s, wk, m in _variants(t, opt in _BF16_STATE)]
        out += [f"arraytrain_sam_perturb<{t},{m}>" for m in ("false", "true")]
        out += [f"arraytrain_lamb_moments<{t},{s}>" for s in _states(t, True)] + [f"arraytrain_lamb_ratio<{t}>"]
        out += [f"arraytrain_lamb_apply<{t},{s},{wk},{m}>" for s, wk, m in _variants(t, True)]
        out += [f"arraytrain_af_{k}<{t}>" for k in ("rows", "cols", "rscale", "stats", "step")]
        out += [f"arraytrain_af_apply<{t},{wk},{m}>" for _, wk, m in _variants(t, False)]
    return out


SOURCE.instances = tuple(_instances())


def _run(name, p, state, pieces, arrays, scalars, w, wkind, zero_grad, mask):
    """Launch ``arraytrain_<name><T,S,WK,MASK>(*arrays, chunks, *scalars, w, zero_grad, mask)``."""
    t = ctype(p.dtype)
    s = _storage(state, t)
    wk = 0 if w is None else int(wkind)
    expr = f"arraytrain_{name}<{t},{s},{wk},{'true' if mask is not None else 'false'}>"
    ch = _chunks(pieces, state)
    launch(SOURCE.function(expr), ch.count,
           (*(_arg(a) for a in arrays), ch.table, *scalars, ptr(w), np.int32(bool(zero_grad)), ptr(mask)))


# -- 8-bit state (arraytrain.kernels.interface.Q8 of CuPy arrays) -----------------------------


def _storage(state, t: str) -> str:
    """The template's ``S`` for a state slot: ``q8`` (8-bit or float8), ``u16`` (bfloat16 bits) or ``t``."""
    if isinstance(state, QUANTIZED):
        return "q8"
    return "u16" if state is not None and state.dtype == np.uint16 else t


def _arg(a):
    """A kernel's slot argument: an 8-bit slot's device descriptor, else :func:`ptr`. A slot a
    configuration lacks arrives as an empty array (a null pointer), whatever the others' storage."""
    return q8_descriptor(a) if isinstance(a, QUANTIZED) else ptr(a)


_descriptors: dict = {}


def q8_descriptor(q: Q8 | F8):
    """The ``q8`` struct of :data:`arraytrain.kernels.cuda.core.HEADER` for slot ``q`` (CuPy arrays),
    in device memory: 11 little-endian 64-bit words, the 7 pointers then ``shift | bias << 32``,
    ``nb | codec << 32``, ``start`` and the salt (a float8 slot: no table, codec 1 for e4m3 codes, 2
    for e5m2, whose ``start`` and step's salt its stochastic rounding reads; 0 for the others). Built
    once per content (its pointers and ints are its key, so a stale entry cannot describe other
    memory), at most 256 kept; the salt is no part of the key: it changes every step, and its word is
    rewritten on the stream when it does (a kernel queued before read the old one)."""
    cp = cupy()
    salt = 0
    if isinstance(q, F8):
        salt = int(q.salt) & 0xFFFFFFFF if q.wide else 0
        words = (q.codes.data.ptr, q.aux.data.ptr, q.base.data.ptr, q.quant.data.ptr, q.offset.data.ptr,
                 q.qmap.data.ptr, 0, 0, (1 + int(q.wide)) << 32, q.start.data.ptr)
    else:
        words = (q.codes.data.ptr, q.aux.data.ptr, q.base.data.ptr, q.quant.data.ptr, q.offset.data.ptr,
                 q.qmap.data.ptr, q.table.data.ptr, (int(q.shift) & 0xFFFFFFFF) | ((int(q.bias) & 0xFFFFFFFF) << 32),
                 int(q.nb) & 0xFFFFFFFF, 0)
    key = (device(), words)
    hit = _descriptors.get(key)
    if hit is None:
        if len(_descriptors) >= 256:
            _descriptors.clear()  # launches on the stream keep their order: a queued kernel read its copy first
        hit = _descriptors[key] = [cp.asarray(np.array(words + (salt,), dtype=np.uint64)), salt]
    elif hit[1] != salt:
        hit[0][10:].set(np.array([salt], dtype=np.uint64))
        hit[1] = salt
    return hit[0]


_aligned: dict = {}


def _chunks(pieces, state):
    """The chunk table of ``pieces``; with an 8-bit slot, checked once per table (per ``pieces`` and
    segment offsets) to start every chunk on a block boundary of its parameter: the 8-bit loop
    takes a block of state per pass of the thread block (the reference raises the same error)."""
    ch = chunks_for(pieces)
    if isinstance(state, QUANTIZED) and ch.count:
        key = (id(ch), state.offset.data.ptr, state.offset.size)
        if _aligned.get(key) is not ch:
            offsets = to_host(state.offset) if hasattr(state.offset, "get") else np.asarray(state.offset)
            rows = ch.host_rows()
            bad = (rows[:, 0] - offsets[rows[:, 2]]) % Q8_BLOCK != 0
            if bad.any():
                lo, hi, seg = rows[np.argmax(bad)].tolist()
                raise ValueError(f"pieces: row [{lo}, {hi}) splits an 8-bit block of segment {seg} "
                                 f"(8-bit state needs pieces cut at multiples of {Q8_BLOCK} from each parameter's start)")
            if len(_aligned) >= 256:
                _aligned.clear()
            _aligned[key] = ch
    return ch


def _seg(values, p):
    return seg_arg(values, p.dtype)


def _gs(gscale, t):
    """``(gscale, gate)`` kernel arguments: a number, or a :class:`DeviceScale` formed on the device."""
    if isinstance(gscale, DeviceScale):
        return t(gscale.sign), gscale.gate
    return t(gscale), NULL


def sgd_step(p, g, buf, pieces, *, gscale, lr, l2, momentum, dampening, nesterov, first, working=None, kind=LP_NONE,
             zero_grad=False, grad_ptrs=None, mask=None):
    """Fused SGD update; see :func:`arraytrain.kernels.reference.sgd_step`."""
    refuse_grad_ptrs(grad_ptrs)
    t = p.dtype.type
    _run("sgd_step", p, buf, pieces, (p, g, buf),
         (*_gs(gscale, t), *_seg(lr, p), *_seg(l2, p), t(momentum), t(1.0 - dampening), np.int32(bool(nesterov)),
          np.int32(bool(first))), working, kind, zero_grad, mask)


def adam_step(p, g, m, v, vmax, pieces, *, gscale, step_size, beta1, beta2, eps, inv_bc2_sqrt, l2, decay, amsgrad,
              working=None, kind=LP_NONE, zero_grad=False, grad_ptrs=None, mask=None):
    """Fused Adam/AdamW update; see :func:`arraytrain.kernels.reference.adam_step`."""
    refuse_grad_ptrs(grad_ptrs)
    t = p.dtype.type
    _run("adam_step", p, m, pieces, (p, g, m, v, vmax),
         (*_gs(gscale, t), *_seg(step_size, p), t(1.0 - beta1), t(beta2), t(1.0 - beta2), t(eps), t(inv_bc2_sqrt),
          *_seg(l2, p), *_seg(decay, p), np.int32(bool(amsgrad))), working, kind, zero_grad, mask)


def adagrad_step(p, g, sum_sq, pieces, *, gscale, lr, l2, eps, working=None, kind=LP_NONE, zero_grad=False, grad_ptrs=None, mask=None):
    """Fused Adagrad update; see :func:`arraytrain.kernels.reference.adagrad_step`."""
    refuse_grad_ptrs(grad_ptrs)
    t = p.dtype.type
    _run("adagrad_step", p, sum_sq, pieces, (p, g, sum_sq),
         (*_gs(gscale, t), *_seg(lr, p), *_seg(l2, p), t(eps)), working, kind, zero_grad, mask)


def rmsprop_step(p, g, square_avg, grad_avg, momentum_buffer, pieces, *, gscale, lr, l2, alpha, eps, momentum,
                 centered, working=None, kind=LP_NONE, zero_grad=False, grad_ptrs=None, mask=None):
    """Fused RMSprop update; see :func:`arraytrain.kernels.reference.rmsprop_step`."""
    refuse_grad_ptrs(grad_ptrs)
    t = p.dtype.type
    _run("rmsprop_step", p, square_avg, pieces, (p, g, square_avg, grad_avg, momentum_buffer),
         (*_gs(gscale, t), *_seg(lr, p), *_seg(l2, p), t(alpha), t(1.0 - alpha), t(eps), t(momentum),
          np.int32(bool(centered)), np.int32(bool(momentum > 0))), working, kind, zero_grad, mask)


def lion_step(p, g, m, pieces, *, gscale, lr, decay, beta1, beta2, working=None, kind=LP_NONE, zero_grad=False,
              grad_ptrs=None, mask=None):
    """Fused Lion update; see :func:`arraytrain.kernels.reference.lion_step`."""
    refuse_grad_ptrs(grad_ptrs)
    t = p.dtype.type
    _run("lion_step", p, m, pieces, (p, g, m),
         (*_gs(gscale, t), *_seg(lr, p), *_seg(decay, p), t(beta1), t(1.0 - beta1), t(beta2), t(1.0 - beta2)),
         working, kind, zero_grad, mask)


def sophia_step(p, g, m, h, pieces, *, gscale, lr, decay, beta1, rho_bs, eps, working=None, kind=LP_NONE,
                zero_grad=False, mask=None):
    """Fused SophiaG update; see :func:`arraytrain.kernels.reference.sophia_step`."""
    t = p.dtype.type
    _run("sophia_step", p, m, pieces, (p, g, m, h),
         (*_gs(gscale, t), *_seg(lr, p), *_seg(decay, p), t(beta1), t(1.0 - beta1), t(rho_bs), t(eps)),
         working, kind, zero_grad, mask)


def sam_perturb(p, g, backup, pieces, *, scale, adaptive, zero_grad=False, mask=None):
    """``backup = p; p += scale * (p^2 if adaptive) * g``, pruned weights 0.

    See :func:`arraytrain.kernels.reference.sam_perturb`.
    """
    ch = chunks_for(pieces)
    expr = f"arraytrain_sam_perturb<{ctype(p.dtype)},{'true' if mask is not None else 'false'}>"
    launch(SOURCE.function(expr), ch.count, (p, g, backup, ch.table, p.dtype.type(scale), np.int32(bool(adaptive)),
                                             np.int32(bool(zero_grad)), ptr(mask)))


def lamb_step(p, g, m, v, pieces, *, gscale, lr, weight_decay, beta1, beta2, eps, eps_root, inv_bc1, inv_bc2,
              working=None, kind=LP_NONE, zero_grad=False, reduce_sums=None, grad_ptrs=None, mask=None):
    """Fused LAMB update; returns the per-parameter trust ratios (float64, on the device).

    Three launches and no synchronisation: moments with per-chunk norms, the trust
    ratios and steps per parameter, the update. See :func:`arraytrain.kernels.reference.lamb_step`
    (``reduce_sums`` gets the device array of the ``2 * nseg`` sums, on the current stream).
    """
    refuse_grad_ptrs(grad_ptrs)
    cp, t, tn = cupy(), p.dtype.type, ctype(p.dtype)
    sn = _storage(m, tn)  # the state's storage: the parameters' type, u16 bfloat16 bits or q8
    nseg = len(np.asarray(lr).reshape(-1))
    ch = _chunks(pieces, m)
    wd = _seg(weight_decay, p)
    gs = _gs(gscale, t)
    gate = gs[1]
    inv_bc1, inv_bc2 = t(inv_bc1), t(inv_bc2)
    ratio = cp.ones(nseg, dtype=cp.float64)
    if ch.count == 0 and reduce_sums is None:
        return ratio
    # [0, ||p_s||^2..., 0, ||u_s||^2...]: each half as seg_reduce writes it (a total slot first)
    sums = cp.zeros(2 * (1 + nseg), cp.float64)
    pn, un = sums[: 1 + nseg], sums[1 + nseg :]
    if ch.count:
        psq, usq = cp.empty(ch.count, cp.float64), cp.empty(ch.count, cp.float64)
        launch(SOURCE.function(f"arraytrain_lamb_moments<{tn},{sn}>"), ch.count,
               (p, g, _arg(m), _arg(v), ch.table, *gs, *wd, t(1.0 - beta1), t(beta2), t(1.0 - beta2), inv_bc1, inv_bc2,
                t(eps), t(eps_root), np.int32(bool(zero_grad)), psq, usq))
        reductions.seg_reduce(psq, *ch.seg_ranges(nseg), nseg, pn, total=False)
        reductions.seg_reduce(usq, *ch.seg_ranges(nseg), nseg, un, total=False)
    if reduce_sums is not None:
        both = cp.concatenate((pn[1:], un[1:]))
        reduce_sums(both)
        pn[1:], un[1:] = both[:nseg], both[nseg:]
    step = cp.empty(nseg, dtype=p.dtype)
    launch(SOURCE.function(f"arraytrain_lamb_ratio<{tn}>"), -(-nseg // THREADS),
           (pn, un, *_seg(lr, p), np.int32(nseg), ratio, step, gate))
    wk = 0 if working is None else int(kind)
    if ch.count == 0:
        return ratio
    launch(SOURCE.function(f"arraytrain_lamb_apply<{tn},{sn},{wk},{'true' if mask is not None else 'false'}>"),
           ch.count, (p, _arg(m), _arg(v), ch.table, *wd, step, inv_bc1, inv_bc2, t(eps), t(eps_root), ptr(working), ptr(mask),
                      gate))
    return ratio


class _AfTables:
    """Adafactor's work tables on the device, and each segment's range of rows (rows are in segment order)."""

    def __init__(self, segs, rows, cols, batches):
        cp = cupy()
        self.segs, self.rows, self.cols, self.batches = (cp.asarray(np.ascontiguousarray(a, np.int64))
                                                         for a in (segs, rows, cols, batches))
        nseg, seg_of_row = segs.shape[0], np.asarray(rows)[:, 3]
        s = np.arange(nseg)
        self.row_lo = cp.asarray(np.searchsorted(seg_of_row, s, side="left").astype(np.int64))
        self.row_hi = cp.asarray(np.searchsorted(seg_of_row, s, side="right").astype(np.int64))


_af_cache: dict = {}


def _af_tables(segs, rows, cols, batches) -> _AfTables:
    import weakref

    key = (id(segs), device())
    hit = _af_cache.get(key)
    if hit is not None and hit[0]() is segs:
        return hit[1]
    tables = _AfTables(segs, rows, cols, batches)
    _af_cache[key] = (weakref.ref(segs, lambda _r, k=key: _af_cache.pop(k, None)), tables)
    return tables


def adafactor_step(p, g, row, col, var, pieces, segs, rows, cols, batches, *, gscale, rel_step, decay,
                   one_minus_beta2, eps1, eps2, d, working=None, kind=LP_NONE, zero_grad=False, mask=None):
    """Fused Adafactor update: the CPU family's five passes as eight launches, no synchronisation.

    Rows, columns and the per-matrix row scale as in :mod:`arraytrain.kernels.cpu.optimizers`; the
    per-parameter step sizes are formed on the device from float64 per-chunk and per-row
    partials. See :func:`arraytrain.kernels.reference.adafactor_step`.
    """
    cp, t, tn = cupy(), p.dtype.type, ctype(p.dtype)
    nseg = segs.shape[0]
    ch = chunks_for(pieces)
    tab = _af_tables(segs, rows, cols, batches)
    gs, b2c, eps1sq = _gs(gscale, t), t(one_minus_beta2), t(eps1 * eps1)
    gate = gs[1]
    nrows = rows.shape[0]
    psq_rows = cp.zeros(max(nrows, 1), cp.float64)
    rscale = cp.empty(max(row.size, 1), p.dtype)
    fn = SOURCE.function
    if nrows:
        launch(fn(f"arraytrain_af_rows<{tn}>"), nrows, (p, g, row, tab.rows, *gs, b2c, psq_rows))
        launch(fn(f"arraytrain_af_cols<{tn}>"), cols.shape[0], (g, col, tab.cols, *gs, b2c))
        launch(fn(f"arraytrain_af_rscale<{tn}>"), batches.shape[0], (row, tab.batches, np.float64(eps1), rscale, gate))
    count = max(ch.count, 1)
    psq_part, usq_part = cp.zeros(count, cp.float64), cp.zeros(count, cp.float64)
    launch(fn(f"arraytrain_af_stats<{tn}>"), ch.count, (p, g, col, ptr(var), rscale, ch.table, tab.segs, *gs, b2c,
                                                        eps1sq, psq_part, usq_part))
    pn, pr, un = (cp.zeros(1 + nseg, cp.float64) for _ in range(3))
    lo, hi = ch.seg_ranges(nseg)
    reductions.seg_reduce(psq_part, lo, hi, nseg, pn, total=False)
    reductions.seg_reduce(usq_part, lo, hi, nseg, un, total=False)
    reductions.seg_reduce(psq_rows, tab.row_lo, tab.row_hi, nseg, pr, total=False)
    step = cp.empty(max(nseg, 1), p.dtype)
    launch(fn(f"arraytrain_af_step<{tn}>"), -(-nseg // THREADS),
           (pn, pr, un, tab.segs, *seg_arg(rel_step, np.float64), np.float64(eps2), np.float64(d), np.int32(nseg), step, gate))
    wk = 0 if working is None else int(kind)
    launch(fn(f"arraytrain_af_apply<{tn},{wk},{'true' if mask is not None else 'false'}>"), ch.count,
           (p, g, col, ptr(var), rscale, ch.table, tab.segs, *gs, eps1sq, step, *_seg(decay, p), ptr(working),
            np.int32(bool(zero_grad)), ptr(mask)))


# -- NAdam, RAdam, Adamax, Adadelta ------------------------------------------------------------


def _nadam_radam(p, g, m, v, pieces, gscale, a, b, beta1, beta2, eps, inv_bc2_sqrt, rect, l2, decay, adaptive, w,
                 wkind, zero_grad, mask):
    """The shared NAdam/RAdam template (see :mod:`arraytrain.kernels.cpu.optimizers`)."""
    t = p.dtype.type
    _run("nadam_radam_step", p, m, pieces, (p, g, m, v),
         (*_gs(gscale, t), *_seg(a, p), *_seg(b, p), t(1.0 - beta1), t(beta2), t(1.0 - beta2), t(eps),
          t(inv_bc2_sqrt), t(rect), *_seg(l2, p), *_seg(decay, p), np.int32(bool(adaptive))), w, wkind, zero_grad, mask)


def nadam_step(p, g, m, v, pieces, *, gscale, grad_step, moment_step, beta1, beta2, eps, inv_bc2_sqrt, l2, decay,
               working=None, kind=LP_NONE, zero_grad=False, grad_ptrs=None, mask=None):
    """Fused NAdam update; see :func:`arraytrain.kernels.reference.nadam_step`."""
    refuse_grad_ptrs(grad_ptrs)
    _nadam_radam(p, g, m, v, pieces, gscale, grad_step, moment_step, beta1, beta2, eps, inv_bc2_sqrt, 1.0, l2, decay,
                 True, working, kind, zero_grad, mask)


def radam_step(p, g, m, v, pieces, *, gscale, step_size, beta1, beta2, eps, rect, rectified, l2, decay, working=None,
               kind=LP_NONE, zero_grad=False, grad_ptrs=None, mask=None):
    """Fused RAdam update; see :func:`arraytrain.kernels.reference.radam_step`."""
    refuse_grad_ptrs(grad_ptrs)
    _nadam_radam(p, g, m, v, pieces, gscale, np.zeros(np.shape(step_size)), step_size, beta1, beta2, eps, 1.0, rect,
                 l2, decay, rectified, working, kind, zero_grad, mask)


def adamax_step(p, g, m, u, pieces, *, gscale, step_size, beta1, beta2, eps, l2, working=None, kind=LP_NONE,
                zero_grad=False, grad_ptrs=None, mask=None):
    """Fused Adamax update; see :func:`arraytrain.kernels.reference.adamax_step`."""
    refuse_grad_ptrs(grad_ptrs)
    t = p.dtype.type
    _run("adamax_step", p, m, pieces, (p, g, m, u),
         (*_gs(gscale, t), *_seg(step_size, p), t(1.0 - beta1), t(beta2), t(eps), *_seg(l2, p)),
         working, kind, zero_grad, mask)


def adadelta_step(p, g, square_avg, acc_delta, pieces, *, gscale, lr, l2, rho, eps, working=None, kind=LP_NONE,
                  zero_grad=False, grad_ptrs=None, mask=None):
    """Fused Adadelta update; see :func:`arraytrain.kernels.reference.adadelta_step`."""
    refuse_grad_ptrs(grad_ptrs)
    t = p.dtype.type
    _run("adadelta_step", p, square_avg, pieces, (p, g, square_avg, acc_delta),
         (*_gs(gscale, t), *_seg(lr, p), *_seg(l2, p), t(rho), t(1.0 - rho), t(eps)), working, kind, zero_grad, mask)


# -- Muon and schedule-free AdamW: a source of their own (compiled and build-checked apart) ----
#
# Muon, per matrix of the ``mats`` table (see the CPU family): the momentum kernel over the
# matrix's chunks (a range of the layout's chunk table) writes the update into a stack of its
# shape and float64 partial sums of its squares, one block adds them in a fixed order into the
# normalisation 1/max(||X||, eps), applied on the device (no synchronisation); the
# Newton-Schulz GEMMs go to cuBLAS through CuPy's matmul, batched over matrices of one shape;
# the apply kernel writes the parameters. The gate reaches the momentum and apply kernels: a
# skipped step changes nothing.
# Schedule-free AdamW: one thread per parameter updates max_lr and weight_sum and forms the
# averaging weight (gated), then one launch updates v, z and y.

_MUON_SF_LOOP_CLOSE = r"""
      }
    }
"""

MUON_SF_SOURCE = Source(_PRELUDE + r"""
template <typename T, typename S>
__global__ void arraytrain_muon_momentum(T* __restrict__ g, S* __restrict__ buf, T* __restrict__ u,
        const i64* __restrict__ chunks, i64 off, T gscale_, const double* __restrict__ gate, T mc, int nesterov,
        int zero_grad, double* __restrict__ part) {
    GATE_SCALE
    double s = 0.0;
    slot<S> B(buf, (int)chunks[3 * (i64)blockIdx.x + 2]);
""" + _SOPEN + r"""
        const T d = gscale * g[i];
        T b = B.load(i);
        b = B.store(i, b + mc * (d - b));
        const T x = nesterov ? b + mc * (d - b) : b;
        u[i - off] = x;
        s += (double)x * (double)x;
""" + _sclose("B.close(i, live);") + r"""
    s = block_reduce<false>(s);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}

// One block: the matrix's partials in a fixed order, then scale = 1 / max(sqrt(sum), eps).
__global__ void arraytrain_muon_norm(const double* __restrict__ part, i64 count, double eps, double* __restrict__ out) {
    double s = 0.0;
    for (i64 j = threadIdx.x; j < count; j += blockDim.x) s += part[j];
    s = block_reduce<false>(s);
    if (threadIdx.x == 0) { const double r = sqrt(s); out[0] = 1.0 / (r > eps ? r : eps); }
}

template <typename T, int WK, bool MASK>
__global__ void arraytrain_muon_apply(T* __restrict__ p, const T* __restrict__ o, const i64* __restrict__ chunks,
        i64 off, const double* __restrict__ gate, const T* __restrict__ alr, T alr0, const T* __restrict__ decay,
        T decay0, u16* __restrict__ w, const unsigned char* __restrict__ mask) {
    GATE_SKIP
    const int seg = (int)chunks[3 * (i64)blockIdx.x + 2];
    const T a = seg_value(alr, alr0, seg), dec = seg_value(decay, decay0, seg);
""" + _OPEN + r"""
        store_param<T, WK, MASK>(p, w, mask, i, p[i] * dec - a * o[i - off]);
""" + _MUON_SF_LOOP_CLOSE + r"""
}

// Schedule-free: per parameter, max_lr = max(max_lr, weight_lr) (NaN-propagating),
// w = max_lr^power, weight_sum += w, ck = w / weight_sum (0 for 0/0, NaN kept).
__global__ void arraytrain_sf_weights(double* __restrict__ max_lr, double* __restrict__ weight_sum,
        const double* __restrict__ wlr, double wlr0, double power, int nseg, double* __restrict__ ck,
        const double* __restrict__ gate) {
    GATE_SKIP
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= nseg) return;
    double m = max_lr[s];
    const double x = seg_value(wlr, wlr0, s);
    m = (isnan(m) || isnan(x)) ? m + x : (x > m ? x : m);
    max_lr[s] = m;
    const double wt = pow(m, power), total = weight_sum[s] + wt;
    weight_sum[s] = total;
    const double r = wt / total;
    ck[s] = (isnan(r) && !(isnan(wt) || isnan(total))) ? 0.0 : r;
}

template <typename T, typename S, int WK, bool MASK>
__global__ void arraytrain_sf_adamw_step(T* __restrict__ p, T* __restrict__ g, T* __restrict__ z, S* __restrict__ v,
        const i64* __restrict__ chunks, T gscale_, const double* __restrict__ gate, const T* __restrict__ lr, T lr0,
        const T* __restrict__ wd, T wd0, const double* __restrict__ ck, T b1, T b1c, T beta2, T beta2c, T eps,
        T inv_bc2_sqrt, """ + _TAIL + r""") {
    GATE_SCALE
    const int seg = (int)chunks[3 * (i64)blockIdx.x + 2];
    const T lr_s = seg_value(lr, lr0, seg), wd_s = seg_value(wd, wd0, seg), cw = (T)ck[seg];
    // y' = b1 x' + (1 - b1) z' with x' = (1 - cw) x + cw z' and x = (y - (1 - b1) z) / b1
    const T keep = (T)1 - cw, take = b1 * cw + b1c;
    slot<S> V(v, seg);
""" + _SOPEN + r"""
        const T y = p[i];
        const T d = gscale * g[i];
        const T vi = V.store(i, beta2 * (T)V.load(i) + beta2c * d * d);
        const T upd = d / (sqrt(vi) * inv_bc2_sqrt + eps) + wd_s * y;
        const T zo = z[i];
        const T zn = zo - lr_s * upd;
        store_param<T, 0, MASK>(z, (u16*)0, mask, i, zn);
        store_param<T, WK, MASK>(p, w, mask, i, keep * (y - b1c * zo) + take * zn);
""" + _sclose("V.close(i, live);") + r"""
}
""", [])


def _muon_sf_instances():
    out = ["arraytrain_muon_norm", "arraytrain_sf_weights"]
    for t in ("float", "double"):
        out += [f"arraytrain_muon_momentum<{t},{s}>" for s in _states(t, True)]
        out += [f"arraytrain_muon_apply<{t},{wk},{m}>" for _, wk, m in _variants(t, False)]
        out += [f"arraytrain_sf_adamw_step<{t},{s},{wk},{m}>" for s, wk, m in _variants(t, True)]
    return out


MUON_SF_SOURCE.instances = tuple(_muon_sf_instances())


# the most elements a stack of same-shape matrices iterated together may hold (its iterate;
# the scratch beside it is at most as large again, twice that for wide Gram matrices)
MUON_BATCH_ELEMENTS = 1 << 25


def muon_step(p, g, buf, work, mats, pieces, *, gscale, momentum, nesterov, adjusted_lr, decay, eps_norm,
              ns_coefficients, ns_steps, working=None, kind=LP_NONE, zero_grad=False, mask=None):
    """Muon without synchronisation; see :func:`arraytrain.kernels.reference.muon_step`.

    Matrices of one shape are iterated together: per matrix, the momentum kernel (one
    launch over its chunks) writes its update into a stack and the float64 partials of its
    squares, and one block forms its scale from them; per stack (at most
    ``MUON_BATCH_ELEMENTS`` elements), one scaling and the Newton-Schulz steps as batched
    cuBLAS GEMMs; per matrix, the apply. A model's many same-shape matrices (the layers of
    a transformer) thus cost 3 launches each plus ~20 per stack, not ~40 each. The stacks
    and their scratch come from CuPy's memory pool (``work`` is the CPU family's scratch).
    """
    from .. import newton_schulz

    cp, t, tn = cupy(), p.dtype.type, ctype(p.dtype)
    fn = MUON_SF_SOURCE.function
    ch = _chunks(pieces, buf)
    if ch.count == 0:
        return
    # each piece is cut into ceil(size / CHUNK) consecutive chunks: a matrix's chunk range
    sizes = np.asarray(pieces)[:, 1] - np.asarray(pieces)[:, 0]
    first_chunk = np.concatenate([[0], np.cumsum(-(-sizes // CHUNK))])
    gs = _gs(gscale, t)
    gate = gs[1]
    alr, dec = _seg(adjusted_lr, p), _seg(decay, p)
    momentum_fn = fn(f"arraytrain_muon_momentum<{tn},{_storage(buf, tn)}>")
    bufarg = _arg(buf)
    norm_fn = fn("arraytrain_muon_norm")
    wk = 0 if working is None else int(kind)
    apply_fn = fn(f"arraytrain_muon_apply<{tn},{wk},{'true' if mask is not None else 'false'}>")
    part = cp.empty(ch.count, cp.float64)
    for (rows, cols), batch in _muon_batches(np.asarray(mats), first_chunk):
        m = min(rows, cols)
        stack = cp.empty((len(batch), rows, cols), p.dtype)
        scratch = cp.empty(stack.size + 2 * len(batch) * m * m, p.dtype)
        scales = cp.empty(len(batch), cp.float64)
        for j, (off, c0, c1) in enumerate(batch):
            launch(momentum_fn, c1 - c0, (g, bufarg, stack[j], ch.table[c0:c1], np.int64(off), *gs, t(1.0 - momentum),
                                          np.int32(bool(nesterov)), np.int32(bool(zero_grad)), part[c0:c1]))
            launch(norm_fn, 1, (part[c0:c1], np.int64(c1 - c0), np.float64(eps_norm), scales[j:j + 1]))
        stack *= scales.astype(p.dtype)[:, None, None]  # as the scale kernel: the factor cast to T, then multiplied
        o = newton_schulz.iterate(stack, scratch, ns_coefficients, ns_steps, xp=cp)
        for j, (off, c0, c1) in enumerate(batch):
            launch(apply_fn, c1 - c0,
                   (p, o[j], ch.table[c0:c1], np.int64(off), gate, *alr, *dec, ptr(working), ptr(mask)))


def _muon_batches(mats: np.ndarray, first_chunk: np.ndarray):
    """``((rows, cols), [(offset, chunk_lo, chunk_hi), ...])`` per stack: Muon's matrices with chunks,
    grouped by shape in order of first appearance, each group cut at ``MUON_BATCH_ELEMENTS``."""
    groups: dict = {}
    for _, off, rows, cols, lo, hi in mats.tolist():
        if lo != hi:
            groups.setdefault((rows, cols), []).append((off, int(first_chunk[lo]), int(first_chunk[hi])))
    for shape, members in groups.items():
        per = max(1, MUON_BATCH_ELEMENTS // (shape[0] * shape[1]))
        for i in range(0, len(members), per):
            yield shape, members[i:i + per]


def schedule_free_adamw_step(p, g, z, v, max_lr, weight_sum, pieces, *, gscale, lr, weight_lr, weight_lr_power,
                             weight_decay, beta1, beta2, eps, inv_bc2_sqrt, working=None, kind=LP_NONE, zero_grad=False,
                             mask=None):
    """Schedule-Free AdamW in two launches, no synchronisation; see
    :func:`arraytrain.kernels.reference.schedule_free_adamw_step`."""
    cp, t = cupy(), p.dtype.type
    nseg = max_lr.size
    gs = _gs(gscale, t)
    ck = cp.empty(max(nseg, 1), cp.float64)
    if nseg:
        launch(MUON_SF_SOURCE.function("arraytrain_sf_weights"), -(-nseg // THREADS),
               (max_lr, weight_sum, *seg_arg(weight_lr, np.float64), np.float64(weight_lr_power), np.int32(nseg), ck,
                gs[1]))
    t_name = ctype(p.dtype)
    s_name = _storage(v, t_name)
    wk = 0 if working is None else int(kind)
    ch = _chunks(pieces, v)
    expr = f"arraytrain_sf_adamw_step<{t_name},{s_name},{wk},{'true' if mask is not None else 'false'}>"
    launch(MUON_SF_SOURCE.function(expr), ch.count,
           (p, g, z, _arg(v), ch.table, *gs, *_seg(lr, p), *_seg(weight_decay, p), ck, t(beta1), t(1.0 - beta1), t(beta2),
            t(1.0 - beta2), t(eps), t(inv_bc2_sqrt), ptr(working), np.int32(bool(zero_grad)), ptr(mask)))
