"""FlatBuffer: one contiguous 1-D array of one dtype, addressed by parameter name."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from .backend import (NUMPY, array_module, as_array, backend_of, check_float_dtype, dtype_named, is_bfloat16, same_backend,
                      to_device)
from .errors import ArgumentTypeError, BackendUnavailableError, LayoutError, ReadOnlyError, ShapeMismatchError, UnknownParameterError
from .layout import DEFAULT_ALIGN, Layout


# Every buffer FlatBuffer allocates starts on a 64-byte boundary (a cache line, an AVX-512
# vector). With the layout's 16-element segment alignment every float32/float64 parameter
# view then starts on one too, which is what XLA's CPU client needs to alias an imported
# DLPack buffer instead of copying it (jax.dlpack.from_dlpack), and what torch, numba and
# BLAS prefer. CuPy's memory pool hands out 256-byte-aligned blocks already.
ALIGN_BYTES = 64


def address(arr) -> int:
    """The address of ``arr``'s first element (NumPy or CuPy)."""
    if isinstance(arr, np.ndarray):
        return arr.__array_interface__["data"][0]
    return arr.data.ptr


def aligned_empty(n: int, dtype, xp=np):
    """An uninitialised 1-D array of ``n`` elements whose first element is ``ALIGN_BYTES``-aligned."""
    dtype = dtype_named(dtype)
    if xp is np:
        # over-allocate raw bytes and start the array at the first aligned byte; np.empty of
        # the exact size would be 16-byte aligned only (the allocator's guarantee)
        raw = np.empty(n * dtype.itemsize + ALIGN_BYTES, np.uint8)
        start = -raw.__array_interface__["data"][0] % ALIGN_BYTES
        return raw[start : start + n * dtype.itemsize].view(dtype)
    try:
        arr = xp.empty(n, dtype=dtype)
    except TypeError:  # CuPy before 14 has no bfloat16
        raise BackendUnavailableError(f"dtype {dtype}: CuPy {xp.__version__} cannot hold it on the GPU "
                                      "(bfloat16 needs CuPy >= 14)") from None
    if arr.data.ptr % ALIGN_BYTES == 0:
        return arr
    raw = xp.empty(n * dtype.itemsize + ALIGN_BYTES, xp.uint8)  # a custom allocator: align by hand
    start = -raw.data.ptr % ALIGN_BYTES
    return raw[start : start + n * dtype.itemsize].view(dtype)


def aligned_zeros(n: int, dtype, xp=np):
    """:func:`aligned_empty`, zero-filled."""
    arr = aligned_empty(n, dtype, xp)
    arr.fill(0)
    return arr


def aligned(flat):
    """``flat`` itself if it starts on an ``ALIGN_BYTES`` boundary, else an aligned copy."""
    if address(flat) % ALIGN_BYTES == 0:
        return flat
    xp = array_module(flat)
    out = aligned_empty(flat.size, flat.dtype, xp)
    out[...] = flat
    return out


def kernel_view(flat):
    """What a kernel reads: the array itself, or its uint16 bits for bfloat16 storage."""
    return flat.view(np.uint16) if is_bfloat16(flat.dtype) else flat


class FlatBuffer(Mapping):
    """A :class:`Layout` plus one contiguous 1-D array holding every parameter.

    ``buf[name]`` is a writable, reshaped view into ``buf.flat``; writing to it
    writes the buffer. Padding between segments is zero and stays zero.

    A read-only :class:`collections.abc.Mapping` name -> view, in buffer order:
    ``keys()``, ``values()``, ``items()``, ``get()``, ``in`` and ``dict(buf)``
    (a dict of views, sharing the buffer's memory) work as for any mapping.
    The mapping itself is fixed by the layout: ``buf[name] = x`` and
    ``del buf[name]`` raise :class:`~arraytrain.errors.ReadOnlyError`; write
    the values through the view (``buf[name][...] = x``) or with :meth:`load`.
    Equality is identity, as before (views of arrays have no single truth
    value): compare contents with ``np.array_equal(a.flat, b.flat)``.

    Every buffer the class allocates (:meth:`zeros`, :meth:`from_arrays`,
    :meth:`zeros_like`, :meth:`copy`) starts on a 64-byte boundary
    (:data:`ALIGN_BYTES`), so with the layout's default 16-element alignment
    every float32/float64 view does too. ``FlatBuffer(layout, flat)`` uses
    ``flat`` as it is, alignment included.
    """

    __slots__ = ("layout", "flat", "_views")

    def __init__(self, layout: Layout, flat):
        if not isinstance(layout, Layout):
            raise ArgumentTypeError(f"layout must be a Layout, got {type(layout).__name__}")
        self._check_kind(flat)
        if flat.ndim != 1 or flat.shape[0] != layout.size:
            raise LayoutError(f"flat: expected a 1-D array of {layout.size} elements, got shape {flat.shape}")
        if not flat.flags.c_contiguous:
            raise LayoutError("flat: the buffer must be contiguous")
        if not getattr(flat.flags, "writeable", True):  # CuPy arrays are always writable
            raise ReadOnlyError("flat: the buffer must be writable")
        self.layout = layout
        self.flat = flat
        self._views = {
            name: flat[off : off + size].reshape(shape)
            for name, off, size, shape in zip(layout.names, layout.offsets, layout.sizes, layout.shapes)
        }

    @staticmethod
    def _check_kind(flat) -> None:
        """The array types and dtypes a buffer of this class holds (subclasses narrow them)."""
        backend_of(flat)
        check_float_dtype(flat.dtype, "flat")

    # -- construction -----------------------------------------------------------
    @classmethod
    def zeros(cls, layout: Layout, dtype=np.float32, xp=np) -> "FlatBuffer":
        """A new zero buffer of ``layout`` and ``dtype``, on ``xp``'s device (NumPy or CuPy)."""
        check_float_dtype(dtype, "dtype")
        return cls(layout, aligned_zeros(layout.size, dtype, xp))

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, object], dtype=None, align: int = DEFAULT_ALIGN) -> "FlatBuffer":
        """Copy a mapping of arrays into a new buffer (in the mapping's order).

        ``dtype=None`` takes the common floating dtype of the inputs. All inputs
        must live on one backend (NumPy or CuPy); the buffer is created there.
        """
        if not isinstance(arrays, Mapping):
            raise ArgumentTypeError(f"arrays must be a mapping name -> array, got {type(arrays).__name__}")
        arrs = {name: as_array(a, name) for name, a in arrays.items()}
        backend = backend_of(next(iter(arrs.values()))) if arrs else NUMPY
        for name, a in arrs.items():
            same_backend(a, backend, name)
        if dtype is None:
            dtype = np.result_type(*(a.dtype for a in arrs.values())) if arrs else np.float32
        check_float_dtype(dtype, "dtype")
        layout = Layout({name: a.shape for name, a in arrs.items()}, align=align)
        out = cls.zeros(layout, dtype, array_module(next(iter(arrs.values()))) if arrs else np)
        for name, a in arrs.items():
            out._views[name][...] = a
        return out

    def zeros_like(self, dtype=None) -> "FlatBuffer":
        """A zero buffer of the same layout (for gradients and optimizer state)."""
        return FlatBuffer.zeros(self.layout, dtype or self.flat.dtype, array_module(self.flat))

    def copy(self) -> "FlatBuffer":
        """An independent copy: same layout, dtype and backend, a new aligned flat array."""
        out = aligned_empty(self.flat.size, self.flat.dtype, array_module(self.flat))
        out[...] = self.flat
        return FlatBuffer(self.layout, out)

    # -- mapping interface -------------------------------------------------------
    def __getitem__(self, name: str):
        try:
            return self._views[name]
        except KeyError:
            raise UnknownParameterError(f"{name!r}: no such parameter; known: {list(self.layout.names)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names)

    def __len__(self) -> int:
        return len(self.layout)

    def __contains__(self, name: object) -> bool:
        return name in self._views

    def __setitem__(self, name, value) -> None:
        raise ReadOnlyError(f"{name!r}: a FlatBuffer's names are fixed by its layout; write the values through "
                            f"the view (buf[{name!r}][...] = x) or with buf.load({{{name!r}: x}})")

    def __delitem__(self, name) -> None:
        raise ReadOnlyError(f"{name!r}: a FlatBuffer's names are fixed by its layout; a parameter cannot be removed")

    # identity, not Mapping's value equality (which would ask arrays for one truth value)
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    @property
    def names(self) -> tuple[str, ...]:
        """The parameter names, in buffer order (the layout's)."""
        return self.layout.names

    @property
    def dtype(self):
        """The dtype of the flat array (every view has it)."""
        return self.flat.dtype

    def keys(self):
        """The names, in buffer order (a read-only view)."""
        return self._views.keys()

    def values(self):
        """The views, in buffer order (a read-only view of the mapping; each view writes the buffer)."""
        return self._views.values()

    def items(self):
        """``(name, view)`` pairs, in buffer order."""
        return self._views.items()

    def as_dict(self, copy: bool = False) -> dict:
        """``{name: view}``, or independent copies with ``copy=True``."""
        return {k: (v.copy() if copy else v) for k, v in self._views.items()}

    def load(self, arrays: Mapping[str, object], *, strict: bool = True) -> None:
        """Copy ``arrays`` into the buffer by name, validating everything first.

        With ``strict`` every name of the layout must be present. Floating
        inputs of another precision are cast; shapes must match exactly.
        """
        self.assign(self.check(arrays, strict=strict))

    def check(self, arrays: Mapping[str, object], *, strict: bool = True) -> dict:
        """Validate ``arrays`` for :meth:`load` without writing; returns the arrays to assign."""
        if not isinstance(arrays, Mapping):
            raise ArgumentTypeError(f"expected a mapping name -> array, got {type(arrays).__name__}")
        checked = {}
        for name, a in arrays.items():
            if name not in self._views:
                raise UnknownParameterError(f"{name!r}: no such parameter; known: {list(self.layout.names)}")
            if isinstance(a, Mapping):  # 8-bit optimizer state (arraytrain.lowbit): decoded, onto this device
                from .lowbit import decode_entry, is_q8_entry

                if is_q8_entry(a):
                    a = array_module(self.flat).asarray(decode_entry(name, a, self.layout.shape(name)))
            arr = as_array(a, name, backend_of(self.flat))
            if tuple(arr.shape) != self.layout.shape(name):
                raise ShapeMismatchError(name, self.layout.shape(name), arr.shape, what="array")
            checked[name] = arr
        if strict:
            missing = [n for n in self.layout.names if n not in checked]
            if missing:
                raise LayoutError(f"missing arrays for {missing}")
        return checked

    def assign(self, checked: dict) -> None:
        """Write arrays already validated by :meth:`check`."""
        for name, arr in checked.items():
            self._views[name][...] = arr

    def __repr__(self) -> str:
        return f"FlatBuffer({len(self)} params, {self.layout.num_elements} elements, dtype={self.flat.dtype})"


def as_flat_buffer(params, dtype=None, device=None) -> FlatBuffer:
    """An engine's parameters as a :class:`FlatBuffer` on ``device``: a mapping name -> array copied
    into a new buffer (``dtype``, or the common floating dtype); a FlatBuffer used in place (it must
    hold ``dtype`` where one is given), or copied once where ``device`` names the other side."""
    if isinstance(params, FlatBuffer):
        if dtype is not None and np.dtype(dtype) != params.dtype:
            raise LayoutError(f"dtype: the FlatBuffer holds {params.dtype}, got dtype={np.dtype(dtype)}")
    elif isinstance(params, Mapping):
        params = FlatBuffer.from_arrays(params, dtype=dtype)
    else:
        raise ArgumentTypeError(f"params: expected a mapping name -> array or a FlatBuffer, got {type(params).__name__}")
    moved = to_device(params.flat, device)
    if moved is not params.flat:
        params = FlatBuffer(params.layout, aligned(moved))  # a fresh copy: aligned too
    return params


class SubsetLayout:
    """A layout whose ``pieces`` are some of another's rows (everything else is the other's): what a
    kernel walks when it is to touch some parameters only."""

    __slots__ = ("_layout", "pieces")

    def __init__(self, layout: Layout, pieces: np.ndarray):
        self._layout, self.pieces = layout, pieces

    @property
    def whole(self) -> Layout:
        """The layout these pieces are some of (a buffer of the whole layout, such as a pruning mask, is
        indexed by the same offsets)."""
        return self._layout

    def __getattr__(self, name):
        return getattr(self._layout, name)

    def __len__(self) -> int:
        return len(self._layout)


class Subset:
    """A flat buffer as an update over some parameters sees it: the same array, the given pieces only
    (Muon's fallback parameters; the parameters that have a gradient this step, see
    :mod:`arraytrain.param_steps`). A subset of :class:`GradsAt` still reads where the gradients lie."""

    __slots__ = ("flat", "layout", "_source")

    def __init__(self, buf, pieces: np.ndarray):
        if isinstance(buf, Subset):  # some rows of a subset: of its source
            buf = buf._source
        self.flat, self.layout, self._source = buf.flat, SubsetLayout(buf.layout, pieces), buf

    @property
    def dtype(self):
        return self.flat.dtype

    @property
    def bases(self):
        """The source's :attr:`GradsAt.bases`, or None."""
        return getattr(self._source, "bases", None)

    def ptrs(self, pieces: np.ndarray) -> np.ndarray:
        """:meth:`GradsAt.ptrs` of the source."""
        return self._source.ptrs(pieces)


def segment_addresses(buf) -> np.ndarray:
    """The address of every parameter's first element in ``buf`` (a FlatBuffer of a NumPy array):
    int64 by segment, read-only (what :class:`GradsAt` starts from for gradients in the buffer)."""
    out = buf.flat.ctypes.data + np.asarray(buf.layout.offsets, np.int64) * buf.flat.itemsize
    out.flags.writeable = False
    return out


class GradsAt:
    """One step's gradient read where it lies: the engine's gradient buffer (its dtype and layout), and
    for every parameter the address of its gradient's first element, which may be anywhere (a torch
    ``.grad`` tensor, an array given to ``step(grads)``, or the buffer itself). Optimizers that
    ``reads_in_place`` hand their kernels :meth:`ptrs` (``grad_ptrs``, see
    :mod:`arraytrain.kernels.interface`) instead of copying the gradients into the buffer first."""

    __slots__ = ("flat", "layout", "bases", "_offsets", "_last")

    def __init__(self, grads: FlatBuffer, bases: np.ndarray, offsets: tuple):
        self.flat, self.layout, self.bases, self._offsets = grads.flat, grads.layout, bases, offsets
        self._last = (None, None)  # (pieces, their addresses): the norm pass and the update share them

    @staticmethod
    def offsets_of(grads: FlatBuffer) -> tuple:
        """What :class:`GradsAt` takes as ``offsets`` for ``grads``: the parameters' offsets (int64), with the
        layout's pieces, their segments and byte offsets from their parameter's start (so that the
        addresses of the layout's own pieces take two array operations)."""
        pieces = grads.layout.pieces
        offsets = np.asarray(grads.layout.offsets, np.int64)
        seg = np.ascontiguousarray(pieces[:, 2])
        return offsets, pieces, seg, (pieces[:, 0] - offsets[seg]) * grads.flat.itemsize

    @property
    def dtype(self):
        return self.flat.dtype

    def ptrs(self, pieces: np.ndarray) -> np.ndarray:
        """The address of the gradient's element at each piece's start (int64, one per row)."""
        last, out = self._last
        if pieces is last:
            return out
        offsets, full, seg, delta = self._offsets
        if pieces is full:
            out = self.bases[seg]
            out += delta
        else:
            seg = pieces[:, 2]
            out = self.bases[seg] + (pieces[:, 0] - offsets[seg]) * self.flat.itemsize
        self._last = (pieces, out)
        return out
