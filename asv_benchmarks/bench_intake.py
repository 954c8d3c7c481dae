"""The dict path: one ``{name: np.ndarray}`` micro-batch handed to ``engine.step`` (no optimizer step)."""

from __future__ import annotations

import numpy as np

import arraytrain as at
from arraytrain.kernels import cpu

ELEMENTS = 1_000_000


def _model(tensors: int):
    """``(params, grads)``: 1e6 float32 elements in ``tensors`` named arrays each."""
    rng = np.random.default_rng(0)
    p = {f"t{i}": rng.standard_normal(ELEMENTS // tensors).astype(np.float32) for i in range(tensors)}
    return p, {k: v * np.float32(0.01) for k, v in p.items()}


class DictIntake:
    """A micro-batch of ``tensors`` float32 gradients, 1e6 elements in all, accumulated into the engine.

    ``general``: the path every structure takes the first time (``as_array`` and
    the checks per gradient, one accumulate call each); ``cached``: the reused
    structure (the default from the second micro-batch on). ``track_per_tensor_us``
    subtracts one accumulate over the whole flat buffer (the copy-in's memory
    traffic) and divides by the tensor count.
    """

    params = [["general", "cached"], [100, 500, 2000]]
    param_names = ["path", "tensors"]

    def setup(self, path, tensors):
        p, self.grads = _model(tensors)
        self.engine = at.Engine(p, at.optim.AdamW(lr=1e-3), accumulation_steps=2**40)
        self.engine.intake.fast = path == "cached"
        self.src = np.ones(self.engine.grads.flat.size, np.float32)
        for _ in range(2):  # JIT compilation and the structure cache: outside the timed method
            self.engine.step(self.grads)
            cpu.accumulate(self.engine.grads.flat, self.src, w=1.0, overwrite=False)
        self.tensors = tensors

    def time_micro_batch(self, path, tensors):
        self.engine.step(self.grads)

    def track_per_tensor_us(self, path, tensors):
        import timeit

        t = min(timeit.repeat(lambda: self.engine.step(self.grads), number=10, repeat=5)) / 10
        floor = min(timeit.repeat(lambda: cpu.accumulate(self.engine.grads.flat, self.src, w=1.0, overwrite=False),
                                  number=10, repeat=5)) / 10
        return (t - floor) / tensors * 1e6

    track_per_tensor_us.unit = "us"


class DictStep:
    """A whole AdamW step (one micro-batch a window, clip 1.0) from ``{name: np.ndarray}``, 1e6 float32
    elements in ``tensors`` tensors: ``in place`` reads the gradients where they lie (the large ones in
    the caller's arrays, the small ones gathered by one concatenate), ``copied`` copies them into the
    engine's buffer first (the path before gradients were read in place), ``zero-copy`` has them in
    ``engine.grads`` already."""

    params = [["in place", "copied", "zero-copy"], [10, 100, 2000]]
    param_names = ["path", "tensors"]

    def setup(self, path, tensors):
        p, self.grads = _model(tensors)
        # zero-copy: the gradients stay in the buffer from step to step (the kernel does not clear them)
        self.engine = at.Engine(p, at.optim.AdamW(lr=1e-3), max_grad_norm=1.0,
                                zero_grad_on_step=path != "zero-copy")
        if path == "copied":
            self.engine.intake.in_place = False  # the copy-in path
        if path == "zero-copy":
            self.engine.grads.load(self.grads)
        self.step = self.engine.step if path == "zero-copy" else lambda: self.engine.step(self.grads)
        for _ in range(2):  # JIT compilation and the structure cache: outside the timed method
            self.step()

    def time_step(self, path, tensors):
        self.step()


class MissingSkip:
    """An AdamW (or NAdam) step over 1e6 float32 elements in 100 tensors where ``absent`` of them have no
    gradient (``missing="skip"``: the step walks the others' pieces only, once per step count among them;
    NAdam also once per momentum product), against ``missing="zero"`` (every parameter stepped, the absent
    ones with a zero gradient)."""

    params = [["skip", "zero"], [0, 10, 50], ["AdamW", "NAdam"]]
    param_names = ["missing", "absent", "optimizer"]

    def setup(self, missing, absent, optimizer):
        rng = np.random.default_rng(0)
        p = {f"t{i}": rng.standard_normal(ELEMENTS // 100).astype(np.float32) for i in range(100)}
        self.engine = at.Engine(p, getattr(at.optim, optimizer)(lr=1e-3), missing=missing)
        self.engine.grads.flat[...] = 0.01
        self.absent = [f"t{i}" for i in range(0, 2 * absent, 2)] or None
        for _ in range(3):  # compilation, and the per-parameter step counts diverging
            self.engine.step(absent=self.absent)

    def time_step(self, missing, absent, optimizer):
        self.engine.step(absent=self.absent)
