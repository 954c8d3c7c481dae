"""One rank's range of a saved array: what a reader is asked for and what it returns.

Under sharded state (:mod:`arraytrain.parallel.shard`) a rank holds a contiguous range of each
parameter's optimizer state. :func:`arraytrain.load` reads only that range of each saved
array: the engine's template names it with :class:`Owned`, and the reader hands back an
:class:`OwnedRange`. The state buffers that take such ranges (:class:`arraytrain.parallel.shard.ShardBuffer`,
a partition's :class:`arraytrain.optim.state8.Quant8Buffer`) check its range against their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Owned:
    """A reader's template for one saved array of a sharded buffer: its full ``shape`` and ``dtype``,
    and the flat range ``[start, stop)`` of it that this rank owns (``start == stop``: none).
    :func:`arraytrain.load` reads only that range of the file."""

    shape: tuple
    dtype: np.dtype
    start: int
    stop: int
    on_device: bool


@dataclass(frozen=True)
class OwnedRange:
    """What a reader took of one saved array: its flat elements ``[start, start + data.size)`` of an
    array of ``shape``."""

    data: object
    start: int
    shape: tuple
