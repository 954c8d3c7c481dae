"""The overlapped exchange over MPIComm's nonblocking collectives (run by ``checks.py overlap``).

``MPI_Iallreduce`` / ``MPI_Ireduce`` handles against their blocking twins, then the MLP
trained through the zero-copy path, each layer marked ready by its backward: overlapped
equals blocking (bitwise with 2 ranks), replicated and sharded, with ranks that mark in
different orders and a parameter one rank never marks; ``MPI_Iallgather`` of pieces of every
block against the blocking all-gather, and a torch model whose sharded weights are gathered
during its next forward pass (``gather_in_forward``) against the publish at the step.
"""

from __future__ import annotations

import numpy as np
from comm_checks import same_everywhere

import arraytrain as at
from arraytrain import nn

SIZES = [20, 64, 48, 32, 10]


def check_nonblocking_collectives_equal_the_blocking_ones(comm) -> int:
    cases = 0
    for dtype in (np.float32, np.float64, np.int32):
        for n in (0, 1, 1000, 300_001):
            x = (np.arange(n) % 97 * (comm.rank + 1)).astype(dtype)
            want = x.copy()
            comm.allreduce(want)
            h = comm.iallreduce(x)
            while not h.test():  # MPI_Test moves it on
                pass
            h.wait()
            np.testing.assert_array_equal(x, want)
            for root in range(comm.size):
                y = (np.arange(n) % 89 * (comm.rank + 2)).astype(dtype)
                comm.ireduce(y, root).wait()
                if comm.rank == root:
                    np.testing.assert_array_equal(y, sum((np.arange(n) % 89 * (r + 2)).astype(dtype)
                                                         for r in range(comm.size)).astype(dtype))
            cases += 1
    for n in (1, 5, 1000, 70_001):
        for step in (n, 333, 1) if n < 1000 else (n, 333):
            x = np.zeros(comm.size * n, np.float32)
            x[comm.rank * n : (comm.rank + 1) * n] = np.arange(n) % 101 + 1000 * comm.rank
            want = x.copy()
            comm.allgather_blocks(want)
            handles = [comm.iallgather_blocks(x, lo, min(lo + step, n)) for lo in range(0, n, step)]
            for h in handles[::-1]:  # any order of completion
                h.wait()
            np.testing.assert_array_equal(x, want)
            cases += 1
    return cases


def _train(comm, overlap, shard=False, mode=None, bucket_bytes=2048):
    model = nn.MLP(SIZES, dtype=np.float64)
    eng = at.Engine(model.init(seed=0), at.optim.AdamW(lr=1e-2, weight_decay=0.01), comm=comm, accumulation_steps=2,
                    max_grad_norm=1.0, overlap=overlap, shard_state=shard, bucket_bytes=bucket_bytes)
    model.bind(eng)
    last = comm.size - 1
    for t in range(3):
        for m in range(2):
            rng = np.random.default_rng([comm.rank, t, m])
            x, y = rng.standard_normal((16, SIZES[0])), rng.integers(0, SIZES[-1], 16)
            _, d = nn.softmax_cross_entropy(model.forward(x), y)
            if mode is not None:
                model._engine = None  # marked by hand below
            model.backward(d, accumulate=m > 0)
            if mode is not None:
                model._engine = eng
                names = list(eng.layout.names)
                if mode == "unused" and comm.rank == last:
                    eng.grads["fc1.bias"][...] = 0
                    names.remove("fc1.bias")
                if mode == "reversed" and comm.rank == last:
                    names = names[::-1]
                for name in names:
                    eng.mark_ready(name)
            eng.step()
    return np.concatenate([eng.params[n].ravel() for n in model.shapes])  # the model's order, whatever the layout's


def check_progress_thread_completes_what_nobody_tests(comm) -> int:
    """MPIComm's progress thread completes a started collective while the caller only sleeps (both sides
    of the all-reduce, so each rank's thread moves its own part), then forgets it; without the thread
    the request stays where it was started."""
    import time

    from arraytrain.distributed import MPIComm

    assert comm.progress is not None  # mpi4py starts MPI with MPI_THREAD_MULTIPLE
    x = np.full(300_001, comm.rank + 1.0)
    h = comm.iallreduce(x)
    end = time.monotonic() + 30
    while not h.done and time.monotonic() < end:
        time.sleep(0.01)
    assert h.done, "the progress thread did not complete the all-reduce"
    np.testing.assert_array_equal(x, sum(range(1, comm.size + 1)))
    while comm.progress.in_flight and time.monotonic() < end:
        time.sleep(0.01)
    assert comm.progress.in_flight == 0
    h.wait()  # completed already: nothing left to do, and no second completion
    assert h.test()
    lazy = MPIComm(comm.comm, progress_thread=False)
    assert lazy.progress is None
    h = lazy.iallreduce(x)
    assert not h.done
    h.wait()
    np.testing.assert_array_equal(x, sum(range(1, comm.size + 1)) * comm.size)
    return 2


def check_overlapped_equals_blocking(comm) -> int:
    from arraytrain.distributed import MPIComm

    lazy = MPIComm(comm.comm, progress_thread=False)
    cases = 0
    for shard in (False, True):
        for mode in (None, "reversed", "unused"):
            want = _train(comm, False, shard, "unused" if mode == "unused" else None)
            got = _train(comm, True, shard, mode)
            assert same_everywhere(comm, got), (shard, mode)
            np.testing.assert_array_equal(_train(lazy, True, shard, mode), got)  # the thread changes no bit
            assert same_everywhere(comm, got), (shard, mode)
            if comm.size == 2:
                np.testing.assert_array_equal(got, want, err_msg=f"shard={shard} mode={mode}")
            else:
                np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15, err_msg=f"shard={shard} mode={mode}")
            cases += 1
    return cases


def check_weights_gathered_in_the_next_forward_pass_equal_the_publish_at_the_step(comm) -> int:
    import torch

    from arraytrain.interop import torch as att

    def run(gif):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(30, 600), torch.nn.Tanh(), torch.nn.Linear(600, 300),
                                    torch.nn.Tanh(), torch.nn.Linear(300, 10)).double()
        eng = att.bind(model, at.optim.AdamW(lr=1e-2), comm=comm, shard_state=True, max_grad_norm=1.0,
                       gather_in_forward=gif)
        outs = []
        for t in range(4):
            rng = np.random.default_rng([comm.rank, t])
            out = model(torch.from_numpy(rng.standard_normal((8, 30))))
            outs.append(out.detach().numpy().copy())
            out.square().mean().backward()
            eng.step()
            assert (eng._placement.in_flight > 0) == gif
        final = np.concatenate([v.numpy().ravel() for v in model.state_dict().values()])
        assert eng._placement.in_flight == 0
        return outs, final

    (o1, f1), (o2, f2) = run(False), run(True)
    for a, b in zip(o1, o2):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(f1, f2)
    assert same_everywhere(comm, f2)
    return len(o1)
