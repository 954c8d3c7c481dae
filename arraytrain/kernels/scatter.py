"""Scatter-accumulate: many small gradients, packed back to back, written into a flat buffer in one call.

The engine's dict path packs the small gradients of a micro-batch into one
staging array (``np.concatenate``: one C call, no Python per element) and this
kernel writes each packed run to its segment of the flat buffer:
``acc[d:d+n] (=|+=) w * src[s:s+n]`` for every row ``(s, d, n)`` of ``table``.
The arithmetic is exactly that of :func:`arraytrain.kernels.cpu.accumulate`
(``w`` in ``acc``'s dtype, the same loop body and fastmath flags), so a
gradient written through the staging array has the same bits as one written
directly. ``scatter_reference`` is the slow twin, built on the reference
``accumulate``.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from . import reference
from .cpu import _pick, _twins

# rows are [src_start, dst_start, size]
TABLE_COLUMNS = 3


def _scatter(acc, src, table, w, overwrite):
    for t in prange(table.shape[0]):
        s = table[t, 0]
        d = table[t, 1]
        n = table[t, 2]
        ab, gb = acc[d : d + n], src[s : s + n]
        if overwrite:
            for i in range(ab.size):
                ab[i] = w * gb[i]
        else:
            for i in range(ab.size):
                ab[i] += w * gb[i]


_SCATTER = _twins(_scatter)


def scatter(acc, src, table, w, overwrite):
    """``acc[d:d+n] = w * src[s:s+n]`` (or ``+=``) for each row ``(s, d, n)`` of the int64 ``table``.

    Rows must not overlap in ``acc`` (each row is one parameter's segment); the
    caller validates the table once, when it builds it.
    """
    if table.shape[0]:
        # parallel over rows only when there is enough work to pay for the launch
        _pick(_SCATTER, src.size)(acc, src, table, acc.dtype.type(w), bool(overwrite))


def scatter_reference(acc, src, table, w, overwrite):
    """The slow twin: one reference ``accumulate`` per row."""
    for s, d, n in np.asarray(table, np.int64).reshape(-1, TABLE_COLUMNS):
        if n:
            reference.accumulate(acc[d : d + n], src[s : s + n], w, overwrite)
