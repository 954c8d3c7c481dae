"""The deadline on collectives' waits (:mod:`arraytrain.parallel.deadline`): its limits, its line, its exit,
and the engine telling the communicator when the job is steady. The multi-process case (a rank that stops
answering under mpiexec) is ``test_mpi.py``'s; a link taken down, ``tests/bench/test_bench_cluster.py``'s."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import arraytrain as at
from arraytrain.errors import ArgumentTypeError, CommTimeoutError
from arraytrain.parallel import deadline as dl
from thread_group import ThreadGroup


def test_timeouts_are_checked_and_the_default_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(dl.ENV, raising=False)
    assert dl.check_timeout("default") == dl.DEFAULT_TIMEOUT == 60.0
    assert dl.check_timeout(5) == 5.0 and dl.check_timeout(0.5) == 0.5
    assert dl.check_timeout(None) is None and dl.check_timeout(0) is None and dl.check_timeout(float("inf")) is None
    monkeypatch.setenv(dl.ENV, "12.5")
    assert dl.check_timeout("default") == 12.5
    monkeypatch.setenv(dl.ENV, "0")
    assert dl.check_timeout("default") is None
    monkeypatch.setenv(dl.ENV, "soon")
    with pytest.raises(ArgumentTypeError, match=dl.ENV):
        dl.check_timeout("default")
    for bad in (-1, float("nan"), "5", True, [5]):
        with pytest.raises(ArgumentTypeError, match="timeout"):
            dl.check_timeout(bad)


def test_bad_timeouts_are_refused_before_a_transport_starts():
    from arraytrain.distributed import MPIComm, NCCLComm, TorchComm

    for cls in (MPIComm, NCCLComm, TorchComm):
        with pytest.raises(ArgumentTypeError, match="timeout"):
            cls(timeout=-3)


def test_the_limits_before_and_after_the_job_is_steady():
    d = dl.Deadline(2.0, 0, 2)
    assert d.limit() == 2.0 * dl.START_FACTOR
    d.steady()
    assert d.limit() == 2.0
    with d.patience():
        with d.patience():
            assert d.limit() == 2.0 * dl.START_FACTOR
        assert d.limit() == 2.0 * dl.START_FACTOR
    assert d.limit() == 2.0
    assert dl.Deadline(None, 0, 2).limit() is None


def test_no_deadline_starts_no_thread_and_waits_nest():
    d = dl.Deadline(None, 0, 2)
    with d.wait("allreduce", 8):
        pass
    assert d._thread is None and d._current is None
    d = dl.Deadline(30.0, 0, 2)
    with d.wait("allreduce", 8):
        outer = d._current
        with d.wait("iallreduce", 4):
            assert d._current is outer  # the outer wait's start counts
        assert d._current is outer
    assert d._current is None and d._thread is not None and d._thread.daemon


def test_the_line_says_what_waited_how_long_and_what_to_do():
    d = dl.Deadline(60.0, 1, 4)
    line = d.message("allreduce", 67_100_000, 61.2, 60.0)
    assert line.startswith("rank 1 of 4: allreduce of 67.1 MB has waited 61.2 s for the other ranks, over its limit "
                           "of 60 s: a peer has died or the network to it is down; ending this process (exit "
                           f"status {dl.EXIT_STATUS})")
    assert dl.ENV in line and "timeout=" in line
    assert "before the group is steady" in d.message("gather_objects", 0, 601.0, 600.0)
    assert d.message("allreduce", 16, 61.0, 60.0).startswith("rank 1 of 4: allreduce of 16 bytes has waited 61.0 s")
    assert issubclass(CommTimeoutError, TimeoutError) and issubclass(CommTimeoutError, at.ArrayTrainError)


def _run(code: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)
    return proc, time.monotonic() - t0


def test_a_wait_past_its_limit_ends_the_process_with_one_line():
    """Within about a second of the limit; stdout flushed first; no finally block or atexit handler runs."""
    proc, took = _run("""
        import atexit, sys, time
        from arraytrain.parallel.deadline import Deadline
        atexit.register(lambda: print("atexit ran", flush=True))
        d = Deadline(0.5, 1, 2)
        with d.wait("allreduce", 1000):  # the start's limit: 5 s
            time.sleep(1.0)
        d.steady()
        sys.stdout.write("waiting")  # not flushed by the program: the deadline flushes it
        try:
            with d.wait("allreduce", 4_000_000):
                time.sleep(30)
        finally:
            print("finally ran", flush=True)
    """)
    assert proc.returncode == dl.EXIT_STATUS, proc.stderr
    assert proc.stdout == "waiting"
    assert proc.stderr.startswith("arraytrain: CommTimeoutError: rank 1 of 2: allreduce of 4 MB has waited ")
    assert proc.stderr.count("\n") == 1
    assert took < 20  # 1 s, then 0.5 s and a tick; the interpreter's start is most of it


def test_a_patient_wait_keeps_the_long_limit():
    proc, _ = _run("""
        import time
        from arraytrain.parallel.deadline import Deadline
        d = Deadline(0.3, 0, 2)
        d.steady()
        with d.patience(), d.wait("gather_objects"):  # 3 s allowed
            time.sleep(1.0)
        print("done", flush=True)
    """)
    assert proc.returncode == 0 and proc.stdout == "done\n", proc.stderr


def test_an_engine_tells_its_group_it_is_steady_after_two_boundaries():
    at.distributed.LocalComm().steady()  # a group of one: nothing to watch
    with at.distributed.LocalComm().patient():
        pass
    group = ThreadGroup(2)

    def body(rank, comm):
        marks = []
        comm.steady = lambda: marks.append(True)
        eng = at.Engine({"w": np.ones(4)}, at.optim.SGD(lr=0.1), comm=comm)
        seen = []
        for _ in range(4):
            eng.step({"w": np.full(4, rank, float)})
            seen.append(len(marks))
        return seen, eng.params["w"].copy()

    (seen0, w0), (seen1, w1) = group.run(body)
    assert seen0 == seen1 == [0, 1, 1, 1] and np.array_equal(w0, w1)
