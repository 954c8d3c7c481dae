"""Counter-based random numbers: element ``i`` of draw ``key`` is a pure function of both.

Stochastic compressors (random-k, stochastic rounding, TernGrad) need random
numbers inside parallel kernels that do not depend on the thread count and
that a resumed run draws again exactly. A counter-based generator gives that
with no state beyond the key: ``u(key, i) = splitmix64(key + (i + 1) * phi)``
(Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
OOPSLA 2014; the finaliser of Java's SplittableRandom), top 53 bits as a
double in [0, 1). The host derives one key per (seed, call) with
:func:`step_key`; the NumPy twin :func:`uniform_np` gives the same bits, so the
numba kernels and their reference twins draw identical numbers.
"""

from __future__ import annotations

import numpy as np

_PHI = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)
_ONE = np.uint64(1)
_INV53 = 1.0 / 9007199254740992.0  # 2**-53
_MASK = (1 << 64) - 1


def _mix_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def step_key(seed: int, step: int, stream: int = 0) -> int:
    """A 64-bit key for draw number ``step`` of a generator seeded with ``seed``.

    ``stream`` separates independent uses within one call (e.g. index choice and rounding).
    """
    z = _mix_int((int(seed) * 0x9E3779B97F4A7C15 + int(stream)) & _MASK)
    return _mix_int((z + (int(step) + 1) * 0xD1B54A32D192ED03) & _MASK)


def _uniform(key, i):
    """A double in [0, 1) for element ``i`` of draw ``key`` (``key``: np.uint64)."""
    z = key + (np.uint64(i) + _ONE) * _PHI
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    z = z ^ (z >> _S31)
    return np.float64(z >> _S11) * _INV53


def __getattr__(name: str):
    """``uniform``: :func:`_uniform` as a numba function, made on first use so that numba is imported
    only by the CPU kernels (the host's :func:`step_key` and the NumPy twin need none)."""
    if name != "uniform":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from numba import njit

    global uniform
    _uniform.__name__ = _uniform.__qualname__ = "uniform"
    uniform = njit(inline="always", cache=True)(_uniform)
    return uniform


def uniform_np(key: int, idx) -> np.ndarray:
    """NumPy twin of :func:`uniform` for an array of element indices."""
    with np.errstate(over="ignore"):
        z = np.uint64(key) + (np.asarray(idx, dtype=np.uint64) + _ONE) * _PHI
        z = (z ^ (z >> _S30)) * _M1
        z = (z ^ (z >> _S27)) * _M2
        z = z ^ (z >> _S31)
    return (z >> _S11).astype(np.float64) * _INV53
