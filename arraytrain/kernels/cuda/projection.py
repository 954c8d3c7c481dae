r"""CUDA projection kernels: the same names and signatures as :mod:`arraytrain.kernels.cpu.projection`.

The pieces of :class:`arraytrain.compress.VSA`'s subsampled randomized Hadamard transform
(the math is written out in :mod:`arraytrain.kernels.reference.projection`):

* :func:`fwht`: the stages ``h < 2048`` of each block in shared memory, one thread block
  per 2048 elements (several Hadamard blocks at once when ``block < 2048``); blocks
  longer than that take one global-memory pass per further stage. Stages run in
  ascending ``h`` as in the numba family, butterflies in the storage dtype, and the
  ``1/sqrt(block)`` scale is applied in the last stage: float32 results agree with the
  float64 reference to the project's tolerance.
* :func:`sign_bind`: element-wise, the ±1 key from the counter RNG (the same signs as
  the CPU families: a key bound on one device unbinds on the other).
* :func:`select_gather` / :func:`select_scatter`: one thread block per Hadamard block; the
  block's partial Fisher–Yates shuffle is serial (each swap depends on the last), run by
  one thread over a permutation in shared memory (``block <= 4096``) or in a global
  scratch of ``4 * z.size`` bytes (larger blocks). Each block's count and offset in the
  kept vector are formed in the kernel from the drawn rotation, so nothing is copied to
  the device but scalars. The kept positions are those of the CPU families, exactly.
"""

from __future__ import annotations

import numpy as np

from ..counter_rng import uniform_np
from .core import Source, cupy, launch
from .compression import COUNTER_RNG
from .reductions import grid

FWHT_SHARED = 2048  # elements of a thread block's shared-memory transform
SELECT_SHARED = 4096  # longest block whose permutation lives in shared memory

_FLOATS = ("float", "double")

SOURCE = Source(COUNTER_RNG + r"""
#define FWHT_SHARED 2048
#define SELECT_SHARED 4096

// Stages h = 1 .. h_stop / 2 of every block inside this thread block's 2048 (or fewer, a
// multiple of the Hadamard block) elements; `scale`: multiply by s at the end (the last stage).
template <typename T>
__global__ void arraytrain_fwht_shared(T* __restrict__ x, i64 n, int h_stop, T s, int scale) {
    __shared__ T v[FWHT_SHARED];
    const i64 lo = blockIdx.x * (i64)FWHT_SHARED;
    const int cnt = (int)min((i64)FWHT_SHARED, n - lo);
    for (int i = threadIdx.x; i < cnt; i += blockDim.x) v[i] = x[lo + i];
    __syncthreads();
    for (int h = 1; h < h_stop; h <<= 1) {  // uniform: h_stop is a kernel argument
        for (int q = threadIdx.x; q < (cnt >> 1); q += blockDim.x) {
            const int i = ((q & ~(h - 1)) << 1) | (q & (h - 1));
            const T a = v[i], c = v[i + h];
            v[i] = a + c;
            v[i + h] = a - c;
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < cnt; i += blockDim.x) x[lo + i] = scale ? v[i] * s : v[i];
}

// One stage h >= 2048 over the whole buffer: pair q is (i, i + h) inside its 2h-group.
template <typename T>
__global__ void arraytrain_fwht_stage(T* __restrict__ x, i64 half, i64 h, T s, int scale) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 q = blockIdx.x * (i64)blockDim.x + threadIdx.x; q < half; q += stride) {
        const i64 i = ((q & ~(h - 1)) << 1) | (q & (h - 1));
        const T a = x[i], c = x[i + h];
        T p = a + c, m = a - c;
        if (scale) { p = p * s; m = m * s; }
        x[i] = p;
        x[i + h] = m;
    }
}

// out may be x (in place): no __restrict__
template <typename T>
__global__ void arraytrain_sign_bind(const T* x, u64 key, i64 n, T* out) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += stride) {
        const T xi = x[i];
        out[i] = counter_uniform(key, (u64)i) >= 0.5 ? -xi : xi;
    }
}

// One thread block per Hadamard block b. Kept: k or k + 1 (the rem blocks from `shift` on,
// cyclically); offset in y: b * k + the extra ones before b. SCATTER: z's block zeroed, then
// z[t] = scale * y[j]; else y[j] = z[t].
template <typename T, bool SCATTER, bool SHARED>
__global__ void arraytrain_select(T* __restrict__ z, u64 key, i64 block, i64 nb, i64 k, i64 rem, i64 shift,
                                  T* __restrict__ y, T scale, int* __restrict__ perm_global) {
    __shared__ int perm_shared[SHARED ? SELECT_SHARED : 1];
    const i64 b = blockIdx.x, base = b * block;
    int* perm = SHARED ? perm_shared : perm_global + base;
    for (i64 i = threadIdx.x; i < block; i += blockDim.x) {
        perm[i] = (int)i;
        if (SCATTER) z[base + i] = (T)0;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    const i64 rot = ((b - shift) % nb + nb) % nb;
    const i64 count = k + (rot < rem ? 1 : 0);
    i64 extra_before;
    if (shift + rem <= nb) extra_before = min(max(b - shift, (i64)0), rem);
    else extra_before = min(b, shift + rem - nb) + max(b - shift, (i64)0);
    T* yb = y + b * k + extra_before;
    for (i64 j = 0; j < count; ++j) {
        // partial Fisher-Yates: slot j takes a uniform pick of the block - j positions not yet taken
        const i64 r = j + (i64)(counter_uniform(key, (u64)(base + j)) * (double)(block - j));
        const int t = perm[r];
        perm[r] = perm[j];
        perm[j] = t;
        if (SCATTER) z[base + t] = scale * yb[j];
        else yb[j] = z[base + t];
    }
}
""", [f"arraytrain_{k}<{t}>" for k in ("fwht_shared", "fwht_stage", "sign_bind") for t in _FLOATS]
   + [f"arraytrain_select<{t},{sc},{sh}>" for t in _FLOATS for sc in ("false", "true") for sh in ("false", "true")])


def _t(dtype) -> str:
    return {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}[np.dtype(dtype)]


def fwht(x, *, block):
    """In place: every ``block``-element block of ``x`` becomes ``H v / sqrt(block)``; see the reference."""
    n, block = int(x.size), int(block)
    if n == 0:
        return
    t = _t(x.dtype)
    s = x.dtype.type(1.0 / np.sqrt(block))
    inner = min(block, FWHT_SHARED)
    launch(SOURCE.function(f"arraytrain_fwht_shared<{t}>"), -(-n // FWHT_SHARED),
           (x, np.int64(n), np.int32(inner), s, np.int32(block <= FWHT_SHARED)))
    stage = SOURCE.function(f"arraytrain_fwht_stage<{t}>")
    h = FWHT_SHARED
    while h < block:
        launch(stage, grid(n // 2), (x, np.int64(n // 2), np.int64(h), s, np.int32(2 * h == block)))
        h *= 2


def sign_bind(x, out, *, key):
    """``out[i] = s_i * x[i]`` for ``i < out.size`` (``out`` may be ``x``); see the reference."""
    launch(SOURCE.function(f"arraytrain_sign_bind<{_t(out.dtype)}>"), grid(out.size),
           (x, np.uint64(key), np.int64(out.size), out))


def _select(z, key, block, y, scale, scatter: bool):
    block = int(block)
    nb = int(z.size) // block
    if nb == 0:
        return
    d = int(y.size)
    k, rem = divmod(d, nb)
    # the rotation of the blocks that keep one more, drawn as in project._counts (host: a scalar)
    shift = int(uniform_np(key, np.array([nb * block], dtype=np.uint64))[0] * nb)
    shared = block <= SELECT_SHARED
    perm = np.uint64(0) if shared else cupy().empty(nb * block, dtype=np.int32)
    sc, sh = ("true" if scatter else "false"), ("true" if shared else "false")
    launch(SOURCE.function(f"arraytrain_select<{_t(z.dtype)},{sc},{sh}>"), nb,
           (z, np.uint64(key), np.int64(block), np.int64(nb), np.int64(k), np.int64(rem), np.int64(shift), y,
            z.dtype.type(scale), perm))


def select_gather(z, y, *, key, block):
    """``y`` = the kept coordinates of ``z``, block by block; see the reference."""
    _select(z, key, block, y, 0.0, False)


def select_scatter(y, z, *, key, block, factor):
    """``z`` = zero except the kept coordinates, which get ``factor * y``; see the reference."""
    _select(z, key, block, y, factor, True)
