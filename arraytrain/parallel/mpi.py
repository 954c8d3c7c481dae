"""The communicator over MPI (NumPy buffers) and over NCCL (CuPy buffers, one process per GPU).

:class:`MPIComm` implements :class:`~arraytrain.parallel.communicator.Communicator` with
mpi4py's buffer collectives; :class:`NCCLComm` with NCCL through ``cupy.cuda.nccl`` (and
MPI for the NumPy arrays it is given, and to start). mpi4py and CuPy are imported on
construction; :mod:`arraytrain.distributed` (the public face) describes the collectives,
CuPy arrays under MPI and failure.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np

from .._checks import check_int
from ..backend import CUPY, NUMPY, backend_of
from ..errors import ArgumentTypeError, BackendError, BackendUnavailableError, DTypeError
from .communicator import DONE, OPS, Communicator, Pending, block_length, block_span, check_buffer
from .deadline import Deadline, check_timeout
from .progress import Progress, shared
from .progress import available as progress_available

__all__ = ["INSTALL_HINT", "MPIComm", "MPIRequest", "NCCLComm", "mpi"]

#: What to install for processes over MPI; the errors for a missing mpi4py or mpiexec quote it.
INSTALL_HINT = 'pip install "arraytrain[mpi]" (mpi4py and the MPICH library from PyPI)'

# numpy dtype -> the name of its MPI datatype (fixed-width named types, which reductions accept)
_MPI_TYPES = {
    np.dtype(np.float32): "FLOAT", np.dtype(np.float64): "DOUBLE",
    np.dtype(np.int8): "INT8_T", np.dtype(np.int16): "INT16_T",
    np.dtype(np.int32): "INT32_T", np.dtype(np.int64): "INT64_T",
    np.dtype(np.uint8): "UINT8_T", np.dtype(np.uint16): "UINT16_T",
    np.dtype(np.uint32): "UINT32_T", np.dtype(np.uint64): "UINT64_T",
}
_NCCL_INT_COUNT = 2**31 - 1  # the most elements one call of CuPy's NcclCommunicator.bcast takes
# numpy dtype -> the name of its NCCL datatype constant in cupy.cuda.nccl
_NCCL_TYPES = {
    np.dtype(np.float16): "NCCL_FLOAT16", np.dtype(np.float32): "NCCL_FLOAT32",
    np.dtype(np.float64): "NCCL_FLOAT64",
    np.dtype(np.int8): "NCCL_INT8", np.dtype(np.int32): "NCCL_INT32", np.dtype(np.int64): "NCCL_INT64",
    np.dtype(np.uint8): "NCCL_UINT8", np.dtype(np.uint32): "NCCL_UINT32", np.dtype(np.uint64): "NCCL_UINT64",
}


#: MPICH's settings arraytrain chooses when it is the first to initialise MPI (a value already in the
#: environment is kept). ``MPIR_CVAR_IREDUCE_INTRA_ALGORITHM=sched_binomial``: the sharded, overlapped
#: exchange reduces each bucket's pieces to their owners with ``MPI_Ireduce``, and MPICH's default for
#: large pieces (reduce-scatter, then gather to the root) sends 1.5 pieces per piece; the binomial tree
#: sends each non-owner's piece once (measured on 2 nodes: 1.25x -> 1.01x a ring all-reduce's bytes,
#: docs/cluster.md). Other MPI libraries ignore the variable; a program's own ``MPI_Ireduce`` calls in that
#: process use it too.
MPICH_DEFAULTS = {"MPIR_CVAR_IREDUCE_INTRA_ALGORITHM": "sched_binomial"}


def mpi():
    """mpi4py's ``MPI`` module (importing it initialises MPI, with :data:`MPICH_DEFAULTS` where no value
    is set); a clear error when it is missing."""
    if "mpi4py.MPI" not in sys.modules:  # MPI reads its settings once, at initialisation
        for key, value in MPICH_DEFAULTS.items():
            os.environ.setdefault(key, value)
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise BackendUnavailableError(f"processes over MPI need mpi4py and an MPI library: {INSTALL_HINT} "
                                      f"({exc})") from None
    return MPI


def _checked(x, name: str, backend: str, types: dict, writeable: bool):
    """The datatype for array ``x`` after checking its backend, layout and dtype (nothing is touched)."""
    try:
        kind = NUMPY if type(x) is np.ndarray else backend_of(x)  # the common case first: a call's overhead
    except BackendError:
        raise BackendError(f"{name}: expected a {backend} array, got {type(x).__name__}") from None
    if kind != backend:  # NCCLComm sends NumPy arrays through MPI itself: only MPIComm gets here
        raise BackendError(f"{name}: a CuPy array given to MPIComm, which moves host buffers only (the MPICH "
                           "from PyPI is not CUDA-aware, and arraytrain never copies between device and host "
                           "implicitly): use arraytrain.distributed.NCCLComm for CuPy buffers")
    dt = types.get(x.dtype)
    if dt is None:
        raise DTypeError(f"{name}: expected one of {', '.join(str(t) for t in types)}, got {x.dtype}")
    check_buffer(x, name, writeable)
    return dt


def _check_op(op, ops: dict):
    found = ops.get(op) if isinstance(op, str) else None
    if found is None:
        raise ArgumentTypeError(f"op: expected one of {OPS}, got {op!r}")
    return found


class MPIComm(Communicator):
    """The communicator over MPI, on NumPy buffers (see the module docstring).

    Parameters
    ----------
    comm : mpi4py communicator, optional
        An ``mpi4py.MPI.Intracomm`` (``COMM_WORLD`` by default, or a
        communicator split from it). ``rank`` and ``size`` are its own.
    timeout : float or None, optional
        Seconds a step's collective may wait for the other ranks once the job is steady
        (10 times that before, and for set-up and checkpoint agreement); past it the rank
        writes one line and ends (:mod:`arraytrain.parallel.deadline`). By default
        ``ARRAYTRAIN_COMM_TIMEOUT``, else 60; None or 0: wait forever.
    progress_thread : bool, optional
        A thread of this process tests the nonblocking collectives in flight (the overlapped
        exchange's buckets) every 0.5 ms, so they move while the process computes
        (:mod:`arraytrain.parallel.progress`; True by default; with one process, or MPI started
        without ``MPI_THREAD_MULTIPLE``, there is none). False: they move only inside this
        process's own MPI calls.

    Attributes
    ----------
    comm : mpi4py communicator
        The communicator itself, for anything outside the four collectives.
    deadline : arraytrain.parallel.deadline.Deadline
        The deadline of this communicator's waits.
    progress : arraytrain.parallel.progress.Progress or None
        The progress thread, the process's one (None: there is none).
    """

    def __init__(self, comm=None, *, timeout="default", progress_thread: bool = True):
        timeout = check_timeout(timeout)
        if not isinstance(progress_thread, bool):
            raise ArgumentTypeError(f"progress_thread: expected a bool, got {type(progress_thread).__name__}")
        MPI = mpi()
        if comm is None:
            comm = MPI.COMM_WORLD
        elif not isinstance(comm, MPI.Intracomm):
            raise ArgumentTypeError(f"comm: expected an mpi4py intracommunicator (e.g. MPI.COMM_WORLD), "
                                    f"got {type(comm).__name__}")
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.deadline = Deadline(timeout if self.size > 1 else None, self.rank, self.size)
        self.progress = shared() if progress_thread and self.size > 1 and progress_available(MPI) else None
        self._in_place = MPI.IN_PLACE
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX}
        self._types = {dt: getattr(MPI, name) for dt, name in _MPI_TYPES.items()}
        self._strided: dict = {}  # (dtype, count, stride) -> a committed datatype (iallgather_blocks)

    def allreduce(self, x, op: str = "sum") -> None:
        """``x`` becomes the element-wise ``op`` over ranks, in place (``MPI_Allreduce`` with ``MPI_IN_PLACE``)."""
        mpi_op = _check_op(op, self._ops)
        dt = _checked(x, "x", NUMPY, self._types, True)
        with self.deadline.wait("allreduce", x.nbytes):
            self.comm.Allreduce(self._in_place, [x, dt], mpi_op)

    def allgather(self, x) -> list:
        """Every rank's ``x``, in rank order: views of one received ``(size, *x.shape)`` array."""
        dt = _checked(x, "x", NUMPY, self._types, False)
        recv = np.empty((self.size, *x.shape), x.dtype)
        with self.deadline.wait("allgather", recv.nbytes):
            self.comm.Allgather([x, dt], [recv, dt])
        return [recv[i, ...] for i in range(self.size)]

    def broadcast(self, x, root: int = 0) -> None:
        """``x`` becomes rank ``root``'s ``x``, in place (``MPI_Bcast``)."""
        root = check_int("root", root, 0, self.size - 1, error=ArgumentTypeError)
        dt = _checked(x, "x", NUMPY, self._types, True)
        with self.deadline.wait("broadcast", x.nbytes):
            self.comm.Bcast([x, dt], root=root)

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj`` (pickled), in rank order: set-up checks, never the step's hot path."""
        with self.deadline.wait("gather_objects"):
            return self.comm.allgather(obj)

    def gather(self, x, root: int = 0):
        """Every rank's ``x`` to rank ``root`` (``MPI_Gather``): views of one received ``(size, *x.shape)``
        array there, None elsewhere."""
        root = check_int("root", root, 0, self.size - 1, error=ArgumentTypeError)
        dt = _checked(x, "x", NUMPY, self._types, False)
        if self.rank != root:
            with self.deadline.wait("gather", x.nbytes):
                self.comm.Gather([x, dt], None, root=root)
            return None
        recv = np.empty((self.size, *x.shape), x.dtype)
        with self.deadline.wait("gather", recv.nbytes):
            self.comm.Gather([x, dt], [recv, dt], root=root)
        return [recv[i, ...] for i in range(self.size)]

    def reduce_scatter(self, x):
        """Block ``rank`` of ``x`` summed over ranks: ``MPI_Reduce_scatter_block`` in place, so the
        sum lands in the first block of ``x``, which is returned (the rest of ``x`` is left as it was)."""
        dt = _checked(x, "x", NUMPY, self._types, True)
        n = block_length(x, self.size)
        with self.deadline.wait("reduce_scatter", x.nbytes):
            self.comm.Reduce_scatter_block(self._in_place, [x, dt], self._ops["sum"])
        return x[:n]

    def allgather_blocks(self, x) -> None:
        """In place, block ``r`` of ``x`` becomes rank ``r``'s (``MPI_Allgather`` with ``MPI_IN_PLACE``)."""
        dt = _checked(x, "x", NUMPY, self._types, True)
        block_length(x, self.size)
        with self.deadline.wait("allgather_blocks", x.nbytes):
            self.comm.Allgather(self._in_place, [x, dt])

    def iallgather_blocks(self, x, lo: int, hi: int) -> Pending:
        """Start: in place, elements ``[lo, hi)`` of block ``r`` of ``x`` become rank ``r``'s: one
        ``MPI_Iallgather`` with ``MPI_IN_PLACE`` whose receive type is ``hi - lo`` elements spaced a
        block apart (``MPI_Type_create_resized``), so the pieces land in every block without a copy."""
        dt = _checked(x, "x", NUMPY, self._types, True)
        n = block_length(x, self.size)
        lo, hi = block_span(lo, hi, n)
        if hi == lo:
            return DONE
        key = (x.dtype.str, hi - lo, n)
        kind = self._strided.get(key)
        if kind is None:
            kind = self._strided[key] = dt.Create_contiguous(hi - lo).Create_resized(0, n * x.itemsize).Commit()
        request = self.comm.Iallgather(self._in_place, [x[lo:], 1, kind])
        return MPIRequest(request, self.deadline, "iallgather_blocks", (hi - lo) * x.itemsize * self.size,
                          self.progress)

    def iallreduce(self, x, op: str = "sum") -> Pending:
        """Start ``allreduce(x, op)``: ``MPI_Iallreduce`` in place. MPI moves it on inside MPI calls
        only: the progress thread's and the handle's ``test()`` (``MPI_Test``)."""
        mpi_op = _check_op(op, self._ops)
        dt = _checked(x, "x", NUMPY, self._types, True)
        return MPIRequest(self.comm.Iallreduce(self._in_place, [x, dt], mpi_op), self.deadline, "iallreduce", x.nbytes,
                          self.progress)

    def ireduce(self, x, root: int = 0) -> Pending:
        """Start the sum of every rank's ``x`` into rank ``root``'s ``x``: ``MPI_Ireduce``, in place at the
        root (elsewhere ``x`` is only read)."""
        root = check_int("root", root, 0, self.size - 1, error=ArgumentTypeError)
        dt = _checked(x, "x", NUMPY, self._types, True)
        if self.rank == root:
            request = self.comm.Ireduce(self._in_place, [x, dt], self._ops["sum"], root)
        else:
            request = self.comm.Ireduce([x, dt], None, self._ops["sum"], root)
        return MPIRequest(request, self.deadline, "ireduce", x.nbytes, self.progress)

    def __repr__(self) -> str:
        return f"MPIComm(rank={self.rank}, size={self.size})"


class MPIRequest(Pending):
    """A started nonblocking MPI collective (an ``mpi4py.MPI.Request``); its wait is held to ``deadline``
    (None: not watched), named ``what`` and ``nbytes`` in the deadline's line. Given a ``progress``
    thread (:class:`~arraytrain.parallel.progress.Progress`), that thread tests it while it is in flight;
    ``lock`` keeps the two threads from completing it at once, ``done`` says it has completed."""

    __slots__ = ("request", "deadline", "what", "nbytes", "done", "lock")

    def __init__(self, request, deadline: Deadline | None = None, what: str = "a nonblocking collective",
                 nbytes: int = 0, progress: Progress | None = None):
        self.request, self.deadline, self.what, self.nbytes = request, deadline, what, nbytes
        self.done = False
        self.lock = threading.Lock()
        if progress is not None:
            progress.add(self)

    def wait(self) -> None:
        """``MPI_Wait`` (nothing when the progress thread has completed it)."""
        with self.lock:
            if self.done:
                return
            if self.deadline is None:
                self.request.Wait()
            else:
                with self.deadline.wait(self.what, self.nbytes):
                    self.request.Wait()
            self.done = True

    def test(self) -> bool:
        """``MPI_Test``: True once complete; each call also moves MPI's progress on. Without a call to MPI
        while another thread holds the request (False, unless that one completed it)."""
        if self.done or not self.lock.acquire(blocking=False):
            return self.done
        try:
            if self.request.Test():
                self.done = True
            return self.done
        finally:
            self.lock.release()


def _nccl():
    """``cupy.cuda.nccl``; a clear error when CuPy or its NCCL binding is missing."""
    from ..kernels.cuda.core import cupy

    cupy()
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        raise BackendUnavailableError(f"NCCLComm needs CuPy's NCCL binding (pip install nvidia-nccl-cu12, or "
                                      f"-cu13, matching CuPy): {exc}") from None
    if not getattr(nccl, "available", True):
        raise BackendUnavailableError("NCCLComm: CuPy could not load the NCCL library "
                                      "(pip install nvidia-nccl-cu12, or -cu13, matching CuPy)")
    return nccl


class NCCLComm(Communicator):
    """The communicator over NCCL, on CuPy buffers: one process per GPU, started by ``mpiexec``.

    MPI starts the processes, broadcasts NCCL's unique id from rank 0 and
    carries :meth:`gather_objects`; CuPy arrays go through NCCL on the current
    CuPy stream, so the collectives are ordered after the kernels that wrote
    them and before those that read them, with no host synchronisation. NumPy
    arrays (the engine's host scalars: weight sums, skip flags) go through the
    MPI communicator :attr:`mpi`, each array over the link of its own memory —
    nothing is copied between host and device. Select each rank's GPU before
    constructing it (e.g. ``cupy.cuda.Device(local_rank).use()``); NCCL refuses
    two ranks on one GPU. Set-up failures (no CuPy, no NCCL, no usable GPU on
    some rank) raise :class:`~arraytrain.errors.BackendUnavailableError` on
    every rank.

    Parameters
    ----------
    comm : mpi4py communicator, optional
        As for :class:`MPIComm`; its ranks are the NCCL ranks.
    timeout : float or None, optional
        As for :class:`MPIComm`: the deadline of the waits on the host (the NumPy arrays'
        collectives over MPI and set-up); NCCL's collectives do not block the host.
    """

    def __init__(self, comm=None, *, timeout="default"):
        self.mpi = MPIComm(comm, timeout=timeout)
        self.rank, self.size = self.mpi.rank, self.mpi.size
        self.deadline = self.mpi.deadline  # the host's waits (NCCL's own run on the stream, not the host)
        problem = None
        try:
            from ..backend import require_cuda

            require_cuda("NCCLComm")
            nccl = _nccl()
        except BackendUnavailableError as exc:
            problem = str(exc)
        # every rank learns of any rank's failure before rank 0 broadcasts, so none waits alone
        problems = self.mpi.gather_objects(problem)
        bad = [r for r, p in enumerate(problems) if p is not None]
        if bad:
            raise BackendUnavailableError(f"NCCLComm: rank {bad[0]} of {self.size} cannot run NCCL "
                                          f"({len(bad)} rank(s) failed): {problems[bad[0]]}")
        import cupy

        self._cupy = cupy
        uid = self.mpi.comm.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
        self.device = cupy.cuda.Device()
        self._comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        self._ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX}
        self._types = {dt: getattr(nccl, name) for dt, name in _NCCL_TYPES.items()}

    def _stream(self) -> int:
        return self._cupy.cuda.get_current_stream().ptr

    def allreduce(self, x, op: str = "sum") -> None:
        """``x`` becomes the element-wise ``op`` over ranks, in place, on the current stream."""
        if isinstance(x, np.ndarray):
            return self.mpi.allreduce(x, op)
        nccl_op = _check_op(op, self._ops)
        dt = _checked(x, "x", CUPY, self._types, True)
        if x.size:
            self._comm.allReduce(x.data.ptr, x.data.ptr, x.size, dt, nccl_op, self._stream())

    def allgather(self, x) -> list:
        """Every rank's ``x``, in rank order: views of one ``(size, *x.shape)`` device array."""
        if isinstance(x, np.ndarray):
            return self.mpi.allgather(x)
        dt = _checked(x, "x", CUPY, self._types, False)
        recv = self._cupy.empty((self.size, *x.shape), x.dtype)
        if x.size:
            self._comm.allGather(x.data.ptr, recv.data.ptr, x.size, dt, self._stream())
        return [recv[i, ...] for i in range(self.size)]

    def broadcast(self, x, root: int = 0) -> None:
        """``x`` becomes rank ``root``'s ``x``, in place, on the current stream."""
        if isinstance(x, np.ndarray):
            return self.mpi.broadcast(x, root)
        root = check_int("root", root, 0, self.size - 1, error=ArgumentTypeError)
        dt = _checked(x, "x", CUPY, self._types, True)
        step = _NCCL_INT_COUNT  # CuPy's bcast takes a C int count: a large buffer goes in pieces
        for lo in range(0, x.size, step):
            n = min(step, x.size - lo)
            self._comm.bcast(x.data.ptr + lo * x.itemsize, n, dt, root, self._stream())

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj`` over MPI (set-up only)."""
        return self.mpi.gather_objects(obj)

    def reduce_scatter(self, x):
        """Block ``rank`` of ``x`` summed over ranks, in place into block ``rank`` (``ncclReduceScatter``)."""
        if isinstance(x, np.ndarray):
            return self.mpi.reduce_scatter(x)
        dt = _checked(x, "x", CUPY, self._types, True)
        n = block_length(x, self.size)
        own = x[self.rank * n : (self.rank + 1) * n]
        if n:
            self._comm.reduceScatter(x.data.ptr, own.data.ptr, n, dt, self._ops["sum"], self._stream())
        return own

    def gather(self, x, root: int = 0):
        """Every rank's ``x`` to rank ``root``: NumPy arrays over MPI; CuPy arrays all-gathered (NCCL has
        no gather), kept on ``root`` only."""
        if isinstance(x, np.ndarray):
            return self.mpi.gather(x, root)
        return super().gather(x, root)

    def iallreduce(self, x, op: str = "sum") -> Pending:
        """Start ``allreduce(x, op)``: NCCL's calls are already asynchronous on the current stream (the
        kernels after it wait for it there), so the handle is complete for the host at once."""
        if isinstance(x, np.ndarray):
            return self.mpi.iallreduce(x, op)
        self.allreduce(x, op)
        return DONE

    def ireduce(self, x, root: int = 0) -> Pending:
        """Start the sum of every rank's ``x`` into rank ``root``'s ``x`` (``ncclReduce`` in place, on the
        current stream; see :meth:`iallreduce`)."""
        if isinstance(x, np.ndarray):
            return self.mpi.ireduce(x, root)
        root = check_int("root", root, 0, self.size - 1, error=ArgumentTypeError)
        dt = _checked(x, "x", CUPY, self._types, True)
        if x.size:
            self._comm.reduce(x.data.ptr, x.data.ptr, x.size, dt, self._ops["sum"], root, self._stream())
        return DONE

    def allgather_blocks(self, x) -> None:
        """In place, block ``r`` of ``x`` becomes rank ``r``'s (``ncclAllGather`` in place)."""
        if isinstance(x, np.ndarray):
            return self.mpi.allgather_blocks(x)
        dt = _checked(x, "x", CUPY, self._types, True)
        n = block_length(x, self.size)
        if n:
            own = x[self.rank * n : (self.rank + 1) * n]
            self._comm.allGather(own.data.ptr, x.data.ptr, n, dt, self._stream())

    def __repr__(self) -> str:
        return f"NCCLComm(rank={self.rank}, size={self.size}, device={self.device.id})"
