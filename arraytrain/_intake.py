"""Validation and copy-in of ``{name: grad}`` mappings, shared by Engine and GradientAccumulator.

Everything is checked before anything is written, so a refused call changes
nothing. Gradients of another floating precision are accepted and cast:
float32/float64 inside the kernel, float16 (which numba cannot read) by a
copy made during validation. Non-contiguous gradients are accepted and read
through a contiguous copy.
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


def write_grads(kernels, buf: FlatBuffer, grads: dict, weight: float, overwrite: bool) -> None:
    """``buf[name] (=|+=) weight * grad`` for each validated gradient."""
    layout = buf.layout
    for name, g in grads.items():
        if g.size:
            kernels.accumulate(buf.flat[layout.slice(name)], g, weight, overwrite)
