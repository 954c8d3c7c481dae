"""Sharded optimizer state: each rank of a group keeps and updates one contiguous partition.

``Engine(..., comm=..., shard_state=True)`` cuts the flat buffer into ``K`` equal
contiguous partitions, one per rank. The layout's end is padded so that every
partition has the same length, a whole number of the layout's reduction chunks
(:data:`arraytrain.layout.REDUCE_CHUNK` elements): every piece of
:attr:`Layout.pieces <arraytrain.layout.Layout.pieces>` then lies in exactly one
partition, and a parameter may straddle two. Rank ``r`` owns the elements
``[r * length, (r + 1) * length)``; its optimizer slots (and, under a working copy,
its float32 master weights) hold those elements only.

A :class:`Partition` says which elements a rank owns; a :class:`ShardBuffer` is the
rank's partition of a flat buffer as the optimizers' kernels take it (``flat`` and
``layout.pieces``, the partition's pieces shifted to start at 0, each still naming
its parameter, so per-parameter hyperparameters apply unchanged). The functions at
the end move name-keyed arrays (a state dict, a checkpoint) in and out of shards.

The partitions are contiguous in the engine's layout, which :func:`interleaved` orders so that the
overlapped exchange's buckets alternate owners (the layout as given would put the last layers in
the last rank's partition and the first in the first's).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..backend import array_module, as_array, backend_of
from ..buffer import FlatBuffer, aligned_empty, aligned_zeros
from ..errors import (ArgumentTypeError, LayoutError, ShapeMismatchError,
                     UnknownParameterError)
from ..layout import REDUCE_CHUNK, Layout
from ..owned import Owned, OwnedRange
from ..lowbit import decode_entry, is_q8_entry


@dataclass(frozen=True)
class Partition:
    """Rank ``rank``'s partition of a layout cut into ``ranks`` partitions of ``length`` elements."""

    layout: Layout
    ranks: int
    rank: int
    length: int

    @property
    def lo(self) -> int:
        """The first element this rank owns."""
        return self.rank * self.length

    @property
    def hi(self) -> int:
        """One past the last element this rank owns (may lie in the end padding)."""
        return self.lo + self.length

    @property
    def padded(self) -> int:
        """The flat length with the end padding: ``ranks * length``."""
        return self.ranks * self.length

    @functools.cached_property
    def piece_range(self) -> tuple[int, int]:
        """``(first, stop)``: the layout's pieces that lie in this partition (a contiguous run)."""
        starts = self.layout.pieces[:, 0]
        return int(np.searchsorted(starts, self.lo)), int(np.searchsorted(starts, self.hi))

    @functools.cached_property
    def pieces(self) -> np.ndarray:
        """This partition's pieces, shifted to start at 0 (``[start, stop, parameter]`` rows)."""
        a, b = self.piece_range
        out = self.layout.pieces[a:b].copy()
        out[:, :2] -= self.lo
        out.flags.writeable = False
        return out

    def spans(self):
        """``(name, start, stop, shard_start)`` per parameter with elements here: its elements
        ``[start, stop)`` (flat, within the parameter) lie at ``shard_start`` of the shard."""
        for name, off, size in zip(self.layout.names, self.layout.offsets, self.layout.sizes):
            a, b = max(off, self.lo), min(off + size, self.hi)
            if a < b:
                yield name, a - off, b - off, a - self.lo


def partition(layout: Layout, ranks: int, rank: int) -> Partition:
    """Rank ``rank``'s :class:`Partition` of ``layout`` cut into ``ranks`` equal partitions."""
    chunks = -(-layout.size // REDUCE_CHUNK)
    return Partition(layout, ranks, rank, max(1, -(-chunks // ranks)) * REDUCE_CHUNK)


class ShardLayout:
    """A layout as an optimizer sees a shard: the partition's ``pieces``; everything else is the
    full layout's (names, shapes, and ``len``: per-parameter arrays keep one value per parameter)."""

    __slots__ = ("_layout", "pieces")

    def __init__(self, partition: Partition):
        self._layout, self.pieces = partition.layout, partition.pieces

    def __getattr__(self, name):
        return getattr(self._layout, name)

    def __len__(self) -> int:
        return len(self._layout)


class ShardBuffer:
    """One rank's partition of a flat buffer: ``flat`` holds the elements
    ``[partition.lo, partition.hi)`` of the full buffer (padding included)."""

    __slots__ = ("flat", "layout", "partition")

    def __init__(self, partition: Partition, flat):
        if flat.ndim != 1 or flat.shape[0] != partition.length:
            raise ValueError(f"flat: expected {partition.length} elements, got shape {flat.shape}")
        self.flat, self.partition, self.layout = flat, partition, ShardLayout(partition)

    @property
    def dtype(self):
        """The dtype of the flat array."""
        return self.flat.dtype

    def zeros_like(self, dtype=None) -> ShardBuffer:
        """A zero shard of the same partition (optimizer slots)."""
        return ShardBuffer(self.partition, aligned_zeros(self.partition.length, dtype or self.flat.dtype,
                                                         array_module(self.flat)))

    def copy(self) -> ShardBuffer:
        """An independent copy of the same partition (a new aligned array)."""
        out = aligned_empty(self.partition.length, self.flat.dtype, array_module(self.flat))
        out[...] = self.flat
        return ShardBuffer(self.partition, out)

    def __repr__(self) -> str:
        p = self.partition
        return f"ShardBuffer(rank {p.rank} of {p.ranks}, elements [{p.lo}, {p.hi}), dtype={self.flat.dtype})"


def aligned_to(params: FlatBuffer, align: int) -> FlatBuffer:
    """``params`` in a layout whose offsets are multiples of ``align`` too: ``params`` itself where they
    are, else a copy in the same names, shapes and dtype with the alignment raised (see
    :attr:`arraytrain.optim.Optimizer.shard_align`)."""
    lay = params.layout
    if lay.align % align == 0:
        return params
    return relaid(params, Layout(dict(zip(lay.names, lay.shapes)), align=math.lcm(lay.align, align)))


def relaid(params: FlatBuffer, layout: Layout) -> FlatBuffer:
    """A copy of ``params`` in ``layout`` (the same names and shapes, laid out otherwise), by name."""
    out = FlatBuffer(layout, aligned_zeros(layout.size, params.dtype, array_module(params.flat)))
    for name in layout.names:
        out[name][...] = params[name]
    return out


def interleaved(params: FlatBuffer, ranks: int, bucket_bytes: int | None) -> tuple[FlatBuffer, list]:
    """``params`` laid out so that a sharded engine's buckets alternate owners: the overlapped exchange's
    buckets (:func:`arraytrain.parallel.sync.buckets`, bucket 0 the last parameters) dealt to ``ranks``
    groups in turn, the groups laid one after the other, each bucket's parameters in their own order.
    Consecutive buckets of the backward pass then fall in different ranks' partitions, so their reduces
    to the owners cross the links both ways at once (with contiguous partitions of the layout as given,
    the backward pass finishes one rank's partition before it starts the next one's, one direction at
    a time). Returns ``(params in the new layout, the buckets' names in the order they start)``, with
    ``params`` itself where the order does not change (a single bucket, or one rank)."""
    from .sync import buckets, default_bucket_bytes

    lay = params.layout
    itemsize = params.dtype.itemsize
    if bucket_bytes is None:
        bucket_bytes = default_bucket_bytes(lay.size * itemsize)
    members = [[lay.names[i] for i in sorted(b.params)] for b in buckets(lay, bucket_bytes, itemsize)]
    order = [n for g in range(ranks) for k in range(len(members) - 1, -1, -1) if k % ranks == g for n in members[k]]
    if order == list(lay.names):
        return params, members
    return relaid(params, Layout({n: lay.shape(n) for n in order}, align=lay.align)), members


def padded_buffer(layout: Layout, dtype, xp, partition: Partition) -> tuple[FlatBuffer, object]:
    """A zero :class:`FlatBuffer` of ``layout`` whose array is the head of a padded one of
    ``partition.padded`` elements; returns ``(buffer, padded array)``."""
    full = aligned_zeros(partition.padded, dtype, xp)
    return FlatBuffer(layout, full[: layout.size]), full


def gather(comm, shard: ShardBuffer, root: int | None = None) -> FlatBuffer | None:
    """Every rank's shard into one new full buffer of the layout (a collective, as bytes); with
    ``root``, on that rank only (None on the others, which hold nothing more than their shard)."""
    partition = shard.partition
    xp = array_module(shard.flat)
    if root is not None:
        got = comm.gather(shard.flat.view(np.uint8), root)
        if got is None:
            return None
        full = xp.concatenate(got).view(shard.flat.dtype)
        return FlatBuffer(partition.layout, full[: partition.layout.size])
    full = aligned_zeros(partition.padded, shard.flat.dtype, xp)
    full[partition.lo : partition.hi] = shard.flat
    comm.allgather_blocks(full.view(np.uint8))
    return FlatBuffer(partition.layout, full[: partition.layout.size])


def template(shard: ShardBuffer) -> dict:
    """``{name: Owned}``: the full shapes, the shard's dtype and this rank's range of each (a reader's
    template: no memory, and a reader takes only the owned elements)."""
    lay = shard.partition.layout
    spans = {name: (a, b) for name, a, b, _ in shard.partition.spans()}
    cupy = array_module(shard.flat) is not np
    return {n: Owned(tuple(s), shard.flat.dtype, *spans.get(n, (0, 0)), cupy) for n, s in zip(lay.names, lay.shapes)}


def check_arrays(shard: ShardBuffer, arrays) -> dict:
    """Full name-keyed arrays for ``shard``'s layout, validated as :meth:`FlatBuffer.check` does
    (every name, exact shapes, the shard's backend); nothing is allocated for the layout."""
    lay = shard.partition.layout
    if not isinstance(arrays, Mapping):
        raise ArgumentTypeError(f"expected a mapping name -> array, got {type(arrays).__name__}")
    checked = {}
    spans = {name: (a, b) for name, a, b, _ in shard.partition.spans()}
    for name, a in arrays.items():
        if name not in lay:
            raise UnknownParameterError(f"{name!r}: no such parameter; known: {list(lay.names)}")
        if is_q8_entry(a):  # 8-bit state into float slots: decoded (a reader took the whole entry)
            a = array_module(shard.flat).asarray(decode_entry(name, a, lay.shape(name)))
        if isinstance(a, OwnedRange):  # a reader took this rank's range only (see Owned)
            data = as_array(a.data, name, backend_of(shard.flat))
            if tuple(a.shape) != lay.shape(name):
                raise ShapeMismatchError(name, lay.shape(name), tuple(a.shape), what="array")
            want = spans.get(name, (0, 0))
            if (a.start, a.start + data.size) != want and want[0] != want[1]:
                raise LayoutError(f"{name!r}: holds elements [{a.start}, {a.start + data.size}), this rank "
                                  f"owns [{want[0]}, {want[1]})")
            checked[name] = OwnedRange(data, a.start, tuple(a.shape))
            continue
        arr = as_array(a, name, backend_of(shard.flat))
        if tuple(arr.shape) != lay.shape(name):
            raise ShapeMismatchError(name, lay.shape(name), arr.shape, what="array")
        checked[name] = arr
    missing = [n for n in lay.names if n not in checked]
    if missing:
        raise LayoutError(f"missing arrays for {missing}")
    return checked


def own_part(shard: ShardBuffer, checked: dict):
    """The write that copies this rank's elements of full name-keyed arrays (already checked) into ``shard``."""
    def source(name, a, b):
        got = checked[name]
        return got.data if isinstance(got, OwnedRange) else got.reshape(-1)[a:b]

    moves = [(shard.flat[s0 : s0 + b - a], source(name, a, b)) for name, a, b, s0 in shard.partition.spans()]

    def write():
        for dst, src in moves:
            dst[...] = src

    return write


# -- a state buffer that may be a rank's shard: what engine_state asks of every buffer ------------
def state_arrays(comm, buf, copy: bool, gather_shards: bool) -> dict:
    """A buffer's name-keyed arrays; a rank's :class:`ShardBuffer` as the full arrays: gathered over
    ranks (a collective), or with ``gather_shards`` False a template of their shapes only."""
    if not isinstance(buf, ShardBuffer):
        return buf.as_dict(copy=copy)
    return gather(comm, buf).as_dict() if gather_shards else template(buf)


def state_arrays_at(comm, buf, copy: bool, root: int) -> dict | None:
    """:func:`state_arrays` gathered on rank ``root`` only (None on the others)."""
    if not isinstance(buf, ShardBuffer):
        return buf.as_dict(copy=copy)
    full = gather(comm, buf, root)
    return None if full is None else full.as_dict()


def shard_write(buf, arrays):
    """For a :class:`ShardBuffer`: the write of this rank's elements of full name-keyed ``arrays``
    (checked now); None for any other buffer."""
    if not isinstance(buf, ShardBuffer):
        return None
    return own_part(buf, check_arrays(buf, arrays))
