"""Array intake and backend dispatch.

Gradients arrive from any framework. :func:`as_array` reads NumPy arrays,
objects with ``__dlpack__`` (torch, JAX, CuPy, ...), ``__array_interface__`` or
the buffer protocol (``memoryview``) without importing their framework, and
returns a NumPy array on the CPU or a CuPy array on a CUDA device. Nothing is
ever copied between host and device behind the caller's back: a CUDA array
handed to a CPU engine is an error, and so is the other way round.

:func:`check_kernel_dtype` says whether a buffer's dtype is one the kernels run on;
the kernels themselves come from :func:`arraytrain.kernels.interface.family`, by
:func:`backend_of` the buffer.
"""

from __future__ import annotations

import sys
from types import ModuleType

import numpy as np

from . import _dlpack
from .errors import BackendError, BackendUnavailableError, DTypeError, HyperparameterError

NUMPY, CUPY = "numpy", "cupy"
KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))



# The CPU executor's device arrays (ARRAYTRAIN_CUDA=cpu): NumPy arrays that stand for CuPy's.
_STAND_IN = "arraytrain.kernels.cuda.on_cpu"


def is_device_array(x: object) -> bool:
    """``x`` is a CuPy array, or the CPU executor's stand-in for one; from the type alone."""
    m = type(x).__module__
    return m.partition(".")[0] == "cupy" or m == _STAND_IN


def cupy():
    """CuPy (or, with ``ARRAYTRAIN_CUDA=cpu``, the CPU executor standing for it)."""
    from .kernels.cuda.core import cupy

    return cupy()


def backend_of(x: object) -> str:
    """``"numpy"`` or ``"cupy"`` from the type alone; never imports CuPy."""
    if is_device_array(x):
        return CUPY
    if isinstance(x, np.ndarray):
        return NUMPY
    raise BackendError(f"expected a NumPy or CuPy array, got {type(x).__name__}")


def array_module(x) -> ModuleType:
    """``numpy`` for a NumPy array, ``cupy`` for a CuPy array (imported only then)."""
    if backend_of(x) == NUMPY:
        return np
    return cupy()


DEVICES = ("cpu", "cuda")


def to_device(flat, device: str | None, name: str = "params"):
    """``flat`` on ``device`` ("cpu", "cuda" or None for where it is): the one explicit move.

    Moving to "cuda" needs CuPy and a visible CUDA device; a clear
    :class:`BackendUnavailableError` says which is missing.
    """
    if device is None:
        return flat
    if device not in DEVICES:
        raise HyperparameterError(f"device: expected None, 'cpu' or 'cuda', got {device!r}")
    here = "cpu" if backend_of(flat) == NUMPY else "cuda"
    if device == here:
        return flat
    if device == "cpu":
        return flat.get()
    require_cuda(name)
    return cupy().asarray(flat)


def require_cuda(name: str = "device") -> None:
    """Raise :class:`BackendUnavailableError` unless CuPy is installed and runs a kernel on a GPU."""
    from .kernels.cuda.core import probe

    cupy()  # the install hint when CuPy is missing
    if not probe():
        raise BackendUnavailableError(
            f"{name}: CuPy is installed but no CUDA device ran a test kernel "
            "(no GPU visible, CUDA_VISIBLE_DEVICES empty, or a driver older than CuPy's CUDA)"
        )


def _cupy(name: str) -> ModuleType:
    try:
        return cupy()
    except BackendUnavailableError:
        raise BackendUnavailableError(
            f"{name!r}: a CUDA array was given but CuPy is not installed "
            "(pip install 'arraytrain[cuda12]' or 'arraytrain[cuda13]')"
        ) from None


def _probe(x: object, attr: str, name: str) -> bool:
    """``hasattr`` that turns an exporter's own failure (anything but AttributeError) into BackendError."""
    try:
        getattr(x, attr)
    except AttributeError:
        return False
    except Exception as exc:
        raise BackendError(f"{name!r}: reading {type(x).__name__}.{attr} failed: {exc!r}") from None
    return True


def as_array(x: object, name: str = "array", backend: str | None = None):
    """Return ``x`` as a NumPy or CuPy array without copying where possible.

    Raises :class:`BackendError` for objects that are not arrays and
    :class:`DTypeError` for non-floating dtypes; ``name`` is used in messages.
    ``backend`` (``"numpy"`` or ``"cupy"``): the side the array must be on; an
    object on the other side is refused with :class:`BackendError` before it is
    read (a DLPack exporter is never asked to export).
    A NumPy subclass is read as a plain ``ndarray`` view of the same memory
    (``np.matrix``, whose ``reshape(-1)`` stays 2-D, ``np.memmap``, ...), except a
    masked array, which is refused: the kernels cannot honour its mask.
    """
    if is_device_array(x):
        _expect(CUPY, backend, name)
        arr = x
    elif isinstance(x, np.ndarray):
        _expect(NUMPY, backend, name)
        if isinstance(x, np.ma.MaskedArray):
            raise BackendError(f"{name!r}: a masked array; its mask cannot be applied by the kernels "
                               "(pass x.filled(0) or x.data)")
        arr = x if type(x) is np.ndarray else x.view(np.ndarray)
    elif _probe(x, "__dlpack_device__", name) and _probe(x, "__dlpack__", name):
        try:
            device = int(x.__dlpack_device__()[0])
        except Exception as exc:  # a broken exporter
            raise BackendError(f"{name!r}: __dlpack_device__ failed: {exc}") from None
        if device in _dlpack.HOST_DEVICES:
            _expect(NUMPY, backend, name)
            reader = np.from_dlpack
        elif device in _dlpack.GPU_DEVICES:
            _expect(CUPY, backend, name)
            reader = _cupy(name).from_dlpack
        else:
            raise BackendError(f"{name!r}: unsupported DLPack device type {device}")
        try:
            arr = reader(x)
        except Exception as exc:
            arr = _bfloat16_without_dlpack(x, name, reader is np.from_dlpack)
            if arr is None:
                # e.g. torch refuses to export a tensor that requires grad; a broken exporter may
                # raise anything (AttributeError included): all of it means "cannot read this"
                raise BackendError(f"{name!r}: could not read {type(x).__name__} via DLPack: {exc}") from None
    elif _probe(x, "__cuda_array_interface__", name):
        _expect(CUPY, backend, name)
        arr = _cupy(name).asarray(x)
    else:
        _expect(NUMPY, backend, name)
        try:
            arr = np.asarray(x)
        except Exception as exc:
            raise BackendError(f"{name!r}: not an array: {type(x).__name__} ({exc})") from None
        if arr.dtype == object:
            raise BackendError(f"{name!r}: not an array of numbers: {type(x).__name__}")
    check_float_dtype(arr.dtype, name)
    return arr


def bfloat16():
    """ml_dtypes' bfloat16 dtype, imported on first use (ml_dtypes 0.7.0's import alone takes 1.2 s on a
    Zen 3, longer than the rest of a first step)."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def dtype_named(dtype) -> np.dtype:
    """``np.dtype(dtype)``, with the name ``"bfloat16"`` resolved through ml_dtypes (NumPy knows that
    name only once something has imported ml_dtypes)."""
    return bfloat16() if isinstance(dtype, str) and dtype == "bfloat16" else np.dtype(dtype)


def is_bfloat16(dtype) -> bool:
    """Whether ``dtype`` is ml_dtypes' bfloat16, without importing ml_dtypes: no array of that dtype can
    exist before something imported it."""
    m = sys.modules.get("ml_dtypes")
    return m is not None and dtype == m.bfloat16


def _bfloat16_without_dlpack(x, name: str, host: bool):
    """A bfloat16 array that DLPack could not carry, read another way, or None if ``x`` is not bfloat16.

    NumPy's DLPack reader has no bfloat16 (NumPy has no such dtype; ml_dtypes adds it), so a
    JAX or torch bfloat16 array fails there with "Unsupported dtype". A host exporter with
    ``__array__`` that yields ml_dtypes' bfloat16 (JAX does, without a copy) is read that way,
    so it gets the same treatment as a NumPy bfloat16 array; anything else is a DTypeError that
    says so instead of DLPack's message.
    """
    dtype = getattr(x, "dtype", None)
    if "bfloat16" not in str(dtype).lower():
        return None
    if host and hasattr(x, "__array__"):
        try:
            arr = np.asarray(x)
        except Exception:
            arr = None
        if arr is not None and is_bfloat16(arr.dtype):
            return arr
    raise DTypeError(f"{name!r}: a bfloat16 {type(x).__name__} cannot be read through DLPack "
                     f"({'NumPy' if host else 'this CuPy'} has no bfloat16 DLPack type); cast it to float32 first, "
                     "or pass a NumPy array of ml_dtypes.bfloat16")


def is_float_dtype(dtype) -> bool:
    """float16/32/64, or ml_dtypes' bfloat16 (NumPy has none of its own)."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or is_bfloat16(dtype)


def check_float_dtype(dtype, name: str) -> None:
    dtype = np.dtype(dtype)
    if not is_float_dtype(dtype):
        raise DTypeError(f"{name!r}: expected a floating dtype (float16/32/64 or ml_dtypes.bfloat16), got {dtype}")


def same_backend(arr, expected: str, name: str) -> None:
    _expect(backend_of(arr), expected, name)


def _expect(got: str, expected: str | None, name: str) -> None:
    if expected is not None and got != expected:
        raise BackendError(
            f"{name!r}: a {got} array was given to a {expected} buffer; "
            "arraytrain never moves data between host and device implicitly"
        )


def check_kernel_dtype(dtype, name: str = "buffer") -> None:
    """Raise :class:`DTypeError` unless the kernels run on buffers of ``dtype`` (float32 or float64)."""
    dtype = np.dtype(dtype)
    if dtype not in KERNEL_DTYPES:
        raise DTypeError(
            f"{name} dtype {dtype}: the kernels run on float32 or float64 buffers "
            "(float16 gradients are accepted and cast on intake)"
        )


def module_of_backend(backend: str) -> ModuleType:
    """``numpy`` or ``cupy`` by backend name (CuPy imported only then)."""
    return np if backend == NUMPY else _cupy("array")
