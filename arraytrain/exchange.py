"""The exchange seam: what the engine's step needs from a group of processes.

The engine talks to its peers through four collective operations and nothing
else. :class:`LocalExchange` is the group of one process (every operation is
the identity); :mod:`arraytrain.distributed` implements the same interface over
MPI (and NCCL for CuPy buffers). A collective is entered by every process of
the group, in the same order, with arrays of the same shape and dtype.

- ``allreduce(x, op)``: in place, ``x`` becomes the element-wise ``op``
  ("sum" or "max") of every process's ``x`` (NumPy or CuPy, contiguous).
  Every process receives the same bits.
- ``allgather(x)``: a list of every process's ``x`` (same shape and dtype on
  every process), in rank order, on ``x``'s backend.
- ``broadcast(x, root)``: in place, ``x`` becomes process ``root``'s ``x``.
- ``gather_objects(obj)``: a list of every process's small picklable ``obj``,
  in rank order (set-up checks only, never in the step's hot path).

:meth:`Exchange.agree` builds the set-up check on the last one: every process
raises the same typed error when one of them differs, so a mismatch never
leaves a process waiting in a collective the others skipped.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from .backend import backend_of
from .errors import ArgumentTypeError, HyperparameterError, LayoutError

#: The element-wise operations of ``allreduce``.
OPS = ("sum", "max")


class Exchange(ABC):
    """A group of ``size`` processes; this one is ``rank``. See the module docstring."""

    rank: int = 0
    size: int = 1

    @abstractmethod
    def allreduce(self, x, op: str = "sum") -> None:
        """Element-wise ``op`` of every process's ``x``, in place."""

    @abstractmethod
    def allgather(self, x) -> list:
        """Every process's ``x`` (same shape and dtype everywhere), in rank order."""

    @abstractmethod
    def broadcast(self, x, root: int = 0) -> None:
        """Process ``root``'s ``x`` into every process's ``x``, in place."""

    @abstractmethod
    def gather_objects(self, obj) -> list:
        """Every process's picklable ``obj``, in rank order (set-up only)."""

    def agree(self, what: str, value, error=LayoutError) -> None:
        """Raise ``error`` on every process unless every process passed an equal ``value``."""
        values = self.gather_objects(value)
        odd = [r for r, v in enumerate(values) if v != values[0]]
        if odd:
            raise error(f"{what} differs across processes: rank 0 has {values[0]!r}, "
                        f"rank {odd[0]} has {values[odd[0]]!r} ({len(odd)} of {self.size} ranks differ)")

    @property
    def is_local(self) -> bool:
        """True for a group of one process: every collective is the identity."""
        return self.size == 1


class LocalExchange(Exchange):
    """The group of one process: every collective returns its input."""

    def allreduce(self, x, op: str = "sum") -> None:
        if op not in OPS:
            raise ArgumentTypeError(f"op: expected one of {OPS}, got {op!r}")

    def allgather(self, x) -> list:
        return [x]

    def broadcast(self, x, root: int = 0) -> None:
        if root != 0:
            raise ArgumentTypeError(f"root: a group of one process has rank 0 only, got {root!r}")

    def gather_objects(self, obj) -> list:
        return [obj]

    def __repr__(self) -> str:
        return "LocalExchange()"


class PerRank(dict):
    """A template part of a state dict that a checkpoint holds as itself (one process) or per rank.

    Per rank: ``{"ranks": [rank 0's, rank 1's, ...]}``, each entry shaped like this one
    (see :meth:`arraytrain.Engine.state_dict` and :func:`arraytrain.load`).
    """


def check_exchange(comm, name: str = "comm") -> Exchange:
    """An :class:`Exchange` (None: the local one); a clear error otherwise."""
    if comm is None:
        return LocalExchange()
    if not isinstance(comm, Exchange):
        raise ArgumentTypeError(f"{name}: expected an arraytrain Exchange (e.g. arraytrain.distributed.MPIComm()), "
                                f"got {type(comm).__name__}")
    return comm


def agree_on_setup(comm: Exchange, params, optimizer, compressor, **settings) -> None:
    """Every rank has the same layout, dtype, backend, optimizer and settings.

    Else every rank raises the same :class:`~arraytrain.errors.LayoutError` (the
    parameters) or :class:`~arraytrain.errors.HyperparameterError` (the settings),
    never a hang. ``params`` is a :class:`~arraytrain.FlatBuffer`.
    """
    comm.agree("the parameter layout", (params.layout.names, params.layout.shapes, str(params.dtype),
                                        backend_of(params.flat)))
    comm.agree("the engine's settings", repr((type(optimizer).__name__, optimizer.hyperparameters(),
                                              None if compressor is None else compressor.describe(),
                                              sorted(settings.items()))),
               error=HyperparameterError)
