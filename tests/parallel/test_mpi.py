"""Processes over MPI: the multi-rank checks of ``tests/parallel/mpi/`` under mpiexec, each launch bounded.

Every multi-rank test launches ``mpiexec -n K python tests/parallel/mpi/checks.py GROUP...``
through :func:`arraytrain.distributed.launch` with a timeout (a distributed bug is a
hang until proven otherwise) and is skipped when mpi4py or mpiexec is missing
(``pip install "arraytrain[mpi]"``). Many checks share one launch: start-up is the cost.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import arraytrain
from arraytrain.distributed import abort_on_error, find_mpiexec, launch
from arraytrain.errors import BackendUnavailableError
from thread_group import ThreadGroup

HERE = Path(__file__).resolve().parent
CHECKS = HERE / "mpi" / "checks.py"
# the arraytrain this process imports, for the ranks too (a source checkout beside an installed copy)
SOURCE = str(Path(arraytrain.__file__).resolve().parents[1])
TIMEOUT = 300  # seconds per launch; the checks take a few seconds on 2 cores


def rank_env() -> dict:
    """Skip without MPI; else the variables for the ranks (this arraytrain, one numba thread each)."""
    if importlib.util.find_spec("mpi4py") is None or find_mpiexec() is None:
        pytest.skip('needs mpi4py and mpiexec: pip install "arraytrain[mpi]"')
    path = os.pathsep.join(p for p in (SOURCE, os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "NUMBA_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def ranks(n: int, *args, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    env = rank_env()
    try:
        return launch(n, [sys.executable, *args], timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpiexec -n {n} {args} did not finish in {timeout} s (a hang?)\n"
                    f"stdout:\n{exc.output}\nstderr:\n{exc.stderr}")


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_collectives_compressed_exchange_and_engine(n):
    proc = ranks(n, CHECKS, "comm", "compress", "engine")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("all ") and f"checks passed on {n} ranks" in summary, proc.stdout + proc.stderr
    print(summary)


def _shard_checks():
    sys.path.insert(0, str(CHECKS.parent))
    try:
        import shard_checks
    finally:
        sys.path.remove(str(CHECKS.parent))
    return shard_checks


@pytest.mark.slow  # the slow tier: 2 then 3 ranks (about a minute of compiling with numba's cache empty)
def test_sharded_state_and_overlap_over_mpi_and_a_checkpoint_across_numbers_of_ranks(tmp_path):
    """2 ranks then 3 ranks: the sharded engine follows the replicated one, the overlapped exchange the
    blocking one (MPI's nonblocking collectives, with and without MPIComm's progress thread; on 2, 3
    and 4 ranks); 3 ranks resume the 2 ranks' checkpoint, and one process resumes both, each
    continuing the one-process trajectory."""
    rank_env()  # (skips without MPI)
    shard_checks = _shard_checks()
    # The checks' kernels compiled once, here, on a group of two threads (numba compiles under one
    # lock), and loaded from numba's cache by the ranks: 2 or 3 ranks compiling the same kernels
    # at once on 2 cores took 2.5 minutes of CI; one process compiles them in about as much CPU
    # time as one rank, and the ranks then take seconds. The threads run the checks themselves.
    for check in (shard_checks.check_sharded_equals_replicated_for_every_kind_of_elementwise_step,
                  shard_checks.check_low_precision_sharded_equals_replicated,
                  shard_checks.check_8bit_sharded_equals_replicated):
        ThreadGroup(2).run(lambda rank, comm: check(comm))  # noqa: B023 - run at once
    os.environ["ARRAYTRAIN_SHARD_DIR"] = str(tmp_path)  # launch() passes this process's environment on
    try:
        for n, groups in ((2, ("shard", "overlap")), (3, ("shard", "overlap")), (4, ("overlap",))):
            proc = ranks(n, CHECKS, *groups)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert f"checks passed on {n} ranks" in proc.stdout.strip().splitlines()[-1], proc.stdout + proc.stderr
    finally:
        del os.environ["ARRAYTRAIN_SHARD_DIR"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved-by-2.safetensors", "saved-by-3.safetensors"]
    os.environ["ARRAYTRAIN_SHARD_DIR"] = str(tmp_path)
    try:
        assert shard_checks.check_a_checkpoint_resumes_on_any_number_of_ranks(None) == 3
    finally:
        del os.environ["ARRAYTRAIN_SHARD_DIR"]


def test_a_crashing_rank_ends_the_job_with_its_error():
    """The last rank fails before a collective the others wait in: abort_on_error ends every rank."""
    t0 = time.monotonic()
    proc = ranks(2, CHECKS, "crash", timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 100
    assert "arraytrain: rank 1 of 2 failed; aborting all 2 ranks (MPI_Abort)" in proc.stderr, proc.stderr
    assert "ArgumentTypeError: x: expected a C-contiguous array" in proc.stderr, proc.stderr
    assert "unreachable" not in proc.stdout
    assert proc.stderr.count("Traceback") == 1, proc.stderr


def test_a_rank_failing_with_buckets_in_flight_ends_the_job():
    """The overlapped exchange: a rank dies while its nonblocking all-reduces are in flight; every rank ends."""
    t0 = time.monotonic()
    proc = ranks(2, CHECKS, "crash-in-flight", timeout=120)
    assert proc.returncode != 0 and time.monotonic() - t0 < 100
    assert "rank 1 of 2 failed; aborting all 2 ranks (MPI_Abort)" in proc.stderr, proc.stderr
    assert "this rank fails with buckets in flight" in proc.stderr and "unreachable" not in proc.stdout


def test_a_rank_that_stops_answering_ends_the_others_at_their_deadline():
    """Once steady, a collective waits at most the communicator's timeout (2 s here): the waiting rank writes
    one typed line and ends with status 124, and mpiexec ends the silent one; the first step's slow peer
    (4 s, as when compiling) was waited for under the start's limit (20 s)."""
    from arraytrain.parallel.deadline import EXIT_STATUS

    t0 = time.monotonic()
    proc = ranks(2, CHECKS, "stall", timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode != 0 and took < 100, (took, proc.stdout, proc.stderr)
    assert "rank 0: steady after 3 steps" in proc.stdout and "rank 1: steady after 3 steps" in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if "CommTimeoutError" in ln]
    assert len(lines) == 1, proc.stderr
    assert re.match(r"arraytrain: CommTimeoutError: rank 0 of 2: iallreduce of [0-9]+ bytes has waited [0-9.]+ s ", lines[0])
    assert f"over its limit of 2 s: a peer has died or the network to it is down; ending this process " \
           f"(exit status {EXIT_STATUS})" in lines[0]
    assert "unreachable" not in proc.stdout and "Traceback" not in proc.stderr


def test_launch_ends_a_hung_job_at_its_timeout():
    code = "import time; from mpi4py import MPI; MPI.COMM_WORLD.Barrier(); time.sleep(600)"
    env = rank_env()
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        launch(2, [sys.executable, "-c", code], timeout=3, env=env)
    assert time.monotonic() - t0 < 30


def test_without_mpi4py_a_clear_error_names_the_extra(monkeypatch):
    from arraytrain.distributed import MPIComm

    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py -> ImportError
    with pytest.raises(BackendUnavailableError, match=r'pip install "arraytrain\[mpi\]"'):
        MPIComm()
    with pytest.raises(ImportError):  # the builtin a caller would catch
        MPIComm()


def test_import_arraytrain_does_not_import_mpi4py():
    code = "import sys, arraytrain, arraytrain.distributed; print('mpi4py' in sys.modules, 'cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=SOURCE)).stdout
    assert out.split() == ["False", "False"]


def test_mpich_defaults_apply_where_arraytrain_initialises_mpi_and_a_set_value_is_kept():
    rank_env()  # (skips without MPI)
    from arraytrain.parallel.mpi import MPICH_DEFAULTS

    code = ("import os; from arraytrain.distributed import MPIComm; c = MPIComm(); "
            f"print(*[os.environ.get(k) for k in {sorted(MPICH_DEFAULTS)!r}])")
    env = {k: v for k, v in os.environ.items() if k not in MPICH_DEFAULTS}
    for preset, want in ((None, [MPICH_DEFAULTS[k] for k in sorted(MPICH_DEFAULTS)]), ("auto", ["auto"])):
        extra = {} if preset is None else dict.fromkeys(MPICH_DEFAULTS, preset)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**env, **extra, "PYTHONPATH": SOURCE})
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == want * (1 if preset is None else len(MPICH_DEFAULTS))


def test_abort_on_error_outside_a_job_lets_the_exception_through():
    # MPI not initialised in this process (or one rank): nothing to abort, the error propagates
    with pytest.raises(KeyError, match="x"):
        with abort_on_error():
            raise KeyError("x")
    with pytest.raises(SystemExit):
        with abort_on_error():
            raise SystemExit(0)


def test_nccl_one_rank_on_one_gpu():
    from cuda_family import require_gpu

    require_gpu()  # NCCL
    code = textwrap.dedent("""
        import cupy as cp, numpy as np
        from arraytrain.distributed import NCCLComm
        from arraytrain.errors import BackendError, ReadOnlyError, DTypeError
        c = NCCLComm()
        assert (c.rank, c.size, c.is_local) == (0, 1, True)
        for dtype in (np.float32, np.float64, np.int32, np.uint8):
            x = cp.arange(1037, dtype=dtype)
            ptr = x.data.ptr
            c.allreduce(x); c.allreduce(x, op="max")
            assert x.data.ptr == ptr and bool((x == cp.arange(1037, dtype=dtype)).all())
        got = c.allgather(cp.arange(6, dtype=cp.float32).reshape(2, 3))
        assert len(got) == 1 and got[0].shape == (2, 3) and float(got[0].sum()) == 15.0
        y = cp.ones(5, cp.float64); c.broadcast(y, 0); assert float(y.sum()) == 5.0
        c.allreduce(cp.zeros(0, cp.float32))
        assert c.gather_objects("a") == ["a"]
        h = np.arange(3, dtype=np.float64)  # host arrays go over MPI
        c.allreduce(h); c.broadcast(h, 0)
        assert h.tolist() == [0.0, 1.0, 2.0] and c.allgather(h)[0].tolist() == [0.0, 1.0, 2.0]
        assert isinstance(c.allgather(h)[0], np.ndarray)
        for call, err in ((lambda: c.allreduce([1.0]), BackendError),
                          (lambda: c.allreduce(cp.ones(3, cp.int16)), DTypeError),
                          (lambda: c.allreduce(cp.ones(4, cp.float32)[::2]), TypeError)):
            try:
                call()
            except err:
                pass
            else:
                raise AssertionError(err)
        cp.cuda.get_current_stream().synchronize()
        # the engine over NCCLComm (one rank): every step equals the engine without a comm, bitwise,
        # dense and with error-feedback top-k (a gathered exchange)
        import arraytrain as at
        rs = np.random.default_rng(0)
        p = {"w": rs.standard_normal((7, 5)).astype(np.float32), "b": rs.standard_normal(5).astype(np.float32)}
        grads = [{k: 3 * rs.standard_normal(v.shape).astype(np.float32) for k, v in p.items()} for _ in range(6)]
        for make in (lambda: None, lambda: at.compress.ErrorFeedback(at.compress.TopK(ratio=0.2))):
            engines = [at.Engine(p, at.optim.AdamW(lr=1e-2), max_grad_norm=0.5, device="cuda", comm=comm,
                                 accumulation_steps=2, compressor=make()) for comm in (None, c)]
            for g in grads:
                for e in engines:
                    e.step({k: cp.asarray(v) for k, v in g.items()})
            assert engines[1].state.step == 3
            for k in p:
                assert bool((engines[0].params[k] == engines[1].params[k]).all()), k
        print("nccl ok")
    """)
    proc = ranks(1, "-c", code, timeout=300)
    assert proc.returncode == 0 and "nccl ok" in proc.stdout, proc.stdout + proc.stderr
