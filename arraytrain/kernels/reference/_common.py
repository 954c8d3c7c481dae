"""What the reference kernels share: float64 views of any storage, one rounding on store, pieces."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..interface import LP_BF16, LP_F16

LP_DTYPES = {LP_BF16: np.dtype(ml_dtypes.bfloat16), LP_F16: np.dtype(np.float16)}


def f64(x):
    """float64 values of a float array, or of a uint16 array of bfloat16 bits."""
    x = np.asarray(x)
    if x.dtype == np.uint16:
        return x.view(ml_dtypes.bfloat16).astype(np.float64)
    return x.astype(np.float64)


def store(dst, values):
    """Round ``values`` once to ``dst``'s storage (bfloat16 bits for uint16) and return what was stored."""
    if dst.dtype == np.uint16:
        # float64 -> float32 -> bfloat16: the fast kernels do float32 math, so their
        # input to the bfloat16 rounding is a float32
        dst[...] = np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    else:
        dst[...] = values
    return f64(dst)


def segments(pieces, n):
    """Segment index of every element covered by ``pieces`` (and the covered positions)."""
    idx = np.concatenate([np.arange(a, b) for a, b, _ in pieces]) if len(pieces) else np.zeros(0, np.int64)
    seg = np.concatenate([np.full(b - a, s) for a, b, s in pieces]) if len(pieces) else np.zeros(0, np.int64)
    return idx.astype(np.int64), seg.astype(np.int64)


def store_at(dst, i, values):
    """``dst[i] = values`` rounded to the storage; returns the stored values as float64."""
    out = np.empty(len(i), dst.dtype)
    stored = store(out, values)
    dst[i] = out
    return stored


def apply_mask(p, mask, i):
    """``p[i] = 0`` where ``mask[i] == 0`` (uint8, 1 = keep): pruned weights are exactly +0."""
    p[i] = np.where(mask[i] != 0, p[i], p.dtype.type(0))
