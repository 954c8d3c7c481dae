"""The CUDA family: the norm pass, every optimizer with CUDA kernels and the whole engine step on a GPU.

Skipped (``NotImplementedError`` in ``setup``, asv's way) where no CUDA device runs a
probe kernel. Every timed call synchronises the device before it returns, so asv's
wall-clock timer sees device time. ``track_fraction_of_copy`` divides the step's
unavoidable bytes per second by the device's copy bandwidth measured in the same process.
"""

from __future__ import annotations

import functools


import arraytrain as at

from .bench_optim import MATRIX_OPTIMIZERS, OPTIMIZERS, matrix_shapes, step_bytes
from .common import QUICK, split

# SAM: two calls a step (engine-level). The 8-bit rows (AdamW, SGD momentum) run the 8-bit
# kernels: their step_bytes count one byte per state element (the block scales are 1/64 more).
CUDA_OPTIMIZERS = [k for k in OPTIMIZERS if k != "SAM-AdamW"]
SIZES = [100_000] if QUICK else [1_000_000, 10_000_000, 100_000_000]


@functools.lru_cache(maxsize=1)
def _usable() -> bool:
    from arraytrain.backend import require_cuda

    try:
        require_cuda()  # CuPy is installed and a probe kernel ran on a device
    except at.BackendUnavailableError:
        return False
    return True


def _require():
    if not _usable():
        raise NotImplementedError("no usable CUDA device")
    import cupy

    return cupy


@functools.lru_cache(maxsize=1)
def copy_gbs() -> float:
    """Device-to-device copy bandwidth (bytes read + written), best of 10."""
    cp = _require()
    a = cp.ones(1 << 28, cp.float32)
    b = cp.empty_like(a)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    best = float("inf")
    for _ in range(10):
        start.record()
        cp.copyto(b, a)
        end.record()
        end.synchronize()
        best = min(best, cp.cuda.get_elapsed_time(start, end) / 1e3)
    return 2 * a.nbytes / best / 1e9


def _cuda_params(n: int, seed: int = 0) -> dict:
    cp = _require()
    rs = cp.random.RandomState(seed)
    return {f"p{i}": rs.standard_normal(k, dtype=cp.float32) for i, k in enumerate(split(n))}


class CudaOptimizerStep:
    """One fused optimizer update on the device (no norm pass): ``opt.update`` over the flat buffer."""

    params = (CUDA_OPTIMIZERS, SIZES)
    param_names = ["optimizer", "n"]
    timeout = 300

    def setup(self, name, n):
        cp = _require()
        self.cp = cp
        shaped = (lambda a: {k: v.reshape(s) for (k, v), s in zip(a.items(), matrix_shapes(n))}) \
            if name in MATRIX_OPTIMIZERS else (lambda a: a)  # Muon takes matrices only
        self.p = at.FlatBuffer.from_arrays(shaped(_cuda_params(n)))
        self.g = at.FlatBuffer.from_arrays(shaped(_cuda_params(n, 1)))
        self.opt = OPTIMIZERS[name]()
        self.state = self.opt.init(self.p)
        from arraytrain.kernels.interface import family

        self.k = family("cupy")
        self.time_step(name, n)  # compile and warm

    def time_step(self, name, n):
        self.opt.update(self.k, self.p, self.g, self.state, gscale=1e-3)
        self.cp.cuda.Device().synchronize()

    def track_fraction_of_copy(self, name, n):
        import time

        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            self.time_step(name, n)
            best = min(best, time.perf_counter() - t0)
        return step_bytes(name, self.p, self.state) / best / 1e9 / copy_gbs()

    track_fraction_of_copy.unit = "fraction"


class CudaNormPass:
    """The clipping norm pass on the device: chunk partials, per-parameter and global float64 sums."""

    params = (SIZES,)
    param_names = ["n"]

    def setup(self, n):
        cp = _require()
        self.cp = cp
        self.g = at.FlatBuffer.from_arrays(_cuda_params(n))
        from arraytrain.kernels.interface import family
        from arraytrain.ops import norm_pass

        self.k, self.norm_pass = family("cupy"), norm_pass
        self.time_norm_pass(n)

    def time_norm_pass(self, n):
        self.norm_pass(self.k, self.g.flat, self.g.layout)  # reads the sums back: synchronises


class CudaEngineStep:
    """``engine.step()`` on the device: norm pass, one host sync, clipped AdamW update."""

    params = (SIZES,)
    param_names = ["n"]
    timeout = 300

    def setup(self, n):
        cp = _require()
        self.cp = cp
        self.engine = at.Engine(_cuda_params(n), at.optim.AdamW(lr=1e-3), max_grad_norm=1.0,
                                zero_grad_on_step=False)
        self.engine.grads.load(_cuda_params(n, 1))
        self.time_engine_step(n)

    def time_engine_step(self, n):
        self.engine.step()
        self.cp.cuda.Device().synchronize()

    def track_gbs(self, n):
        import time

        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            self.time_engine_step(n)
            best = min(best, time.perf_counter() - t0)
        return 32 * n / best / 1e9  # norm pass reads g; the update reads p, g, m, v, writes p, m, v

    track_gbs.unit = "GB/s"
