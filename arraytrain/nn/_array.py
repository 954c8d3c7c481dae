"""Choosing the array module (NumPy or CuPy) from the arrays in hand, and what differs between the two."""

from __future__ import annotations

import contextlib
from types import ModuleType

import numpy as np

from ..backend import CUPY, NUMPY, backend_of
from ..errors import BackendError


def array_namespace(*arrays) -> ModuleType:
    """``numpy`` for NumPy arrays, ``cupy`` for CuPy arrays; mixing the two is an error.

    The decision reads the arrays' types only; CuPy is imported only when a
    CuPy array is already in hand. ``None`` entries are ignored.
    """
    kinds = {backend_of(a) for a in arrays if a is not None}
    if len(kinds) > 1:
        raise BackendError("arrays: NumPy and CuPy arrays mixed in one call; move them to one device first")
    if kinds == {CUPY}:
        from ..backend import cupy

        return cupy()
    return np


def to_numpy(a) -> np.ndarray:
    """A host NumPy array: NumPy input as is, CuPy input copied to the host (explicitly)."""
    if isinstance(a, np.ndarray) or backend_of(a) == NUMPY:
        return a
    return a.get()


def checked_numerics(x):
    """NumPy's overflow / invalid-value warnings off around a computation whose result is
    checked afterwards (the engine's NaN/Inf test, the epoch's non-finite loss count).
    CuPy does not warn: nothing to switch off."""
    if isinstance(x, np.ndarray):
        return np.errstate(over="ignore", invalid="ignore")
    return contextlib.nullcontext()
