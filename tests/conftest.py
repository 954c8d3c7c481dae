"""Shared helpers for the arraytrain tests.

Import the plain helpers with ``from conftest import ...`` (pytest puts this
directory on ``sys.path``); fixtures are picked up automatically.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from arraytrain import Layout

# Flat-buffer sizes every kernel is checked at: empty, single element, below a
# SIMD vector, odd mid-size, and large enough for the parallel (prange) path
# with several reduction chunks and a ragged last block.
SIZES = (0, 1, 7, 1037, 278011)
DTYPES = (np.float32, np.float64)

# The project's tolerance rule (fast kernels vs. references, arraytrain vs. torch).
TOLERANCES = {
    np.dtype(np.float64): {"rtol": 1e-7, "atol": 1e-7},
    np.dtype(np.float32): {"rtol": 1.3e-6 * 5, "atol": 1e-5 * 5},
}


def tol(dtype) -> dict:
    """``{"rtol": ..., "atol": ...}`` for a storage dtype."""
    return dict(TOLERANCES[np.dtype(dtype)])


def assert_close(actual, desired, dtype=None, err_msg: str = "") -> None:
    """``assert_allclose`` at the project's tolerance for ``dtype`` (default: ``actual``'s)."""
    actual, desired = np.asarray(actual), np.asarray(desired)
    dtype = actual.dtype if dtype is None else dtype
    t = tol(dtype)
    a, d = actual.astype(np.float64), desired.astype(np.float64)
    if a.shape == d.shape and np.all(np.abs(a - d) <= t["atol"] + t["rtol"] * np.abs(d)):
        return  # fast path; NaN anywhere fails it and gets assert_allclose's report
    np.testing.assert_allclose(actual, desired, err_msg=err_msg, **t)


def padded_shapes(n: int) -> dict:
    """Shapes with zero-size parameters first, in the middle and last around an ``n``-element one."""
    return {"empty0": (0,), "a": (n,), "empty1": (0, 3), "b": (5, 3), "empty2": (0,)}


def padded_layout(n: int) -> Layout:
    return Layout(padded_shapes(n))


@functools.lru_cache(maxsize=64)
def _live_mask(layout: Layout) -> np.ndarray:
    mask = np.zeros(layout.size, dtype=bool)
    for name in layout.names:
        mask[layout.slice(name)] = True
    mask.flags.writeable = False
    return mask


def live_mask(layout: Layout) -> np.ndarray:
    """True where the flat buffer holds a parameter element, False on padding (read-only, cached)."""
    return _live_mask(layout)


def live_indices(layout: Layout) -> np.ndarray:
    return np.flatnonzero(live_mask(layout))


def random_flat(layout: Layout, dtype, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """A flat buffer with standard-normal * ``scale`` parameter elements and zero padding."""
    flat = np.zeros(layout.size, dtype=dtype)
    for name in layout.names:
        s = layout.slice(name)
        flat[s] = rng.standard_normal(s.stop - s.start) * scale
    return flat


def assert_padding_zero(flat: np.ndarray, layout: Layout, what: str = "buffer") -> None:
    pad = np.where(live_mask(layout), 0, flat)
    assert not np.any(pad), f"{what}: padding is not zero ({np.count_nonzero(pad)} non-zero elements)"


# Optimizer configurations shared by the torch comparisons and the convergence
# smoke tests: (name, class name in both arraytrain.optim and torch.optim,
# hyperparameters with torch's names). Learning rates are tuned for gradients
# of scale ~1e3; weight decays, eps and the AMSGrad rows' short beta2 are
# chosen so that each option changes the trajectory beyond the comparison
# tolerance (with beta2=0.999 the running max would not matter in 50 steps).
# Add a row to test a new configuration everywhere.
OPTIMIZER_CONFIGS = [
    ("sgd", "SGD", {"lr": 1e-4}),
    ("sgd_wd", "SGD", {"lr": 1e-4, "weight_decay": 10.0}),
    ("sgd_momentum", "SGD", {"lr": 1e-4, "momentum": 0.9}),
    ("sgd_dampening", "SGD", {"lr": 1e-4, "momentum": 0.9, "dampening": 0.3}),
    ("sgd_nesterov", "SGD", {"lr": 1e-4, "momentum": 0.9, "nesterov": True}),
    ("sgd_nesterov_wd", "SGD", {"lr": 1e-4, "momentum": 0.8, "nesterov": True, "weight_decay": 10.0}),
    ("adam", "Adam", {"lr": 1e-2}),
    ("adam_betas_eps", "Adam", {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 5.0}),
    ("adam_amsgrad", "Adam", {"lr": 1e-2, "betas": (0.9, 0.9), "amsgrad": True}),
    ("adam_wd", "Adam", {"lr": 1e-2, "weight_decay": 10.0}),
    ("adam_wd_amsgrad", "Adam", {"lr": 1e-2, "betas": (0.9, 0.9), "weight_decay": 10.0, "amsgrad": True}),
    ("adamw", "AdamW", {"lr": 1e-2, "weight_decay": 0.5}),
    ("adamw_amsgrad", "AdamW", {"lr": 1e-2, "betas": (0.9, 0.9), "weight_decay": 0.5, "amsgrad": True}),
]


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240611)


def engine_snapshot(engine) -> dict:
    """Everything a refused call must leave unchanged, bit for bit (dtype included).

    Two snapshots compare equal exactly when params, grads, every optimizer
    slot, the step count and the accumulation window are bitwise equal.
    """

    def bits(a):
        return a.dtype.str.encode() + a.tobytes()

    return {
        "params": bits(engine.params.flat),
        "grads": bits(engine.grads.flat),
        "slots": {k: bits(b.flat) for k, b in engine.state.slots.items()},
        "step": engine.state.step,
        "micro": engine.micro_batches,
        "wsum": engine._weight_sum,
        "layout": engine.layout,
    }
