"""The threading policy: numba's kernels and the BLAS behind NumPy share the cores.

What was measured (2-core machine, numba 0.68, OpenBLAS 0.3.31, each
configuration in a fresh process, a hand-written NumPy MLP of ~1.07M
parameters whose update is one parallel numba kernel; ``python -m
arraytrain.bench threads``): with numba's default OpenMP layer, its idle
workers spin after every kernel and steal the cores OpenBLAS needs for the
next matmul, and the MLP runs several times slower than with workers that
sleep. One numba thread avoids the fight too, but then a large update runs on
one core.

Two fixes were measured and rejected: ``OMP_WAIT_POLICY=PASSIVE`` cures the
MLP, but numba's system libgomp and torch's bundled one share a SONAME, so
the setting reached torch too and made ``torch.optim`` on 100 tensors ~4x
slower; numba's ``workqueue`` layer also cures it, but aborts the process
when two threads launch parallel kernels at once.

The policy, applied when arraytrain's kernels first run in parallel:

1. numba's **TBB** threading layer (the ``tbb`` wheel is a dependency on
   x86-64 Linux): idle TBB workers do not keep the cores from BLAS, the
   layer is thread-safe, and nothing outside numba is touched. The wheel puts
   ``libtbb.so.12`` in ``<prefix>/lib``, off the loader's path in a
   virtualenv, so it is loaded by its full path first. Where TBB cannot load,
   numba's own default is kept and :func:`describe` says so.
2. A layer the user chose (``NUMBA_THREADING_LAYER``) is respected, and so
   are numba threads already started by other code (then it is too late to
   choose); ``ARRAYTRAIN_THREAD_POLICY=off`` leaves numba's default.
3. numba's thread count is left alone; kernels on buffers smaller than
   ``arraytrain.kernels.cpu.SERIAL_BELOW`` run serial, where a parallel
   launch costs more than it saves. BLAS keeps its own thread count.
4. **Where torch's OpenMP runtime is already loaded** (torch imported before
   the first parallel kernel, its parallel backend OpenMP), numba's ``omp``
   layer instead: torch exposes its libgomp to the whole process, so numba's
   OpenMP pool binds to it and arraytrain's kernels run on torch's own
   threads. Measured in the torch loop (``python -m arraytrain.bench
   dropin``): with TBB, numba's workers and torch's spinning OpenMP workers
   fought for the two cores, and the drop-in's kernels ran slower inside the
   loop than on one thread; on torch's pool they do not. GNU OpenMP is not
   fork-safe (numba ends a forked child that starts a parallel region once
   the parent has), so a child forked after that runs every kernel's serial
   twin, which gives the same bits.
"""

from __future__ import annotations

import os
import sys
import threading

#: numba's threading layer that the policy chooses.
LAYER = "tbb"
#: The layer it chooses instead where torch's OpenMP runtime is already in the process (point 4 above).
TORCH_LAYER = "omp"
#: The environment variable that turns the policy off (``ARRAYTRAIN_THREAD_POLICY=off``).
OPT_OUT = "ARRAYTRAIN_THREAD_POLICY"

_lock = threading.Lock()
_applied: str | None = None
#: True in a process forked after numba's pool started on GNU OpenMP: parallel kernels run serial there.
forked_omp = False


def _torch_openmp() -> bool:
    """Whether torch is imported, its parallel backend is OpenMP and its runtime's symbols are visible
    process-wide (then numba's ``omp`` layer binds to that runtime, not to a second one)."""
    import ctypes

    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
            return False
        scope = ctypes.CDLL(None)
        scope.GOMP_parallel, scope.omp_get_max_threads, scope.omp_set_num_threads  # noqa: B018 - GNU OpenMP
    except (AttributeError, OSError, RuntimeError):
        return False
    return True


def _after_fork_in_child() -> None:
    global forked_omp
    forked_omp = True


def _preload_tbb() -> bool:
    """Load the ``tbb`` wheel's libtbb globally so numba's tbbpool finds it."""
    import ctypes
    import importlib.metadata

    try:
        files = importlib.metadata.files("tbb") or []
    except importlib.metadata.PackageNotFoundError:
        return False
    for f in files:
        if f.name.startswith("libtbb.so.12") or f.name == "tbb12.dll":
            try:
                ctypes.CDLL(str(f.locate()), mode=ctypes.RTLD_GLOBAL)
                return True
            except OSError:
                continue
    return False


def start_numba_threads() -> str:
    """Start numba's thread pool under the policy (idempotent); returns what was done."""
    global _applied
    if _applied is not None:
        return _applied
    with _lock:
        if _applied is not None:
            return _applied
        import numba
        from numba.np.ufunc import parallel

        if getattr(parallel, "_is_initialized", True):
            _applied = "numba's threads were started before arraytrain's: layer not chosen"
        elif os.environ.get(OPT_OUT, "").lower() == "off":
            parallel._launch_threads()
            _applied = f"policy off ({OPT_OUT}=off)"
        elif os.environ.get("NUMBA_THREADING_LAYER"):
            parallel._launch_threads()
            _applied = "layer from NUMBA_THREADING_LAYER"
        else:
            before = numba.config.THREADING_LAYER
            _applied = None
            if _torch_openmp():
                import ctypes

                runtime = ctypes.CDLL(None)  # torch's libgomp, in the global scope (see _torch_openmp)
                torch_threads = runtime.omp_get_max_threads()
                numba.config.THREADING_LAYER = TORCH_LAYER
                try:
                    parallel._launch_threads()
                    _applied = f"{TORCH_LAYER} layer chosen by arraytrain: torch's OpenMP threads"
                except ValueError:  # numba's omppool cannot load: the usual choice below
                    numba.config.THREADING_LAYER = before
                # numba's launch sets the runtime's thread count (omp_set_num_threads): torch's, put back
                runtime.omp_set_num_threads(torch_threads)
            if _applied is None:
                _preload_tbb()
                numba.config.THREADING_LAYER = LAYER
                try:
                    parallel._launch_threads()
                    _applied = f"{LAYER} layer chosen by arraytrain"
                except ValueError:  # TBB missing or incompatible: numba's default instead
                    numba.config.THREADING_LAYER = before
                    parallel._launch_threads()
                    _applied = f"{LAYER} unavailable: numba's default layer"
        if numba.threading_layer() == "omp" and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_after_fork_in_child)
        return _applied


def describe() -> str:
    """One line: numba layer and threads, how it was chosen, BLAS threads."""
    import numba

    policy = start_numba_threads()
    parts = [f"numba layer {numba.threading_layer()}, {numba.get_num_threads()} threads", policy]
    try:
        from threadpoolctl import threadpool_info

        blas = [f"{i['internal_api']} {i['num_threads']}" for i in threadpool_info() if i["user_api"] == "blas"]
        parts.append("BLAS " + ", ".join(blas) + " threads")
    except ImportError:
        pass
    return "; ".join(parts)
