"""TorchComm on CuPy buffers over NCCL, one GPU per rank (run by ``checks.py nccl``; needs torch with CUDA).

Each rank selects GPU ``local_rank`` in torch and in CuPy; the group is
``cpu:gloo,cuda:nccl``, so CuPy arrays go through NCCL and NumPy arrays through gloo.
Checks: the collectives on the arrays' own memory (pointers unchanged, nothing copied),
ordering with a non-default CuPy stream (a kernel writes, the collective reads, a kernel
reads, no host synchronisation in between), the nonblocking handles, and the CUDA engine
over TorchComm against one process with the global batch.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

import arraytrain as at

SHAPES = {"w1": (12, 9), "b1": (12,), "w2": (4, 12), "b2": (4,)}


def check_collectives_on_device_memory(comm) -> int:
    cases = 0
    for dtype in (cp.float32, cp.float64, cp.float16, cp.int32, cp.uint8, cp.int16):
        for n in (0, 1, 7, 1037):
            x = ((cp.arange(n) * 7 + 3 * comm.rank) % 23).astype(dtype)
            ptr = x.data.ptr
            comm.allreduce(x)
            want = sum(((np.arange(n) * 7 + 3 * r) % 23) for r in range(comm.size)).astype(dtype)
            assert x.data.ptr == ptr
            np.testing.assert_array_equal(cp.asnumpy(x), want, err_msg=f"{np.dtype(dtype)} n={n}")
            got = comm.allgather(x)
            assert all(isinstance(g, cp.ndarray) and g.shape == x.shape for g in got)
            y = cp.full(n, comm.rank, dtype)
            comm.broadcast(y, comm.size - 1)
            np.testing.assert_array_equal(cp.asnumpy(y), np.full(n, comm.size - 1, dtype))
            cases += 3
    z = cp.arange(comm.size * 5, dtype=cp.float32) * (comm.rank + 1)
    own = comm.reduce_scatter(z)
    lo = comm.rank * 5
    want = np.arange(comm.size * 5, dtype=np.float32)[lo : lo + 5] * sum(range(1, comm.size + 1))
    assert own.data.ptr == z.data.ptr + lo * 4
    np.testing.assert_array_equal(cp.asnumpy(own), want)
    b = cp.zeros(comm.size * 3, cp.float64)
    b[lo // 5 * 3 : lo // 5 * 3 + 3] = comm.rank + 1
    comm.allgather_blocks(b)
    np.testing.assert_array_equal(cp.asnumpy(b), np.repeat(np.arange(1, comm.size + 1), 3).astype(np.float64))
    h = np.array([comm.rank + 1.0])  # a host array in the same comm: gloo
    comm.allreduce(h)
    assert h[0] == comm.size * (comm.size + 1) / 2
    return cases + 3


def check_ordering_on_a_non_default_cupy_stream(comm) -> int:
    """Written by a kernel, reduced, read by a kernel: all enqueued on one CuPy stream, no host sync."""
    stream = cp.cuda.Stream(non_blocking=True)
    n = 1 << 22
    with stream:
        x = cp.empty(n, cp.float32)
        for _ in range(20):  # a long queue before the collective: it must wait for it
            x.fill(comm.rank + 1.0)
            x *= 1.0
        comm.allreduce(x)
        total = float(x.sum())  # .sum() on the stream, then the host reads it
        x.fill(1.0)
        h = comm.iallreduce(x)
        h.wait()  # the stream waits, not the host
        second = x.sum()
    stream.synchronize()
    assert total == n * comm.size * (comm.size + 1) / 2, total
    assert float(second) == n * comm.size
    return 2


def check_cuda_engine_equals_one_process(comm) -> int:
    def params():
        rng = np.random.default_rng(0)
        return {k: cp.asarray(rng.standard_normal(s)) for k, s in SHAPES.items()}

    def grads(t, r):
        rng = np.random.default_rng([t, r, 5])
        return {k: cp.asarray(3 * rng.standard_normal(s)) for k, s in SHAPES.items()}

    eng = at.Engine(params(), at.optim.AdamW(lr=1e-2), comm=comm, max_grad_norm=2.0)
    one = at.Engine(params(), at.optim.AdamW(lr=1e-2), accumulation_steps=comm.size, max_grad_norm=2.0)
    shard = at.Engine(params(), at.optim.AdamW(lr=1e-2), comm=comm, max_grad_norm=2.0, shard_state=True)
    for t in range(5):
        eng.step(grads(t, comm.rank))
        shard.step(grads(t, comm.rank))
        for r in range(comm.size):
            one.step(grads(t, r))
    np.testing.assert_allclose(cp.asnumpy(eng.params.flat), cp.asnumpy(one.params.flat), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(cp.asnumpy(shard.params.flat), cp.asnumpy(eng.params.flat), rtol=1e-12, atol=1e-15)
    return 2
