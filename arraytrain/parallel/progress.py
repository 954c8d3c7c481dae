"""A thread that moves MPI's nonblocking collectives on while the process computes.

MPI moves a nonblocking collective forward only inside MPI calls of the process that
started it (MPICH has no progress thread unless ``MPIR_CVAR_ASYNC_PROGRESS=1``, which
spins a core). The overlapped exchange starts its buckets from the backward pass's
hooks; between two hooks a layer's backward computes for tens of milliseconds, and
over a network nothing moves once the sockets' buffers are full.

:class:`Progress` is one thread (one per process: :func:`shared`, as MPI's progress is the
process's) that, while any request is in
flight, tests each (``MPI_Test``) every :data:`INTERVAL` seconds and sleeps in between;
with nothing in flight it waits on a condition and costs nothing. mpi4py releases the GIL
inside MPI calls, and numpy's and torch's kernels release it while they compute, so the
thread runs while the backward pass does. Measured on 2 nodes (``docs/cluster.md``, the
16.8M-parameter MLP, batch 512 a rank): at 1 Gbit/s the overlapped step took 870 ms with
the thread, 1,032 without it and 1,114 blocking; on one machine's shared memory it
changed nothing measurable.

A request is completed by exactly one thread at a time (MPI forbids two completing the
same request): each carries a lock that the progress thread only ever tries
(``acquire(blocking=False)``) and that the owner's :meth:`~arraytrain.parallel.mpi.MPIRequest.wait` holds
while it waits; a request completed by either is marked ``done`` and never touched by MPI
again. The thread needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default); where MPI was started
with less, :func:`available` says no and requests are moved on by the caller's calls only.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

__all__ = ["INTERVAL", "Progress", "available", "shared"]

#: Seconds between two passes of the progress thread over the requests in flight.
INTERVAL = 5e-4


def available(MPI) -> bool:
    """True when MPI runs with ``MPI_THREAD_MULTIPLE``: another thread may call MPI while the main one does."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


class Progress:
    """A progress thread: :meth:`add` a request in flight; the thread tests it until it completes (or its
    owner completes it), then forgets it. Started at the first request."""

    def __init__(self, interval: float = INTERVAL):
        self.interval = interval
        self._cond = threading.Condition()
        self._flight: list = []
        self._thread: threading.Thread | None = None
        self._closing = False

    def add(self, request) -> None:
        """``request`` (a :class:`~arraytrain.parallel.mpi.MPIRequest`) is in flight: test it until done."""
        with self._cond:
            if self._closing:
                return
            self._flight.append(request)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="arraytrain-mpi-progress", daemon=True)
                self._thread.start()
                atexit.register(self.close)  # before MPI_Finalize (mpi4py's handler, registered earlier, runs later)
            self._cond.notify()

    @property
    def in_flight(self) -> int:
        """How many requests the thread is testing."""
        return len(self._flight)

    def close(self) -> None:
        """Stop the thread (at exit, before MPI is finalised): requests still in flight are left to their owners."""
        with self._cond:
            self._closing = True
            self._flight = []
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._flight and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                flight = list(self._flight)
            finished = [r for r in flight if r.test()]
            if finished:
                with self._cond:
                    self._flight = [r for r in self._flight if r not in finished]
            time.sleep(self.interval)


_SHARED: Progress | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> Progress:
    """The process's progress thread, made at the first call (every :class:`~arraytrain.parallel.mpi.MPIComm`
    of the process uses it; a forked child starts a new one)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = Progress()
        return _SHARED


def _forget_in_child() -> None:
    global _SHARED, _SHARED_LOCK
    _SHARED, _SHARED_LOCK = None, threading.Lock()  # the parent's thread (and any lock it held) is not here


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
