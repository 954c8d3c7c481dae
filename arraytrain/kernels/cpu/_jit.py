"""numba's configuration for the CPU family: the JIT options and the serial/parallel twins.

Every kernel is one pass over a flat 1-D buffer, split into fixed blocks of ``BLOCK``
elements that numba's ``prange`` hands to its threads. Buffers up to ``SERIAL_BELOW``
elements run a serial twin of the same code: a parallel launch costs more than it saves
there, and a small step leaves the cores to BLAS. (Muon's per-matrix kernels are serial at
every size: its Newton-Schulz GEMMs, on threaded BLAS, are the step's cost.)

Floating-point rules: ``fastmath`` is restricted to flags that keep NaN/Inf semantics (no
``nnan``/``ninf``), so non-finite detection stays exact. Kernels compile lazily on first
call (``cache=True`` keeps the machine code on disk for later processes).

Compiling: a cache load skips numba's full context refresh; processes that meet one uncached
signature at once compile it once (a file lock per signature); :data:`COMPILE_CLOCK` counts this
process's compile seconds (the engine's first-step notice reads it); :func:`both_twins` makes a
call compile the other twin too (``arraytrain compile``, :mod:`arraytrain.precompile`).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from contextlib import contextmanager

from numba import njit
from numba.core import event
from numba.core.caching import Cache
from numba.core.compiler_lock import global_compiler_lock
from numba.core.dispatcher import Dispatcher

from ... import threads

FASTMATH = {"nsz", "arcp", "contract", "afn", "reassoc"}
# Without ``arcp``/``afn`` LLVM keeps ``sqrt(a) / sqrt(b)`` as two roots and a division: with them
# it forms ``sqrt(a) * rsqrt(b)`` from the hardware's reciprocal-root estimate and one Newton
# step, whose bits differ between CPU generations (Adadelta's float32 ``acc_delta`` moved up to
# 3 ulp from the reference and 4e-4 relative from torch after 10 steps on an AMD Zen 5).
EXACT_DIVISION = FASTMATH - {"arcp", "afn"}
# error_model="numpy": IEEE division (x/0 -> inf) instead of Python's
# ZeroDivisionError check, whose branch stops LLVM from vectorising the loops.
JIT = dict(fastmath=FASTMATH, error_model="numpy", cache=True)
BLOCK = 1 << 14
SERIAL_BELOW = 1 << 16


def twins(fn, fastmath=FASTMATH):
    """Compile ``fn`` twice: parallel (prange over blocks) and serial.

    Both dispatchers share the Python source; the serial one treats ``prange``
    as ``range``. ``fn.__qualname__`` differs per twin so their on-disk caches
    do not collide. ``fastmath``: the flags, for a kernel that needs fewer than
    :data:`FASTMATH` (see :data:`EXACT_DIVISION`).
    """
    options = dict(JIT, fastmath=fastmath)
    par = njit(parallel=True, **options)(fn)
    ser_fn = type(fn)(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__, fn.__closure__)
    ser_fn.__qualname__ = fn.__qualname__ + "_serial"
    ser = njit(parallel=False, **options)(ser_fn)
    return par, ser


_both = threading.local()


@contextmanager
def both_twins():
    """Inside: a kernel called through :func:`pick` also compiles its other twin for the same
    argument types, so that a small compile-ahead step (``arraytrain compile``) leaves both the
    serial and the parallel machine code in the cache, whatever size a later run has."""
    _both.on = True
    try:
        yield
    finally:
        _both.on = False


def _with_twin(chosen, other):
    def run(*args):
        other.compile(tuple(other.typeof_pyval(a) for a in args))
        return chosen(*args)

    return run


def pick(pair, n, *slots):
    """The twin for ``n`` elements; ``slots``: the kernel's state slots. A kernel with an 8-bit
    slot (arraytrain.kernels.interface.Q8, a tuple) runs its parallel twin at every size: in the serial one
    numba increfs and decrefs the slot's arrays at every block of 256 elements (the parfor
    function does not), and AdamW's serial twin took 1.8 ns per element against 0.76 for the
    parallel one on one thread; with two threads the parallel twin was the faster from 5,000
    elements (9 against 13 us) up."""
    eight_bit = False
    for s in slots:  # (a loop: a generator costs microseconds on the per-step path)
        if isinstance(s, tuple):
            eight_bit = True
    both = getattr(_both, "on", False) and not eight_bit  # (an 8-bit kernel never runs its serial twin)
    if (n < SERIAL_BELOW and not eight_bit) or threads.forked_omp:  # (GNU OpenMP in a forked child: serial)
        return _with_twin(pair[1], pair[0]) if both else pair[1]
    threads.start_numba_threads()  # idempotent: numba's pool starts under arraytrain's policy (arraytrain.threads)
    return _with_twin(pair[0], pair[1]) if both else pair[0]


def _load_cached_without_refresh(load_overload=Cache.load_overload):
    """Load arraytrain's kernels from numba's on-disk cache without the full context refresh.

    numba refreshes its target context before every cache load: the first time in a
    process that imports and installs every implementation registry numba has (linalg,
    which imports scipy.linalg, random, typed containers, ...), most of a first step's
    time with a warm cache. Machine code loaded from the cache needs none of that, only
    numba's runtime (NRT) symbols, so for arraytrain's own functions the load initialises
    the runtime alone; a cache miss still compiles through numba's own path, which
    refreshes the context itself. Other numba functions in the process are untouched.
    """
    if getattr(load_overload, "_arraytrain", False):
        return
    try:
        from numba.core.runtime import rtsys

        Cache._guard_against_spurious_io_errors, Cache._load_overload  # noqa: B018 - the parts used below
    except (ImportError, AttributeError):  # another numba: keep its own path
        return

    def load(self, sig, target_context):
        if not getattr(self._py_func, "__module__", "").startswith("arraytrain."):
            return load_overload(self, sig, target_context)
        rtsys.initialize(target_context)
        with self._guard_against_spurious_io_errors():
            return self._load_overload(sig, target_context)

    load._arraytrain = True
    Cache.load_overload = load


_load_cached_without_refresh()


def _ours(dispatcher) -> bool:
    return getattr(dispatcher.py_func, "__module__", "").startswith("arraytrain.")


def _compile_once_across_processes(compile=Dispatcher.compile):
    """Processes that meet the same uncached kernel signature at once compile it once.

    Without this, two pytest-xdist workers (or two ranks started together on a cold cache)
    each compile what the other is compiling, and a kernel signature costs 2-7 s here. A
    compile of one of arraytrain's functions takes an exclusive file lock named after the
    function and the signature next to numba's cache index, then compiles as usual: numba's
    compile first tries the on-disk cache, so the process that waited loads what the other
    wrote. The lock is taken inside numba's own (per-process) compiler lock, so a thread that
    holds it never waits on a thread of its own process; a compile that calls another kernel
    takes that kernel's lock inside its own, in the order of the call graph, which has no
    cycles. Where file locks are unavailable (no ``fcntl``, a cache that is not on disk) the
    compile runs unlocked, as numba's does.
    """
    if getattr(compile, "_arraytrain", False):
        return
    try:
        import fcntl
    except ImportError:  # Windows: numba's own behaviour
        return

    def locked(self, sig):
        index = getattr(getattr(getattr(self, "_cache", None), "_cache_file", None), "_index_path", None)
        if index is None or not _ours(self):
            return compile(self, sig)
        key = hashlib.sha1(repr(sig).encode()).hexdigest()[:16]
        with global_compiler_lock:
            try:
                os.makedirs(os.path.dirname(index), exist_ok=True)
                fd = os.open(f"{index[:-4]}.{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:  # a read-only cache directory: numba will not write there either
                return compile(self, sig)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                return compile(self, sig)
            finally:
                os.close(fd)  # releases the lock

    locked._arraytrain = True
    Dispatcher.compile = locked


_compile_once_across_processes()


class CompileClock(event.Listener):
    """Seconds spent compiling arraytrain's kernels in this process (cache loads excluded).

    A compile that calls other kernels is counted once, at the outermost level. numba's
    compiles run under its global compiler lock, so the events of one process never overlap.
    """

    def __init__(self):
        self.seconds = 0.0
        self.count = 0
        #: ``"<function qualname>(<argument types>)"`` of each outermost compile, in order
        self.compiled: list[str] = []
        self._depth = 0
        self._start = 0.0

    def on_start(self, ev):
        if _ours(ev.data["dispatcher"]):
            if self._depth == 0:
                self._start = time.perf_counter()
            self._depth += 1

    def on_end(self, ev):
        if _ours(ev.data["dispatcher"]):
            self._depth -= 1
            if self._depth == 0:
                self.seconds += time.perf_counter() - self._start
                self.count += 1
                args = ", ".join(map(str, ev.data["args"]))
                self.compiled.append(f"{ev.data['dispatcher'].py_func.__qualname__}({args})")


#: The process's clock (see :class:`CompileClock`).
COMPILE_CLOCK = CompileClock()
event.register("numba:compile", COMPILE_CLOCK)
