"""The threading policy: numba's kernels and the BLAS behind NumPy share the cores.

What was measured (2-core machine, numba 0.68 OpenMP layer, OpenBLAS 0.3.31,
each configuration in a fresh process, a hand-written NumPy MLP of ~1.07M
parameters whose update is one parallel numba kernel): with OpenMP's default
*active* wait policy, numba's idle workers keep spinning after every kernel
and steal the cores OpenBLAS needs for the next matmul: ~60 steps/s at batch
128, against ~130 with idle workers that sleep. One numba thread avoids the
fight too, but then a large update runs on one core.

The policy, applied once when arraytrain is imported:

1. ``OMP_WAIT_POLICY=PASSIVE`` unless the environment already sets it or
   numba's threading layer has already started (then it is too late and
   nothing is changed). Idle OpenMP workers sleep; numba keeps every core for
   large kernels and BLAS gets the cores back between them. The variable is
   read by each OpenMP runtime when it loads, so an OpenMP library loaded
   later in the same process (e.g. torch's) sees it too.
2. numba's default layer and thread count; kernels on buffers smaller than
   ``arraytrain.kernels.cpu.SERIAL_BELOW`` run serial, where a parallel
   launch would cost more than it saves.
3. BLAS keeps its own thread count.

``ARRAYTRAIN_THREAD_POLICY=off`` leaves the environment untouched.
"""

from __future__ import annotations

import os

WAIT_POLICY = "OMP_WAIT_POLICY"
OPT_OUT = "ARRAYTRAIN_THREAD_POLICY"

_applied: str | None = None


def _numba_layer_started() -> bool:
    try:
        from numba.np.ufunc import parallel
    except ImportError:  # numba moved it: assume started, change nothing
        return True
    return bool(getattr(parallel, "_is_initialized", True))


def apply_policy() -> str:
    """Apply the policy (idempotent); returns what was done, for :func:`describe`."""
    global _applied
    if _applied is None:
        if os.environ.get(OPT_OUT, "").lower() == "off":
            _applied = f"policy off ({OPT_OUT}=off)"
        elif WAIT_POLICY in os.environ:
            _applied = f"{WAIT_POLICY}={os.environ[WAIT_POLICY]} (from the environment)"
        elif _numba_layer_started():
            _applied = "numba's threads had already started: environment unchanged"
        else:
            os.environ[WAIT_POLICY] = "PASSIVE"
            _applied = f"{WAIT_POLICY}=PASSIVE (set by arraytrain)"
    return _applied


def describe() -> str:
    """One line: numba layer and threads, the wait policy, BLAS threads."""
    import numba

    try:
        layer = numba.threading_layer()
    except ValueError:  # not started yet
        layer = f"{numba.config.THREADING_LAYER} (not started)"
    parts = [f"numba layer {layer}, {numba.get_num_threads()} threads", apply_policy()]
    try:
        from threadpoolctl import threadpool_info

        blas = [f"{i['internal_api']} {i['num_threads']}" for i in threadpool_info() if i["user_api"] == "blas"]
        parts.append("BLAS " + ", ".join(blas) + " threads")
    except ImportError:
        pass
    return "; ".join(parts)
