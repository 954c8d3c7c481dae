"""Pieces of the compressors' group exchange that need no MPI (the exchange itself: in threads in
tests/parallel/test_sync.py, under mpiexec in tests/parallel/mpi/).

The all-reduce of summable payload arrays (one collective per dtype) over the thread-backed
group of tests/thread_group.py, and int8's wire type for the sums of codes.
"""

from __future__ import annotations

import numpy as np
import pytest

from arraytrain import Layout
from arraytrain import compress as C
from arraytrain.compress._quant import _decode_wide
from arraytrain.compress._summed import allreduce_arrays
from arraytrain.parallel.communicator import LocalComm
from thread_group import ThreadGroup


def test_summable_arrays_travel_in_one_all_reduce_per_dtype():
    group = ThreadGroup(3)

    def rank_run(rank, comm):
        arrays = [np.full(3, rank, np.float32), np.full((2, 2), 10 * rank, np.float32),
                  np.full(5, rank, np.int16), np.full(1, rank, np.float32)]
        allreduce_arrays(comm, arrays)
        return arrays

    for arrays in group.run(rank_run):
        assert [a.shape for a in arrays] == [(3,), (2, 2), (5,), (1,)]
        assert np.all(arrays[0] == 3) and np.all(arrays[1] == 30) and np.all(arrays[2] == 3) and arrays[3][0] == 3
    assert group.calls[0] == [("allreduce", (8,), "<f4", "sum"), ("allreduce", (5,), "<i2", "sum")]


class _Sized(LocalComm):
    """A group of ``size`` processes for rules that depend on the size alone (no collective runs)."""

    def __init__(self, size):
        self.size = size


@pytest.mark.parametrize("size, backend, want", [(1, "numpy", np.int8), (2, "numpy", np.int16),
                                                 (258, "numpy", np.int16), (259, "numpy", np.int32),
                                                 (16, "cupy", np.float16), (17, "cupy", np.int32)])
def test_int8_codes_travel_in_a_type_that_holds_their_sum(size, backend, want):
    c = C.Int8Block().bind(Layout({"w": (300,)}), np.float32, comm=_Sized(size))
    c._backend = backend  # the rule only: NCCL (CuPy arrays) has no int16
    codes = c._codes_dtype()
    assert codes == np.dtype(want)
    if size > 1:  # every partial sum of ``size`` codes in [-127, 127] is exact in that type
        top = 127 * size
        assert np.array(top, codes) == top and np.array(-top, codes) == -top


@pytest.mark.parametrize("wide", [np.int16, np.int32, np.float16])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_summed_codes_decode_as_codes_times_their_block_scale(wide, dtype, rng):
    n, block = 1037, 64
    codes = rng.integers(-2032, 2033, n).astype(wide)
    scales = rng.uniform(0.1, 2, -(-n // block)).astype(dtype)
    out = np.empty(n, dtype)
    _decode_wide(codes, scales, block, out)
    want = codes.astype(np.float64) * np.repeat(scales.astype(np.float64), block)[:n]
    np.testing.assert_allclose(out, want, rtol=np.finfo(dtype).eps)
