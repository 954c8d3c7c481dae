"""The CUDA family on the CPU: ``ARRAYTRAIN_CUDA=cpu`` makes :func:`arraytrain.kernels.cuda.core.cupy` this module.

It stands for CuPy as far as the CUDA family uses it, so that the family's own Python (its
launchers, chunk tables, descriptors, grid sizes and argument packing) runs unchanged and
its own CUDA C source strings are executed by :mod:`.runtime` (compiled by the system C++
compiler, each block's threads interleaved as fibers). Device arrays are
:class:`DeviceArray`, a NumPy array with CuPy's ``.get()``, ``.set()`` and ``.data.ptr``;
a plain NumPy array passed to a kernel is refused, as CuPy refuses it.

What it does the least of, and so cannot check: streams and events (one queue, every
launch runs to its end before it returns), memory pools, NCCL, more than one device.
What the executor cannot see is listed in :mod:`.runtime`.
"""

from __future__ import annotations

import os
import sys
import types

import numpy as np

from ...._dlpack import GPU_DEVICES
from ....errors import BackendUnavailableError
from .runtime import Module as RawModule  # noqa: F401
from .runtime import CompileError, LaunchError  # noqa: F401


class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


class DeviceArray(np.ndarray):
    """A NumPy array standing for a CuPy array: its memory is "device memory" a kernel may take."""

    @property
    def data(self):
        return _Pointer(self.__array_interface__["data"][0])

    @property
    def device(self):
        return cuda.Device()

    def get(self, stream=None, out=None):
        """A host copy (a plain NumPy array), as ``cupy.ndarray.get``."""
        host = np.array(self.view(np.ndarray), copy=True)
        if out is not None:
            out[...] = host
            return out
        return host

    def set(self, arr, stream=None):
        """Copy host array ``arr`` in, as ``cupy.ndarray.set`` (same shape and dtype)."""
        arr = np.asarray(arr)
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"set: {arr.shape} {arr.dtype} into {self.shape} {self.dtype}")
        self.view(np.ndarray)[...] = arr

    def __array_wrap__(self, arr, context=None, return_scalar=False):
        # CuPy's reductions give 0-d device arrays, not host scalars
        return np.asarray(arr).view(DeviceArray)

    def __repr__(self):
        return "DeviceArray(" + repr(self.view(np.ndarray))[6:]


ndarray = DeviceArray
#: With ``ARRAYTRAIN_CUDA=cpu`` (every CUDA kernel of a run on it) arraytrain.kernels.cuda.core.Source
#: asks for every instance of a source in one module: one host-compiler run per source, a tenth of
#: the time of one per instance. Put in CuPy's place for a few kernels (a test's monkeypatch): one
#: instance at a time, as NVRTC is asked.
COMPILES_WHOLE_SOURCES = os.environ.get("ARRAYTRAIN_CUDA") == "cpu"


def _device(a) -> DeviceArray:
    return a if isinstance(a, DeviceArray) else np.asarray(a).view(DeviceArray)


def _host_only(a):
    """Refuse another library's GPU array: there is no GPU memory here to read it from."""
    dl = getattr(a, "__dlpack_device__", None)
    if hasattr(a, "__cuda_array_interface__") or (dl is not None and int(dl()[0]) in GPU_DEVICES):
        raise BackendUnavailableError(f"a GPU array ({type(a).__name__}): the CPU executor (ARRAYTRAIN_CUDA=cpu) "
                                      "stands for CuPy's own arrays, in host memory")


def asarray(a, dtype=None, order=None) -> DeviceArray:
    """A device array of ``a``: a host array is copied over; a device array of the dtype is itself."""
    if isinstance(a, DeviceArray) and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    _host_only(a)
    return np.array(np.asarray(a), dtype=dtype, order=order or "K", copy=True).view(DeviceArray)


def from_dlpack(a) -> DeviceArray:
    _host_only(a)
    return np.from_dlpack(a).view(DeviceArray)


def asnumpy(a, stream=None, out=None):
    return a.get(out=out) if isinstance(a, DeviceArray) else np.asarray(a)


def get_array_module(*args):
    return _this if any(isinstance(a, DeviceArray) for a in args) else np


def _wrap(fn):
    def call(*args, **kwargs):
        out = fn(*args, **kwargs)
        if isinstance(out, np.ndarray):
            return _device(out)
        if isinstance(out, tuple):
            return tuple(_device(o) if isinstance(o, np.ndarray) else o for o in out)
        return out

    call.__name__ = getattr(fn, "__name__", "numpy")
    return call


def __getattr__(name):
    """Every other name is NumPy's: dtypes as they are, functions returning device arrays."""
    value = getattr(np, name)
    if isinstance(value, type) or not callable(value):
        return value
    return _wrap(value)


class _Queue:
    """What a stream or a device is here: every launch has finished when it returns, so there is
    nothing to wait for, and one device."""

    ptr = 0

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    use = __enter__


class _Device(_Queue):
    id = 0

    def __init__(self, device=None):
        if device not in (None, 0):
            raise ValueError(f"device {device!r}: the CPU executor has one device, 0")


class _Runtime:
    @staticmethod
    def getDeviceCount():
        return 1


_stream = _Queue()
cuda = types.SimpleNamespace(Device=_Device, Stream=lambda *a, **k: _stream, get_current_stream=lambda: _stream,
                             runtime=_Runtime, is_available=lambda: True)

_this = sys.modules[__name__]
