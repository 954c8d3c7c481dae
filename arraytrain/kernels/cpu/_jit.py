"""numba's configuration for the CPU family: the JIT options and the serial/parallel twins.

Every kernel is one pass over a flat 1-D buffer, split into fixed blocks of ``BLOCK``
elements that numba's ``prange`` hands to its threads. Buffers up to ``SERIAL_BELOW``
elements run a serial twin of the same code: a parallel launch costs more than it saves
there, and a small step leaves the cores to BLAS. (Muon's per-matrix kernels are serial at
every size: its Newton-Schulz GEMMs, on threaded BLAS, are the step's cost.)

Floating-point rules: ``fastmath`` is restricted to flags that keep NaN/Inf semantics (no
``nnan``/``ninf``), so non-finite detection stays exact. Kernels compile lazily on first
call (``cache=True`` keeps the machine code on disk for later processes).
"""

from __future__ import annotations

from numba import njit
from numba.core.caching import Cache

from ...threads import start_numba_threads

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


def pick(pair, n, *slots):
    """The twin for ``n`` elements; ``slots``: the kernel's state slots. A kernel with an 8-bit
    slot (arraytrain.state8.Q8, a tuple) runs its parallel twin at every size: in the serial one
    numba increfs and decrefs the slot's arrays at every block of 256 elements (the parfor
    function does not), and AdamW's serial twin took 1.8 ns per element against 0.76 for the
    parallel one on one thread; with two threads the parallel twin was the faster from 5,000
    elements (9 against 13 us) up."""
    if n < SERIAL_BELOW and not any(isinstance(s, tuple) for s in slots):
        return pair[1]
    start_numba_threads()  # idempotent: numba's pool starts under arraytrain's policy (arraytrain.threads)
    return pair[0]


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
