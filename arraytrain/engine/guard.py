"""The engine's call guard: one thread at a time on an engine, detected rather than corrupted."""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager

from ..errors import ConcurrentUseError


class CallGuard:
    """Refuses a call on an engine while a call from another thread is running on it.

    A non-blocking re-entrant lock: the thread holding it may nest calls (``save``
    holds it while it writes what ``state_dict`` returned); any other thread gets
    :class:`ConcurrentUseError` at once, before its call changes anything.
    """

    def __init__(self):
        self._lock = threading.RLock()
        self._holder: tuple | None = None  # (thread, what) of the call holding it
        self._outer: list = []  # the holders of the calls it nests in

    def acquire(self, what: str) -> None:
        """Hold the guard (``what`` names the caller in another thread's error), or raise at once."""
        if not self._lock.acquire(blocking=False):
            thread, busy = self._holder or (None, "another call")
            raise ConcurrentUseError(
                f"{what}: the engine is busy with {busy} on thread {getattr(thread, 'name', '?')!r}; an Engine is "
                "not thread-safe: serialise the calls on one engine (e.g. with a lock of your own)"
            )
        self._outer.append(self._holder)
        self._holder = (threading.current_thread(), what)

    def release(self) -> None:
        self._holder = self._outer.pop()
        self._lock.release()

    @contextmanager
    def __call__(self, what: str):
        self.acquire(what)
        try:
            yield
        finally:
            self.release()


def guarded(method):
    """Run a method of an engine (or a subclass) inside ``self.exclusive("<name>()")``; an engine's
    own methods take its guard without a generator (the per-step path)."""
    what = f"{method.__name__}()"

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        enter = getattr(self, "_enter", None)
        if enter is None:
            with self.exclusive(what):
                return method(self, *args, **kwargs)
        enter(what)
        try:
            return method(self, *args, **kwargs)
        finally:
            self._guard.release()

    return run
