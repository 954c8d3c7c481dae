"""arraytrain: a framework-agnostic training engine on flat NumPy buffers.

Parameters, gradients and optimizer state live in flat 1-D buffers; each
parameter is a named view. Gradients arrive as arrays from any framework and
one fused numba kernel per stage does the rest of the training step.
"""

from . import compress, nn, optim, phase, prune, quantize, schedules, threads
from .accumulate import AccumulationConfig, AccumulationStats, GradientAccumulator
from .amp import LossScaler
from .buffer import FlatBuffer
from .checkpoint import load, save
from .engine import Engine, StepReport
from .errors import (
    AccumulationError,
    AccumulatorFullError,
    AliasingError,
    ArgumentTypeError,
    ArrayTrainError,
    BackendError,
    BackendUnavailableError,
    CheckpointError,
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
from .layout import Layout
from .predict import GradientPredictor
from .prune import magnitude_mask, sparsity
from .quantize import QuantizedTensor, dequantize_params, quantize_params

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
