"""Choosing the array module (NumPy or CuPy) from the arrays in hand."""

from __future__ import annotations

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
        import cupy

        return cupy
    return np


def to_numpy(a) -> np.ndarray:
    """A host NumPy array: NumPy input as is, CuPy input copied to the host (explicitly)."""
    if isinstance(a, np.ndarray) or backend_of(a) == NUMPY:
        return a
    return a.get()
