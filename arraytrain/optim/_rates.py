"""The per-parameter rates a step hands its kernel, formed in one compiled call.

A step's kernel takes its learning rate, L2 coefficient and decay factor as one value per
parameter, in the parameters' dtype. Formed with NumPy (the overrides' NaN replaced by the
optimizer's value, the bias correction divided in, the decay factor, each cast to the storage
dtype) that is about ten calls on arrays of a few dozen elements a step: microseconds each,
several times that inside a training loop, where the forward and backward pass have just
evicted NumPy's code from the caches. :func:`step_rates` forms the three in one loop with the same
float64 operations in the same order, so the bits are those of the NumPy expressions
(``Optimizer._step_rates``'s form with a schedule's rates, compared in
``tests/optim/test_rates.py``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..kernels.cpu.optimizers import rates_into

# No fastmath: each product, quotient and difference rounds as NumPy's does (no contraction into an FMA).
_JIT = dict(cache=True, error_model="numpy", nogil=True)

_EMPTY: dict = {}


def empty_of(dtype) -> np.ndarray:
    """An empty array of ``dtype``: what the compiled helpers take to know the dtype of their output."""
    try:
        return _EMPTY[dtype]
    except KeyError:
        return _EMPTY.setdefault(dtype, np.empty(0, dtype))


@njit(**_JIT)
def step_rates(hp_lr, hp_wd, lr, weight_decay, lr_div, decoupled, like):
    """``(rate, l2, decay)`` in ``like``'s dtype: per parameter, the override (``hp_lr``/``hp_wd``, NaN:
    none) or the optimizer's ``lr``/``weight_decay``; ``rate = lr / lr_div`` (Adam's bias correction,
    Adagrad's decay of the rate, 1 for the others); decoupled (AdamW, Lion): ``l2 = 0``, ``decay = 1 -
    lr * weight_decay``; else ``l2 = weight_decay``, ``decay = 1``."""
    n = hp_lr.size
    step_size = np.empty(n, like.dtype)
    l2 = np.empty(n, like.dtype)
    decay = np.empty(n, like.dtype)
    rates_into(hp_lr, hp_wd, lr, weight_decay, lr_div, decoupled, step_size, l2, decay)
    return step_size, l2, decay
