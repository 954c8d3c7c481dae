"""The CUDA kernel family seen through NumPy arrays, so the CPU family's tests run it unchanged.

The ``family`` and ``numba_family`` fixtures of conftest.py hand :data:`ON_DEVICE` to every
kernel-vs-reference test (and to the compressors' and the predictor's tests) as their CUDA param.

``ON_DEVICE.<kernel>(...)`` copies every NumPy array argument (buffers, slots, working
copies, masks) to the GPU, runs the CUDA kernel, and copies each one back into the
array it came from; host-side tables and per-parameter hyperparameters (``pieces``,
``lr``, ...) stay NumPy, as the optimizers pass them. Arguments that are the same
NumPy array share one device copy, so aliasing behaves as on the CPU. An 8-bit or float8 slot
(:class:`arraytrain.kernels.interface.Q8`/``F8`` of NumPy arrays) goes over as one of device copies,
and its codes and side array come back.

With ``ARRAYTRAIN_CUDA=cpu`` "the GPU" is :mod:`arraytrain.kernels.cuda.on_cpu`: the same CUDA
sources executed on the CPU, with the same copies to and from its device arrays.

:func:`cuda_usable` probes by running a tiny kernel (CuPy imports fine without a GPU).
"""

from __future__ import annotations

import functools
import importlib
import inspect

import numpy as np
import pytest

from arraytrain.kernels import reference as ref

# per-parameter values and the layout's tables: host arrays in the CUDA family's signatures too
HOST_ARGS = {"pieces", "segs", "rows", "cols", "batches", "lr", "weight_decay", "step_size", "l2", "decay",
             "rel_step", "grad_step", "moment_step"}
HOST_ARGS |= {"mats", "adjusted_lr", "weight_lr"}  # Muon's matrix table, Muon's and schedule-free's per-parameter lrs


@functools.lru_cache(maxsize=1)
def cuda_usable() -> bool:
    try:
        from arraytrain.kernels.cuda.core import probe
    except Exception:
        return False
    return probe()


def device_cupy():
    """CuPy, or the CPU executor standing for it under ``ARRAYTRAIN_CUDA=cpu``."""
    from arraytrain.kernels.cuda.core import cupy

    return cupy()


def on_device(a) -> bool:
    """``a`` is a device array (CuPy's, or the CPU executor's)."""
    from arraytrain.backend import is_device_array

    return is_device_array(a)


def require_cuda() -> None:
    if not cuda_usable():
        pytest.skip("no usable CUDA device (CuPy missing, or no GPU ran the probe kernel)")


def require_gpu() -> None:
    """A real GPU: for tests of torch's or JAX's CUDA arrays, which the CPU executor does not stand for."""
    require_cuda()
    if device_cupy().__name__ == "arraytrain.kernels.cuda.on_cpu":
        pytest.skip("needs a GPU: torch's or JAX's CUDA arrays (ARRAYTRAIN_CUDA=cpu stands for CuPy only)")


class OnDevice:
    """The CUDA family behind NumPy arguments (see the module docstring).

    ``cuda_module``: the CUDA kernel module; ``reference``: the module of the reference
    twins whose signatures say which argument is which (the optimizer family by default;
    e.g. ``OnDevice("arraytrain.kernels.cuda.compression", compress_reference)``).
    """

    def __init__(self, cuda_module: str = "arraytrain.kernels.cuda", reference=ref):
        self._cuda_module = cuda_module
        self._reference = reference

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        cuda = importlib.import_module(self._cuda_module)
        fn = getattr(cuda, name)
        if not callable(fn):
            return fn
        sig = inspect.signature(getattr(self._reference, name))

        def call(*args, **kwargs):
            from arraytrain.kernels.cuda.core import cupy
            from arraytrain.kernels.interface import QUANTIZED

            cp = cupy()

            bound = sig.bind(*args, **kwargs)
            copies, q8s = {}, {}
            for key, value in bound.arguments.items():
                if isinstance(value, np.ndarray) and key not in HOST_ARGS:
                    if id(value) not in copies:
                        copies[id(value)] = (value, cp.asarray(value))
                    bound.arguments[key] = copies[id(value)][1]
                elif isinstance(value, QUANTIZED):  # one device copy per slot (Adam's unused vmax is m's own)
                    if id(value) not in q8s:
                        q8s[id(value)] = (value, type(value)(*(cp.asarray(f) if isinstance(f, np.ndarray) else f
                                                               for f in value)))
                    bound.arguments[key] = q8s[id(value)][1]
            out = fn(*bound.args, **bound.kwargs)
            for host, dev in copies.values():
                if host.flags.writeable:
                    host[...] = dev.get()
            for host, dev in q8s.values():
                host.codes[...] = dev.codes.get()
                host.aux[...] = dev.aux.get()
            if isinstance(out, cp.ndarray):
                return out.get()
            if isinstance(out, tuple):
                return tuple(o.get() if isinstance(o, cp.ndarray) else o for o in out)
            return out

        call.__name__ = name
        call.__signature__ = sig
        return call


ON_DEVICE = OnDevice()
