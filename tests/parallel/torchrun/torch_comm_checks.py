"""TorchComm's collectives on every rank over gloo (run by ``checks.py comm``).

Every ``check_*(comm)`` runs on every rank and returns how many cases it covered. The
dtype-independent checks of ``../mpi/comm_checks.py`` run first, unchanged, over TorchComm;
these add what differs from MPIComm: torch's dtypes (float16 and bfloat16 summed, 16-bit
and unsigned integers widened, every dtype moved bit-exactly), the block collectives at
several sizes against NumPy, the nonblocking handles, subgroups and the bad-input table.
"""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import torch.distributed as dist
from comm_checks import (  # noqa: F401  (run here over TorchComm, in this order)
    FakeCupyArray,
    check_agree_raises_the_same_error_on_every_rank,
    check_allgather,
    check_allreduce_of_a_slice_writes_only_the_slice,
    check_broadcast_from_every_root,
    check_gather_objects,
    check_sum_of_random_buffers_at_every_size,
    same_everywhere,
)

from arraytrain.errors import ArgumentTypeError, BackendError, DTypeError, ReadOnlyError
from arraytrain.parallel.torch_dist import TorchComm, TorchWork

BF16 = np.dtype(ml_dtypes.bfloat16)
REDUCED = (np.float16, BF16, np.float32, np.float64, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.int64,
           np.uint32)
MOVED = (*REDUCED, np.uint64)
SIZES = (0, 1, 7, 1037)


def rank_values(dtype, n: int, rank: int) -> np.ndarray:
    """Small exact values (every sum of 4 ranks is exact in float16 and bfloat16), distinct per rank."""
    return ((np.arange(n) * 7 + 3 * rank) % 23).astype(np.float64).astype(dtype)


def check_attributes(comm: TorchComm) -> int:
    assert (comm.rank, comm.size) == (dist.get_rank(), dist.get_world_size())
    assert comm.backend == "gloo" and comm.is_local is False and comm.group is dist.group.WORLD
    assert repr(comm) == f"TorchComm(rank={comm.rank}, size={comm.size}, backend='gloo')"
    return 1


def check_sum_and_max_every_reduced_dtype_and_size(comm: TorchComm) -> int:
    cases = 0
    for dtype in REDUCED:
        for n in SIZES:
            for op in ("sum", "max"):
                x = rank_values(dtype, n, comm.rank)
                ptr = x.ctypes.data
                assert comm.allreduce(x, op) is None
                got = [rank_values(dtype, n, r).astype(np.float64) for r in range(comm.size)]
                want = (np.sum(got, axis=0) if op == "sum" else np.max(got, axis=0)).astype(dtype)
                assert x.ctypes.data == ptr and x.dtype == np.dtype(dtype)  # in place, the caller's memory
                np.testing.assert_array_equal(x, want, err_msg=f"{np.dtype(dtype)} n={n} {op}")
                cases += 1
    return cases


def check_integer_sums_wrap_as_numpys(comm: TorchComm) -> int:
    """int16/uint16 (summed in int32) and uint32 (in int64) write back the wrapped narrow sum, as MPI's."""
    cases = 0
    for dtype in (np.int16, np.uint16, np.uint32, np.int8, np.uint8):
        info = np.iinfo(dtype)
        def values(r):
            return np.array([info.max, info.min, info.max // 2 + r], dtype)

        x, want = values(comm.rank), values(0)
        for r in range(1, comm.size):
            want += values(r)  # numpy wraps too
        want_max = np.array([info.max, info.min, info.max // 2 + comm.size - 1], dtype)
        y = x.copy()
        comm.allreduce(x, "sum")
        comm.allreduce(y, "max")
        np.testing.assert_array_equal(x, want, err_msg=str(np.dtype(dtype)))
        np.testing.assert_array_equal(y, want_max, err_msg=str(np.dtype(dtype)))
        cases += 2
    return cases


def check_half_precision_random_sums(comm: TorchComm) -> int:
    """float16 and bfloat16 random buffers: the same bits everywhere, close to the float64 sum."""
    cases = 0
    for dtype in (np.float16, BF16):
        for n in (7, 1037, 278011):
            x = np.random.default_rng([n, comm.rank]).standard_normal(n).astype(dtype)
            comm.allreduce(x)
            want = sum(np.random.default_rng([n, r]).standard_normal(n).astype(dtype).astype(np.float64)
                       for r in range(comm.size))
            np.testing.assert_allclose(x.astype(np.float64), want, rtol=5e-3 * comm.size, atol=5e-3 * comm.size)
            assert same_everywhere(comm, x.view(np.uint16)), f"{dtype} n={n}"
            cases += 1
    return cases


def check_every_dtype_moves_bit_exactly(comm: TorchComm) -> int:
    """allgather, broadcast and allgather_blocks move bytes: NaN payloads, -0.0, uint64 extremes intact."""
    cases = 0
    for dtype in MOVED:
        for n in SIZES:
            bits = np.random.default_rng([n, comm.rank, 11]).integers(0, 256, n * np.dtype(dtype).itemsize,
                                                                      dtype=np.uint8)
            x = bits.view(dtype)  # any bit pattern, NaNs with payloads included
            got = comm.allgather(x)
            for r, g in enumerate(got):
                want = np.random.default_rng([n, r, 11]).integers(0, 256, bits.size, dtype=np.uint8)
                assert g.dtype == np.dtype(dtype) and g.shape == x.shape
                np.testing.assert_array_equal(g.view(np.uint8), want, err_msg=f"allgather {np.dtype(dtype)} n={n}")
            for root in range(comm.size):
                y = x.copy()
                comm.broadcast(y, root)
                np.testing.assert_array_equal(y.view(np.uint8), got[root].view(np.uint8))
            z = np.zeros(comm.size * n, dtype)
            z[comm.rank * n : (comm.rank + 1) * n] = x
            comm.allgather_blocks(z)
            np.testing.assert_array_equal(z.view(np.uint8), np.concatenate([g.view(np.uint8) for g in got]))
            cases += 3
    shaped = np.full((2, 3), comm.rank, np.int64)  # allgather keeps shapes (views of one (size, 2, 3) buffer)
    got = comm.allgather(shaped)
    assert all(g.shape == (2, 3) and int(g[1, 2]) == r for r, g in enumerate(got))
    return cases + 1


def check_block_collectives_at_several_sizes(comm: TorchComm) -> int:
    """reduce_scatter: block ``rank`` of the sum, in place in block ``rank``; allgather_blocks: every block."""
    cases = 0
    for dtype in (np.float32, np.float64, BF16, np.int64, np.uint16):
        for n in SIZES:
            x = rank_values(dtype, comm.size * n, comm.rank)
            total = np.sum([rank_values(dtype, comm.size * n, r).astype(np.float64) for r in range(comm.size)],
                           axis=0).astype(dtype)
            own = comm.reduce_scatter(x)
            lo, hi = comm.rank * n, (comm.rank + 1) * n
            assert own.shape == (n,) and own.dtype == x.dtype
            assert n == 0 or (np.shares_memory(own, x) and own.ctypes.data == x[lo:].ctypes.data)
            np.testing.assert_array_equal(own, total[lo:hi], err_msg=f"{np.dtype(dtype)} n={n}")
            y = np.zeros(comm.size * n, dtype)
            y[lo:hi] = rank_values(dtype, n, comm.rank)
            comm.allgather_blocks(y)
            np.testing.assert_array_equal(y, np.concatenate([rank_values(dtype, n, r) for r in range(comm.size)]))
            cases += 2
    return cases


def check_nonblocking_allreduce_and_reduce(comm: TorchComm) -> int:
    cases = 0
    # several in flight at once, completed in another order than started
    xs = [rank_values(dt, 1037, comm.rank) for dt in (np.float32, np.float64, BF16, np.int16, np.int64)]
    wants = [np.sum([rank_values(x.dtype, 1037, r).astype(np.float64) for r in range(comm.size)], axis=0)
             .astype(x.dtype) for x in xs]
    handles = [comm.iallreduce(x) for x in xs]
    assert all(isinstance(h, TorchWork) for h in handles)
    for h in reversed(handles):
        assert h.wait() is None
    for h, x, want in zip(handles, xs, wants):
        assert h.test() is True and repr(h) == "TorchWork(complete)"
        h.wait()  # twice: harmless
        np.testing.assert_array_equal(x, want, err_msg=str(x.dtype))
        cases += 1
    # test() polls without blocking: rank 0 starts first, and cannot complete before the others join,
    # which they do only once rank 0 has tested (told through the job's key-value store, not a
    # collective; a test() that blocked would never return, and the job's timeout would end it)
    store = dist.distributed_c10d._get_default_store()
    x = np.full(100, comm.rank + 1.0)
    if comm.rank != 0:
        store.wait(["rank 0 tested"])
    h = comm.iallreduce(x, "max")
    if comm.rank == 0:
        assert h.test() is False, "test() completed alone"
        assert repr(h) == "TorchWork(pending)"
        store.set("rank 0 tested", "yes")
    while not h.test():
        time.sleep(0.001)
    assert np.all(x == comm.size)  # test() True: the result is in place without wait()
    cases += 1
    # ireduce to every root: the root holds the sum
    for root in range(comm.size):
        for dtype in (np.float32, np.float64, np.uint16):
            x = rank_values(dtype, 7, comm.rank)
            h = comm.ireduce(x, root)
            h.wait()
            if comm.rank == root:
                want = np.sum([rank_values(dtype, 7, r).astype(np.float64) for r in range(comm.size)], axis=0)
                np.testing.assert_array_equal(x, want.astype(dtype))
            cases += 1
    # several in flight at once, to every root (point-to-point over gloo), completed in reverse order
    xs = [(root, k, rank_values(np.float32, 5 + k, comm.rank)) for root in range(comm.size) for k in range(3)]
    handles = [comm.ireduce(x, root) for root, _, x in xs]
    for h in reversed(handles):
        h.wait()
    for root, k, x in xs:
        if comm.rank == root:
            want = np.sum([rank_values(np.float32, 5 + k, r) for r in range(comm.size)], axis=0, dtype=np.float32)
            np.testing.assert_array_equal(x, want)
    cases += 1
    empty = comm.iallreduce(np.zeros(0, np.float32))  # nothing to move: the exchange's completed handle
    assert empty.test() and empty.wait() is None
    return cases + 1


def check_a_subgroup(comm: TorchComm) -> int:
    """TorchComm over groups of one rank each: its own rank, size and roots; a non-member is refused."""
    singles = [dist.new_group([r]) for r in range(comm.size)]  # every rank creates every group, in order
    mine = TorchComm(singles[comm.rank])
    assert (mine.rank, mine.size, mine.is_local) == (0, 1, True)
    x = np.array([comm.rank + 1.0])
    mine.allreduce(x)
    mine.broadcast(x, 0)
    assert x[0] == comm.rank + 1.0 and mine.gather_objects(comm.rank) == [comm.rank]
    other = singles[(comm.rank + 1) % comm.size]
    if comm.size > 1:
        try:
            TorchComm(other)
        except ArgumentTypeError as exc:
            assert "not a member" in str(exc)
        else:
            raise AssertionError("a group without this process was taken")
    # the whole world again, as a new gloo group: roots are its ranks
    again = TorchComm(dist.new_group(list(range(comm.size)), backend="gloo"))
    y = np.full(3, float(comm.rank))
    again.broadcast(y, comm.size - 1)
    assert np.all(y == comm.size - 1)
    return 3


def check_bad_input_raises_before_any_collective(comm: TorchComm) -> int:
    """Each refused call raises a typed error naming the argument; the ranks stay in step."""
    ok = np.zeros(8, np.float32)
    ro = np.zeros(8, np.float32)
    ro.flags.writeable = False
    table = [
        (lambda: comm.allreduce(ok[::2]), ArgumentTypeError, "x: expected a C-contiguous"),
        (lambda: comm.allreduce(np.zeros((4, 4), np.float32).T), ArgumentTypeError, "x: expected a C-contiguous"),
        (lambda: comm.allreduce(ro), ReadOnlyError, "x: the collective writes"),
        (lambda: comm.allreduce(np.zeros(3, np.complex64)), DTypeError, "got complex64"),
        (lambda: comm.allreduce(np.zeros(3, bool)), DTypeError, "got bool"),
        (lambda: comm.allreduce(np.zeros(3, np.uint64)), DTypeError, "for a reduction, got uint64"),
        (lambda: comm.allreduce(np.zeros(3, ml_dtypes.float8_e4m3fn)), DTypeError, "got float8_e4m3fn"),
        (lambda: comm.allreduce(ok, op="mean"), ArgumentTypeError, "op: expected one of ('sum', 'max')"),
        (lambda: comm.allreduce(ok, op=None), ArgumentTypeError, "op:"),
        (lambda: comm.allreduce([1.0, 2.0]), BackendError, "x: expected a numpy or cupy array, got list"),
        (lambda: comm.allreduce(FakeCupyArray()), BackendError, "has no CUDA backend"),
        (lambda: comm.iallreduce(ro), ReadOnlyError, "x:"),
        (lambda: comm.iallreduce(ok, op="min"), ArgumentTypeError, "op:"),
        (lambda: comm.ireduce(ok, root=comm.size), ArgumentTypeError, "root: expected an int in [0, "),
        (lambda: comm.ireduce(ok[::2], root=0), ArgumentTypeError, "x: expected a C-contiguous"),
        (lambda: comm.ireduce(np.zeros(3, bool), root=0), DTypeError, "x:"),
        (lambda: comm.allgather(ok[::2]), ArgumentTypeError, "x: expected a C-contiguous"),
        (lambda: comm.allgather(np.zeros(2, np.complex128)), DTypeError, "x:"),
        (lambda: comm.allgather(FakeCupyArray()), BackendError, "no CUDA backend"),
        (lambda: comm.broadcast(ok, root=comm.size), ArgumentTypeError, "root: expected an int in [0, "),
        (lambda: comm.broadcast(ok, root=-1), ArgumentTypeError, "root:"),
        (lambda: comm.broadcast(ok, root=True), ArgumentTypeError, "root:"),
        (lambda: comm.broadcast(ro), ReadOnlyError, "x:"),
        (lambda: comm.broadcast(ok[::2]), ArgumentTypeError, "x:"),
        (lambda: comm.reduce_scatter(np.zeros(comm.size * 3 + 1)), ArgumentTypeError, "multiple of the group's"),
        (lambda: comm.reduce_scatter(np.zeros(comm.size * 2, np.uint64)), DTypeError, "x:"),
        (lambda: comm.reduce_scatter(np.zeros((comm.size, 2))), ArgumentTypeError, "1-D array"),
        (lambda: comm.allgather_blocks(np.zeros(comm.size * 3 + 1)), ArgumentTypeError, "multiple of the group's"),
        (lambda: comm.allgather_blocks(np.zeros(comm.size * 4, np.float32)[::2]), ArgumentTypeError, "C-contiguous"),
        (lambda: TorchComm(group="world"), ArgumentTypeError, "group: expected a torch.distributed ProcessGroup"),
    ]
    for i, (call, error, text) in enumerate(table):
        try:
            call()
        except error as exc:
            assert text in str(exc), f"case {i}: {text!r} not in {str(exc)!r}"
        else:
            raise AssertionError(f"case {i}: no {error.__name__}")
    assert np.all(ok == 0)
    # had any case entered a collective, this one would pair with it and fail or hang
    x = np.ones(3, np.int64)
    comm.allreduce(x)
    assert np.all(x == comm.size)
    return len(table)
