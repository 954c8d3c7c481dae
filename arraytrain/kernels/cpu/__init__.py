"""The CPU kernel family (numba): the interface of :mod:`arraytrain.kernels.interface`, by domain.

Importing it compiles nothing: kernels compile on first call and are cached on disk.
"""

from ..interface import HOST_KERNELS, KERNELS, export
from ._jit import BLOCK, JIT, SERIAL_BELOW  # noqa: F401

#: Every kernel of :data:`~arraytrain.kernels.interface.KERNELS` (and the CPU's own, ``HOST_KERNELS``), from its
#: domain's module.
__all__ = export(globals(), __name__, {**KERNELS, **HOST_KERNELS})
