"""What the reference kernels share: float64 views of any storage, one rounding on store, pieces."""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np

from ..interface import F8, LP_BF16, LP_F16

LP_DTYPES = {LP_BF16: np.dtype(ml_dtypes.bfloat16), LP_F16: np.dtype(np.float16)}


def f64(x):
    """float64 values of a float array, or of a uint16 array of bfloat16 bits."""
    x = np.asarray(x)
    if x.dtype == np.uint16:
        return x.view(ml_dtypes.bfloat16).astype(np.float64)
    return x.astype(np.float64)


def store(dst, values):
    """Round ``values`` once to ``dst``'s storage (bfloat16 bits for uint16) and return what was stored."""
    if dst.dtype == np.uint16:
        # float64 -> float32 -> bfloat16: the fast kernels do float32 math, so their
        # input to the bfloat16 rounding is a float32
        dst[...] = np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    else:
        dst[...] = values
    return f64(dst)


def segments(pieces, n):
    """Segment index of every element covered by ``pieces`` (and the covered positions)."""
    idx = np.concatenate([np.arange(a, b) for a, b, _ in pieces]) if len(pieces) else np.zeros(0, np.int64)
    seg = np.concatenate([np.full(b - a, s) for a, b, s in pieces]) if len(pieces) else np.zeros(0, np.int64)
    return idx.astype(np.int64), seg.astype(np.int64)


def store_at(dst, i, values):
    """``dst[i] = values`` rounded to the storage; returns the stored values as float64."""
    out = np.empty(len(i), dst.dtype)
    stored = store(out, values)
    dst[i] = out
    return stored


def apply_mask(p, mask, i):
    """``p[i] = 0`` where ``mask[i] == 0`` (uint8, 1 = keep): pruned weights are exactly +0."""
    p[i] = np.where(mask[i] != 0, p[i], p.dtype.type(0))


# -- 8-bit state (arraytrain.lowbit) -----------------------------------------------------------
#
# The reference runs an 8-bit slot as bitsandbytes' CPU optimizers do, in three whole passes:
# decode every slot into a float32 array at the parameters' offsets, run the float update
# (which stores float32 values), encode every block the pieces cover. The fast kernels fuse
# the three per block of 256.


def q8_expand(slot) -> np.ndarray:
    """An 8-bit slot's values, decoded, as a float32 array at the flat buffer's offsets."""
    from ...lowbit import BLOCK

    out = np.zeros(slot.codes.size, np.float32)
    for seg in range(slot.offset.size):
        off, b = int(slot.offset[seg]), int(slot.base[seg])
        n = _seg_size(slot, seg)
        if slot.quant[seg]:
            scale = np.repeat(slot.aux[b : b + -(-n // BLOCK)], BLOCK)[:n]
            out[off : off + n] = slot.qmap[slot.codes[off : off + n]] * scale
        else:
            out[off : off + n] = slot.aux[b : b + n]
    return out


def _seg_size(slot, seg) -> int:
    """Segment ``seg``'s element count, from the side array's layout (absmax blocks or values)."""
    from ...lowbit import BLOCK

    nxt = slot.base[seg + 1] if seg + 1 < slot.base.size else slot.aux.size
    if not slot.quant[seg]:
        return int(nxt - slot.base[seg])
    # up to the next segment's codes, within the segment's blocks (padding codes decode to 0)
    stop = slot.offset[seg + 1] if seg + 1 < slot.offset.size else slot.codes.size
    return int(min(stop - slot.offset[seg], (nxt - slot.base[seg]) * BLOCK))


def q8_commit(slot, values, pieces) -> None:
    """Write float32 ``values`` (flat) into an 8-bit slot over ``pieces``: float32 segments as
    they are, 8-bit ones encoded block by block (every block a piece covers; a piece must not
    split one). A float8 slot (:class:`~arraytrain.kernels.interface.F8`): each block by
    :func:`arraytrain.lowbit.float8_encode`, an e5m2 one by :func:`arraytrain.lowbit.sr_codes`
    (stochastic rounding: the elements' positions in their parameter and the slot's salt)."""
    from ...lowbit import BLOCK, float8_encode, nearest_codes, sr_codes, sr_key

    for lo, hi, seg in np.asarray(pieces).tolist():
        off, b = int(slot.offset[seg]), int(slot.base[seg])
        if not slot.quant[seg]:
            slot.aux[b + lo - off : b + hi - off] = values[lo:hi]
            continue
        if (lo - off) % BLOCK:
            raise ValueError(f"pieces: row [{lo}, {hi}) splits an 8-bit block of segment {seg}")
        for a in range(lo, hi, BLOCK):
            x = np.asarray(values[a : min(a + BLOCK, hi)], np.float32)
            if isinstance(slot, F8):
                if slot.wide:
                    first = a - off + int(slot.start[seg])
                    codes, scale = sr_codes(x, np.arange(first, first + x.size), sr_key(slot.salt, seg))
                else:
                    codes, scale = float8_encode(x, "e4m3")
                slot.codes[a : a + x.size] = codes
                slot.aux[b + (a - off) // BLOCK] = scale[0]
                continue
            am = np.float32(np.abs(x).max()) if not np.isnan(x).any() else np.float32(np.nan)
            inv = np.float32(1) / am if am > 0 else np.float32(0)
            with np.errstate(invalid="ignore"):
                slot.codes[a : a + x.size] = nearest_codes(x * inv, slot.qmap)
            slot.aux[b + (a - off) // BLOCK] = am


def with_q8(fn):
    """Run reference kernel ``fn`` with its 8-bit slots (:class:`arraytrain.kernels.interface.Q8` arguments)
    decoded into float32 arrays, then encoded back over the pieces."""
    import functools
    import inspect

    where = list(inspect.signature(fn).parameters).index("pieces")

    @functools.wraps(fn)
    def run(*args, **kwargs):
        from ..interface import QUANTIZED

        slots = {k: a for k, a in enumerate(args) if isinstance(a, QUANTIZED)}
        if not slots:
            return fn(*args, **kwargs)
        args = list(args)
        expanded = {}  # by identity: a slot passed twice (Adam's unused vmax) is one array
        for k, slot in slots.items():
            if id(slot) not in expanded:
                expanded[id(slot)] = (slot, q8_expand(slot))
            args[k] = expanded[id(slot)][1]
        out = fn(*args, **kwargs)
        for slot, values in expanded.values():
            q8_commit(slot, values, args[where])
        return out

    return run


def gathered(g, pieces, grad_ptrs):
    """The gradient as one flat array: ``g``, or (``grad_ptrs``: an address per piece, see
    :mod:`arraytrain.kernels.interface`) a copy of ``g`` with every piece read where it lies."""
    if grad_ptrs is None:
        return g
    out = g.copy()
    for (lo, hi, _), address in zip(np.asarray(pieces).tolist(), np.asarray(grad_ptrs).tolist()):
        if hi > lo:
            raw = (ctypes.c_char * ((hi - lo) * g.itemsize)).from_address(address)
            out[lo:hi] = np.frombuffer(raw, dtype=g.dtype)
    return out
