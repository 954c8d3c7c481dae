"""The whole ``engine.step``: norm pass, non-finite check, clipping, fused optimizer."""

from __future__ import annotations

import numpy as np

import arraytrain as at

from .common import DTYPES, SIZES, _Bandwidth, make_params


class EngineStep(_Bandwidth):
    """AdamW with global-norm clipping, one micro-batch per step.

    ``zero-copy``: gradients already in ``engine.grads``; 32 B/param in float32
    (norm pass 4 + AdamW 28). ``dict``: a ``{name: array}`` of 100 tensors is
    copied in first (+8 B/param).
    """

    params = [["zero-copy", "dict"], SIZES, DTYPES]
    param_names = ["path", "size", "dtype"]

    def setup(self, path, n, dtype):
        p = make_params(n, dtype)
        self.engine = at.Engine(p, at.optim.AdamW(lr=1e-3), max_grad_norm=1.0, zero_grad_on_step=False)
        rng = np.random.default_rng(1)
        self.grads = {k: rng.standard_normal(v.shape).astype(dtype) for k, v in p.items()}
        self.engine.grads.load(self.grads)
        item = np.dtype(dtype).itemsize
        if path == "zero-copy":
            self._call = self.engine.step
            self._bytes = 8 * item * n
        else:
            self._call = lambda: self.engine.step(self.grads)
            self._bytes = 10 * item * n
        self._call()

    def time_step(self, path, n, dtype):
        self._call()

    def peakmem_step(self, path, n, dtype):
        self._call()


class Accumulation(_Bandwidth):
    """Four micro-batches handed over as dicts, then the boundary step (mean reduction)."""

    params = [SIZES, DTYPES]
    param_names = ["size", "dtype"]

    def setup(self, n, dtype):
        p = make_params(n, dtype)
        self.engine = at.Engine(p, at.optim.AdamW(lr=1e-3), accumulation_steps=4, max_grad_norm=1.0)
        rng = np.random.default_rng(1)
        self.grads = {k: rng.standard_normal(v.shape).astype(dtype) for k, v in p.items()}
        item = np.dtype(dtype).itemsize
        # 1st micro-batch: read g, write buf; 3 more: read g and buf, write buf; boundary: 4 + 28 + zeroing 4
        self._bytes = (2 + 3 * 3 + 1 + 7 + 1) * item * n
        self._call()

    def _call(self):
        for _ in range(4):
            self.engine.step(self.grads)

    def time_window(self, n, dtype):
        self._call()
