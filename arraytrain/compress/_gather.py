"""Packing the live ranges of a flat buffer into one dense vector and back (a compressor's domain)."""

from __future__ import annotations

import numpy as np

from ..backend import backend_of, module_of_backend
from ..layout import Layout


def _runs(layout: Layout, names) -> list[tuple[int, int]]:
    """Live ``[lo, hi)`` ranges of ``names`` in the flat buffer, adjacent ranges merged."""
    runs: list[list[int]] = []
    for name in names:
        s = layout.slice(name)
        if s.stop == s.start:
            continue
        if runs and runs[-1][1] == s.start:
            runs[-1][1] = s.stop
        else:
            runs.append([s.start, s.stop])
    return [(lo, hi) for lo, hi in runs]


class Gather:
    """Pack the live ranges of ``names`` in a flat buffer into a dense vector and back (a view when one range).

    ``size``: the elements of those ranges together.
    """

    def __init__(self, layout: Layout, names, size: int, dtype):
        self.runs = _runs(layout, names)
        self.size = size
        self.dtype = dtype
        self.view = len(self.runs) == 1
        self._scratch = None  # allocated on first use, on the backend of the arrays packed

    def _buffer(self, like):
        s = self._scratch
        if s is None or type(s) is not type(like):
            s = self._scratch = module_of_backend(backend_of(like)).empty(self.size, self.dtype)
        return s

    def pack(self, x: np.ndarray) -> np.ndarray:
        """The dense vector of ``x``'s ranges: a view of ``x`` or the (reused) scratch."""
        out, k = self.target(x), 0
        if not self.view:
            for lo, hi in self.runs:
                out[k:k + hi - lo] = x[lo:hi]
                k += hi - lo
        return out

    def target(self, out: np.ndarray) -> np.ndarray:
        """Where to decode so that :meth:`finish` lands it in ``out`` (a view of ``out`` when one range)."""
        if self.size == 0:
            return out[:0]
        if self.view:
            lo, hi = self.runs[0]
            return out[lo:hi]
        return self._buffer(out)

    def finish(self, dense: np.ndarray, out: np.ndarray) -> None:
        """Scatter :meth:`target`'s contents into ``out`` (nothing to do for a view)."""
        if not self.view:
            self.put(dense, out)

    def add(self, x: np.ndarray, out: np.ndarray) -> None:
        """``out += x`` over the live ranges (padding is left as is)."""
        for lo, hi in self.runs:
            out[lo:hi] += x[lo:hi]

    def put(self, dense: np.ndarray, out: np.ndarray) -> None:
        """Scatter the dense vector ``dense`` into ``out``'s ranges."""
        k = 0
        for lo, hi in self.runs:
            out[lo:hi] = dense[k:k + hi - lo]
            k += hi - lo
