"""The error hierarchy.

Every error is an :class:`ArrayTrainError` and also the builtin a caller would
naturally catch (``ValueError``, ``KeyError``, ``TypeError``, ``ImportError``).
Messages name the parameter and say what was expected and what was got.
"""

from __future__ import annotations


class ArrayTrainError(Exception):
    """Root of every error arraytrain raises on purpose."""


class _PlainKeyError(KeyError):
    # KeyError.__str__ repr-quotes its message; ours are sentences.
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class HyperparameterError(ArrayTrainError, ValueError):
    """A hyperparameter is out of its valid range (raised at construction)."""


class ArgumentTypeError(ArrayTrainError, TypeError):
    """An argument is not of the kind expected (a mapping, a Layout, an Optimizer, ...)."""


class DTypeError(ArrayTrainError, TypeError):
    """An array has a dtype that cannot be used (integer, bool, complex, ...)."""


class BackendError(ArrayTrainError, TypeError):
    """An object is not an array arraytrain can read, or backends are mixed."""


class BackendUnavailableError(ArrayTrainError, ImportError):
    """The array library or kernels needed for an array are not installed/built."""


class ReadOnlyError(ArrayTrainError, ValueError):
    """An array arraytrain must write into is read-only."""


class AliasingError(ArrayTrainError, ValueError):
    """An input array shares memory with a buffer it must not overlap."""


class LayoutError(ArrayTrainError, ValueError):
    """Names, shapes or buffer sizes do not fit a layout."""


class StateDictError(ArrayTrainError, ValueError):
    """A state dict does not match the object it is loaded into."""


class CheckpointError(StateDictError):
    """A checkpoint file is unreadable, not an arraytrain checkpoint, or does not match the engine."""


class AccumulationError(ArrayTrainError):
    """Base class of the errors raised while accumulating gradients."""


class ShapeMismatchError(AccumulationError, ValueError):
    """A gradient's shape differs from its parameter's registered shape."""

    def __init__(self, name: str, expected: tuple, got: tuple, what: str = "grad"):
        self.name, self.expected, self.got = name, tuple(expected), tuple(got)
        super().__init__(f"{name!r}: {what} shape {self.got} != param shape {self.expected}")


class UnknownParameterError(AccumulationError, _PlainKeyError):
    """A gradient was given for a name that is not registered."""


class MissingGradientError(AccumulationError, _PlainKeyError):
    """A micro-batch lacks gradients for registered names (policy ``missing='error'``)."""


class NoGradientsError(AccumulationError, ValueError):
    """Gradients were requested but nothing is registered or accumulated."""


class AccumulatorFullError(AccumulationError, RuntimeError):
    """More micro-batches were accumulated than configured before a reset."""


class ConcurrentUseError(ArrayTrainError, RuntimeError):
    """An engine was called while another call on it was still running (another thread).

    The engine refuses the second call before it changes anything; the first
    one completes normally. Serialise calls on one engine with a lock of your own.
    """


class PhaseOrderError(ArrayTrainError, RuntimeError):
    """A :class:`PhaseController` call out of order (e.g. a prediction asked for on a FULL step).

    Raised before anything changes: the call can be made again in its place.
    """


class NonFiniteError(ArrayTrainError, FloatingPointError):
    """Too many consecutive steps were skipped for NaN/Inf gradients."""


class CommTimeoutError(ArrayTrainError, TimeoutError):
    """A collective waited for the other processes past its deadline: a peer died or the network is down.

    The waiting call cannot be interrupted, so the error is not raised: a watching thread writes it
    as one line to stderr and ends the process (see :mod:`arraytrain.parallel.deadline`).
    """


class DataError(ArrayTrainError, ValueError):
    """A data set or data file is unusable (missing arrays, wrong shapes, non-finite values...)."""


class MissingDependencyError(ArrayTrainError, ImportError):
    """An optional dependency (an extra such as ``arraytrain[train]``) is not installed."""
