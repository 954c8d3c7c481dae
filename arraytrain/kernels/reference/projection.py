r"""Reference projection kernels: slow, obviously correct NumPy, the oracle of :mod:`.project`.

Same names and signatures as :mod:`arraytrain.kernels.cpu.projection`. They build the
subsampled randomized Hadamard transform (SRHT) of :class:`arraytrain.compress.VSA`
from three pieces, none of which forms a matrix:

* :func:`fwht` — the orthonormal Walsh–Hadamard transform of every block of
  ``block`` (a power of two) consecutive elements, in place. With the
  Sylvester matrix :math:`H_1 = (1)`, :math:`H_{2k} = \begin{pmatrix} H_k & H_k \\ H_k & -H_k
  \end{pmatrix}`, a block ``v`` becomes :math:`H_B v / \sqrt{B}`, computed with
  :math:`\log_2 B` butterfly passes :math:`(a, b) \to (a + b, a - b)`; the
  transform is symmetric and orthogonal, so it is its own inverse.
* :func:`sign_bind` — the elementwise product with a ±1 key (VSA *binding*):
  :math:`s_i = -1` if :math:`u(key, i) \ge 1/2` else :math:`+1`, with ``u`` the
  counter-based uniform of :mod:`.counter_rng`, so element ``i``'s sign is a
  pure function of ``(key, i)``.
* :func:`select_gather` / :func:`select_scatter` — keep ``d`` coordinates
  spread over the blocks, ``k`` or ``k + 1`` per block (``k = d // nb``; the
  ``d mod nb`` blocks that get one more start at a drawn rotation), each
  block's set a uniform ``k``-subset drawn by a partial Fisher–Yates shuffle
  (draw ``j`` of block ``b`` is :math:`u(key, bB + j)`; the rotation is
  :math:`\lfloor nb \cdot u(key, nb B) \rfloor`). Every coordinate is
  kept with probability exactly ``d / (nb B)`` (up to the 2**-53 grain of
  the uniform), which is what makes the decode unbiased.

Math in float64, rounded once to the storage dtype.
"""

from __future__ import annotations

import numpy as np

from ..counter_rng import uniform_np


def fwht(x, *, block):
    """In place: every ``block``-element block of ``x`` (``x.size % block == 0``) becomes ``H v / sqrt(block)``."""
    if x.size == 0:
        return
    nb = x.size // block
    v = x.astype(np.float64).reshape(nb, block)
    h = 1
    while h < block:
        y = v.reshape(nb, block // (2 * h), 2, h)
        a, b = y[:, :, 0, :].copy(), y[:, :, 1, :].copy()
        y[:, :, 0, :] = a + b
        y[:, :, 1, :] = a - b
        h *= 2
    x[...] = (v / np.sqrt(block)).reshape(-1)


def signs(key, lo, n):
    """The ±1 key of elements ``lo .. lo + n - 1`` as float64."""
    u = uniform_np(key, np.arange(lo, lo + n, dtype=np.uint64))
    return np.where(u >= 0.5, -1.0, 1.0)


def sign_bind(x, out, *, key):
    """``out[i] = s_i * x[i]`` for ``i < out.size`` (``out`` may be ``x``); ``s`` from :func:`signs`."""
    n = out.size
    out[...] = signs(key, 0, n) * x[:n].astype(np.float64)


def _counts(key, nb, block, d):
    """Kept coordinates per block: ``k`` or ``k + 1``, the extra ones from a drawn rotation on."""
    k, rem = divmod(d, nb)
    shift = int(uniform_np(key, np.array([nb * block], dtype=np.uint64))[0] * nb)
    extra = ((np.arange(nb) - shift) % nb) < rem
    return k + extra.astype(np.int64)


def positions(key, nb, block, d):
    """``(pos, counts)``: the kept positions of every block (``pos[o_b : o_b + counts[b]]`` for block ``b``)."""
    counts = _counts(key, nb, block, d)
    kmax = int(counts.max()) if nb else 0
    perm = np.tile(np.arange(block, dtype=np.int64), (nb, 1))
    rows = np.arange(nb, dtype=np.int64)
    for j in range(kmax):
        live = counts > j
        b = rows[live]
        u = uniform_np(key, (b * block + j).astype(np.uint64))
        r = j + np.floor(u * (block - j)).astype(np.int64)
        pj, pr = perm[b, j].copy(), perm[b, r].copy()
        perm[b, j], perm[b, r] = pr, pj
    pos = np.concatenate([perm[b, :counts[b]] + b * block for b in range(nb)]) if nb else np.zeros(0, np.int64)
    return pos, counts


def select_gather(z, y, *, key, block):
    """``y`` (``d`` values) = the kept coordinates of ``z`` (``z.size`` a multiple of ``block``), block by block."""
    pos, _ = positions(key, z.size // block, block, y.size)
    y[...] = z[pos]


def select_scatter(y, z, *, key, block, factor):
    """``z`` = zero except the kept coordinates, which get ``factor * y`` (the transpose of :func:`select_gather`)."""
    pos, _ = positions(key, z.size // block, block, y.size)
    acc = np.zeros(z.size, dtype=np.float64)
    acc[pos] = float(factor) * y.astype(np.float64)
    z[...] = acc
