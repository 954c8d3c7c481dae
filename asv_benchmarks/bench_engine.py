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


MIXED = {
    # name: (loss scaler + Warmup/CosineAnnealingLR schedule, working copy dtype)
    "float32": (False, None),
    "loss-scaler+warmup-cosine": (True, None),
    "working-bfloat16": (False, "bfloat16"),
    "working-float16": (False, "float16"),
    "loss-scaler+working-float16": (True, "float16"),
}


class MixedPrecisionStep(_Bandwidth):
    """What mixed precision costs per ``engine.step`` (zero-copy AdamW, clipped, float32 master weights).

    The loss scaler's unscale is folded into the norm pass and the optimizer
    kernel, and the schedule's lr is computed on the host, so neither adds
    traffic: 32 B/param like ``float32``. A working copy adds the optimizer
    kernel's write of the 2-byte weights: 34 B/param. The gradients are
    standard normal, as if already multiplied by the loss scale (2**16 by
    default): no step is skipped; the scale doubles every 2000 steps, which
    changes the values, not the work.
    """

    params = [list(MIXED), SIZES]
    param_names = ["variant", "size"]

    def setup(self, variant, n):
        scaled, working = MIXED[variant]
        p = make_params(n, "float32")
        extra = {}
        if scaled:
            extra = {"loss_scaler": at.LossScaler(),
                     "schedule": at.schedules.Warmup(100, at.schedules.CosineAnnealingLR(1_000_000, eta_min=1e-5))}
        self.engine = at.Engine(p, at.optim.AdamW(lr=1e-3), max_grad_norm=1.0, zero_grad_on_step=False,
                                working_dtype=working, **extra)
        rng = np.random.default_rng(1)
        self.engine.grads.load({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in p.items()})
        self._bytes = (32 + (2 if working else 0)) * n
        self._call = self.engine.step
        self._call()

    def time_step(self, variant, n):
        self._call()


class AutoCompressorStep(_Bandwidth):
    """``compressor="auto"`` in one process (dense, nothing travels) beside no compressor: what the
    choice costs a step where it stays dense (AdamW, clipping; the zero-copy path)."""

    params = [["none", "auto"], SIZES]
    param_names = ["compressor", "size"]

    def setup(self, compressor, n):
        p = make_params(n, np.float32)
        self.engine = at.Engine(p, at.optim.AdamW(lr=1e-3), max_grad_norm=1.0, zero_grad_on_step=False,
                                compressor=None if compressor == "none" else compressor)
        rng = np.random.default_rng(1)
        self.engine.grads.load({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in p.items()})
        self._bytes = 32 * n
        self._call = self.engine.step
        self._call()

    def time_step(self, compressor, n):
        self._call()
