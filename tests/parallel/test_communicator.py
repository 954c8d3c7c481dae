"""The communicator (``parallel/communicator.py``) in one process: :class:`LocalComm`, the interface's default
collectives over a group of threads (``thread_group.ThreadGroup``), the set-up agreement, the window's sums and
the checks of the engine's parallel arguments. The transports: ``test_mpi.py`` (under mpiexec) and
``test_torch_dist.py`` (under torchrun).
"""

from __future__ import annotations

import numpy as np
import pytest

import arraytrain as at
from arraytrain.errors import ArgumentTypeError, HyperparameterError
from arraytrain.parallel.communicator import Communicator, LocalComm, check_comm, check_parallel, window_sums
from builders import random_engine
from thread_group import ThreadExchange, ThreadGroup

SHAPES = {"w1": (12, 9), "b1": (12,), "w2": (4, 12), "b2": (4,)}


def test_the_local_comm_is_the_default_and_other_objects_are_refused():
    eng = random_engine(SHAPES, at.optim.SGD(lr=0.1))
    assert isinstance(eng.comm, LocalComm) and eng.comm.is_local
    with pytest.raises(ArgumentTypeError, match="comm"):
        random_engine(SHAPES, at.optim.SGD(lr=0.1), comm=object())
    assert isinstance(check_comm(None), LocalComm)


def test_ranges_of_every_block_are_gathered_and_a_bad_range_is_refused():
    """``iallgather_blocks``: the default (an all-gather of the own block's range, copied into place) in a thread
    group, and a group of one; ``lo``/``hi`` outside a block refused by name before anything moves."""
    def rank_run(rank, comm):
        x = np.full(3 * 10, -1.0)
        x[rank * 10 : (rank + 1) * 10] = rank * 100 + np.arange(10)
        assert comm.iallgather_blocks(x, 2, 5).test()
        for r in range(3):
            want = np.full(10, -1.0) if r != rank else r * 100 + np.arange(10.0)
            want[2:5] = r * 100 + np.arange(2, 5)
            np.testing.assert_array_equal(x[r * 10 : (r + 1) * 10], want)
        for lo, hi, name in ((-1, 3, "lo"), (4, 3, "hi"), (0, 11, "hi"), (11, 11, "lo")):
            with pytest.raises(ArgumentTypeError, match=name):
                comm.iallgather_blocks(x, lo, hi)
        return True

    assert ThreadGroup(3).run(rank_run) == [True] * 3
    one = np.arange(4.0)
    LocalComm().iallgather_blocks(one, 0, 4).wait()
    np.testing.assert_array_equal(one, np.arange(4.0))
    with pytest.raises(ArgumentTypeError, match="hi"):
        LocalComm().iallgather_blocks(one, 0, 5)


def test_the_local_comm_is_the_identity_and_refuses_what_a_group_of_one_cannot_do():
    comm = LocalComm()
    assert comm.is_local and (comm.rank, comm.size) == (0, 1) and repr(comm) == "LocalComm()"
    x = np.arange(6.0)
    comm.allreduce(x, "max")
    comm.broadcast(x, 0)
    comm.allgather_blocks(x)
    assert comm.reduce_scatter(x) is x and comm.allgather(x)[0] is x and comm.gather_objects("o") == ["o"]
    assert comm.iallreduce(x).test() and comm.ireduce(x).test()
    np.testing.assert_array_equal(x, np.arange(6.0))
    with pytest.raises(ArgumentTypeError, match="op"):
        comm.allreduce(x, "prod")
    with pytest.raises(ArgumentTypeError, match="root"):
        comm.broadcast(x, 1)
    with pytest.raises(ArgumentTypeError, match="1-D"):
        comm.reduce_scatter(np.zeros((2, 3)))


class _DefaultBlocks(ThreadExchange):
    """A thread rank with the interface's default block collectives and gather (built on allreduce/allgather)."""

    reduce_scatter = Communicator.reduce_scatter
    allgather_blocks = Communicator.allgather_blocks
    gather = Communicator.gather


class _DefaultGroup(ThreadGroup):
    def comms(self):
        return [_DefaultBlocks(self, r) for r in range(self.size)]


def test_the_default_block_collectives_move_each_ranks_block():
    def rank_run(rank, comm):
        x = np.arange(12.0) + 100 * rank
        own = comm.reduce_scatter(x)
        assert np.shares_memory(own, x) and own.shape == (4,)
        y = np.full(12, -1.0)
        y[4 * rank : 4 * rank + 4] = rank
        comm.allgather_blocks(y)
        z = np.full(3, float(rank))
        assert comm.ireduce(z, 1).test()  # the default: an all-reduce at once
        with pytest.raises(ArgumentTypeError, match="multiple of the group's size 3"):
            comm.reduce_scatter(np.zeros(10))
        return own.copy(), y, comm.gather(np.array([rank]), 1), z

    for rank, (own, y, gathered, z) in enumerate(_DefaultGroup(3).run(rank_run)):
        np.testing.assert_array_equal(own, 3 * np.arange(4.0 * rank, 4.0 * rank + 4) + 300)
        np.testing.assert_array_equal(y, np.repeat([0.0, 1.0, 2.0], 4))
        np.testing.assert_array_equal(z, np.full(3, 3.0))
        if rank == 1:
            assert [int(a[0]) for a in gathered] == [0, 1, 2]
        else:
            assert gathered is None


def test_window_sums_adds_the_weight_sums_and_flags_a_bad_rank_everywhere():
    assert ThreadGroup(3).run(lambda rank, comm: window_sums(comm, rank + 1.0, rank == 2)) == [(6.0, True)] * 3
    assert ThreadGroup(2).run(lambda rank, comm: window_sums(comm, 0.25, False)) == [(0.5, False)] * 2
    assert window_sums(LocalComm(), 2.5, True) == (2.5, True)


def test_agree_raises_the_same_error_on_every_rank_naming_the_first_odd_one():
    def rank_run(rank, comm):
        comm.agree("the thing", ("same", 1))  # equal everywhere: nothing
        with pytest.raises(HyperparameterError) as info:
            comm.agree("the thing", 5 if rank >= 2 else 1, error=HyperparameterError)
        return str(info.value)

    msgs = ThreadGroup(4).run(rank_run)
    assert len(set(msgs)) == 1
    assert msgs[0] == "the thing differs across processes: rank 0 has 1, rank 2 has 5 (2 of 4 ranks differ)"


def test_check_parallel_refuses_sharded_state_alone_and_a_bad_bucket_size():
    comm, shard, overlap, bucket = check_parallel(None, False, True, 4096)
    assert isinstance(comm, LocalComm) and (shard, overlap, bucket) == (False, True, 4096)
    with pytest.raises(HyperparameterError, match="shard_state: sharded state needs a group"):
        check_parallel(None, True, False, None)
    with pytest.raises(HyperparameterError, match="bucket_bytes"):
        check_parallel(None, False, True, 0)
