r"""CUDA trend kernels for gradient prediction: the same names and signatures as
:mod:`arraytrain.kernels.cpu.trend` (the math is in :mod:`arraytrain.kernels.reference.trend`).

Element-wise, one pass: each element's weighted sum over the ``H`` ring slots is
accumulated in float64, slots in order and zero weights skipped (as the CPU families
do), and rounded once to the storage dtype. The weights ``c`` (float64, ``H`` values)
may be a host array (copied to the device, ``8 H`` bytes) or a device array.
"""

from __future__ import annotations

import numpy as np

from .core import Source, cupy, launch
from .reductions import grid

_FLOATS = ("float", "double")

SOURCE = Source(r"""
template <typename T>
__device__ __forceinline__ double trend_at(const T* hist, i64 n, const double* __restrict__ c, int H, i64 i) {
    double acc = 0.0;
    for (int k = 0; k < H; ++k) {
        const double ck = c[k];
        if (ck != 0.0) acc += ck * (double)hist[(i64)k * n + i];
    }
    return acc;
}

template <typename T>
__global__ void arraytrain_trend_predict(const T* __restrict__ hist, i64 n, const double* __restrict__ c, int H,
                                         const T* __restrict__ corr, T* __restrict__ out) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = (T)(trend_at(hist, n, c, H, i) + (double)corr[i]);
}

// The trend of element i is read before its slot is overwritten (same thread, same element).
template <typename T>
__global__ void arraytrain_trend_correct(T* hist, i64 n, const double* __restrict__ c, int H, T* __restrict__ corr,
                                         const T* __restrict__ g, int slot, double beta, double beta_c) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += stride) {
        const double acc = trend_at(hist, n, c, H, i);
        const T gi = g[i];
        corr[i] = (T)(beta * (double)corr[i] + beta_c * ((double)gi - acc));
        hist[(i64)slot * n + i] = gi;
    }
}
""", [f"arraytrain_trend_{k}<{t}>" for k in ("predict", "correct") for t in _FLOATS])


def _t(dtype) -> str:
    return {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}[np.dtype(dtype)]


def _weights(c):
    return cupy().asarray(c, dtype=np.float64).reshape(-1)


def trend_predict(hist, c, corr, out):
    """``out = sum_k c[k] * hist[k] + corr``; see :func:`arraytrain.kernels.reference.trend.trend_predict`."""
    n = int(out.size)
    c = _weights(c)
    launch(SOURCE.function(f"arraytrain_trend_predict<{_t(out.dtype)}>"), grid(n),
           (hist, np.int64(n), c, np.int32(c.size), corr, out))


def trend_correct(hist, c, corr, g, *, slot, beta):
    """Correction update fused with recording ``g``; see :func:`arraytrain.kernels.reference.trend.trend_correct`."""
    n = int(g.size)
    c = _weights(c)
    beta = float(beta)
    launch(SOURCE.function(f"arraytrain_trend_correct<{_t(g.dtype)}>"), grid(n),
           (hist, np.int64(n), c, np.int32(c.size), corr, g, np.int32(slot), np.float64(beta),
            np.float64(1.0 - beta)))
