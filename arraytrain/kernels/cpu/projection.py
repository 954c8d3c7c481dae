r"""Projection kernels, numba-jitted: the same names and signatures as
:mod:`arraytrain.kernels.reference.projection` (where the math is written out).

The pieces of the subsampled randomized Hadamard transform behind
:class:`arraytrain.compress.VSA`: the blockwise orthonormal Walsh–Hadamard
transform (:func:`fwht`), the ±1 binding with a counter-RNG key
(:func:`sign_bind`), and the per-block choice of kept coordinates
(:func:`select_gather`, :func:`select_scatter`). Memory: nothing beyond the
arrays passed in, save one ``block``-sized index scratch per block being
worked on; no matrix is formed.

Parallelism: :func:`fwht` and the selection kernels hand whole Hadamard blocks
to numba's threads (``prange`` over blocks), :func:`sign_bind` fixed pieces of
``BLOCK`` elements; buffers below ``SERIAL_BELOW`` elements run the serial
twins (:mod:`.cpu`). Every output element is a function of the key and its
index only, so the bits do not depend on the thread count.

Floating point: the butterflies run in the storage dtype (float32 buffers get
float32 adds, 8 lanes per AVX2 vector); the reference adds in float64, so the
two agree to the project's float32 tolerance, and bitwise for float64 inputs
up to the rounding of the final ``1/sqrt(block)`` scale.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ..counter_rng import uniform, uniform_np
from ._jit import BLOCK, pick, twins


def _fwht(x, block, s):
    nb = x.size // block
    for b in prange(nb):
        v = x[b * block : b * block + block]
        h = 1
        if block >= 8:
            # the three stages h = 1, 2, 4 (strided pairs that do not vectorise) in registers,
            # one pass over the block: the same butterflies in the same order as stage by stage
            for i in range(0, block, 8):
                a0, a1, a2, a3 = v[i], v[i + 1], v[i + 2], v[i + 3]
                a4, a5, a6, a7 = v[i + 4], v[i + 5], v[i + 6], v[i + 7]
                b0, b1, b2, b3 = a0 + a1, a0 - a1, a2 + a3, a2 - a3
                b4, b5, b6, b7 = a4 + a5, a4 - a5, a6 + a7, a6 - a7
                c0, c1, c2, c3 = b0 + b2, b1 + b3, b0 - b2, b1 - b3
                c4, c5, c6, c7 = b4 + b6, b5 + b7, b4 - b6, b5 - b7
                v[i], v[i + 1], v[i + 2], v[i + 3] = c0 + c4, c1 + c5, c2 + c6, c3 + c7
                v[i + 4], v[i + 5], v[i + 6], v[i + 7] = c0 - c4, c1 - c5, c2 - c6, c3 - c7
            h = 8
        while h < block:
            for i in range(0, block, 2 * h):
                lo = v[i : i + h]
                hi = v[i + h : i + 2 * h]
                for j in range(h):
                    a = lo[j]
                    c = hi[j]
                    lo[j] = a + c
                    hi[j] = a - c
            h *= 2
        for i in range(block):
            v[i] *= s


_FWHT = twins(_fwht)


def fwht(x, *, block):
    """In place: every ``block``-element block of ``x`` becomes ``H v / sqrt(block)``; see the reference."""
    if x.size == 0:
        return
    pick(_FWHT, x.size)(x, int(block), x.dtype.type(1.0 / np.sqrt(block)))


def _sign_bind(x, key, out):
    n = out.size
    for b in prange((n + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        hi = min(lo + BLOCK, n)
        xb, ob = x[lo:hi], out[lo:hi]
        for i in range(ob.size):
            xi = xb[i]
            ob[i] = -xi if uniform(key, lo + i) >= 0.5 else xi


_SIGN_BIND = twins(_sign_bind)


def sign_bind(x, out, *, key):
    """``out[i] = s_i * x[i]`` for ``i < out.size`` (``out`` may be ``x``); see the reference."""
    pick(_SIGN_BIND, out.size)(x, np.uint64(key), out)


def _counts(key, nb, block, d):
    """Kept coordinates per block and each block's offset in the kept vector (host side, ``nb`` integers)."""
    k, rem = divmod(d, nb)
    shift = int(uniform_np(key, np.array([nb * block], dtype=np.uint64))[0] * nb)
    counts = k + (((np.arange(nb) - shift) % nb) < rem).astype(np.int64)
    offs = np.zeros(nb, dtype=np.int64)
    np.cumsum(counts[:-1], out=offs[1:])
    return counts, offs


def _select(z, key, block, counts, offs, y, scale, scatter):
    nb = counts.size
    for b in prange(nb):
        base = b * block
        zb = z[base : base + block]
        kb = counts[b]
        yb = y[offs[b] : offs[b] + kb]
        if scatter:
            zb[:] = 0
        perm = np.arange(block)
        for j in range(kb):
            # partial Fisher-Yates: slot j takes a uniform pick of the block - j positions not yet taken
            r = j + np.int64(uniform(key, base + j) * (block - j))
            t = perm[r]
            perm[r] = perm[j]
            perm[j] = t
            if scatter:
                zb[t] = scale * yb[j]
            else:
                yb[j] = zb[t]


_SELECT = twins(_select)


def select_gather(z, y, *, key, block):
    """``y`` = the kept coordinates of ``z``, block by block; see the reference."""
    nb = z.size // block
    if nb == 0:
        return
    counts, offs = _counts(key, nb, block, y.size)
    pick(_SELECT, z.size)(z, np.uint64(key), int(block), counts, offs, y, y.dtype.type(0), False)


def select_scatter(y, z, *, key, block, factor):
    """``z`` = zero except the kept coordinates, which get ``factor * y``; see the reference."""
    nb = z.size // block
    if nb == 0:
        return
    counts, offs = _counts(key, nb, block, y.size)
    pick(_SELECT, z.size)(z, np.uint64(key), int(block), counts, offs, y, z.dtype.type(factor), True)
