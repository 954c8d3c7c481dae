"""The CUDA kernel family (CuPy raw kernels): the interface of :mod:`arraytrain.kernels.interface`.

Importing this package neither imports CuPy nor compiles anything (the sources can be
compile-checked with nvcc on a machine without CuPy or a GPU): CuPy is imported at the
first launch, with a clear :class:`BackendUnavailableError` naming the extra to install
when it is missing, and every kernel is compiled by NVRTC on first use and memoised
(see :mod:`.core`).
"""

from ..interface import DEVICE_KERNELS, KERNELS, export
from .core import DeviceScale  # noqa: F401

#: Every kernel of :data:`~arraytrain.kernels.interface.KERNELS` and the device-side gate's.
__all__ = export(globals(), __name__, {**KERNELS, **DEVICE_KERNELS})
