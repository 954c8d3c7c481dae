"""The communicator over torch.distributed: gloo for NumPy buffers, NCCL for CuPy buffers.

:class:`TorchComm` implements :class:`~arraytrain.parallel.communicator.Communicator` over an
initialised ``torch.distributed`` process group, so a script started by
``torchrun`` trains with arraytrain without MPI::

    torchrun --standalone --nproc-per-node 4 train.py

    # train.py
    import torch.distributed as dist
    from arraytrain.distributed import TorchComm
    dist.init_process_group("gloo")       # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, ...
    engine = arraytrain.Engine(params, opt, comm=TorchComm())

torch is imported when a :class:`TorchComm` is built, never by ``import
arraytrain``. Without torch, or before ``init_process_group``, the constructor
raises :class:`~arraytrain.errors.BackendUnavailableError` saying what to do.

No copies
---------
A NumPy array becomes a tensor with ``torch.from_numpy`` and a CuPy array with
``torch.from_dlpack``: both share the array's memory, so ``allreduce`` works on
the flat gradient buffer as it lies (the fusion buffer), in place. NumPy arrays
go through the group's CPU backend (gloo, or MPI), CuPy arrays through its CUDA
backend (NCCL); a CuPy array given to a group without one is refused
(:class:`~arraytrain.errors.BackendError`), never staged through the host. A
group with NCCL alone (``init_process_group("nccl")``) gets a gloo group of the
same ranks at construction for the NumPy arrays the engine exchanges beside
the device buffers (weight sums, skip flags) and for :meth:`gather_objects`;
``init_process_group("cpu:gloo,cuda:nccl")`` (torch's default when CUDA is
available and no backend is named) needs none.

Data types
----------
Operations that move data without arithmetic (``allgather``,
``allgather_blocks``, ``broadcast``) send the bytes (``uint8`` views), so every
fixed-width dtype moves bit-exactly: float16, bfloat16, float32, float64 and
the signed and unsigned integers of 8 to 64 bits. Reductions (``allreduce``,
``reduce_scatter``, ``iallreduce``, ``ireduce``) take float16, bfloat16,
float32, float64, int8, uint8, int32 and int64 in torch's own dtypes (a
bfloat16 NumPy array is viewed as ``torch.bfloat16``). gloo in torch 2.13
has no 16-bit integers and no unsigned integers wider than 8 bits ("Invalid
scalar type"), NCCL no 16-bit integers: int16 and uint16 are summed (or
maxed) in an int32 copy and uint32 in an int64 copy, then written back — exact,
the sum wrapping modulo 2**16 or 2**32 as MPI's does; the compressors' int16
code sums take that path. uint64 reductions, bool and complex arrays are
refused with :class:`~arraytrain.errors.DTypeError`. Buffers must be
C-contiguous; buffers written into must be writeable. Every check runs before
the collective is entered (the same typed errors as
:class:`arraytrain.distributed.MPIComm`), so a refused call changes nothing —
its peers are then waiting in that collective: ``torchrun`` ends every rank
when one exits with an error (its agent stops the others), so the job fails
instead of hanging.

Block collectives
-----------------
``reduce_scatter`` is torch's ``reduce_scatter_single`` (``reduce_scatter_tensor``
before torch 2.13) in place, the input being ``x`` and the output its block
``rank`` (as :class:`~arraytrain.distributed.NCCLComm` places it);
``allgather_blocks`` is ``all_gather_single`` (``all_gather_into_tensor``) with
block ``rank`` as the input. gloo implements both on CPU tensors in torch 2.13
(the torchrun tests check them against NumPy), so neither falls back to an
all-reduce.

Nonblocking operations
----------------------
:meth:`iallreduce` and :meth:`ireduce` start an operation and return a
:class:`TorchWork` handle (an :class:`~arraytrain.parallel.communicator.Pending` over
torch's ``async_op=True`` work): ``wait()`` completes it, ``test()`` says
without blocking whether it has completed (an empty array's operation returns
the exchange's completed ``DONE``). gloo progresses them on its own threads, so
nothing needs polling. The array
must not be read or written until the handle is complete.

CuPy streams
------------
arraytrain's CUDA kernels run on CuPy's current stream; torch's NCCL
collectives are enqueued on an internal NCCL stream that first waits for
*torch's* current stream, and ``work.wait()`` makes torch's current stream wait
for the NCCL stream (no host synchronisation). Every CUDA operation here runs
with torch's current stream set to CuPy's current one (a
``torch.cuda.ExternalStream`` of its pointer, or torch's default stream for
CuPy's null stream) on the array's device, so the collective starts after the
kernels that wrote the buffer and the kernels enqueued after it read the
result. A nonblocking handle remembers that stream: its ``wait()`` makes it
(not the host) wait. Select each rank's GPU in both libraries before
constructing (``torch.cuda.set_device(local_rank)`` and
``cupy.cuda.Device(local_rank).use()``).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import numpy as np

from .._checks import check_int
from ..backend import CUPY, NUMPY, backend_of, cupy
from ..errors import ArgumentTypeError, BackendError, BackendUnavailableError, DTypeError
from .communicator import DONE, OPS, Communicator, Pending, block_length, block_span, check_buffer
from .deadline import Deadline, check_timeout

__all__ = ["TorchComm", "TorchWork", "INIT_HINT"]

#: What to do before building a TorchComm; the constructor's errors quote it.
INIT_HINT = ("call torch.distributed.init_process_group('gloo') on every process first (NCCL, or "
             "'cpu:gloo,cuda:nccl', for CuPy buffers), or start the script under torchrun")

_MOVED = tuple(np.dtype(t) for t in (np.float32, np.float64, np.float16, np.int8, np.int16, np.int32, np.int64,
                                      np.uint8, np.uint16, np.uint32, np.uint64))
# dtype name -> (torch dtype name, wider dtype name for the reduction or None); bfloat16 added by name
_REDUCED = {"float16": ("float16", None), "bfloat16": ("bfloat16", None), "float32": ("float32", None),
            "float64": ("float64", None), "int8": ("int8", None), "uint8": ("uint8", None),
            "int32": ("int32", None), "int64": ("int64", None),
            "int16": ("int16", "int32"), "uint16": ("uint16", "int32"), "uint32": ("uint32", "int64")}
_MOVED_NAMES = frozenset({str(t) for t in _MOVED} | {"bfloat16"})


def _torch_dist():
    """``(torch, torch.distributed)``; a clear error without torch or its distributed package."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise BackendUnavailableError(f"TorchComm needs PyTorch (pip install torch): {exc}") from None
    if not dist.is_available():
        raise BackendUnavailableError("TorchComm: this PyTorch build has no torch.distributed "
                                      "(install a build with distributed support, e.g. pip install torch)")
    return torch, dist


def _devices(backend: str) -> tuple[bool, bool]:
    """Whether a group's backend serves CPU tensors and CUDA tensors (``"gloo"``, ``"cpu:gloo,cuda:nccl"``...)."""
    spec = backend.lower()
    if ":" in spec:
        pairs = dict(p.split(":", 1) for p in spec.split(",") if ":" in p)
        return "cpu" in pairs, "cuda" in pairs
    return spec in ("gloo", "mpi"), spec == "nccl"


#: The tag of :meth:`TorchComm.ireduce`'s point-to-point messages (a user's own messages on the group
#: with another tag cannot be taken for them).
REDUCE_TAG = 0x4154


class _AllWork:
    """Several torch works as one: complete when every one is."""

    __slots__ = ("_works",)

    def __init__(self, works):
        self._works = works

    def wait(self) -> None:
        for w in self._works:
            w.wait()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


class TorchWork(Pending):
    """A nonblocking operation started by :meth:`TorchComm.iallreduce` or :meth:`TorchComm.ireduce`.

    ``wait()`` completes it (returns None; a CUDA operation makes the CuPy stream
    current at its start wait, not the host); ``test()`` is True once it has completed,
    without blocking. Until then the array must not be touched. Completing it twice is
    harmless.
    """

    __slots__ = ("_work", "_finish", "_keep", "_stream", "_deadline", "_what", "_nbytes")

    def __init__(self, work, finish=None, keep=(), stream=None, deadline: Deadline | None = None,
                 what: str = "a nonblocking collective", nbytes: int = 0):
        self._work, self._finish, self._keep, self._stream = work, finish, keep, stream
        self._deadline, self._what, self._nbytes = deadline, what, nbytes

    def wait(self) -> None:
        """Complete the operation (the result is then in the array)."""
        if self._keep is None:
            return
        with self._stream() if self._stream is not None else contextlib.nullcontext():
            if self._work is not None:
                if self._deadline is None:
                    self._work.wait()
                else:
                    with self._deadline.wait(self._what, self._nbytes):
                        self._work.wait()
            if self._finish is not None:
                self._finish()
        self._work = self._finish = self._keep = self._stream = None

    def test(self) -> bool:
        """True once the operation has completed (and then its result is in the array)."""
        if self._keep is None:
            return True
        if self._work is not None and not self._work.is_completed():
            return False
        self.wait()  # complete: only the bookkeeping (and a widened result's copy back) is left
        return True

    def __repr__(self) -> str:
        return f"TorchWork({'complete' if self._keep is None else 'pending'})"


class TorchComm(Communicator):
    """The communicator over a torch.distributed process group (see the module docstring).

    Parameters
    ----------
    group : torch.distributed.ProcessGroup or None
        The group (None: the default group, ``torch.distributed.group.WORLD``).
        ``rank`` and ``size`` are this process's rank in it and its size;
        ``root`` arguments are ranks in it.
    timeout : float or None, optional
        Seconds a step's collective may wait for the other ranks once the job is steady
        (10 times that before, and for set-up and checkpoint agreement); past it the rank
        writes one line and ends (:mod:`arraytrain.parallel.deadline`), which ``torchrun``
        sees as a failed worker. By default ``ARRAYTRAIN_COMM_TIMEOUT``, else 60; None or 0:
        only the process group's own timeout (``init_process_group(timeout=)``, 30 minutes
        for gloo by default).

    Attributes
    ----------
    group : torch.distributed.ProcessGroup
        The group itself, for anything outside the collectives. TorchComm holds it weakly:
        after ``torch.distributed.destroy_process_group()`` every call raises
        :class:`~arraytrain.errors.BackendUnavailableError`, and a TorchComm kept alive until
        the interpreter exits does not keep the group (and gloo's threads) alive with it.
    backend : str
        Its backend as torch names it (``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``).
    deadline : arraytrain.parallel.deadline.Deadline
        The deadline of this communicator's waits.
    """

    def __init__(self, group=None, *, timeout="default"):
        timeout = check_timeout(timeout)
        torch, dist = _torch_dist()
        if not dist.is_initialized():
            raise BackendUnavailableError(f"TorchComm: torch.distributed is not initialised: {INIT_HINT}")
        if group is None:
            group = dist.group.WORLD
        elif group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns outside the group
            raise ArgumentTypeError(f"group: this process (global rank {dist.get_rank()}) is not a member of it "
                                    "(new_group returned GroupMember.NON_GROUP_MEMBER here)")
        elif not isinstance(group, dist.ProcessGroup):
            raise ArgumentTypeError(f"group: expected a torch.distributed ProcessGroup or None, "
                                    f"got {type(group).__name__}")
        rank = dist.get_rank(group)
        if rank < 0:
            raise ArgumentTypeError(f"group: this process (global rank {dist.get_rank()}) is not a member of it")
        self._torch, self._dist = torch, dist
        # weak: torch's registry keeps a group until destroy_process_group; a reference held past it
        # (a TorchComm alive until the interpreter exits) lets gloo's threads abort the process at exit
        self._group = weakref.ref(group)
        self.rank, self.size = rank, dist.get_world_size(group)
        self.deadline = Deadline(timeout if self.size > 1 else None, rank, self.size)
        self.backend = str(dist.get_backend(group))
        self._cpu, self._cuda = _devices(self.backend)
        self._ranks = dist.get_process_group_ranks(group)  # group rank -> global rank
        # a group without a CPU backend: a gloo group of the same ranks for host arrays and objects
        host = group if self._cpu else dist.new_group(self._ranks, backend="gloo", use_local_synchronization=True)
        self._host = weakref.ref(host)
        self._ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self._tdtypes = {name: getattr(torch, name, None) for pair in _REDUCED.values() for name in pair if name}

    # -- arrays to tensors ----------------------------------------------------------------------------

    def _check(self, x, name: str, writeable: bool, reduce: bool) -> str:
        """The backend of array ``x`` after checking it (nothing is touched, nothing entered)."""
        try:
            kind = NUMPY if type(x) is np.ndarray else backend_of(x)
        except BackendError:
            raise BackendError(f"{name}: expected a numpy or cupy array, got {type(x).__name__}") from None
        if kind == CUPY and not self._cuda:
            raise BackendError(f"{name}: a CuPy array given to TorchComm over a {self.backend!r} group, which has "
                               "no CUDA backend (arraytrain never copies between device and host implicitly): "
                               "init_process_group('nccl') or 'cpu:gloo,cuda:nccl' for CuPy buffers")
        dt = str(x.dtype)
        if reduce:
            if dt not in _REDUCED:
                raise DTypeError(f"{name}: expected one of {', '.join(_REDUCED)} for a reduction, got {dt}")
        elif dt not in _MOVED_NAMES:
            raise DTypeError(f"{name}: expected one of {', '.join(sorted(_MOVED_NAMES))}, got {dt}")
        check_buffer(x, name, writeable)
        return kind

    def _tensor(self, x, kind: str):
        """A tensor sharing ``x``'s memory (``x`` checked, C-contiguous), in torch's dtype of ``x``."""
        torch = self._torch
        if kind == CUPY:
            return torch.from_dlpack(x)
        if x.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: torch reads its bits as int16, then views them
            return self._tensor(x.view(np.int16), kind).view(torch.bfloat16)
        if not x.flags.writeable:  # read-only input (gathered, never written): torch warns, needlessly here
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(x)
        return torch.from_numpy(x)

    def _bytes(self, x, kind: str):
        """``x``'s bytes as a 1-D uint8 tensor sharing its memory."""
        return self._tensor(x.reshape(-1).view(np.uint8), kind)

    @property
    def group(self):
        """The process group (held weakly: torch holds it until ``destroy_process_group``)."""
        return self._alive(self._group)

    def _alive(self, ref):
        group = ref()
        if group is None:
            raise BackendUnavailableError("TorchComm: its process group was destroyed "
                                          "(torch.distributed.destroy_process_group)")
        return group

    def _group_of(self, kind: str):
        return self._alive(self._group if kind == CUPY else self._host)

    def _on_stream(self, x, kind: str):
        """A context under which torch's current stream is CuPy's current one, on ``x``'s device (CUDA), else none."""
        if kind != CUPY:
            return contextlib.nullcontext
        import cupy

        torch = self._torch
        device = torch.device("cuda", x.device.id)
        ptr = cupy.cuda.get_current_stream().ptr
        stream = torch.cuda.ExternalStream(ptr, device=device) if ptr else torch.cuda.default_stream(device)

        @contextlib.contextmanager
        def ctx():
            with torch.cuda.device(device), torch.cuda.stream(stream):
                yield

        return ctx

    def _reduced(self, x, kind: str):
        """``(tensor to reduce, finish)``: ``x``'s own tensor, or a widened copy and the copy back."""
        torch_name, wide = _REDUCED[str(x.dtype)]
        t = self._tensor(x, kind)
        if wide is None:
            return t, None
        w = t.to(self._tdtypes[wide])
        return w, lambda: t.copy_(w)  # integer narrowing wraps: the bits of the narrow sum

    # -- the collectives --------------------------------------------------------------------------------

    def allreduce(self, x, op: str = "sum") -> None:
        """``x`` becomes the element-wise ``op`` over ranks, in place (``all_reduce`` on ``x``'s memory)."""
        red = self._op(op)
        kind = self._check(x, "x", True, True)
        if x.size:
            with self._on_stream(x, kind)():
                t, finish = self._reduced(x, kind)
                with self.deadline.wait("allreduce", x.nbytes):
                    self._dist.all_reduce(t, op=red, group=self._group_of(kind))
                if finish is not None:
                    finish()

    def iallreduce(self, x, op: str = "sum") -> Pending:
        """Start ``allreduce(x, op)``; complete it with the handle's ``wait()``."""
        red = self._op(op)
        kind = self._check(x, "x", True, True)
        if not x.size:
            return DONE
        return self._start(x, kind, lambda t: self._dist.all_reduce(t, op=red, group=self._group_of(kind),
                                                                     async_op=True), "iallreduce")

    def ireduce(self, x, root: int = 0) -> Pending:
        """Start a sum of every rank's ``x`` into rank ``root``'s ``x``, in place; elsewhere ``x`` is left
        undefined. Complete it with the handle's ``wait()``.

        A NumPy array (gloo) is sent by each other rank straight to ``root`` (``isend``/``irecv``, tag
        :data:`REDUCE_TAG`), which adds what it received in rank order when the handle completes: every
        rank sends ``x`` once, what a ring reduce-scatter sends per element, where gloo's own ``reduce``
        sent 1.4-1.7 times that on a shaped link (``python -m arraytrain.bench cluster``). A CuPy array
        goes through the group's ``reduce`` (NCCL's)."""
        root = check_int("root", root, 0, self.size - 1, error=ArgumentTypeError)
        kind = self._check(x, "x", True, True)
        if not x.size:
            return DONE
        if kind == NUMPY:
            return self._ireduce_direct(x, root)
        return self._start(x, kind, lambda t: self._dist.reduce(t, dst=self._ranks[root], op=self._ops["sum"],
                                                                 group=self._group_of(kind), async_op=True),
                           "ireduce")

    def _ireduce_direct(self, x, root: int) -> Pending:
        """:meth:`ireduce` of a host array by point-to-point messages to ``root``."""
        dist, group = self._dist, self._group_of(NUMPY)
        t, finish = self._reduced(x, NUMPY)
        if self.rank != root:
            work = dist.isend(t, dst=self._ranks[root], group=group, tag=REDUCE_TAG)
            return TorchWork(work, finish, (x, t), None, self.deadline, "ireduce", x.nbytes)
        received = [(r, self._torch.empty_like(t)) for r in range(self.size) if r != root]
        works = [dist.irecv(buf, src=self._ranks[r], group=group, tag=REDUCE_TAG) for r, buf in received]

        def add():  # in rank order, whatever order the messages came in: the same bits every time
            for _, buf in received:
                t.add_(buf)
            if finish is not None:
                finish()

        return TorchWork(_AllWork(works), add, (x, t, received), None, self.deadline, "ireduce", x.nbytes)

    def _start(self, x, kind: str, collective, what: str) -> Pending:
        """``collective(t)`` started on ``x``'s reduction tensor (on the array's stream for CuPy)."""
        on_stream = self._on_stream(x, kind)
        with on_stream():
            t, finish = self._reduced(x, kind)
            work = collective(t)
        return TorchWork(work, finish, (x, t), on_stream if kind == CUPY else None, self.deadline, what, x.nbytes)

    def allgather(self, x) -> list:
        """Every rank's ``x``, in rank order: views of one received ``(size, *x.shape)`` array."""
        kind = self._check(x, "x", False, False)
        xp = np if kind == NUMPY else cupy()
        recv = xp.empty((self.size, *x.shape), x.dtype)
        if x.size:
            with self._on_stream(x, kind)(), self.deadline.wait("allgather", recv.nbytes):
                self._all_gather(self._bytes(recv, kind), self._bytes(x, kind), group=self._group_of(kind))
        return [recv[i, ...] for i in range(self.size)]

    def broadcast(self, x, root: int = 0) -> None:
        """``x`` becomes rank ``root``'s ``x``, in place (its bytes)."""
        root = check_int("root", root, 0, self.size - 1, error=ArgumentTypeError)
        kind = self._check(x, "x", True, False)
        if x.size:
            with self._on_stream(x, kind)(), self.deadline.wait("broadcast", x.nbytes):
                self._dist.broadcast(self._bytes(x, kind), src=self._ranks[root], group=self._group_of(kind))

    def gather_objects(self, obj) -> list:
        """Every rank's picklable ``obj``, in rank order (``all_gather_object`` over the CPU group; set-up only)."""
        out = [None] * self.size
        with self.deadline.wait("gather_objects"):
            self._dist.all_gather_object(out, obj, group=self._alive(self._host))
        return out

    def reduce_scatter(self, x):
        """Block ``rank`` of ``x`` summed over ranks, in place into block ``rank`` (``reduce_scatter_single``);
        the rest of ``x`` is left undefined."""
        kind = self._check(x, "x", True, True)
        n = block_length(x, self.size)
        own = x[self.rank * n : (self.rank + 1) * n]
        if n:
            with self._on_stream(x, kind)():
                t, finish = self._reduced(x, kind)
                with self.deadline.wait("reduce_scatter", x.nbytes):
                    self._reduce_scatter(t[self.rank * n : (self.rank + 1) * n], t, op=self._ops["sum"],
                                         group=self._group_of(kind))
                if finish is not None:
                    finish()
        return own

    def allgather_blocks(self, x) -> None:
        """In place, block ``r`` of ``x`` becomes rank ``r``'s (``all_gather_single`` of block ``rank``, as bytes)."""
        kind = self._check(x, "x", True, False)
        n = block_length(x, self.size) * x.itemsize
        if n:
            with self._on_stream(x, kind)(), self.deadline.wait("allgather_blocks", x.nbytes):
                b = self._bytes(x, kind)
                self._all_gather(b, b[self.rank * n : (self.rank + 1) * n], group=self._group_of(kind))

    def iallgather_blocks(self, x, lo: int, hi: int) -> Pending:
        """Start: in place, elements ``[lo, hi)`` of block ``r`` of ``x`` become rank ``r``'s (``all_gather``
        into views of ``x``, as bytes); complete it with the handle's ``wait()``."""
        kind = self._check(x, "x", True, False)
        n = block_length(x, self.size)
        lo, hi = block_span(lo, hi, n)
        if hi == lo:
            return DONE
        s, on_stream = x.itemsize, self._on_stream(x, kind)
        with on_stream():
            b = self._bytes(x, kind)
            outs = [b[(r * n + lo) * s : (r * n + hi) * s] for r in range(self.size)]
            work = self._dist.all_gather(outs, outs[self.rank], group=self._group_of(kind), async_op=True)
        return TorchWork(work, None, (x, b, outs), on_stream if kind == CUPY else None, self.deadline,
                         "iallgather_blocks", (hi - lo) * s * self.size)

    def _op(self, op):
        found = self._ops.get(op) if isinstance(op, str) else None
        if found is None:
            raise ArgumentTypeError(f"op: expected one of {OPS}, got {op!r}")
        return found

    def __repr__(self) -> str:
        return f"TorchComm(rank={self.rank}, size={self.size}, backend={self.backend!r})"
