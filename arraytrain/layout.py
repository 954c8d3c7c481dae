"""Layout: where each named parameter lives inside one flat 1-D buffer."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Mapping
from functools import cached_property

import numpy as np

from .errors import LayoutError, UnknownParameterError

DEFAULT_ALIGN = 16
# Reduction chunk: sums of squares are formed per fixed chunk of this many
# elements and then added in chunk order, so the bits never depend on how many
# threads ran. 2**14 float32 elements = 64 KiB, a few L2-sized pieces per core.
REDUCE_CHUNK = 1 << 14


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise LayoutError(f"parameter names must be non-empty strings, got {name!r}")
    return name


def check_shape(name: str, shape: object) -> tuple[int, ...]:
    try:
        dims = tuple(shape)  # type: ignore[arg-type]
    except TypeError:
        raise LayoutError(f"{name!r}: shape must be a sequence of ints, got {shape!r}") from None
    if not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in dims):
        raise LayoutError(f"{name!r}: shape must be a sequence of ints, got {shape!r}")
    dims = tuple(int(d) for d in dims)
    if any(d < 0 for d in dims):
        raise LayoutError(f"{name!r}: negative dimension in shape {dims}")
    return dims


class Layout:
    """Ordered names, shapes and aligned offsets of parameters in one flat buffer.

    Every segment starts at a multiple of ``align`` elements, so a vector load
    never straddles two parameters; the gaps between segments are padding that
    stays zero. Zero-size parameters are allowed anywhere. A layout is
    immutable, hashable and compares equal to a layout with the same names,
    shapes and alignment.
    """

    def __init__(self, shapes: Mapping[str, object], align: int = DEFAULT_ALIGN):
        if isinstance(align, bool) or not isinstance(align, int) or align < 1:
            raise LayoutError(f"align must be a positive int, got {align!r}")
        names, dims, offsets, sizes = [], [], [], []
        offset = 0
        for name, shape in shapes.items():
            name = _check_name(name)
            shape = check_shape(name, shape)
            size = math.prod(shape)
            names.append(name)
            dims.append(shape)
            offsets.append(offset)
            sizes.append(size)
            offset += -(-size // align) * align
        self._names = tuple(names)
        self._shapes = tuple(dims)
        self._offsets = tuple(offsets)
        self._sizes = tuple(sizes)
        self._index = {n: i for i, n in enumerate(names)}
        self._align = align
        self._size = offset

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, object], align: int = DEFAULT_ALIGN) -> "Layout":
        """The layout of a mapping of arrays (or anything with a shape), in the mapping's order."""
        return cls({k: getattr(v, "shape", None) or np.shape(v) for k, v in arrays.items()}, align=align)

    # -- read-only views -------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        """The parameter names, in buffer order."""
        return self._names

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """The parameter shapes, in buffer order."""
        return self._shapes

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each parameter's segment starts in the flat buffer (a multiple of :attr:`align`)."""
        return self._offsets

    @property
    def sizes(self) -> tuple[int, ...]:
        """The parameters' element counts (padding excluded), in buffer order."""
        return self._sizes

    @property
    def align(self) -> int:
        """Every segment starts at a multiple of this many elements."""
        return self._align

    @property
    def size(self) -> int:
        """Total flat length, padding included."""
        return self._size

    @property
    def num_elements(self) -> int:
        """Elements that belong to parameters (padding excluded)."""
        return sum(self._sizes)

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def index(self, name: str) -> int:
        """The position of ``name`` in the layout (its segment number); an error naming the known ones."""
        try:
            return self._index[name]
        except KeyError:
            raise UnknownParameterError(f"{name!r}: no such parameter; known: {list(self._names)}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of parameter ``name``."""
        return self._shapes[self.index(name)]

    def slice(self, name: str) -> slice:
        """The part of the flat buffer that holds parameter ``name`` (padding excluded)."""
        i = self.index(name)
        return slice(self._offsets[i], self._offsets[i] + self._sizes[i])

    # -- identity --------------------------------------------------------
    def _key(self):
        return (self._names, self._shapes, self._align)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        body = ", ".join(f"{n}: {s}" for n, s in zip(self._names, self._shapes))
        return f"Layout({{{body}}}, align={self._align}, size={self._size})"

    # -- arrays the kernels consume ----------------------------------------
    @cached_property
    def pieces(self) -> np.ndarray:
        """``(P, 3)`` int64 rows ``[start, stop, segment]`` for chunked reductions.

        A piece is the intersection of one parameter's segment with one fixed
        chunk ``[c * REDUCE_CHUNK, (c + 1) * REDUCE_CHUNK)`` of the flat buffer.
        Kernels reduce each piece independently (in parallel) and then add the
        pieces in this order, so the result is the same for any thread count.
        Padding is never read; zero-size parameters have no pieces. Read-only: it is shared,
        and every array of pieces the kernels see (a partition's, an 8-bit layout's) is
        read-only too, so numba compiles one signature for them, not two.
        """
        rows = []
        for seg, (start, size) in enumerate(zip(self._offsets, self._sizes)):
            stop = start + size
            pos = start
            while pos < stop:
                cut = min(stop, (pos // REDUCE_CHUNK + 1) * REDUCE_CHUNK)
                rows.append((pos, cut, seg))
                pos = cut
        out = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        out.flags.writeable = False
        return out
