"""CUDA kernels (CuPy): the same names and signatures as ``cpu`` and ``reference``.

Importing this package neither imports CuPy nor compiles anything (the sources can be
compile-checked with nvcc on a machine without CuPy or a GPU): CuPy is imported at the
first launch, with a clear :class:`BackendUnavailableError` naming the extra to install
when it is missing, and every kernel is compiled by NVRTC on first use and memoised
(see :mod:`._core`).
"""

from ...backend import LP_BF16, LP_F16, LP_NONE  # noqa: F401  (kinds of working copies)
from .optimizers import (  # noqa: F401
    adafactor_step,
    adagrad_step,
    adam_step,
    lamb_step,
    lion_step,
    rmsprop_step,
    sam_perturb,
    sgd_step,
    sophia_step,
)
from ._core import DeviceScale  # noqa: F401
from .reductions import (  # noqa: F401
    accumulate,
    all_finite,
    cast_working,
    max_abs,
    read_sums,
    scale,
    sumsq_gate,
    sumsq,
    sumsq_product,
    sumsq_scaled,
)
