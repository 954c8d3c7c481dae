"""Pruning masks inside the optimizer kernel, the gradient-trend predictor, int8 weight quantization."""

from __future__ import annotations

import numpy as np

import arraytrain as at
from arraytrain.kernels.interface import family

from .common import SIZES, _Bandwidth, make_params


class MaskedAdamWStep(_Bandwidth):
    """AdamW's fused step with and without a pruning mask (50% pruned); GB/s of AdamW's 28 B/param
    (float32) plus, with a mask, 1 B/param read of the mask."""

    params = [["none", "mask"], SIZES]
    param_names = ["mask", "size"]

    def setup(self, mask, n):
        self.p = at.FlatBuffer.from_arrays(make_params(n, "float32"))
        self.g = self.p.zeros_like()
        self.g.flat[:] = np.random.default_rng(1).standard_normal(self.g.flat.size)
        self.opt = at.optim.AdamW(lr=1e-3)
        self.state = self.opt.init(self.p)
        self.k = family("numpy")
        self.mask = at.magnitude_mask(self.p, ratio=0.5, names=["*"]) if mask == "mask" else None
        self._bytes = (28 + (1 if self.mask is not None else 0)) * self.p.layout.num_elements
        self._call()

    def _call(self):
        self.opt.update(self.k, self.p, self.g, self.state, gscale=1.0, mask=self.mask)

    def time_step(self, mask, n):
        self._call()


class TrendPredict(_Bandwidth):
    """``GradientPredictor.predict``: one pass over H = 4 recorded gradients and the correction
    (reads 5 and writes 1 float32 buffer: 24 B/element)."""

    params = [SIZES]
    param_names = ["size"]

    def setup(self, n):
        params = at.FlatBuffer.from_arrays(make_params(n, "float32"))
        self.pred = at.GradientPredictor(params, history=4)
        rng = np.random.default_rng(0)
        for step in range(4):
            self.pred.record(rng.standard_normal(params.flat.size).astype(np.float32), step)
        self.out = np.zeros(params.flat.size, np.float32)
        self._bytes = 24 * params.layout.num_elements
        self._call()

    def _call(self):
        self.pred.predict(4, self.out)

    def time_predict(self, n):
        self._call()


class QuantizeWeights:
    """int8 quantization of a model's weights (a one-off conversion; NumPy)."""

    params = [["symmetric", "asymmetric"], ["tensor", "channel"], [s for s in SIZES if s <= 1_000_000]]
    param_names = ["scheme", "granularity", "size"]

    def setup(self, scheme, granularity, n):
        rows = max(1, int(np.sqrt(n)))
        rng = np.random.default_rng(0)
        self.params = at.FlatBuffer.from_arrays({"w": rng.standard_normal((rows, n // rows)).astype(np.float32)})
        self.kw = {"scheme": scheme, "granularity": granularity}

    def time_quantize(self, scheme, granularity, n):
        at.quantize_params(self.params, **self.kw)
