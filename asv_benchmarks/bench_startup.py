"""Import time and the first step in a fresh process, with a cold and a warm numba cache.

``import arraytrain`` imports only the error classes (every other name loads on first
access), so :func:`timeraw_import_arraytrain` is the package alone and
:func:`timeraw_import_engine` adds the engine's own modules (NumPy included, numba not).
numba loads with the first CPU kernel family (``Engine(...)``), and a warm cache's first
step loads the machine code of each kernel it runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

# the engine of asv's first step: one 256x256 float32 tensor, clipped (the parallel twins)
ONE_TENSOR = (
    "shapes = {'w': (256, 256)}\n"
    "kw = dict(max_grad_norm=1.0)\n"
)
# the MLP of ``arraytrain train`` (64-128-64-10 on the digits, AdamW, the serial twins)
MLP = (
    "shapes = {'0.w': (64, 128), '0.b': (128,), '1.w': (128, 64), '1.b': (64,), '2.w': (64, 10), '2.b': (10,)}\n"
    "kw = dict(zero_grad_on_step=False)\n"
)
FIRST_STEP = (
    "import time; t0 = time.perf_counter()\n"
    "import numpy as np, arraytrain as at\n"
    "e = at.Engine({k: np.ones(s, np.float32) for k, s in shapes.items()}, at.optim.AdamW(), **kw)\n"
    "g = {k: np.ones(s, np.float32) for k, s in shapes.items()}\n"
    "t1 = time.perf_counter()\n"
    "e.step(g)\n"
    "t2 = time.perf_counter()\n"
    "print(t2 - t0, t2 - t1)\n"
)


def _first_step(cache_dir: str, engine: str = ONE_TENSOR) -> tuple[float, float]:
    """Seconds (from interpreter start to the end of the first step, of the first step alone)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", engine + FIRST_STEP], env=env, capture_output=True, text=True,
                         check=True)
    total, step = out.stdout.split()[-2:]
    return float(total), float(step)


def _warm(engine: str = ONE_TENSOR) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as cache:
        _first_step(cache, engine)  # fills the cache
        return _first_step(cache, engine)


def timeraw_import_arraytrain():
    return "import arraytrain"


def timeraw_import_engine():
    """The engine's modules (and NumPy) without numba: what ``Engine(...)`` needs before its kernels."""
    return "import arraytrain; arraytrain.Engine, arraytrain.optim.AdamW"


class FirstStep:
    """The first ``engine.step`` in a fresh process: with the import, or alone (``*_step``)."""

    repeat = 3
    number = 1
    timeout = 300

    def track_cold_cache(self):
        """Seconds from interpreter start to the end of the first step (import included), cold cache."""
        with tempfile.TemporaryDirectory() as cache:
            return _first_step(cache)[0]

    track_cold_cache.unit = "seconds"

    def track_warm_cache(self):
        """Seconds from interpreter start to the end of the first step (import included), warm cache."""
        return _warm()[0]

    track_warm_cache.unit = "seconds"

    def track_warm_step(self):
        """The first ``step`` call alone, warm cache (the kernels' cache loads, the thread pool's start)."""
        return _warm()[1]

    track_warm_step.unit = "seconds"

    def track_warm_step_mlp(self):
        """The first ``step`` call alone of ``arraytrain train``'s MLP engine, warm cache."""
        return _warm(MLP)[1]

    track_warm_step_mlp.unit = "seconds"
