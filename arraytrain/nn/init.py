r"""Weight initialisation from a seed.

* He (Kaiming) normal, He et al. 2015, "Delving Deep into Rectifiers":
  :math:`W \sim \mathcal N(0, 2 / n_{in})` — keeps the activation variance of
  ReLU-like layers (ReLU, GELU) constant through depth.
* Xavier (Glorot) uniform, Glorot & Bengio 2010: :math:`W \sim U(-a, a)`,
  :math:`a = \sqrt{6 / (n_{in} + n_{out})}` — for saturating activations
  (tanh, sigmoid) and linear layers.

Biases start at zero. Draws are made in float64 from
``numpy.random.default_rng(seed)`` and then cast, so a float32 and a float64
model of one seed start from the same values (rounded).
"""

from __future__ import annotations

import numpy as np

from ..errors import HyperparameterError

INITS = ("he", "xavier")


def he_normal(rng: np.random.Generator, fan_in: int, fan_out: int, dtype=np.float32) -> np.ndarray:
    """A ``(fan_in, fan_out)`` matrix drawn from N(0, 2/fan_in)."""
    std = np.sqrt(2.0 / fan_in)
    return (rng.standard_normal((fan_in, fan_out)) * std).astype(dtype)


def xavier_uniform(rng: np.random.Generator, fan_in: int, fan_out: int, dtype=np.float32) -> np.ndarray:
    """A ``(fan_in, fan_out)`` matrix drawn from U(-a, a), a = sqrt(6/(fan_in+fan_out))."""
    a = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-a, a, (fan_in, fan_out)).astype(dtype)


def weight_init(kind: str):
    """The initialiser called ``kind`` ("he" or "xavier")."""
    if kind == "he":
        return he_normal
    if kind == "xavier":
        return xavier_uniform
    raise HyperparameterError(f"init: expected one of {INITS}, got {kind!r}")
