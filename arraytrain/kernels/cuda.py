"""CUDA kernels (CuPy): the same names and signatures as ``cpu`` and ``reference``.

The CuPy kernels are not written yet. Arrays on a CUDA device are recognised by
the backend layer (so they are never copied to the host by accident) and then
refused here with a clear error.
"""

from ..errors import BackendUnavailableError

raise BackendUnavailableError(
    "arraytrain's CUDA (CuPy) kernels are not available in this version; "
    "pass NumPy arrays to run on the CPU"
)
