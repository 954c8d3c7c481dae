"""Shared pieces of the asv suite: sizes, data, bandwidth figures.

Sizes: 1e4 .. 1e7 elements by default; ``ARRAYTRAIN_BENCH_HUGE=1`` adds 1e8,
``ARRAYTRAIN_BENCH_QUICK=1`` keeps 1e5, float32 and a small triad (CI's smoke run: every
benchmark runs once, none for long; asv runs each parameter in a process of its own, so each
size kept costs every parametrized benchmark a process).
"""

from __future__ import annotations

import functools
import os
import time

import numpy as np

QUICK = bool(os.environ.get("ARRAYTRAIN_BENCH_QUICK"))
if QUICK:
    SIZES, DTYPES = [100_000], ["float32"]
else:
    SIZES, DTYPES = [10_000, 100_000, 1_000_000, 10_000_000], ["float32", "float64"]
    if os.environ.get("ARRAYTRAIN_BENCH_HUGE"):
        SIZES.append(100_000_000)
N_TENSORS = 100


def split(n: int, parts: int = N_TENSORS) -> list[int]:
    """``n`` elements as ``parts`` tensor sizes (the shape of a real model's parameter list)."""
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


def make_params(n: int, dtype: str, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {f"p{i}": rng.standard_normal(k).astype(dtype) for i, k in enumerate(split(n))}


def best_seconds(fn, reps: int = 7) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@functools.lru_cache(maxsize=None)
def _triad():
    """The triad kernel, compiled or loaded from numba's cache on first use (asv forks a fresh
    process for every benchmark and parameter: compiling it in each cost 25 of the 65 s that
    OptimizerStep's triad fractions took in the quick run)."""
    from numba import njit, prange

    @njit(parallel=True, cache=True)
    def triad(a, b, c, s):
        for i in prange(a.size):
            a[i] = b[i] + s * c[i]

    return triad


@functools.lru_cache(maxsize=None)
def triad_gbs() -> float:
    """This machine's streaming bandwidth now: numba triad ``a = b + s*c`` (12 B/element)."""
    triad = _triad()
    n = 2_000_000 if QUICK else 20_000_000  # 240 MB: far beyond any cache
    a, b, c = np.zeros(n, np.float32), np.ones(n, np.float32), np.ones(n, np.float32)
    triad(a, b, c, np.float32(2.0))
    return 12 * n / best_seconds(lambda: triad(a, b, c, np.float32(2.0)), 10) / 1e9


class _Bandwidth:
    """Mixin: ``track_gbs`` and ``track_fraction_of_triad`` for a class with ``_call`` and ``_bytes``."""

    def track_gbs(self, *args):
        return self._bytes / best_seconds(self._call) / 1e9

    track_gbs.unit = "GB/s"

    def track_fraction_of_triad(self, *args):
        return self.track_gbs(*args) / triad_gbs()

    track_fraction_of_triad.unit = "fraction"
