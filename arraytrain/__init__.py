"""arraytrain: a framework-agnostic training engine on flat NumPy buffers.

Parameters, gradients and optimizer state live in flat 1-D buffers; each
parameter is a named view. Gradients arrive as arrays from any framework and
one fused numba kernel per stage does the rest of the training step.
"""

import importlib
import importlib.util

from .errors import (
    AccumulationError,
    AccumulatorFullError,
    AliasingError,
    ArgumentTypeError,
    ArrayTrainError,
    BackendError,
    BackendUnavailableError,
    CheckpointError,
    CommTimeoutError,
    ConcurrentUseError,
    DataError,
    DTypeError,
    HyperparameterError,
    LayoutError,
    MissingDependencyError,
    MissingGradientError,
    NoGradientsError,
    NonFiniteError,
    PhaseOrderError,
    ReadOnlyError,
    ShapeMismatchError,
    StateDictError,
    UnknownParameterError,
)

# Everything else is imported on first use (PEP 562), so that ``import arraytrain`` stays cheap:
# numba, safetensors and ml_dtypes load only when a kernel, a checkpoint or bfloat16 needs them.
# public name -> the submodule that defines it (a subpackage for itself)
_LAZY = {
    "AccumulationConfig": "accumulate",
    "AccumulationStats": "accumulate",
    "GradientAccumulator": "accumulate",
    "LossScaler": "amp",
    "FlatBuffer": "buffer",
    "load": "checkpoint",
    "save": "checkpoint",
    "Engine": "engine",
    "StepReport": "engine",
    "Layout": "layout",
    "GradientPredictor": "phase.predict",
    "magnitude_mask": "prune",
    "sparsity": "prune",
    "QuantizedTensor": "quantize",
    "dequantize_params": "quantize",
    "quantize_params": "quantize",
}
_SUBPACKAGES = ("compress", "nn", "optim", "phase", "prune", "quantize", "schedules", "threads")

__version__ = "0.1.0"

__all__ = [
    "AccumulationConfig",
    "AccumulationError",
    "AccumulationStats",
    "AccumulatorFullError",
    "AliasingError",
    "ArgumentTypeError",
    "ArrayTrainError",
    "BackendError",
    "BackendUnavailableError",
    "CheckpointError",
    "CommTimeoutError",
    "ConcurrentUseError",
    "DTypeError",
    "DataError",
    "Engine",
    "FlatBuffer",
    "GradientAccumulator",
    "GradientPredictor",
    "HyperparameterError",
    "Layout",
    "LayoutError",
    "LossScaler",
    "MissingDependencyError",
    "MissingGradientError",
    "NoGradientsError",
    "NonFiniteError",
    "PhaseOrderError",
    "QuantizedTensor",
    "ReadOnlyError",
    "ShapeMismatchError",
    "StateDictError",
    "StepReport",
    "UnknownParameterError",
    "compress",
    "dequantize_params",
    "load",
    "magnitude_mask",
    "nn",
    "optim",
    "phase",
    "prune",
    "quantize",
    "quantize_params",
    "save",
    "schedules",
    "sparsity",
    "threads",
]


def __getattr__(name: str):
    """Import a public name's module on first access (and any submodule, as the eager imports did)."""
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    elif name in _SUBPACKAGES or (not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}")):
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
