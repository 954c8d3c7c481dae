"""The communicator: everything arraytrain needs from a group of processes.

A :class:`Communicator` is a group of ``size`` processes, this one being ``rank``,
and ten collective operations on it: four basic ones, one for checkpoint writers,
three block collectives for sharded state and two nonblocking ones for the bucketed
exchange. :class:`LocalComm` is the group of one process (every operation is the
identity); :mod:`arraytrain.parallel.mpi` implements the interface over MPI (and NCCL
for CuPy buffers), :mod:`arraytrain.parallel.torch_dist` over torch.distributed. A
collective is entered by every process of the group, in the same order, with arrays
of the same shape and dtype.

- ``allreduce(x, op)``: in place, ``x`` becomes the element-wise ``op``
  ("sum" or "max") of every process's ``x`` (NumPy or CuPy, contiguous).
  Every process receives the same bits.
- ``allgather(x)``: a list of every process's ``x`` (same shape and dtype on
  every process), in rank order, on ``x``'s backend.
- ``broadcast(x, root)``: in place, ``x`` becomes process ``root``'s ``x``.
- ``gather_objects(obj)``: a list of every process's small picklable ``obj``,
  in rank order (set-up checks only, never in the step's hot path).
- ``gather(x, root)``: every process's ``x`` (same shape and dtype) to process ``root``,
  in rank order; None on the others (a checkpoint writer's collective; the default here
  all-gathers).

Three block collectives serve sharded optimizer state (``Engine(shard_state=True)``);
``x`` is 1-D, contiguous, of ``size * n`` elements, block ``r`` being
``x[r*n:(r+1)*n]``:

- ``reduce_scatter(x)``: returns a view of ``n`` elements of ``x`` holding the sum
  over processes of every process's block ``rank`` (one reduce-scatter: each
  process receives only its own block). Where in ``x`` it lies is the transport's
  choice (MPI's in-place form: the first block; NCCL's: block ``rank``); the rest
  of ``x`` is left undefined.
- ``allgather_blocks(x)``: in place, block ``r`` of ``x`` becomes process ``r``'s
  block ``r``, for every ``r`` (one all-gather).
- ``iallgather_blocks(x, lo, hi)``: starts the same for elements ``[lo, hi)`` of every
  block only (``x[r*n+lo:r*n+hi]`` becomes process ``r``'s) and returns a :class:`Pending`
  (below): the sharded engine's weights gathered piece by piece while the next forward
  pass runs.

Their defaults here are built on ``allreduce`` and ``allgather`` (correct, but
moving more bytes); the transports implement them directly.

Two nonblocking collectives serve the bucketed exchange that overlaps the backward pass
(:mod:`arraytrain.parallel.buckets`); each returns a :class:`Pending` whose ``wait()`` completes
it and whose ``test()`` says, without blocking, whether it has (and moves it on):

- ``iallreduce(x, op)``: starts ``allreduce(x, op)``.
- ``ireduce(x, root)``: starts an in-place sum of every process's ``x`` into process
  ``root``'s ``x``; elsewhere ``x`` is left undefined.

Until it completes, the array must not be touched. The defaults here run the blocking
operation at once and return a completed handle.

A transport over a network holds every wait to a deadline (its :attr:`Communicator.deadline`, see
:mod:`arraytrain.parallel.deadline`): a process whose peer died or whose link is down ends with
one line instead of waiting forever. An engine calls :meth:`Communicator.steady` once the job is
past its start; :meth:`Communicator.patient` marks the waits where one rank works alone.

:meth:`Communicator.agree` builds the set-up check on ``gather_objects``: every process
raises the same typed error when one of them differs, so a mismatch never
leaves a process waiting in a collective the others skipped.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

import numpy as np

from .._checks import check_bool, check_int
from ..backend import backend_of
from ..errors import ArgumentTypeError, HyperparameterError, LayoutError, ReadOnlyError

#: The element-wise operations of ``allreduce``.
OPS = ("sum", "max")


class Pending(ABC):
    """A started nonblocking collective: :meth:`wait` completes it, :meth:`test` polls it."""

    __slots__ = ()

    @abstractmethod
    def wait(self) -> None:
        """Complete the operation (its result is then in the array)."""

    @abstractmethod
    def test(self) -> bool:
        """True once the operation has completed (a transport also moves it on here)."""


class Done(Pending):
    """A handle of an operation that completed when it was started."""

    __slots__ = ()

    def wait(self) -> None:
        """Nothing left to do."""

    def test(self) -> bool:
        """Always True."""
        return True


#: The completed handle.
DONE = Done()


class Communicator(ABC):
    """A group of ``size`` processes; this one is ``rank``. See the module docstring."""

    rank: int = 0
    size: int = 1
    #: The deadline of this communicator's waits (:mod:`arraytrain.parallel.deadline`); None: not watched.
    deadline = None

    def patient(self):
        """A context whose collectives keep the long limit of the deadline: one rank works alone (writes or
        reads a file) while the others wait for it."""
        return contextlib.nullcontext() if self.deadline is None else self.deadline.patience()

    def steady(self) -> None:
        """The job is past its start (an engine calls it once two boundaries have completed, so every
        peer has compiled its step): a step's collective is held to the short limit from now on."""
        if self.deadline is not None:
            self.deadline.steady()

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

    def reduce_scatter(self, x):
        """Block ``rank`` of ``x`` summed over processes, as a view of ``x`` (see the module docstring).

        This default all-reduces the whole of ``x``; transports override it with a reduce-scatter.
        """
        n = block_length(x, self.size)
        self.allreduce(x, "sum")
        return x[self.rank * n : (self.rank + 1) * n]

    def allgather_blocks(self, x) -> None:
        """In place, block ``r`` of ``x`` becomes process ``r``'s block ``r`` (see the module docstring).

        This default gathers the own block into a new buffer and copies; transports override it.
        """
        n = block_length(x, self.size)
        for r, block in enumerate(self.allgather(x[self.rank * n : (self.rank + 1) * n])):
            if r != self.rank:
                x[r * n : (r + 1) * n] = block

    def iallgather_blocks(self, x, lo: int, hi: int) -> Pending:
        """Start: in place, elements ``[lo, hi)`` of block ``r`` of ``x`` become process ``r``'s, for every
        ``r`` (see the module docstring). This default gathers them at once and returns a completed handle."""
        n = block_length(x, self.size)
        lo, hi = block_span(lo, hi, n)
        if hi > lo:
            for r, piece in enumerate(self.allgather(x[self.rank * n + lo : self.rank * n + hi])):
                if r != self.rank:
                    x[r * n + lo : r * n + hi] = piece
        return DONE

    def gather(self, x, root: int = 0):
        """Every process's ``x`` to process ``root``, in rank order (None elsewhere). This default
        all-gathers; transports override it so that only ``root`` receives."""
        got = self.allgather(x)
        return got if self.rank == root else None

    def iallreduce(self, x, op: str = "sum") -> Pending:
        """Start ``allreduce(x, op)`` (see the module docstring). This default runs it at once."""
        self.allreduce(x, op)
        return DONE

    def ireduce(self, x, root: int = 0) -> Pending:
        """Start the sum of every process's ``x`` into process ``root``'s ``x``, in place (elsewhere
        ``x`` is left undefined). This default all-reduces ``x`` at once."""
        self.allreduce(x, "sum")
        return DONE

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


def block_length(x, size: int) -> int:
    """The block length of ``x`` cut into ``size`` equal blocks; a clear error when it cannot be."""
    if getattr(x, "ndim", None) != 1 or x.shape[0] % size:
        raise ArgumentTypeError(f"x: expected a 1-D array whose length is a multiple of the group's size {size}, "
                                f"got shape {getattr(x, 'shape', type(x).__name__)}")
    return x.shape[0] // size


def block_span(lo, hi, n: int) -> tuple[int, int]:
    """``(lo, hi)`` checked as a range of a block of ``n`` elements: ``0 <= lo <= hi <= n``."""
    lo = check_int("lo", lo, 0, n, error=ArgumentTypeError)
    return lo, check_int("hi", hi, lo, n, error=ArgumentTypeError)


def check_buffer(x, name: str, writeable: bool) -> None:
    """A collective's array: C-contiguous (one buffer moves) and, where the collective writes
    into it, writeable; an :class:`ArgumentTypeError` or :class:`ReadOnlyError` naming it otherwise."""
    flags = x.flags
    if not flags.c_contiguous:
        raise ArgumentTypeError(f"{name}: expected a C-contiguous array (collectives move one buffer), "
                                f"got strides {x.strides} for shape {x.shape}")
    if writeable and not getattr(flags, "writeable", True):  # CuPy's flags have no writeable: always
        raise ReadOnlyError(f"{name}: the collective writes its result into it, but the array is read-only")


class LocalComm(Communicator):
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

    def reduce_scatter(self, x):
        block_length(x, 1)
        return x

    def allgather_blocks(self, x) -> None:
        block_length(x, 1)

    def iallgather_blocks(self, x, lo: int, hi: int) -> Pending:
        block_span(lo, hi, block_length(x, 1))
        return DONE

    def __repr__(self) -> str:
        return "LocalComm()"


class PerRank(dict):
    """A template part of a state dict that a checkpoint holds as itself (one process) or per rank.

    Per rank: ``{"ranks": [rank 0's, rank 1's, ...]}``, each entry shaped like this one
    (see :meth:`arraytrain.Engine.state_dict` and :func:`arraytrain.load`).
    """


def check_comm(comm, name: str = "comm") -> Communicator:
    """An :class:`Communicator` (None: the local one); a clear error otherwise."""
    if comm is None:
        return LocalComm()
    if not isinstance(comm, Communicator):
        raise ArgumentTypeError(f"{name}: expected an arraytrain communicator (e.g. arraytrain.distributed.MPIComm()), "
                                f"got {type(comm).__name__}")
    return comm


def check_parallel(comm, shard_state, overlap, bucket_bytes) -> tuple:
    """An engine's data-parallel arguments, checked: ``(communicator, shard_state, overlap, bucket_bytes)``."""
    comm = check_comm(comm)
    shard_state = check_bool("shard_state", shard_state)
    overlap = check_bool("overlap", overlap)
    if bucket_bytes is not None:
        bucket_bytes = check_int("bucket_bytes", bucket_bytes, 1)
    if shard_state and comm.is_local:
        raise HyperparameterError("shard_state: sharded state needs a group of processes (comm=MPIComm(), "
                                  "NCCLComm(), ...); with one process there is nothing to shard")
    return comm, shard_state, overlap, bucket_bytes


def agree_on_setup(comm: Communicator, params, optimizer, compressor, **settings) -> None:
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


def window_sums(comm: Communicator, wsum: float, bad: bool) -> tuple[float, bool]:
    """The window's weight sum over ranks, and whether any rank's gradient is not finite (one small
    all-reduce; with one process, the arguments)."""
    if comm.is_local:
        return wsum, bad
    both = np.array([wsum, float(bad)])
    comm.allreduce(both, "sum")
    return float(both[0]), bool(both[1])
