"""The engine's call guard: one thread at a time on an engine, detected rather than corrupted."""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager

from .errors import ConcurrentUseError


class CallGuard:
    """Refuses a call on an engine while a call from another thread is running on it.

    A non-blocking re-entrant lock: the thread holding it may nest calls (``save``
    holds it while it writes what ``state_dict`` returned); any other thread gets
    :class:`ConcurrentUseError` at once, before its call changes anything.
    """

    def __init__(self):
        self._lock = threading.RLock()
        self._holder: tuple[str, str] | None = None

    @contextmanager
    def __call__(self, what: str):
        if not self._lock.acquire(blocking=False):
            thread, busy = self._holder or ("?", "another call")
            raise ConcurrentUseError(
                f"{what}: the engine is busy with {busy} on thread {thread!r}; an Engine is not "
                "thread-safe: serialise the calls on one engine (e.g. with a lock of your own)"
            )
        outer = self._holder
        self._holder = (threading.current_thread().name, what)
        try:
            yield
        finally:
            self._holder = outer
            self._lock.release()


def guarded(method):
    """Run a method of an engine (or a subclass) inside ``self.exclusive("<name>()")``."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.exclusive(f"{method.__name__}()"):
            return method(self, *args, **kwargs)

    return run
