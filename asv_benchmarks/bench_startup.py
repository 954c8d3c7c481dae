"""Import time and the first step in a fresh process, with a cold and a warm numba cache."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

FIRST_STEP = (
    "import time; t0 = time.perf_counter()\n"
    "import numpy as np, arraytrain as at\n"
    "e = at.Engine({'w': np.ones((256, 256), np.float32)}, at.optim.AdamW(), max_grad_norm=1.0)\n"
    "e.step({'w': np.ones((256, 256), np.float32)})\n"
    "print(time.perf_counter() - t0)\n"
)


def _first_step(cache_dir: str) -> float:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", FIRST_STEP], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def timeraw_import_arraytrain():
    return "import arraytrain"


class FirstStep:
    """Seconds from interpreter start to the end of the first ``engine.step`` (import included)."""

    repeat = 3
    number = 1
    timeout = 300

    def track_cold_cache(self):
        with tempfile.TemporaryDirectory() as cache:
            return _first_step(cache)

    track_cold_cache.unit = "seconds"

    def track_warm_cache(self):
        with tempfile.TemporaryDirectory() as cache:
            _first_step(cache)
            return _first_step(cache)

    track_warm_cache.unit = "seconds"
