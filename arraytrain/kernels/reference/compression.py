r"""Reference compression kernels: slow, obviously correct NumPy, the oracle of :mod:`.compress`.

Same names and signatures as :mod:`arraytrain.kernels.cpu.compression`. Every function
works on 1-D arrays and writes into the output arrays it is given. The draws
of the stochastic methods come from :func:`.counter_rng.uniform_np` with the
element index as the counter, so they equal the numba kernels' draws bit for
bit.

Inputs are expected finite (the engine skips non-finite steps before anything
is compressed); :func:`topk` alone defines an order for NaN (see there).

* :func:`topk` — the ``k`` largest ``|x_i|``, ties to the lowest index, sorted by index.
* :func:`randk_indices` — ``k`` of ``n`` indices without replacement (Floyd's algorithm).
* :func:`gather` / :func:`scatter` — the sparse payload's values and its decode.
* :func:`int8_encode` / :func:`int8_decode` — blockwise absmax int8.
* :func:`sign_encode` / :func:`sign_decode` — scaled sign, 8 signs per byte.
* :func:`ternary_encode` / :func:`ternary_decode` — TernGrad, 4 codes per byte.
"""

from __future__ import annotations

import numpy as np

from ..counter_rng import uniform_np
from ..interface import INV127, MAGNITUDE_MASK



def magnitude_keys(x: np.ndarray) -> np.ndarray:
    """The bits of ``|x|`` as unsigned integers: ordered exactly as the magnitudes.

    Clearing the sign bit of an IEEE float leaves a non-negative float whose bit
    pattern, read as an unsigned integer, is monotone in its value; NaN's bits
    lie above +inf's, so a NaN ranks above every number.
    """
    bits = x.view(np.uint32 if x.dtype.itemsize == 4 else np.uint64)
    return bits & MAGNITUDE_MASK[x.dtype.itemsize]


def topk(x, idx_out, val_out, *, k):
    """The ``k`` elements of largest ``|x_i|`` (``1 <= k <= x.size``), sorted by index.

    Ties (equal magnitudes) go to the lowest index. The order is that of
    :func:`magnitude_keys` (NaN above everything). Writes ``idx_out`` (uint32
    or int64) and ``val_out = x[idx_out]``.
    """
    keys = magnitude_keys(x)
    order = np.argsort(~keys, kind="stable")  # descending magnitude, index order among equals
    idx = np.sort(order[:k])
    idx_out[...] = idx
    val_out[...] = x[idx]


def randk_indices(*, n, k, key):
    """``k`` distinct indices of ``range(n)``, uniform over the k-subsets, sorted (int64).

    Floyd's algorithm (Bentley and Floyd, "Programming pearls: a sample of
    brilliance", CACM 1987): for ``j = n-k, ..., n-1`` draw ``t`` uniform in
    ``[0, j]``; insert ``t``, or ``j`` when ``t`` is already in. Draw ``j`` is
    ``t = min(floor(u(key, j) * (j + 1)), j)``.
    """
    js = np.arange(n - k, n, dtype=np.int64)
    u = uniform_np(key, js)
    t = np.minimum(np.floor(u * (js + 1).astype(np.float64)).astype(np.int64), js)
    chosen: set[int] = set()
    for j, tj in zip(js.tolist(), t.tolist()):
        chosen.add(j if tj in chosen else tj)
    return np.array(sorted(chosen), dtype=np.int64)


def gather(x, idx, out):
    """``out = x[idx]``."""
    out[...] = x[idx]


def scatter(idx, values, out, *, factor):
    """``out = 0`` then ``out[idx] = values * factor`` (math in ``out``'s dtype)."""
    out[...] = 0
    out[idx.astype(np.int64)] = values * out.dtype.type(factor)


def _blocks(v, block, fill=0):
    """``v`` padded with ``fill`` to whole blocks, as a ``(nblocks, block)`` array."""
    nb = -(-v.size // block)
    padded = np.full(nb * block, fill, dtype=v.dtype)
    padded[: v.size] = v
    return padded.reshape(nb, block)


def int8_encode(x, codes, scales, *, block, key, stochastic, shared=False):
    r"""Blockwise absmax int8: ``scale_b = max_{i in b} |x_i| / 127``, ``codes = round(x / scale)``.

    ``scales`` (the gradient dtype) is ``absmax * fl(1/127)``; the codes are
    ``t = x * fl(1/scale)`` in float64, rounded to nearest (ties to even) or,
    when ``stochastic``, up with probability ``t - floor(t)`` (``u(key, i) <
    t - floor(t)``), clamped to ``[-127, 127]``. An all-zero block has scale 0
    and codes 0. ``shared``: ``scales`` is read, not written — a scale given
    for every block (at least the block's own, e.g. the maximum over the
    processes of a group), and the codes are taken against it.
    """
    dt = x.dtype.type
    blocks = _blocks(x, block)
    scale = scales.astype(x.dtype) if shared else np.abs(blocks).max(axis=1) * dt(INV127)
    inv = np.zeros_like(scale)
    np.divide(dt(1), scale, out=inv, where=scale > 0)
    t = (blocks.astype(np.float64) * inv.astype(np.float64)[:, None]).reshape(-1)[: x.size]
    if stochastic:
        f = np.floor(t)
        q = f + (uniform_np(key, np.arange(x.size)) < t - f)
    else:
        q = np.rint(t)
    codes[...] = np.clip(q, -127, 127).astype(np.int8)
    if not shared:
        scales[...] = scale


def int8_decode(codes, scales, out, *, block):
    """``out_i = codes_i * scale_{i // block}`` in ``out``'s dtype."""
    out[...] = codes.astype(out.dtype) * np.repeat(scales.astype(out.dtype), block)[: out.size]


def sign_encode(x, bits, scales, *, block):
    r"""Scaled sign: bit ``i`` = ``x_i >= 0``, ``scale_b = ||x_b||_1 / |b|`` (float32).

    Bits are packed 8 per byte, element ``8j + t`` in bit ``t`` of byte ``j``
    (``np.packbits(..., bitorder="little")``, the last byte zero-padded). The
    L1 norm is summed in float64 and rounded once to float32.
    """
    bits[...] = np.packbits(x >= 0, bitorder="little")
    for b in range(scales.size):
        xb = x[b * block : (b + 1) * block].astype(np.float64)
        scales[b] = np.float32(np.abs(xb).sum() / xb.size)


def sign_decode(bits, scales, out, *, block):
    """``out_i = +scale_b`` where bit ``i`` is set, ``-scale_b`` elsewhere."""
    on = np.unpackbits(bits, count=out.size, bitorder="little").astype(bool)
    s = np.repeat(scales.astype(out.dtype), block)[: out.size]
    out[...] = np.where(on, s, -s)


def ternary_scales(x, block):
    """``max_{i in b} |x_i|`` per block as float32, rounded up where float32 rounds it down."""
    s = np.abs(_blocks(x, block)).max(axis=1).astype(np.float64)
    s32 = s.astype(np.float32)
    low = s32.astype(np.float64) < s
    s32[low] = np.nextafter(s32[low], np.float32(np.inf))
    return s32


def ternary_encode(x, codes, scales, *, block, key):
    r"""TernGrad: ``s_b = max |x_b|``, element ``i`` kept with probability ``|x_i| / s_b``.

    Kept when ``u(key, i) * s_b < |x_i|`` (float64); code 1 for a kept
    positive, 2 for a kept negative, 0 otherwise; four codes per byte,
    element ``4j + t`` in bits ``2t, 2t + 1`` of byte ``j``.
    """
    s32 = ternary_scales(x, block)
    s = np.repeat(s32.astype(np.float64), block)[: x.size]
    ax = np.abs(x.astype(np.float64))
    keep = uniform_np(key, np.arange(x.size)) * s < ax
    c = np.where(keep, np.where(x < 0, 2, 1), 0).astype(np.uint8)
    c4 = _blocks(c, 4)
    codes[...] = c4[:, 0] | (c4[:, 1] << 2) | (c4[:, 2] << 4) | (c4[:, 3] << 6)
    scales[...] = s32


def ternary_decode(codes, scales, out, *, block):
    """``out_i = s_b`` for code 1, ``-s_b`` for code 2, 0 for code 0."""
    c = ((codes[:, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3).reshape(-1)[: out.size]
    s = np.repeat(scales.astype(out.dtype), block)[: out.size]
    out[...] = np.where(c == 1, s, np.where(c == 2, -s, out.dtype.type(0)))
