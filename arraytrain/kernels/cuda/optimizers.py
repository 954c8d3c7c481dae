"""CUDA optimizer kernels: the same names, signatures and math as :mod:`arraytrain.kernels.cpu`.

One launch per step covers every parameter: a block per chunk of the layout (see
:mod:`._core`) reads its parameter's hyperparameters once. Variants are template
arguments of one kernel per optimizer (never near-copies): ``T`` the parameters'
float/double, ``S`` the state's storage (``T``, or ``u16`` bfloat16 bits), ``WK`` the
working copy (0 none, 1 bfloat16, 2 float16), ``MASK`` a pruning mask. The learning
rate and every step-dependent value are kernel arguments, so a schedule never
recompiles anything. Scalars are passed as NumPy scalars of the storage type.

LAMB's trust ratios are formed on the device (per-chunk float64 partials, then the
fixed-order per-parameter reduction of :mod:`.reductions`), so a LAMB step does not
synchronise with the host; its return value is a device array.
"""

from __future__ import annotations

import numpy as np

from ...errors import BackendUnavailableError
from . import reductions
from ._core import THREADS, Source, chunks_for, ctype, cupy, launch, ptr, seg_arg

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

SOURCE = Source(r"""
#define ILP 4
template <typename T> __device__ __forceinline__ T nan_max(T a, T b) { return (isnan(a) || isnan(b)) ? a + b : (a > b ? a : b); }
// sign that keeps NaN (np.sign)
template <typename T> __device__ __forceinline__ T sign_of(T x) { return x > (T)0 ? (T)1 : (x < (T)0 ? (T)-1 : x); }

template <typename T, typename S, int WK, bool MASK>
__global__ void arraytrain_sgd_step(T* __restrict__ p, T* __restrict__ g, S* __restrict__ buf,
        const i64* __restrict__ chunks, T gscale, const T* __restrict__ lr, T lr0, const T* __restrict__ wd, T wd0,
        T momentum, T damp_c, int nesterov, int first, """ + _TAIL + r""") {
    const int seg = (int)chunks[3 * (i64)blockIdx.x + 2];
    const T lr_s = seg_value(lr, lr0, seg), wd_s = seg_value(wd, wd0, seg);
    const bool has_buf = momentum != (T)0;
""" + _OPEN + r"""
        const T pi = p[i];
        T d = gscale * g[i] + wd_s * pi;
        if (has_buf) {
            T bi = first ? d : momentum * (T)state<S>::load(buf, i) + damp_c * d;
            bi = state<S>::store(buf, i, bi);
            d = nesterov ? d + momentum * bi : bi;
        }
        store_param<T, WK, MASK>(p, w, mask, i, pi - lr_s * d);
""" + _CLOSE + r"""
}

template <typename T, typename S, int WK, bool MASK>
__global__ void arraytrain_adam_step(T* __restrict__ p, T* __restrict__ g, S* __restrict__ m, S* __restrict__ v,
        S* __restrict__ vmax, const i64* __restrict__ chunks, T gscale, const T* __restrict__ step_size, T step_size0,
        T beta1c, T beta2, T beta2c, T eps, T inv_bc2, const T* __restrict__ l2, T l20, const T* __restrict__ decay,
        T decay0, int amsgrad, """ + _TAIL + r""") {
    const int seg = (int)chunks[3 * (i64)blockIdx.x + 2];
    const T ss = seg_value(step_size, step_size0, seg), l2_s = seg_value(l2, l20, seg), dec = seg_value(decay, decay0, seg);
""" + _OPEN + r"""
        const T pi = p[i];
        const T d = gscale * g[i] + l2_s * pi;
        T mi = state<S>::load(m, i);
        mi = mi + beta1c * (d - mi);
        T vi = beta2 * (T)state<S>::load(v, i) + beta2c * d * d;
        // continue from the stored values, so a low-precision state is what the update sees
        mi = state<S>::store(m, i, mi);
        vi = state<S>::store(v, i, vi);
        if (amsgrad) vi = state<S>::store(vmax, i, nan_max((T)state<S>::load(vmax, i), vi));
        store_param<T, WK, MASK>(p, w, mask, i, pi * dec - ss * mi / (sqrt(vi) * inv_bc2 + eps));
""" + _CLOSE + r"""
}

template <typename T, typename S, int WK, bool MASK>
__global__ void arraytrain_adagrad_step(T* __restrict__ p, T* __restrict__ g, S* __restrict__ sum_sq,
        const i64* __restrict__ chunks, T gscale, const T* __restrict__ clr, T clr0, const T* __restrict__ wd, T wd0,
        T eps, """ + _TAIL + r""") {
    const int seg = (int)chunks[3 * (i64)blockIdx.x + 2];
    const T clr_s = seg_value(clr, clr0, seg), wd_s = seg_value(wd, wd0, seg);
""" + _OPEN + r"""
        const T pi = p[i];
        const T d = gscale * g[i] + wd_s * pi;
        const T si = state<S>::store(sum_sq, i, (T)state<S>::load(sum_sq, i) + d * d);
        store_param<T, WK, MASK>(p, w, mask, i, pi - clr_s * (d / (sqrt(si) + eps)));
""" + _CLOSE + r"""
}

template <typename T, typename S, int WK, bool MASK>
__global__ void arraytrain_rmsprop_step(T* __restrict__ p, T* __restrict__ g, S* __restrict__ sq, S* __restrict__ gavg,
        S* __restrict__ buf, const i64* __restrict__ chunks, T gscale, const T* __restrict__ lr, T lr0,
        const T* __restrict__ wd, T wd0, T alpha, T alpha_c, T eps, T momentum, int centered, int use_momentum,
        """ + _TAIL + r""") {
    const int seg = (int)chunks[3 * (i64)blockIdx.x + 2];
    const T lr_s = seg_value(lr, lr0, seg), wd_s = seg_value(wd, wd0, seg);
""" + _OPEN + r"""
        const T pi = p[i];
        const T d = gscale * g[i] + wd_s * pi;
        T qi = state<S>::store(sq, i, alpha * (T)state<S>::load(sq, i) + alpha_c * d * d);
        if (centered) {
            T ai = state<S>::load(gavg, i);
            ai = state<S>::store(gavg, i, ai + alpha_c * (d - ai));
            qi = qi - ai * ai;
        }
        T step = d / (sqrt(qi) + eps);
        if (use_momentum) step = state<S>::store(buf, i, momentum * (T)state<S>::load(buf, i) + step);
        store_param<T, WK, MASK>(p, w, mask, i, pi - lr_s * step);
""" + _CLOSE + r"""
}

template <typename T, typename S, int WK, bool MASK>
__global__ void arraytrain_lion_step(T* __restrict__ p, T* __restrict__ g, S* __restrict__ m,
        const i64* __restrict__ chunks, T gscale, const T* __restrict__ lr, T lr0, const T* __restrict__ decay, T decay0,
        T b1, T b1c, T b2, T b2c, """ + _TAIL + r""") {
    const int seg = (int)chunks[3 * (i64)blockIdx.x + 2];
    const T lr_s = seg_value(lr, lr0, seg), dec = seg_value(decay, decay0, seg);
""" + _OPEN + r"""
        const T d = gscale * g[i];
        const T mi = state<S>::load(m, i);
        const T c = sign_of(b1 * mi + b1c * d);
        state<S>::store(m, i, b2 * mi + b2c * d);
        store_param<T, WK, MASK>(p, w, mask, i, p[i] * dec - lr_s * c);
""" + _CLOSE + r"""
}

template <typename T, typename S, int WK, bool MASK>
__global__ void arraytrain_sophia_step(T* __restrict__ p, T* __restrict__ g, S* __restrict__ m, const S* __restrict__ h,
        const i64* __restrict__ chunks, T gscale, const T* __restrict__ lr, T lr0, const T* __restrict__ decay, T decay0,
        T beta1, T beta1c, T rho, T eps, """ + _TAIL + r""") {
    const int seg = (int)chunks[3 * (i64)blockIdx.x + 2];
    const T lr_s = seg_value(lr, lr0, seg), dec = seg_value(decay, decay0, seg);
""" + _OPEN + r"""
        const T mi = state<S>::store(m, i, beta1 * (T)state<S>::load(m, i) + beta1c * (gscale * g[i]));
        T den = rho * (T)state<S>::load(h, i);
        den = den < eps ? eps : den;  // NaN-propagating max(rho*h, eps)
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
        const i64* __restrict__ chunks, T gscale, const T* __restrict__ wd, T wd0, T b1c, T b2, T b2c, T inv_bc1,
        T inv_bc2, T eps, T eps_root, int zero_grad, double* __restrict__ psq, double* __restrict__ usq) {
    const chunk c = load_chunk(chunks);
    const T wd_s = seg_value(wd, wd0, c.seg);
    double sp = 0.0, su = 0.0;
    for (i64 i = c.lo + threadIdx.x; i < c.hi; i += blockDim.x) {
        const T pi = p[i];
        const T d = gscale * g[i];
        T mi = state<S>::load(m, i);
        mi = state<S>::store(m, i, mi + b1c * (d - mi));
        const T vi = state<S>::store(v, i, b2 * (T)state<S>::load(v, i) + b2c * d * d);
        const T u = (mi * inv_bc1) / (sqrt(vi * inv_bc2 + eps_root) + eps) + wd_s * pi;
        sp += (double)pi * (double)pi;
        su += (double)u * (double)u;
        if (zero_grad) g[i] = (T)0;
    }
    sp = block_reduce<false>(sp);
    su = block_reduce<false>(su);
    if (threadIdx.x == 0) { psq[blockIdx.x] = sp; usq[blockIdx.x] = su; }
}

// LAMB: per-parameter trust ratio (1 when a norm is 0) and step lr * ratio, on the device.
template <typename T>
__global__ void arraytrain_lamb_ratio(const double* __restrict__ pn, const double* __restrict__ un,
        const T* __restrict__ lr, T lr0, int nseg, double* __restrict__ ratio, T* __restrict__ step) {
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
        T inv_bc2, T eps, T eps_root, u16* __restrict__ w, const unsigned char* __restrict__ mask) {
    const chunk c = load_chunk(chunks);
    const T wd_s = seg_value(wd, wd0, c.seg), st = step[c.seg];
    for (i64 base = c.lo + threadIdx.x; base < c.hi; base += ILP * (i64)blockDim.x) {
      #pragma unroll
      for (int k = 0; k < ILP; ++k) {
        const i64 i = base + k * (i64)blockDim.x;
        if (i >= c.hi) break;
        const T pi = p[i];
        const T u = ((T)state<S>::load(m, i) * inv_bc1) / (sqrt((T)state<S>::load(v, i) * inv_bc2 + eps_root) + eps)
                    + wd_s * pi;
        store_param<T, WK, MASK>(p, w, mask, i, pi - st * u);
      }
    }
}
""", [])

# Which state storages each optimizer instantiates besides the parameters' own type.
_BF16_STATE = {"adam"}
_ELEMENTWISE = ("sgd", "adam", "adagrad", "rmsprop", "lion", "sophia")


def _variants(t: str, bf16: bool):
    states = [t] + (["u16"] if bf16 and t == "float" else [])
    wks = (0, 1, 2) if t == "float" else (0,)
    return [(s, wk, m) for s in states for wk in wks for m in ("false", "true")]


def _instances():
    out = []
    for t in ("float", "double"):
        for opt in _ELEMENTWISE:
            out += [f"arraytrain_{opt}_step<{t},{s},{wk},{m}>" for s, wk, m in _variants(t, opt in _BF16_STATE)]
        out += [f"arraytrain_sam_perturb<{t},{m}>" for m in ("false", "true")]
        out += [f"arraytrain_lamb_moments<{t},{t}>", f"arraytrain_lamb_ratio<{t}>"]
        out += [f"arraytrain_lamb_apply<{t},{t},{wk},{m}>" for _, wk, m in _variants(t, False)]
    return out


SOURCE.instances = tuple(_instances())


def _run(name, p, state, pieces, arrays, scalars, w, wkind, zero_grad, mask):
    """Launch ``arraytrain_<name><T,S,WK,MASK>(*arrays, chunks, *scalars, w, zero_grad, mask)``."""
    t = ctype(p.dtype)
    s = "u16" if state is not None and state.dtype == np.uint16 else t
    wk = 0 if w is None else int(wkind)
    expr = f"arraytrain_{name}<{t},{s},{wk},{'true' if mask is not None else 'false'}>"
    ch = chunks_for(pieces)
    launch(SOURCE.function(expr), ch.count,
           (*(ptr(a) for a in arrays), ch.table, *scalars, ptr(w), np.int32(bool(zero_grad)), ptr(mask)))


def _seg(values, p):
    return seg_arg(values, p.dtype)


def sgd_step(p, g, buf, pieces, gscale, lr, weight_decay, momentum, dampening, nesterov, first, w, wkind, zero_grad,
             mask=None):
    """Fused SGD update; see :func:`arraytrain.kernels.reference.sgd_step`."""
    t = p.dtype.type
    _run("sgd_step", p, None, pieces, (p, g, buf),
         (t(gscale), *_seg(lr, p), *_seg(weight_decay, p), t(momentum), t(1.0 - dampening), np.int32(bool(nesterov)),
          np.int32(bool(first))), w, wkind, zero_grad, mask)


def adam_step(p, g, m, v, vmax, pieces, gscale, step_size, beta1, beta2, eps, bc2_sqrt, l2, decay, amsgrad,
              w, wkind, zero_grad, mask=None):
    """Fused Adam/AdamW update; see :func:`arraytrain.kernels.reference.adam_step`."""
    t = p.dtype.type
    _run("adam_step", p, m, pieces, (p, g, m, v, vmax),
         (t(gscale), *_seg(step_size, p), t(1.0 - beta1), t(beta2), t(1.0 - beta2), t(eps), t(1.0 / bc2_sqrt),
          *_seg(l2, p), *_seg(decay, p), np.int32(bool(amsgrad))), w, wkind, zero_grad, mask)


def adagrad_step(p, g, sum_sq, pieces, gscale, clr, weight_decay, eps, w, wkind, zero_grad, mask=None):
    """Fused Adagrad update; see :func:`arraytrain.kernels.reference.adagrad_step`."""
    t = p.dtype.type
    _run("adagrad_step", p, sum_sq, pieces, (p, g, sum_sq),
         (t(gscale), *_seg(clr, p), *_seg(weight_decay, p), t(eps)), w, wkind, zero_grad, mask)


def rmsprop_step(p, g, square_avg, grad_avg, momentum_buffer, pieces, gscale, lr, weight_decay, alpha, eps,
                 momentum, centered, w, wkind, zero_grad, mask=None):
    """Fused RMSprop update; see :func:`arraytrain.kernels.reference.rmsprop_step`."""
    t = p.dtype.type
    _run("rmsprop_step", p, square_avg, pieces, (p, g, square_avg, grad_avg, momentum_buffer),
         (t(gscale), *_seg(lr, p), *_seg(weight_decay, p), t(alpha), t(1.0 - alpha), t(eps), t(momentum),
          np.int32(bool(centered)), np.int32(bool(momentum > 0))), w, wkind, zero_grad, mask)


def lion_step(p, g, m, pieces, gscale, lr, weight_decay, b1, b2, w, wkind, zero_grad, mask=None):
    """Fused Lion update; see :func:`arraytrain.kernels.reference.lion_step`."""
    t = p.dtype.type
    lr = np.asarray(lr, np.float64)
    decay = 1.0 - lr * np.asarray(weight_decay, np.float64)
    _run("lion_step", p, m, pieces, (p, g, m),
         (t(gscale), *_seg(lr, p), *_seg(decay, p), t(b1), t(1.0 - b1), t(b2), t(1.0 - b2)), w, wkind, zero_grad, mask)


def sophia_step(p, g, m, h, pieces, gscale, lr, decay, beta1, rho, eps, w, wkind, zero_grad, mask=None):
    """Fused SophiaG update; see :func:`arraytrain.kernels.reference.sophia_step`."""
    t = p.dtype.type
    _run("sophia_step", p, m, pieces, (p, g, m, h),
         (t(gscale), *_seg(lr, p), *_seg(decay, p), t(beta1), t(1.0 - beta1), t(rho), t(eps)), w, wkind, zero_grad, mask)


def sam_perturb(p, g, backup, pieces, scale, adaptive, zero_grad, mask=None):
    """``backup = p; p += scale * (p^2 if adaptive) * g``, pruned weights 0.

    See :func:`arraytrain.kernels.reference.sam_perturb`.
    """
    ch = chunks_for(pieces)
    expr = f"arraytrain_sam_perturb<{ctype(p.dtype)},{'true' if mask is not None else 'false'}>"
    launch(SOURCE.function(expr), ch.count, (p, g, backup, ch.table, p.dtype.type(scale), np.int32(bool(adaptive)),
                                             np.int32(bool(zero_grad)), ptr(mask)))


def lamb_step(p, g, m, v, pieces, gscale, lr, weight_decay, beta1, beta2, eps, eps_root, bc1, bc2, w, wkind,
              zero_grad, mask=None):
    """Fused LAMB update; returns the per-parameter trust ratios (float64, on the device).

    Three launches and no synchronisation: moments with per-chunk norms, the trust
    ratios and steps per parameter, the update. See :func:`arraytrain.kernels.reference.lamb_step`.
    """
    cp, t, tn = cupy(), p.dtype.type, ctype(p.dtype)
    nseg = len(np.asarray(lr).reshape(-1))
    ch = chunks_for(pieces)
    wd = _seg(weight_decay, p)
    inv_bc1, inv_bc2 = t(1.0 / bc1), t(1.0 / bc2)
    ratio = cp.ones(nseg, dtype=cp.float64)
    if ch.count == 0:
        return ratio
    psq, usq = cp.empty(ch.count, cp.float64), cp.empty(ch.count, cp.float64)
    launch(SOURCE.function(f"arraytrain_lamb_moments<{tn},{tn}>"), ch.count,
           (p, g, m, v, ch.table, t(gscale), *wd, t(1.0 - beta1), t(beta2), t(1.0 - beta2), inv_bc1, inv_bc2,
            t(eps), t(eps_root), np.int32(bool(zero_grad)), psq, usq))
    pn, un = cp.zeros(1 + nseg, cp.float64), cp.zeros(1 + nseg, cp.float64)
    reductions.seg_reduce(psq, ch, nseg, pn)
    reductions.seg_reduce(usq, ch, nseg, un)
    step = cp.empty(nseg, dtype=p.dtype)
    launch(SOURCE.function(f"arraytrain_lamb_ratio<{tn}>"), -(-nseg // THREADS),
           (pn, un, *_seg(lr, p), np.int32(nseg), ratio, step))
    wk = 0 if w is None else int(wkind)
    launch(SOURCE.function(f"arraytrain_lamb_apply<{tn},{tn},{wk},{'true' if mask is not None else 'false'}>"),
           ch.count, (p, m, v, ch.table, *wd, step, inv_bc1, inv_bc2, t(eps), t(eps_root), ptr(w), ptr(mask)))
    return ratio


def adafactor_step(p, g, row, col, var, pieces, segs, rows, cols, batches, gscale, rho, decay, beta2c, eps1, eps2,
                   d, w, wkind, zero_grad, mask=None):
    """Adafactor has no CUDA kernels yet: refused with a clear error."""
    raise BackendUnavailableError("Adafactor has no CUDA kernels yet; run it on NumPy buffers (the CPU engine)")
