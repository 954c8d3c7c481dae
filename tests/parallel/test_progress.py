"""MPIComm's progress thread (arraytrain.parallel.progress) on stand-in requests: it tests what is in
flight until it completes, never while the owner waits on it, and forgets what either completed.
The real MPI requests run under mpiexec in tests/parallel/mpi/overlap_checks.py."""

from __future__ import annotations

import threading
import time

import pytest

from arraytrain.errors import ArgumentTypeError
from arraytrain.parallel.mpi import MPIComm, MPIRequest
from arraytrain.parallel.progress import Progress, shared


class FakeRequest:
    """An mpi4py request that completes at its ``after``-th Test (or at Wait), counting each thread's calls."""

    def __init__(self, after: int):
        self.after, self.tests, self.waits, self.testers = after, 0, 0, set()
        self.busy = threading.Lock()  # two threads inside one request's MPI call at once: an MPI error

    def Test(self) -> bool:
        assert self.busy.acquire(blocking=False), "two threads in MPI_Test/MPI_Wait of one request"
        try:
            self.tests += 1
            self.testers.add(threading.current_thread().name)
            return self.tests >= self.after
        finally:
            self.busy.release()

    def Wait(self) -> None:
        assert self.busy.acquire(blocking=False), "two threads in MPI_Test/MPI_Wait of one request"
        try:
            time.sleep(0.05)  # the thread keeps testing the others meanwhile
            self.waits += 1
        finally:
            self.busy.release()


def _until(cond, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.002)
    return cond()


def test_the_thread_completes_requests_nobody_tests_then_forgets_them():
    prog = Progress(interval=1e-4)
    try:
        reqs = [FakeRequest(after=k) for k in (1, 5, 40)]
        handles = [MPIRequest(r, progress=prog) for r in reqs]
        assert _until(lambda: all(h.done for h in handles))
        assert _until(lambda: prog.in_flight == 0)
        assert [r.tests for r in reqs] == [1, 5, 40]  # no test after completion
        assert all(r.testers == {"arraytrain-mpi-progress"} for r in reqs)
        for h in handles:
            h.wait()  # completed: no MPI_Wait
            assert h.test()
        assert all(r.waits == 0 for r in reqs) and [r.tests for r in reqs] == [1, 5, 40]
    finally:
        prog.close()


def test_the_owner_waits_alone_and_the_thread_goes_on_with_the_others():
    prog = Progress(interval=1e-4)
    try:
        slow, other = FakeRequest(after=10**9), FakeRequest(after=3)  # slow completes only by Wait
        hs, ho = MPIRequest(slow, progress=prog), MPIRequest(other, progress=prog)
        hs.wait()  # FakeRequest asserts that no Test runs inside this Wait
        assert hs.done and slow.waits == 1
        assert _until(lambda: ho.done and prog.in_flight == 0)
        tests = slow.tests
        time.sleep(0.01)
        assert slow.tests == tests  # forgotten once its owner completed it
    finally:
        prog.close()


def test_without_a_thread_requests_move_only_by_their_owner():
    r = FakeRequest(after=2)
    h = MPIRequest(r)
    time.sleep(0.01)
    assert r.tests == 0 and not h.done
    assert not h.test() and h.test() and h.done
    h.wait()
    assert r.waits == 0


def test_close_stops_the_thread_and_refuses_new_requests():
    prog = Progress(interval=1e-4)
    MPIRequest(FakeRequest(after=1), progress=prog)
    assert _until(lambda: prog.in_flight == 0)
    thread = prog._thread
    prog.close()
    assert not thread.is_alive()
    r = FakeRequest(after=1)
    h = MPIRequest(r, progress=prog)  # after close: left to its owner
    time.sleep(0.01)
    assert r.tests == 0 and prog.in_flight == 0
    h.wait()
    assert r.waits == 1


def test_one_thread_per_process_and_a_bad_flag_is_refused():
    assert shared() is shared()  # every MPIComm of the process shares it (MPI's progress is the process's)
    with pytest.raises(ArgumentTypeError, match="progress_thread"):
        MPIComm(progress_thread="yes")
