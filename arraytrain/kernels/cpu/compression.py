r"""Compression kernels, numba-jitted: the same names and signatures as
:mod:`arraytrain.kernels.reference.compression` (the definitions of the math live
there; this module says how each is computed and in how many passes).

Parallel work is split into fixed pieces (``BLOCK`` elements, or the
method's own blocks), never by thread, so every result is the same with any
number of threads; buffers below ``SERIAL_BELOW`` run the serial twin.
Reductions that are not exact (sign's L1 norms) add float64 per-piece partials
in piece order.

Rounding: the kernels are compiled with :data:`.cpu.JIT`, whose ``arcp`` flag
lets LLVM turn a division by a loop invariant into a multiplication by its
reciprocal. The code therefore never divides in a loop: it multiplies by a
reciprocal formed once (``fl(1/127)``, ``fl(1/scale)``), exactly as the
reference does, so both give the same bits.

Passes over the gradient (reads of ``x`` from memory):

* :func:`topk`: 2 — a 16-bit histogram of the magnitude bits per chunk, then
  one pass collecting the elements above the threshold bin and the candidates
  in it; the candidates (few) are resolved exactly on the remaining bits.
* :func:`randk_indices`: 0 (``k`` draws into an ``n``-bit bitmap), then
  :func:`gather` reads the ``k`` values.
* :func:`int8_encode`: 1 (each block's absmax and codes from cache).
* :func:`sign_encode`: 1 (bits and per-piece L1 sums of the same chunk).
* :func:`ternary_encode`: 2 (block maxima, then codes).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange

from ..counter_rng import uniform
from ..interface import INV127, MAGNITUDE_MASK
from ._jit import BLOCK, JIT, pick, twins

TOPK_CHUNK = 1 << 18  # elements per histogram chunk (a 2**16-bin int32 histogram each)
NBINS = 1 << 16
_LEVEL_BITS = 16


# -- top-k ---------------------------------------------------------------------------------


@njit(**JIT)
def _topk_resolve(keys, mask, shift, sel, cand, need, idx_out):
    # Serial (the candidates are few), and a function of its own: inside the parallel
    # function these plain loops ran slower than the passes over the gradient.
    # The candidates share the top 16 bits: select `need` of them on the lower bits, 16 at a time.
    above, ncand = sel.size, cand.size
    ckey = np.empty(ncand, dtype=np.int64)
    for j in range(ncand):
        ckey[j] = np.int64(keys[cand[j]] & mask)
    active = np.ones(ncand, dtype=np.bool_)
    take = np.zeros(ncand, dtype=np.bool_)
    rem = shift
    while rem > 0:
        w = min(_LEVEL_BITS, rem)
        rem -= w
        wmask = (np.int64(1) << w) - 1
        h2 = np.zeros(np.int64(1) << w, dtype=np.int64)
        for j in range(ncand):
            if active[j]:
                h2[(ckey[j] >> rem) & wmask] += 1
        cum, t2 = 0, 0
        for b in range(h2.size - 1, -1, -1):
            if cum + h2[b] >= need:
                t2 = b
                break
            cum += h2[b]
        for j in range(ncand):
            if active[j]:
                b = (ckey[j] >> rem) & wmask
                if b > t2:
                    take[j] = True
                    active[j] = False
                elif b < t2:
                    active[j] = False
        need -= cum
    # what is still active has the threshold key itself: the lowest indices first
    for j in range(ncand):
        if active[j] and need > 0:
            take[j] = True
            need -= 1
    # merge the two index-ordered lists
    i, j, o = 0, 0, 0
    while i < above or j < ncand:
        if j < ncand and not take[j]:
            j += 1
        elif j >= ncand or (i < above and sel[i] < cand[j]):
            idx_out[o] = sel[i]
            i += 1
            o += 1
        else:
            idx_out[o] = cand[j]
            j += 1
            o += 1


def _topk(keys, mask, shift, k, chunk, idx_out):
    n = keys.size
    nch = (n + chunk - 1) // chunk
    # pass 1: per-chunk histograms of the top 16 magnitude bits (integer counts: exact in any order)
    hist = np.empty((nch, NBINS), dtype=np.int32)
    for c in prange(nch):
        h = hist[c]
        for b in range(NBINS):
            h[b] = 0
        kb = keys[c * chunk : min(c * chunk + chunk, n)]
        for i in range(kb.size):
            h[np.int64(kb[i] & mask) >> shift] += 1
    tot = np.zeros(NBINS, dtype=np.int64)
    for g in prange(NBINS // 1024):  # contiguous runs of bins, chunk by chunk
        tg = tot[g * 1024 : g * 1024 + 1024]
        for c in range(nch):
            hg = hist[c, g * 1024 : g * 1024 + 1024]
            for b in range(1024):
                tg[b] += hg[b]
    # the threshold bin: fewer than k elements lie above it, at least k at or above it
    above, top, thr = 0, NBINS - 1, 0
    while tot[top] == 0:
        top -= 1
    for b in range(top, -1, -1):
        if above + tot[b] >= k:
            thr = b
            break
        above += tot[b]
    need = k - above
    ncand = tot[thr]
    # output offsets of each chunk, from its histogram
    a_off = np.zeros(nch + 1, dtype=np.int64)
    c_off = np.zeros(nch + 1, dtype=np.int64)
    for c in prange(nch):
        s = 0
        for b in range(thr + 1, top + 1):
            s += hist[c, b]
        a_off[c + 1] = s
        c_off[c + 1] = hist[c, thr]
    for c in range(nch):
        a_off[c + 1] += a_off[c]
        c_off[c + 1] += c_off[c]
    # pass 2: elements above the threshold bin (all taken) and the candidates in it, in index order
    sel = np.empty(above, dtype=np.int64)
    cand = np.empty(ncand, dtype=np.int64)
    for c in prange(nch):
        lo = c * chunk
        kb = keys[lo : min(lo + chunk, n)]
        a, e = a_off[c], c_off[c]
        for i in range(kb.size):
            h = np.int64(kb[i] & mask) >> shift
            if h > thr:
                sel[a] = lo + i
                a += 1
            elif h == thr:
                cand[e] = lo + i
                e += 1
    _topk_resolve(keys, mask, shift, sel, cand, need, idx_out)


_TOPK = twins(_topk)


def topk(x, idx_out, val_out, *, k):
    """The ``k`` largest ``|x_i|``, ties to the lowest index; see :func:`arraytrain.kernels.reference.compression.topk`.

    A radix select on the magnitude bits, no sort: :data:`NBINS`-bin histograms
    of the top 16 bits per :data:`TOPK_CHUNK` elements find the bin holding the
    k-th largest; a second pass writes the indices above that bin and collects
    the candidates inside it, whose lower bits are then resolved exactly, 16 at
    a time, with the equal keys taken in index order.
    """
    size = x.dtype.itemsize
    keys = x.view(np.uint32 if size == 4 else np.uint64)
    shift = 8 * size - 1 - _LEVEL_BITS
    pick(_TOPK, x.size)(keys, MAGNITUDE_MASK[size], np.int64(shift), np.int64(k), np.int64(TOPK_CHUNK), idx_out)
    gather(x, idx_out, val_out)


# -- random-k, gather, scatter ----------------------------------------------------------------


@njit(**JIT)
def _randk_indices(n, k, key, out):
    words = np.zeros((n + 63) // 64, dtype=np.uint64)
    one = np.uint64(1)
    for j in range(n - k, n):
        t = min(np.int64(uniform(key, j) * np.float64(j + 1)), j)
        if (words[t >> 6] >> np.uint64(t & 63)) & one:
            t = j
        words[t >> 6] |= one << np.uint64(t & 63)
    o = 0
    byte = np.uint64(0xFF)
    for w in range(words.size):
        v = words[w]
        b = w * 64
        while v:
            if v & byte == 0:  # skip empty bytes: about k/n of the bits are set
                v >>= np.uint64(8)
                b += 8
                continue
            if v & one:
                out[o] = b
                o += 1
            v >>= one
            b += 1


def randk_indices(*, n, k, key):
    """Floyd's sample of ``k`` of ``n``, sorted; see :func:`arraytrain.kernels.reference.compression.randk_indices`.

    Serial: ``k`` draws with membership in an ``n``-bit bitmap, then the set
    bits read out in order (``O(k + n / 64)``, no pass over the gradient).
    """
    out = np.empty(k, dtype=np.int64)
    _randk_indices(np.int64(n), np.int64(k), np.uint64(key), out)
    return out


def _gather(x, idx, out):
    k = idx.size
    for b in prange((k + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        ib, ob = idx[lo : min(lo + BLOCK, k)], out[lo : min(lo + BLOCK, k)]
        for j in range(ib.size):
            ob[j] = x[ib[j]]


_GATHER = twins(_gather)


def gather(x, idx, out):
    """``out = x[idx]``."""
    pick(_GATHER, idx.size)(x, idx, out)


def _scatter(idx, values, factor, out):
    n, k = out.size, idx.size
    for b in prange((n + BLOCK - 1) // BLOCK):
        ob = out[b * BLOCK : min(b * BLOCK + BLOCK, n)]
        for i in range(ob.size):
            ob[i] = 0
    for b in prange((k + BLOCK - 1) // BLOCK):
        lo = b * BLOCK
        ib, vb = idx[lo : min(lo + BLOCK, k)], values[lo : min(lo + BLOCK, k)]
        for j in range(ib.size):
            out[ib[j]] = vb[j] * factor


_SCATTER = twins(_scatter)


def scatter(idx, values, out, *, factor):
    """``out = 0``, then ``out[idx] = values * factor`` (one write pass, ``k`` scattered writes)."""
    pick(_SCATTER, out.size)(idx, values, out.dtype.type(factor), out)


# -- int8 blockwise ------------------------------------------------------------------------


def _int8_encode(x, block, key, stochastic, shared, c127, one, codes, scales):
    n = x.size
    for b in prange(scales.size):
        lo = b * block
        xb, cb = x[lo : min(lo + block, n)], codes[lo : min(lo + block, n)]
        if shared:
            scale = scales[b]
        else:
            amax = one - one
            for i in range(xb.size):
                amax = max(amax, abs(xb[i]))
            scale = amax * c127
            scales[b] = scale
        inv = np.float64(one / scale) if scale > 0 else 0.0
        for i in range(xb.size):
            t = np.float64(xb[i]) * inv
            if stochastic:
                f = np.floor(t)
                q = f + 1.0 if uniform(key, lo + i) < t - f else f
            else:
                q = np.rint(t)
            cb[i] = np.int8(min(max(q, -127.0), 127.0))


_INT8_ENCODE = twins(_int8_encode)


def int8_encode(x, codes, scales, *, block, key, stochastic, shared=False):
    """Blockwise absmax int8, one pass; see :func:`arraytrain.kernels.reference.compression.int8_encode`."""
    dt = x.dtype.type
    pick(_INT8_ENCODE, x.size)(x, np.int64(block), np.uint64(key), bool(stochastic), bool(shared), dt(INV127),
                                dt(1), codes, scales)


def _int8_decode(codes, scales, block, out):
    n = out.size
    for b in prange(scales.size):
        lo = b * block
        cb, ob = codes[lo : min(lo + block, n)], out[lo : min(lo + block, n)]
        s = scales[b]
        for i in range(ob.size):
            ob[i] = cb[i] * s


_INT8_DECODE = twins(_int8_decode)


def int8_decode(codes, scales, out, *, block):
    """``out_i = codes_i * scale_b``."""
    pick(_INT8_DECODE, out.size)(codes, scales.astype(out.dtype, copy=False), np.int64(block), out)


# -- sign and ternary: pieces ------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _pieces(n: int, block: int):
    """The intersections of the fixed ``BLOCK`` chunks with the method's blocks.

    Returns ``edges`` (piece ``p`` is ``[edges[p], edges[p+1])``), ``first``
    (chunk ``c`` holds pieces ``first[c]`` to ``first[c+1] - 1``) and ``owner``
    (the method block of each piece), read-only and cached per ``(n, block)``.
    """
    starts = np.union1d(np.arange(0, n, BLOCK, dtype=np.int64), np.arange(0, n, block, dtype=np.int64))
    edges = np.append(starts, np.int64(n))
    nch = -(-n // BLOCK)
    first = np.searchsorted(starts, np.arange(nch + 1, dtype=np.int64) * BLOCK).astype(np.int64)
    owner = starts // block
    for a in (edges, first, owner):
        a.flags.writeable = False
    return edges, first, owner


def _sign_encode(x, edges, first, bits, part):
    n = x.size
    for c in prange((n + BLOCK - 1) // BLOCK):
        lo = c * BLOCK
        xb = x[lo : min(lo + BLOCK, n)]
        bb = bits[lo // 8 : (lo + xb.size + 7) // 8]
        for j in range(bb.size):
            v = 0
            for t in range(min(8, xb.size - 8 * j)):
                if xb[8 * j + t] >= 0:
                    v |= 1 << t
            bb[j] = v
        for p in range(first[c], first[c + 1]):
            xp = x[edges[p] : edges[p + 1]]
            s = 0.0
            for i in range(xp.size):
                s += abs(np.float64(xp[i]))
            part[p] = s


_SIGN_ENCODE = twins(_sign_encode)


def sign_encode(x, bits, scales, *, block):
    """Scaled sign, one pass: bits and per-piece float64 L1 sums, added per block in piece order."""
    n = x.size
    edges, first, owner = _pieces(n, int(block))
    part = np.empty(edges.size - 1, dtype=np.float64)
    pick(_SIGN_ENCODE, n)(x, edges, first, bits, part)
    total = np.bincount(owner, weights=part, minlength=scales.size)  # adds each block's pieces in order
    counts = np.minimum(block, n - np.arange(scales.size, dtype=np.int64) * block)
    scales[...] = (total / counts).astype(np.float32)


def _sign_decode(bits, scales, edges, first, owner, out):
    n = out.size
    for c in prange((n + BLOCK - 1) // BLOCK):
        for p in range(first[c], first[c + 1]):
            lo = edges[p]
            s = scales[owner[p]]
            op = out[lo : edges[p + 1]]
            for j in range(op.size):
                i = lo + j
                op[j] = (2 * ((bits[i >> 3] >> (i & 7)) & 1) - 1) * s  # +-s, exact


_SIGN_DECODE = twins(_sign_decode)


def sign_decode(bits, scales, out, *, block):
    """``out_i = +-scale_b`` from bit ``i``."""
    edges, first, owner = _pieces(out.size, int(block))
    pick(_SIGN_DECODE, out.size)(bits, scales.astype(out.dtype), edges, first, owner, out)


def _block_max(x, edges, first, part):
    n = x.size
    for c in prange((n + BLOCK - 1) // BLOCK):
        for p in range(first[c], first[c + 1]):
            xp = x[edges[p] : edges[p + 1]]
            m = 0.0
            for i in range(xp.size):
                m = max(m, abs(np.float64(xp[i])))
            part[p] = m


_BLOCK_MAX = twins(_block_max)


def _ternary_encode(x, key, scales, edges, first, owner, codes):
    n = x.size
    for c in prange((n + BLOCK - 1) // BLOCK):
        lo = c * BLOCK
        m = min(BLOCK, n - lo)
        code = np.zeros(BLOCK, dtype=np.uint8)  # 0 past the end: the last byte's padding
        for p in range(first[c], first[c + 1]):
            s = np.float64(scales[owner[p]])
            plo = edges[p]
            xp, cp = x[plo : edges[p + 1]], code[plo - lo : edges[p + 1] - lo]
            for j in range(xp.size):
                xi = np.float64(xp[j])
                keep = uniform(key, plo + j) * s < abs(xi)
                cp[j] = keep * (1 + (xi < 0))  # 0, 1 (+) or 2 (-), without a branch
        cb = codes[lo // 4 : (lo + m + 3) // 4]
        for j in range(cb.size):
            cb[j] = code[4 * j] | (code[4 * j + 1] << 2) | (code[4 * j + 2] << 4) | (code[4 * j + 3] << 6)


_TERNARY_ENCODE = twins(_ternary_encode)


def ternary_encode(x, codes, scales, *, block, key):
    """TernGrad, two passes (block maxima, then codes); see :func:`arraytrain.kernels.reference.compression.ternary_encode`."""
    n = x.size
    edges, first, owner = _pieces(n, int(block))
    part = np.empty(edges.size - 1, dtype=np.float64)
    pick(_BLOCK_MAX, n)(x, edges, first, part)
    s = np.zeros(scales.size, dtype=np.float64)
    np.maximum.at(s, owner, part)
    s32 = s.astype(np.float32)
    low = s32.astype(np.float64) < s
    s32[low] = np.nextafter(s32[low], np.float32(np.inf))
    scales[...] = s32
    pick(_TERNARY_ENCODE, n)(x, np.uint64(key), s32, edges, first, owner, codes)


def _ternary_decode(codes, scales, edges, first, owner, out):
    n = out.size
    for c in prange((n + BLOCK - 1) // BLOCK):
        for p in range(first[c], first[c + 1]):
            lo = edges[p]
            s = scales[owner[p]]
            op = out[lo : edges[p + 1]]
            for j in range(op.size):
                i = lo + j
                v = (codes[i >> 2] >> (2 * (i & 3))) & 3
                op[j] = ((v == 1) - (v == 2)) * s  # s, -s or 0, exact


_TERNARY_DECODE = twins(_ternary_decode)


def ternary_decode(codes, scales, out, *, block):
    """``out_i = s_b * {0, +1, -1}[code_i]``."""
    edges, first, owner = _pieces(out.size, int(block))
    pick(_TERNARY_DECODE, out.size)(codes, scales.astype(out.dtype), edges, first, owner, out)
