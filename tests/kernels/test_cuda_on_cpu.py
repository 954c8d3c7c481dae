"""The CPU executor of the CUDA sources (:mod:`arraytrain.kernels.cuda.on_cpu`).

First the CUDA semantics it must keep, each on a small kernel of its own: barriers that a
missing ``__syncthreads`` shows in either direction of the race, warp shuffles, ballots and
``__reduce_max_sync`` with a warp's lanes in step (lanes that returned take no part), a barrier
that can never complete reported, arguments packed and checked as the driver would read them.
Then one kernel of each CUDA source of the family run on it against the reference twins
through the CPU families' own tests (the default tier's share; CI runs every CUDA-parametrized
test on it in the slow tier with ``ARRAYTRAIN_CUDA=cpu``). Needs the host C++ compiler only.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from arraytrain.errors import HyperparameterError
from arraytrain.kernels.cuda import core, on_cpu
from arraytrain.kernels.cuda.on_cpu import runtime

pytestmark = pytest.mark.skipif(shutil.which(runtime.CXX) is None, reason=f"no host C++ compiler ({runtime.CXX})")

RACES = r"""
// thread 0 adds what every thread stored: with the barrier, the block's sum
__global__ void block_sum(const float* __restrict__ x, float* __restrict__ out, int barrier) {
    __shared__ float s[256];
    s[threadIdx.x] = x[blockIdx.x * blockDim.x + threadIdx.x];
    if (barrier) __syncthreads();
    if (threadIdx.x == 0) {
        float a = 0.0f;
        for (unsigned i = 0; i < blockDim.x; ++i) a += s[i];
        out[blockIdx.x] = a;
    }
}
// each thread reads its lower neighbour's store: the race the other way round
__global__ void from_below(const int* __restrict__ x, int* __restrict__ out, int barrier) {
    __shared__ int s[256];
    const int t = threadIdx.x, b = blockIdx.x * blockDim.x;
    s[t] = x[b + t];
    if (barrier) __syncthreads();
    out[b + t] = s[(t + blockDim.x - 1) % blockDim.x];
}
"""

WARPS = r"""
__global__ void warp_ops(const int* __restrict__ x, int* __restrict__ out) {
    const int t = threadIdx.x, n = blockDim.x, v = x[t];
    out[0 * n + t] = __shfl_down_sync(0xffffffffu, v, 3);
    out[1 * n + t] = __shfl_xor_sync(0xffffffffu, v, 5);
    out[2 * n + t] = __shfl_sync(0xffffffffu, v, 2, 8);
    out[3 * n + t] = (int)__ballot_sync(0xffffffffu, v > 0);
    out[4 * n + t] = (int)__reduce_max_sync(0xffffffffu, (unsigned)v);
    double d = (double)v;
    for (int o = 16; o > 0; o >>= 1) d += __shfl_down_sync(0xffffffffu, d, o);
    out[5 * n + t] = (int)d;
}
__global__ void stuck(int* __restrict__ out) {
    if (threadIdx.x == 0) __syncthreads();  // lane 0 at the block's barrier ...
    else out[threadIdx.x] = __shfl_sync(0xffffffffu, (int)threadIdx.x, 0);  // ... the others wait for it here
}
__global__ void grid2d(int* __restrict__ out) {
    const int b = blockIdx.y * gridDim.x + blockIdx.x;
    out[b * blockDim.x * blockDim.y + threadIdx.y * blockDim.x + threadIdx.x] = 1000 * b + 10 * threadIdx.y + threadIdx.x;
}
__global__ void any_finite(const double* __restrict__ x, long long n, int* __restrict__ bad) {
    int b = 0;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) b |= !isfinite(x[i]);
    if (__syncthreads_or(b) && threadIdx.x == 0) atomicOr(bad, 1);
}
"""


@pytest.fixture(scope="module")
def races():
    return runtime.Module(RACES, (), ("block_sum", "from_below"))


@pytest.fixture(scope="module")
def warps():
    return runtime.Module(WARPS, (), ("warp_ops", "stuck", "grid2d", "any_finite"))


def dev(a):
    return on_cpu.asarray(a)


def test_a_block_reduction_needs_its_barrier(races):
    x = np.arange(3 * 256, dtype=np.float32) % 7
    out = dev(np.zeros(3, np.float32))
    races.get_function("block_sum")((3,), (256,), (dev(x), out, np.int32(1)))
    np.testing.assert_array_equal(out.get(), x.reshape(3, 256).sum(1))
    out[...] = 0
    races.get_function("block_sum")((3,), (256,), (dev(x), out, np.int32(0)))
    assert not np.array_equal(out.get(), x.reshape(3, 256).sum(1)), "the missing barrier went unseen"


@pytest.mark.parametrize("barrier", [1, 0])
def test_a_race_is_seen_from_either_side(races, barrier):
    """Two blocks: one runs its threads forward to the first barrier, the other backward."""
    x = np.arange(2 * 64, dtype=np.int32)
    out = dev(np.full(2 * 64, -1, np.int32))
    races.get_function("from_below")((2,), (64,), (dev(x), out, np.int32(barrier)))
    want = np.roll(x.reshape(2, 64), 1, axis=1).reshape(-1)
    wrong = np.flatnonzero(out.get() != want)
    if barrier:
        assert wrong.size == 0
    else:
        assert wrong.size > 0 and np.any(wrong < 64) and np.any(wrong >= 64)


def test_warp_operations_keep_the_lanes_in_step(warps):
    n = 48  # the second warp has 16 lanes: a shuffle from a lane that does not exist keeps its own value
    x = (np.arange(n) * 37 % 11 - 5).astype(np.int32)
    out = dev(np.zeros(6 * n, np.int32))
    warps.get_function("warp_ops")((1,), (n,), (dev(x), out))
    got = out.get().reshape(6, n)
    lanes = np.arange(n) % 32
    warp = np.arange(n) // 32
    size = np.where(warp == 0, 32, 16)
    down = np.where(lanes + 3 < 32, np.arange(n) + 3, np.arange(n))
    down = np.where(lanes + 3 < size, down, np.arange(n))  # the lane past the last lane: no value (own kept)
    np.testing.assert_array_equal(got[0][lanes + 3 < size], x[down][lanes + 3 < size])
    xor = np.arange(n) ^ 5
    ok = (xor % 32) < size
    np.testing.assert_array_equal(got[1][ok], x[xor[ok]])
    np.testing.assert_array_equal(got[2], x[(np.arange(n) & ~7) + 2])
    for w in (0, 1):
        lo, hi = 32 * w, min(32 * w + 32, n)
        ballot = sum(1 << (i - lo) for i in range(lo, hi) if x[i] > 0)
        np.testing.assert_array_equal(got[3][lo:hi].view(np.uint32), ballot)
        np.testing.assert_array_equal(got[4][lo:hi].view(np.uint32), x[lo:hi].view(np.uint32).max())
    assert got[5][0] == x[:32].sum()  # a warp's tree reduction: the sum in lane 0


def test_the_portable_fiber_switch_runs_the_same(races):
    """ucontext's switch, where the x86-64 one is not built: the same sums, the same missing barrier seen."""
    portable = runtime.Module(RACES, ("-DAT_UCONTEXT",), ("block_sum",))
    x = np.arange(2 * 128, dtype=np.float32) % 5
    for barrier in (1, 0):
        out = dev(np.zeros(2, np.float32))
        portable.get_function("block_sum")((2,), (128,), (dev(x), out, np.int32(barrier)))
        assert np.array_equal(out.get(), x.reshape(2, 128).sum(1)) == bool(barrier)


def test_a_barrier_that_cannot_complete_is_an_error(warps):
    with pytest.raises(on_cpu.LaunchError, match=r"stuck: block \(0, 0, 0\) cannot go on"):
        warps.get_function("stuck")((1,), (32,), (dev(np.zeros(32, np.int32)),))


def test_grid_and_block_in_two_dimensions(warps):
    out = dev(np.zeros(6 * 8, np.int32))
    warps.get_function("grid2d")((3, 2), (4, 2), (out,))
    b, ty, tx = np.meshgrid(np.arange(6), np.arange(2), np.arange(4), indexing="ij")
    np.testing.assert_array_equal(out.get(), (1000 * b + 10 * ty + tx).reshape(-1))


def test_syncthreads_or_and_atomics(warps):
    fn = warps.get_function("any_finite")
    for bad_at in (None, 0, 999):
        x = np.ones(1000)
        if bad_at is not None:
            x[bad_at] = np.inf
        flag = dev(np.zeros(1, np.int32))
        fn((1,), (128,), (dev(x), np.int64(x.size), flag))
        assert int(flag.get()[0]) == (bad_at is not None)


def test_arguments_are_checked_as_the_driver_reads_them(warps):
    fn = warps.get_function("any_finite")
    x, flag = dev(np.ones(4)), dev(np.zeros(1, np.int32))
    with pytest.raises(on_cpu.LaunchError, match="argument 1 is int32 .4 bytes., parameter 1 is 8 bytes"):
        fn((1,), (32,), (x, np.int32(4), flag))  # the kernel would read 8 bytes from a 4-byte argument
    with pytest.raises(on_cpu.LaunchError, match="argument 0 is a NumPy .host. array"):
        fn((1,), (32,), (np.ones(4), np.int64(4), flag))
    with pytest.raises(on_cpu.LaunchError, match="2 arguments for 3 parameters"):
        fn((1,), (32,), (x, np.int64(4)))
    with pytest.raises(on_cpu.LaunchError, match=r"argument 1 \(str\) is no kernel argument"):
        fn((1,), (32,), (x, "4", flag))
    fn((1,), (32,), (x, 4, flag))  # a Python int is packed as int64, as CuPy packs it
    assert int(flag.get()[0]) == 0


def test_a_source_that_does_not_compile_says_why():
    with pytest.raises(on_cpu.CompileError, match="undeclared|not declared"):
        runtime.Module("__global__ void k(float* x) { x[0] = y; }", (), ("k",))


def test_the_environment_variable_selects_it(monkeypatch):
    monkeypatch.setattr(core, "_cupy", None)
    monkeypatch.setenv("ARRAYTRAIN_CUDA", "cpu")
    assert core.cupy() is on_cpu and core.probe()
    monkeypatch.setattr(core, "_cupy", None)
    monkeypatch.setenv("ARRAYTRAIN_CUDA", "yes")
    with pytest.raises(HyperparameterError, match="ARRAYTRAIN_CUDA='yes'"):
        core.cupy()
    assert core._cupy is None  # nothing chosen


def test_device_arrays_behave_as_cupy_arrays():
    a = on_cpu.arange(6, dtype=np.float32)
    assert isinstance(a, on_cpu.ndarray) and type(a.get()) is np.ndarray
    s = (a * 2).sum()
    assert isinstance(s, on_cpu.ndarray) and s.ndim == 0 and float(s.get()) == 30.0
    a[2:].set(np.zeros(4, np.float32))
    assert a.get().tolist() == [0, 1, 0, 0, 0, 0] and a.data.ptr == a.__array_interface__["data"][0]
    with pytest.raises(ValueError):
        a.set(np.zeros(5, np.float32))


# -- one kernel of each CUDA source, through the CPU families' own tests -------------------------------------


@pytest.fixture
def executor(monkeypatch):
    """The CUDA family behind NumPy arguments (cuda_family.ON_DEVICE), executed on the CPU; the test
    directories on the path, so that their modules import when this file runs alone."""
    from cuda_family import ON_DEVICE

    tests = Path(__file__).resolve().parents[1]
    for sub in ("kernels", "compress", "optim", "."):
        monkeypatch.syspath_prepend(str(tests / sub))
    monkeypatch.setattr(core, "_cupy", on_cpu)
    return ON_DEVICE


def test_reductions_source(executor, rng):
    import test_kernels

    test_kernels.test_sumsq_matches_reference(executor, 1037, np.float32, rng)
    test_kernels.test_all_finite_detects_nonfinite(executor, 1037, np.float64, np.nan, "last", rng)


def test_optimizers_source(executor, rng):
    import test_kernels

    test_kernels.test_adam_step_matches_reference(executor, 1037, np.float32, False, True, rng)


def test_compression_source(executor):
    import test_compress

    test_compress.test_topk_ties_and_edge_cases(executor, np.float32, np.int64)


def test_projection_source(executor, rng):
    import test_compress_lowrank

    test_compress_lowrank.test_fwht_kernel_equals_reference_and_is_orthonormal(executor, 64, 3, np.float32, rng)


def test_trend_source(executor, rng):
    import test_predict

    test_predict.test_trend_kernels_match_reference(executor, rng, 1037, np.float32, 3)


def test_muon_and_schedule_free_source(executor, rng):
    import test_schedule_free

    test_schedule_free.test_kernel_matches_reference(executor, 1037, np.float32, rng)
