"""The collectives of :class:`MPIComm` on every rank (run by ``checks.py comm``).

Every ``check_*(comm)`` runs on every rank and returns how many cases it covered.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from arraytrain.distributed import MPIComm, NCCLComm
from arraytrain.errors import (
    ArgumentTypeError,
    BackendError,
    BackendUnavailableError,
    DTypeError,
    LayoutError,
    ReadOnlyError,
    StateDictError,
)

SIZES = (0, 1, 7, 1037, 278011)
INT_TYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
FakeCupyArray = type("ndarray", (), {"__module__": "cupy.core.core"})  # what backend_of sees of CuPy


def same_everywhere(comm, x) -> bool:
    """True when every rank holds the same bits in ``x``."""
    got = comm.allgather(np.ascontiguousarray(x))
    return all(np.array_equal(g.view(np.uint8), got[0].view(np.uint8)) for g in got)


def check_sum_and_max_every_dtype(comm: MPIComm) -> int:
    cases = 0
    base = np.arange(1037) % 5
    for dtype in (np.float32, np.float64, *INT_TYPES):
        for op in ("sum", "max"):
            x = (base + comm.rank + 1).astype(dtype)
            ptr = x.ctypes.data
            assert comm.allreduce(x, op=op) is None
            n = comm.size
            want = n * base + n * (n + 1) // 2 if op == "sum" else base + n
            assert x.ctypes.data == ptr and x.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(x, want.astype(dtype), err_msg=f"{np.dtype(dtype)} {op}")
            cases += 1
    return cases


def check_sum_of_random_buffers_at_every_size(comm: MPIComm) -> int:
    """Every rank gets the same bits, close to the float64 sum of every rank's buffer."""
    cases = 0
    for dtype in (np.float32, np.float64):
        for n in SIZES:
            x = np.random.default_rng([n, comm.rank]).standard_normal(n).astype(dtype)
            comm.allreduce(x)
            want = sum(np.random.default_rng([n, r]).standard_normal(n).astype(dtype).astype(np.float64)
                       for r in range(comm.size))
            np.testing.assert_allclose(x, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)
            assert same_everywhere(comm, x), f"ranks disagree after allreduce ({np.dtype(dtype)}, n={n})"
            cases += 1
    return cases


def check_allreduce_of_a_slice_writes_only_the_slice(comm: MPIComm) -> int:
    """A contiguous slice of a flat buffer goes on the wire as it lies (the fusion buffer, no copy)."""
    flat = np.full(100, float(comm.rank), np.float32)
    comm.allreduce(flat[10:60], op="max")
    assert np.all(flat[10:60] == comm.size - 1)
    assert np.all(flat[:10] == comm.rank) and np.all(flat[60:] == comm.rank)
    return 1


def check_allgather(comm: MPIComm) -> int:
    cases = 0
    arrays = [np.arange(5, dtype=np.float32) + 10 * comm.rank,
              np.full((2, 3), comm.rank, np.int64),
              np.array(comm.rank, np.uint8),
              np.zeros(0, np.float64)]
    ro = np.arange(4, dtype=np.float64) * comm.rank
    ro.flags.writeable = False
    arrays.append(ro)  # read only: allgather only reads it
    for x in arrays:
        got = comm.allgather(x)
        assert isinstance(got, list) and len(got) == comm.size
        for r, g in enumerate(got):
            assert g.shape == x.shape and g.dtype == x.dtype, (g.shape, g.dtype)
            assert isinstance(g, np.ndarray)
        if x.size:
            assert all(g.base is got[0].base for g in got), "expected views of one received buffer"
            if x.ndim == 1 and x.dtype == np.float32:
                for r, g in enumerate(got):
                    np.testing.assert_array_equal(g, np.arange(5, dtype=np.float32) + 10 * r)
            else:
                for r, g in enumerate(got):
                    np.testing.assert_array_equal(g, x * 0 + (np.arange(4) * r if x is ro else r))
        cases += 1
    return cases


def check_broadcast_from_every_root(comm: MPIComm) -> int:
    cases = 0
    for root in range(comm.size):
        for x in (np.full(7, comm.rank, np.float32), np.full((3, 2), comm.rank, np.int32), np.zeros(0)):
            comm.broadcast(x, root=root)
            assert np.all(x == root)
            cases += 1
    return cases


def check_gather_objects(comm: MPIComm) -> int:
    got = comm.gather_objects({"rank": comm.rank, "names": ("a", "b")})
    assert got == [{"rank": r, "names": ("a", "b")} for r in range(comm.size)]
    return 1


def check_agree_raises_the_same_error_on_every_rank(comm: MPIComm) -> int:
    comm.agree("layout hash", "abc")  # equal everywhere: no error
    last = comm.size - 1
    cases = 1
    for error in (LayoutError, StateDictError):
        value = ("w", (3, 4)) if comm.rank != last else ("w", (4, 3))
        try:
            comm.agree("layout", value, error=error)
        except error as exc:
            msg = str(exc)
        else:
            raise AssertionError(f"rank {comm.rank}: agree did not raise")
        messages = comm.gather_objects(msg)
        assert len(set(messages)) == 1, messages
        assert f"rank {last} has ('w', (4, 3))" in msg and "rank 0 has ('w', (3, 4))" in msg, msg
        cases += 1
    return cases


def check_bad_input_raises_before_any_collective(comm: MPIComm) -> int:
    """Each refused call raises a typed error naming the argument; the ranks stay in step."""
    ok = np.zeros(8, np.float32)
    ro = np.zeros(8, np.float32)
    ro.flags.writeable = False
    table = [
        (lambda: comm.allreduce(ok[::2]), ArgumentTypeError, "x: expected a C-contiguous"),
        (lambda: comm.allreduce(np.zeros((4, 4), np.float32).T), ArgumentTypeError, "x: expected a C-contiguous"),
        (lambda: comm.allreduce(ro), ReadOnlyError, "x: the collective writes"),
        (lambda: comm.allreduce(np.zeros(3, np.complex64)), DTypeError, "x: expected one of"),
        (lambda: comm.allreduce(np.zeros(3, bool)), DTypeError, "got bool"),
        (lambda: comm.allreduce(np.zeros(3, np.float16)), DTypeError, "got float16"),
        (lambda: comm.allreduce(np.zeros(3, ml_dtypes.bfloat16)), DTypeError, "got bfloat16"),
        (lambda: comm.allreduce(ok, op="mean"), ArgumentTypeError, "op: expected one of ('sum', 'max')"),
        (lambda: comm.allreduce(ok, op=None), ArgumentTypeError, "op:"),
        (lambda: comm.allreduce([1.0, 2.0]), BackendError, "x: expected a numpy array, got list"),
        (lambda: comm.allreduce(FakeCupyArray()), BackendError, "use arraytrain.distributed.NCCLComm"),
        (lambda: comm.allgather(ok[::2]), ArgumentTypeError, "x: expected a C-contiguous"),
        (lambda: comm.allgather(np.zeros(2, np.complex128)), DTypeError, "x:"),
        (lambda: comm.allgather(FakeCupyArray()), BackendError, "NCCLComm"),
        (lambda: comm.broadcast(ok, root=comm.size), ArgumentTypeError, "root: expected an int in [0, "),
        (lambda: comm.broadcast(ok, root=-1), ArgumentTypeError, "root:"),
        (lambda: comm.broadcast(ok, root=True), ArgumentTypeError, "root:"),
        (lambda: comm.broadcast(ro), ReadOnlyError, "x:"),
        (lambda: comm.broadcast(ok[::2]), ArgumentTypeError, "x:"),
        (lambda: MPIComm(comm="world"), ArgumentTypeError, "comm: expected an mpi4py intracommunicator"),
    ]
    for i, (call, error, text) in enumerate(table):
        try:
            call()
        except error as exc:
            assert text in str(exc), f"case {i}: {text!r} not in {str(exc)!r}"
        else:
            raise AssertionError(f"case {i}: no {error.__name__}")
    assert np.all(ok == 0) and issubclass(ReadOnlyError, ValueError) and issubclass(DTypeError, TypeError)
    # had any case entered a collective, this one would pair with it and fail or hang
    x = np.ones(3, np.int64)
    comm.allreduce(x)
    assert np.all(x == comm.size)
    return len(table)


def check_a_split_communicator(comm: MPIComm) -> int:
    """MPIComm over a communicator split from COMM_WORLD: its own rank and size (size 1 at -n 2)."""
    color = comm.rank % 2
    sub = MPIComm(comm.comm.Split(color, comm.rank))
    try:
        members = [r for r in range(comm.size) if r % 2 == color]
        assert sub.size == len(members) and sub.rank == members.index(comm.rank)
        assert sub.is_local == (sub.size == 1)
        x = np.array([comm.rank], np.int64)
        sub.allreduce(x)
        assert int(x[0]) == sum(members)
        assert [int(g[0]) for g in sub.allgather(np.array([comm.rank]))] == members
    finally:
        sub.comm.Free()
    return 1


def check_nccl_set_up_fails_on_every_rank_without_a_gpu(comm: MPIComm) -> int:
    """Without CuPy/NCCL/a GPU, every rank raises BackendUnavailableError (none waits for the unique id)."""
    from arraytrain.backend import require_cuda

    try:
        require_cuda()
    except BackendUnavailableError:
        pass
    else:
        return 0  # a GPU: the NCCL test of test_mpi.py runs instead (one rank per GPU)
    try:
        NCCLComm()
    except BackendUnavailableError as exc:
        msg = str(exc)
    else:
        raise AssertionError("NCCLComm() without a GPU did not raise")
    assert "NCCLComm: rank 0 of" in msg, msg
    assert len(set(comm.gather_objects(msg))) == 1
    return 1
