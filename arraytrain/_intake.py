"""Validation and copy-in of ``{name: grad}`` mappings, shared by Engine and GradientAccumulator.

Everything is checked before anything is written, so a refused call changes
nothing. Gradients of another floating precision are accepted and cast:
float32/float64 inside the kernel, float16 (which numba cannot read) by a
copy made during validation. Non-contiguous gradients are accepted and read
through a contiguous copy. NumPy subclasses are read as plain arrays and
masked arrays refused (see :func:`arraytrain.backend.as_array`).

:func:`ready_to_assign` prepares arrays that a state load will copy into
buffers, so that the copy itself cannot fail or depend on its order.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .backend import KERNEL_DTYPES, array_module, as_array, backend_of, same_backend
from .buffer import FlatBuffer
from .errors import AliasingError, ArgumentTypeError, ShapeMismatchError, UnknownParameterError


def check_grads(grads: Mapping, buf: FlatBuffer, protect: tuple = ()) -> dict:
    """Return ``{name: 1-D array}`` for a validated gradient mapping.

    ``protect`` lists flat arrays the gradients must not share memory with
    (the parameter buffer, the gradient buffer itself).
    """
    if not isinstance(grads, Mapping):
        raise ArgumentTypeError(f"grads must be a mapping name -> array, got {type(grads).__name__}")
    backend = backend_of(buf.flat)
    xp = array_module(buf.flat)
    out = {}
    for name, g in grads.items():
        if name not in buf:
            raise UnknownParameterError(f"{name!r}: gradient for an unknown parameter; known: {list(buf.names)}")
        arr = as_array(g, name)
        same_backend(arr, backend, name)
        expected = buf.layout.shape(name)
        if tuple(arr.shape) != expected:
            raise ShapeMismatchError(name, expected, arr.shape)
        for flat in protect:
            if arr.size and xp.may_share_memory(arr, flat):
                raise AliasingError(
                    f"{name!r}: the gradient shares memory with an engine buffer; to hand gradients "
                    "over in place write them into engine.grads and call step() with no argument"
                )
        if arr.dtype not in KERNEL_DTYPES:  # e.g. float16: cast here, before anything is written
            arr = arr.astype(buf.dtype)
        out[name] = xp.ascontiguousarray(arr).reshape(-1)  # the CUDA kernels read dense memory
    return out


def ready_to_assign(buf: FlatBuffer, checked: dict, protect: tuple = ()) -> dict:
    """Arrays validated by ``buf.check`` made safe to copy in any order, without failing.

    Each array gets ``buf``'s dtype here (a cast to a narrower float cannot then
    raise under ``np.errstate(over="raise")`` half-way through a load), and one
    that shares memory with a buffer in ``protect`` (those the load writes) is
    copied unless it is exactly the view it will be written to: otherwise
    writing one buffer could change a source read later.
    """
    out = {}
    for name, arr in checked.items():
        if arr.dtype != buf.dtype:
            with np.errstate(all="ignore"):
                arr = arr.astype(buf.dtype)
        elif isinstance(arr, np.ndarray) and arr.size and any(np.may_share_memory(arr, f) for f in protect):
            dest = buf[name]
            same = (arr.__array_interface__["data"][0] == dest.__array_interface__["data"][0]
                    and arr.strides == dest.strides and arr.shape == dest.shape)
            if not same:
                arr = arr.copy()
        out[name] = arr
    return out


def write_grads(kernels, buf: FlatBuffer, grads: dict, weight: float, overwrite: bool) -> None:
    """``buf[name] (=|+=) weight * grad`` for each validated gradient."""
    layout = buf.layout
    for name, g in grads.items():
        if g.size:
            kernels.accumulate(buf.flat[layout.slice(name)], g, weight, overwrite)
