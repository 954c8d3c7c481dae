"""The single-pass kernels: accumulate, scale, the clipping norm pass, finite check."""

from __future__ import annotations

import numpy as np

from arraytrain.kernels.interface import family
from arraytrain.layout import Layout
from arraytrain.ops import clip_coef, norm_pass

from .common import DTYPES, SIZES, _Bandwidth, split


class _Kernel(_Bandwidth):
    params = [SIZES, DTYPES]
    param_names = ["size", "dtype"]

    def setup(self, n, dtype):
        rng = np.random.default_rng(0)
        self.layout = Layout({f"p{i}": (k,) for i, k in enumerate(split(n))})
        self.x = np.zeros(self.layout.size, dtype)
        self.x[:] = rng.standard_normal(self.layout.size)
        self.g = rng.standard_normal(self.layout.size).astype(dtype)
        self.k = family("numpy")
        self.item = np.dtype(dtype).itemsize
        self._call()  # compile outside the timed region

    def time_kernel(self, n, dtype):
        self._call()


class Accumulate(_Kernel):
    """``acc += w * g`` over the flat buffer (read acc, g; write acc)."""

    def _call(self):
        self.k.accumulate(self.x, self.g, w=0.5, overwrite=False)

    @property
    def _bytes(self):
        return 3 * self.item * self.x.size


class Scale(_Kernel):
    """``x *= s`` (read and write x)."""

    def _call(self):
        self.k.scale(self.x, factor=1.0)

    @property
    def _bytes(self):
        return 2 * self.item * self.x.size


class ClipGlobalNorm(_Kernel):
    """Clipping's whole cost: the norm pass (global and per-parameter norms, non-finite
    check; one read) and the clip factor. The scaling itself is folded into the optimizer."""

    def _call(self):
        clip_coef(norm_pass(self.k, self.g, self.layout).norm, 1.0)

    @property
    def _bytes(self):
        return self.item * self.layout.num_elements


class AllFinite(_Kernel):
    """Stand-alone NaN/Inf detection (one read)."""

    def _call(self):
        self.k.all_finite(self.g)

    @property
    def _bytes(self):
        return self.item * self.g.size
