"""A deadline on every wait in a collective: a process whose peers or network are gone ends, saying so.

A collective waits for every process of the group. When a peer has died, or the link to it is
down, MPI over TCP and gloo wait on: a socket to a host that no longer answers is not closed
until TCP gives up (about 15 minutes of retransmissions on Linux), and gloo's own timeout is 30
minutes. Nothing inside the waiting call can be interrupted from Python, so a transport's
:class:`Deadline` watches from a thread of its own, as torch's NCCL watchdog does: the transport
marks a wait's start and end (:meth:`Deadline.wait`); a wait that has lasted longer than its limit
writes one line to stderr, ``arraytrain: CommTimeoutError: rank R of N: ...`` (what it waited in,
how long, and why), and ends the process with :data:`EXIT_STATUS` without running anything else —
no ``finally`` block, no ``atexit`` handler and no MPI_Finalize that would wait for the lost peer
in turn. Checkpoints are written atomically (a private file renamed into place), so an ending
never leaves a half-written one; ``mpiexec`` and ``torchrun`` then see a rank fail.

Two limits, from one ``timeout`` (seconds; :data:`DEFAULT_TIMEOUT`, or the environment's
``ARRAYTRAIN_COMM_TIMEOUT``; 0 or None: no deadline):

- ``timeout`` for the collectives of a step once the group is steady: its engine has completed
  two boundaries (:meth:`Deadline.steady`), so every peer has finished its first step and the
  kernels it compiled on the way;
- ``START_FACTOR * timeout`` before that (a peer may still be importing, reading its data or
  compiling kernels: tens of seconds on a cold cache), and inside :meth:`Deadline.patience`
  (``Communicator.patient()``): the waits where one rank works alone while the others wait for
  it — the agreement after rank 0 writes a checkpoint, the ranks' agreement on a checkpoint each
  has read.

The thread starts at the first wait watched and wakes at most every second, so a deadline is kept
to about a second. Its cost on the step is two clock reads and a few attribute writes per
collective.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

from ..errors import ArgumentTypeError, CommTimeoutError

__all__ = ["DEFAULT_TIMEOUT", "ENV", "EXIT_STATUS", "START_FACTOR", "Deadline", "check_timeout"]

#: Seconds a step's collective may wait for its peers once the group is steady.
DEFAULT_TIMEOUT = 60.0
#: The environment variable that sets the default (seconds; 0 turns the deadline off).
ENV = "ARRAYTRAIN_COMM_TIMEOUT"
#: The limit before the group is steady and inside :meth:`Deadline.patience`: this many times ``timeout``.
START_FACTOR = 10
#: The exit status of a process ended by its deadline (``timeout(1)``'s).
EXIT_STATUS = 124


def check_timeout(timeout, name: str = "timeout") -> float | None:
    """``timeout`` checked: seconds >= 0 (0, None and infinity: no deadline); the default taken from
    :data:`ENV` when ``timeout`` is ``"default"``."""
    if isinstance(timeout, str) and timeout == "default":
        raw = os.environ.get(ENV)
        if raw is None or not raw.strip():
            return DEFAULT_TIMEOUT
        try:
            timeout = float(raw)
        except ValueError:
            raise ArgumentTypeError(f"{ENV}: expected seconds (a number, 0 for no deadline), got {raw!r}") from None
        name = ENV
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ArgumentTypeError(f"{name}: expected seconds (a number >= 0; 0 or None: no deadline), "
                                f"got {type(timeout).__name__}")
    timeout = float(timeout)
    if timeout != timeout or timeout < 0:
        raise ArgumentTypeError(f"{name}: expected seconds (a number >= 0; 0 or None: no deadline), got {timeout!r}")
    return None if timeout == 0 or timeout == float("inf") else timeout


class Deadline:
    """The deadline of one communicator's waits (see the module docstring).

    ``with deadline.wait("allreduce", nbytes):`` around a blocking call. :meth:`steady` switches
    the waits to ``timeout``; inside ``with deadline.patience():`` they keep the long limit.
    ``timeout=None`` watches nothing.
    """

    __slots__ = ("timeout", "rank", "size", "_steady", "_patient", "_current", "_depth", "_thread", "_what",
                 "_nbytes", "__weakref__")

    def __init__(self, timeout: float | None, rank: int, size: int):
        self.timeout, self.rank, self.size = timeout, rank, size
        self._steady = False
        self._patient = 0
        self._current = None  # (start, limit, what, nbytes) of the wait in progress, or None
        self._depth = 0
        self._thread = None
        self._what, self._nbytes = "", 0

    def steady(self) -> None:
        """The group is past its start: from now on a step's collective waits at most ``timeout``."""
        self._steady = True

    def limit(self) -> float | None:
        """The seconds a wait may last now (None: no deadline)."""
        if self.timeout is None:
            return None
        return self.timeout if self._steady and not self._patient else self.timeout * START_FACTOR

    @contextlib.contextmanager
    def patience(self):
        """The waits inside keep the long limit: one rank works alone (writes or reads a file) while the
        others wait for it."""
        self._patient += 1
        try:
            yield
        finally:
            self._patient -= 1

    def wait(self, what: str, nbytes: int = 0) -> Deadline:
        """The context of one wait in ``what`` (a collective moving ``nbytes`` bytes)."""
        self._what, self._nbytes = what, nbytes
        return self

    def __enter__(self) -> Deadline:
        self._depth += 1
        if self._depth == 1 and self.timeout is not None:
            if self._thread is None:
                self._start()
            self._current = (time.monotonic(), self.limit(), self._what, self._nbytes)
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._current = None

    def _start(self) -> None:
        import weakref

        ref = weakref.ref(self)  # the thread must not keep its communicator alive
        tick = min(1.0, self.timeout / 10)
        self._thread = threading.Thread(target=_watch, args=(ref, tick), name="arraytrain-deadline", daemon=True)
        self._thread.start()

    def message(self, what: str, nbytes: int, waited: float, limit: float) -> str:
        """The line a wait past its limit writes (without the ``arraytrain: CommTimeoutError:`` prefix)."""
        size = "" if not nbytes else f" of {nbytes / 1e6:.3g} MB" if nbytes >= 100_000 else f" of {nbytes} bytes"
        phase = ("" if limit == self.timeout else
                 f" (the limit before the group is steady and while a rank reads or writes a checkpoint: "
                 f"{START_FACTOR} x {self.timeout:g} s)")
        return (f"rank {self.rank} of {self.size}: {what}{size} has waited {waited:.1f} s for the other ranks, "
                f"over its limit of {limit:g} s{phase}: a peer has died or the network to it is down; ending "
                f"this process (exit status {EXIT_STATUS}). Set the limit with timeout= on the communicator or "
                f"{ENV} (seconds; 0: wait forever)")


def _watch(ref, tick: float) -> None:
    """The watching thread: ends the process when the wait in progress passes its limit."""
    while True:
        time.sleep(tick)
        deadline = ref()
        if deadline is None:
            return
        current = deadline._current
        if current is not None:
            start, limit, what, nbytes = current
            waited = time.monotonic() - start
            if waited > limit and deadline._current is current:
                _end(CommTimeoutError(deadline.message(what, nbytes, waited, limit)))
        del deadline


def _end(error: CommTimeoutError) -> None:
    """Write the error's line and end the process at once (the main thread is stuck in the wait)."""
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - ending anyway: the line below is what matters
        pass
    os.write(2, f"arraytrain: {type(error).__name__}: {error}\n".encode())
    os._exit(EXIT_STATUS)
