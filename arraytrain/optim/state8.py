"""8-bit and float8 optimizer state slots (``state_dtype="8bit"`` / ``"float8"``) on the flat buffers.

A :class:`Quant8Buffer` holds, per parameter of at least ``threshold`` elements, one uint8 code per
element and one float32 per block of 256 (the codecs: :mod:`arraytrain.lowbit`), every block inside
one parameter (starting at its first element, as bitsandbytes' start at the tensor's). Smaller
parameters keep their slot in float32: decided by the parameter's size (so by its name), never by its
place in the flat buffer; a checkpoint shows it (a ``{"codes", "absmax"}`` pair or a float32 array).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from ..buffer import aligned_zeros
from ..errors import LayoutError, StateDictError, UnknownParameterError
from ..kernels.interface import F8, Q8, f8_slot
from ..layout import Layout
from ..lowbit import (BLOCK, MAPS, SIGNED_MAP, blocks_in, check_entry, codebook, decode, encode, float_entry_values,
                      is_q8_entry, scale_key)
from ..owned import Owned

#: Parameters with fewer elements keep their slots in float32 (bitsandbytes' ``min_8bit_size``).
DEFAULT_THRESHOLD = 4096
#: A quantized slot's codecs: bitsandbytes' dynamic maps (``state_dtype="8bit"``), float8.
CODECS = ("dynamic", "float8")


def quantized_names(layout: Layout, threshold: int) -> tuple[bool, ...]:
    """Per segment: whether its slot is 8-bit (``size >= threshold`` and not empty)."""
    return tuple(n >= threshold and n > 0 for n in layout.sizes)


def block_pieces(layout: Layout, chunk: int) -> np.ndarray:
    """Rows ``[start, stop, segment]`` cutting each parameter at multiples of ``chunk`` elements
    from its own start (``chunk`` a multiple of :data:`BLOCK`): no block is split between rows."""
    rows = []
    for seg, (start, size) in enumerate(zip(layout.offsets, layout.sizes)):
        for a in range(0, size, chunk):
            rows.append((start + a, start + min(size, a + chunk), seg))
    out = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    out.flags.writeable = False  # as every array of pieces (see Layout.pieces)
    return out


class _Tables(NamedTuple):
    base: np.ndarray  # per segment: its first side-array entry here
    quant: np.ndarray  # per segment: 1 where 8-bit
    offset: np.ndarray  # per segment: where its first element held here sits in the slot's codes
    spans: tuple  # per segment: ``(start, stop)`` of its elements held here ((0, 0): none)
    naux: int  # side-array entries
    ncodes: int  # the codes' bytes, padded so that the side array starts 64-byte aligned


def _tables(layout: Layout, threshold: int, lo: int, length: int) -> _Tables:
    """The per-segment tables of a slot holding the layout's flat elements ``[lo, lo + length)``."""
    quant = quantized_names(layout, threshold)
    hi = lo + length
    base, offset, spans, naux = [], [], [], 0
    for q, off, n in zip(quant, layout.offsets, layout.sizes):
        a, b = min(max(off, lo), hi), min(max(off + n, lo), hi)
        span = (a - off, b - off) if a < b else (0, 0)
        if q and span[0] % BLOCK:
            raise LayoutError(f"window [{lo}, {hi}) cuts an 8-bit block of {layout.names[len(base)]!r} "
                              f"(its offset {off}): 8-bit state needs the window and offsets on multiples of {BLOCK}")
        base.append(naux)
        offset.append(a - lo)
        spans.append(span)
        naux += blocks_in(*span) if q else span[1] - span[0]
    return _Tables(np.asarray(base, np.int64), np.asarray(quant, np.uint8), np.asarray(offset, np.int64),
                   tuple(spans), naux, -(-length // 16) * 16)


def _segment(t, codes, aux, seg: int):
    """Segment ``seg``'s codes (None for a small parameter) and side-array entries in ``codes`` and
    ``aux``, the arrays of a slot of tables ``t`` (a :class:`_Tables` or a :class:`Quant8Buffer`)."""
    (a, b), off, k = t.spans[seg], int(t.offset[seg]), int(t.base[seg])
    if t.quant[seg]:
        return codes[off : off + b - a], aux[k : k + blocks_in(a, b)]
    return None, aux[k : k + b - a]


class Quant8Buffer:
    """A state slot in 8 bits: codes and block scales for large parameters, float32 for small ones.

    ``xp``: the array module of the slot's memory, NumPy (the default) or CuPy (an engine on the
    GPU): ``flat`` and its views ``codes`` and ``aux`` live there, and so do the arrays of
    :meth:`kernel_arg`; the per-segment tables ``base``, ``quant`` and ``offset`` are also kept
    on the host. On CuPy, :meth:`check` reads its inputs (host or device arrays) on the host,
    where entries are validated and float arrays encoded, and returns device arrays;
    :meth:`as_dict` gives device arrays (a checkpoint reads them to the host).

    The engine's state protocol sees what it sees of a :class:`~arraytrain.buffer.FlatBuffer`:
    ``layout``, ``flat`` (one aligned uint8 allocation holding codes and the float32 side
    array, so ``flat.nbytes`` is the slot's memory), ``dtype``, ``as_dict``, ``check`` and
    ``assign``. :meth:`as_dict` gives, per name, ``{"codes": uint8 of the parameter's shape,
    "absmax": float32 (blocks,)}`` for an 8-bit parameter, a float32 array for a small one;
    :meth:`check` takes that form bitwise, the other form converted (float arrays of any float
    dtype are encoded, an 8-bit entry for a parameter kept in float32 here is decoded), so a
    state saved with float32 or bfloat16 slots loads into 8-bit slots and back.

    ``codec``: ``"dynamic"`` (bitsandbytes' maps, ``state_dtype="8bit"``) or ``"float8"`` (e4m3
    codes for a signed slot, e5m2 for an unsigned one, a float32 scale per block; see
    :mod:`arraytrain.lowbit`): the same layout and protocol, entries ``{"codes", "scale", "map"}`` with map
    ``"e4m3"`` or ``"e5m2"``. Entries of the other codec (or float arrays) are converted.

    ``window=(lo, length)``: the slot holds only the flat elements ``[lo, lo + length)`` of the
    layout (one rank's partition under sharded state, :mod:`arraytrain.parallel.shard`): ``codes`` has
    ``length`` entries, and the side array holds the blocks and small parameters' values of
    that range. ``lo`` and every 8-bit parameter's offset must be multiples of :data:`BLOCK`
    (the sharded engine lays the parameters out so), so the window cuts no block. Such a slot
    has no :meth:`as_dict` (:func:`gather_window` assembles every rank's partition into full entries,
    :func:`window_template` describes this rank's partition to a reader); :meth:`check` takes full
    entries or the ranges a reader took (:class:`arraytrain.owned.OwnedRange`) and keeps this
    window's elements.
    """

    __slots__ = ("layout", "signed", "codec", "threshold", "flat", "codes", "aux", "base", "quant", "offset", "spans", "xp",
                 "window", "_arg")

    def __init__(self, layout: Layout, signed: bool, threshold: int = DEFAULT_THRESHOLD, xp=np, window=None,
                 codec: str = "dynamic"):
        if codec not in CODECS:
            raise ValueError(f"codec: expected one of {CODECS}, got {codec!r}")
        self.layout, self.signed, self.threshold, self.xp, self.codec = layout, bool(signed), int(threshold), xp, codec
        self.window = None if window is None else (int(window[0]), int(window[1]))
        lo, length = (0, layout.size) if window is None else self.window
        t = _tables(layout, self.threshold, lo, length)
        self.flat = aligned_zeros(t.ncodes + 4 * t.naux, np.uint8, xp)
        self.codes = self.flat[:length]
        self.aux = self.flat[t.ncodes :].view(np.float32)
        self.base, self.quant, self.offset, self.spans = t.base, t.quant, t.offset, t.spans
        if self.signed and codec == "dynamic":  # value 0 is code 127 in the signed map, 0 elsewhere
            self.codes.fill(np.uint8(np.searchsorted(SIGNED_MAP, 0.0)))
        book = None if codec == "float8" else codebook(self.signed)
        first = np.asarray([a for a, _ in self.spans], np.int64)  # (float8: each segment's first held position)
        extra = (MAPS[self.map_name], first) if book is None else (book.qmap, book.table)
        tables = (self.base, self.quant, self.offset, *extra)
        if xp is not np:  # the kernels read every table on the device
            tables = tuple(xp.asarray(t) for t in tables)
        if book is None:  # (wide: e5m2)
            self._arg = f8_slot(self.codes, self.aux, *tables[:4], int(not self.signed), tables[4], 0)
        else:
            self._arg = Q8(self.codes, self.aux, *tables, book.shift, book.bias, book.nb)

    dtype = np.dtype(np.uint8)  # what ready-to-assign arrays (see :meth:`check`) hold

    @property
    def map_name(self) -> str:
        """The map the codes index: ``"signed"`` or ``"unsigned"`` (dynamic), ``"e4m3"`` or ``"e5m2"`` (float8)."""
        if self.codec == "float8":
            return "e4m3" if self.signed else "e5m2"
        return "signed" if self.signed else "unsigned"

    @property
    def names(self) -> tuple[str, ...]:
        return self.layout.names

    def kernel_arg(self) -> Q8 | F8:
        """The slot as the kernels take it."""
        return self._arg

    def is_quantized(self, name: str) -> bool:
        return bool(self.quant[self.layout.index(name)])

    def _parts(self, seg: int):
        """Segment ``seg``'s codes (None for a small parameter) and side-array entries held here."""
        return _segment(self, self.codes, self.aux, seg)

    def _whole(self, what: str) -> None:
        if self.window is not None:
            raise LayoutError(f"{what}: this slot holds one rank's partition [{self.window[0]}, "
                              f"{self.window[0] + self.window[1]}) of the layout; gather_window assembles every rank's")

    def values(self, name: str):
        """The float32 values of parameter ``name``'s slot (decoded; a copy), in its shape, on the slot's device."""
        self._whole("values")
        seg = self.layout.index(name)
        codes, aux = self._parts(seg)
        out = aux.copy() if codes is None else decode(codes, aux, self.map_name)
        return out.reshape(self.layout.shapes[seg])

    def to_float32(self):
        """Every value, decoded, as a flat float32 array of the layout (padding 0), on the slot's device."""
        self._whole("to_float32")
        out = self.xp.zeros(self.layout.size, np.float32)
        for seg, name in enumerate(self.layout.names):
            off, n = self.layout.offsets[seg], self.layout.sizes[seg]
            out[off : off + n] = self.values(name).ravel()
        return out

    def as_dict(self, copy: bool = False) -> dict:
        """Per name: ``{"codes", "absmax"|"scale", "map"}`` (quantized) or a float32 array (small), as views or copies."""
        self._whole("as_dict")
        out = {}
        for seg, name in enumerate(self.layout.names):
            codes, aux = self._parts(seg)
            shape = self.layout.shapes[seg]
            if codes is None:
                out[name] = (aux.copy() if copy else aux).reshape(shape)
            else:
                out[name] = {"codes": (codes.copy() if copy else codes).reshape(shape),
                             scale_key(self.map_name): aux.copy() if copy else aux, "map": self.map_name}
        return out

    def check(self, arrays: Mapping, *, strict: bool = True) -> dict:
        """Validate ``arrays`` (the :meth:`as_dict` form, or float arrays) without writing.

        Returns, per name, a new uint8 array of the bytes :meth:`assign` writes: the codes
        followed by the block scales' bytes (quantized), or the float32 bytes (small).
        """
        if not isinstance(arrays, Mapping):
            raise StateDictError(f"expected a mapping name -> array, got {type(arrays).__name__}")
        out = {}
        for name, a in arrays.items():
            if name not in self.layout:
                raise UnknownParameterError(f"{name!r}: no such parameter; known: {list(self.layout.names)}")
            seg = self.layout.index(name)
            shape, n, span = self.layout.shapes[seg], self.layout.sizes[seg], self.spans[seg]
            if is_q8_entry(a):
                codes, scale, map_name = check_entry(name, a, shape, n, span)
                if self.quant[seg] and map_name == self.map_name:
                    out[name] = np.concatenate([codes.ravel(), scale.view(np.uint8)])
                    continue
                values = decode(codes, scale, map_name)
            else:
                values = float_entry_values(name, a, shape, span)
            if self.quant[seg]:  # the span starts on a block: its blocks are the whole parameter's
                codes, scale = encode(values, self.map_name)
                out[name] = np.concatenate([codes, scale.view(np.uint8)])
            else:
                out[name] = np.ascontiguousarray(values, np.float32).ravel().view(np.uint8).copy()
        if strict:
            missing = [k for k in self.layout.names if k not in out]
            if missing:
                raise LayoutError(f"missing arrays for {missing}")
        if self.xp is not np:  # ready to assign on the slot's device (the one move, after every check)
            out = {k: self.xp.asarray(v) for k, v in out.items()}
        return out

    def assign(self, checked: dict) -> None:
        """Write what :meth:`check` returned (bytes: the float32 side array may start unaligned in ``raw``)."""
        for name, raw in checked.items():
            seg = self.layout.index(name)
            codes, aux = self._parts(seg)
            if codes is None:
                aux.view(np.uint8)[...] = raw
            else:
                codes[...] = raw[: codes.size]
                aux.view(np.uint8)[...] = raw[codes.size :]

    def load(self, arrays: Mapping, *, strict: bool = True) -> None:
        self.assign(self.check(arrays, strict=strict))

    def __repr__(self) -> str:
        nq = int(self.quant.sum())
        return (f"Quant8Buffer({len(self.layout)} params, {nq} in 8 bits, {self.map_name} "
                f"map, {self.flat.nbytes} bytes)")


def window_template(slot: Quant8Buffer) -> dict:
    """A reader's template of a windowed slot: per name, :class:`~arraytrain.owned.Owned` ranges of
    the codes and absmax (8-bit) or of the float32 values (small) this slot holds."""
    on_device = slot.xp is not np
    out = {}
    for seg, name in enumerate(slot.layout.names):
        shape, (a, b) = slot.layout.shapes[seg], slot.spans[seg]
        if slot.quant[seg]:
            first, nb = a // BLOCK, -(-slot.layout.sizes[seg] // BLOCK)
            scales = Owned((nb,), np.dtype(np.float32), first, first + blocks_in(a, b), on_device)
            out[name] = {"codes": Owned(shape, np.dtype(np.uint8), a, b, on_device), scale_key(slot.map_name): scales,
                         "map": slot.map_name}
        else:
            out[name] = Owned(shape, np.dtype(np.float32), a, b, on_device)
    return out


def gather_window(comm, slot: Quant8Buffer, root: int | None = None) -> dict | None:
    """Every rank's window of a slot assembled into full :meth:`Quant8Buffer.as_dict` entries (a
    collective over ``comm``); with ``root``, on that rank only (None on the others)."""
    xp, lay = slot.xp, slot.layout
    infos = comm.gather_objects((int(slot.flat.size), *slot.window))
    mine = xp.zeros(max(size for size, _, _ in infos), np.uint8)
    mine[: slot.flat.size] = slot.flat
    got = comm.allgather(mine) if root is None else comm.gather(mine, root)
    if got is None:
        return None
    key, out = scale_key(slot.map_name), {}
    for seg, name in enumerate(lay.names):
        shape, n = lay.shapes[seg], lay.sizes[seg]
        if slot.quant[seg]:
            out[name] = {"codes": xp.empty(shape, np.uint8), key: xp.empty(-(-n // BLOCK), np.float32), "map": slot.map_name}
        else:
            out[name] = xp.empty(shape, np.float32)
    for raw, (_, lo, length) in zip(got, infos):
        t = _tables(lay, slot.threshold, lo, length)
        aux = raw[t.ncodes : t.ncodes + 4 * t.naux].view(np.float32)
        for seg, name in enumerate(lay.names):  # (written through flat views of the fresh, contiguous arrays)
            (a, b), (codes, side) = t.spans[seg], _segment(t, raw, aux, seg)
            if codes is None:
                out[name].reshape(-1)[a:b] = side
            elif b > a:
                out[name]["codes"].reshape(-1)[a:b] = codes
                out[name][key][a // BLOCK : a // BLOCK + side.size] = side
    return out
