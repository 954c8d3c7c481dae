"""The threading policy: numba's TBB layer where it loads, chosen at the first parallel kernel."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# import, run a kernel large enough for the parallel path, then report
PROBE = """
import os, numba, numpy as np, arraytrain
from arraytrain.kernels import cpu
x = np.ones(cpu.SERIAL_BELOW * 2, np.float32)
cpu.scale(x, factor=2.0)
assert (x == 2).all()
print(numba.threading_layer())
print(arraytrain.threads.start_numba_threads())
print(os.environ.get('OMP_WAIT_POLICY'))
"""
CLEARED = ("OMP_WAIT_POLICY", "ARRAYTRAIN_THREAD_POLICY", "NUMBA_THREADING_LAYER")


def _probe(code=PROBE, **env):
    base = {k: v for k, v in os.environ.items() if k not in CLEARED}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env},
                         capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()


def _tbb_installed():
    import importlib.metadata

    try:
        importlib.metadata.version("tbb")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_first_parallel_kernel_chooses_tbb_or_says_why_not():
    layer, how, wait = _probe()
    if _tbb_installed():
        assert layer == "tbb" and how == "tbb layer chosen by arraytrain"
    else:
        assert "tbb unavailable" in how
    assert wait == "None"  # no process-wide OpenMP setting: torch's runtime is left alone


def test_import_starts_no_threads():
    out, = _probe("import arraytrain; from numba.np.ufunc import parallel; print(parallel._is_initialized)")
    assert out == "False"


@pytest.mark.parametrize("layer", ["workqueue"])  # the one layer numba always has
def test_user_layer_is_respected(layer):
    got, how, _ = _probe(NUMBA_THREADING_LAYER=layer)
    assert got == layer and "NUMBA_THREADING_LAYER" in how


def test_opt_out_keeps_numba_default():
    _, how, _ = _probe(ARRAYTRAIN_THREAD_POLICY="off")
    assert "policy off" in how


def test_too_late_when_numba_threads_already_started():
    _, how, _ = _probe("import numba; numba.get_num_threads()\n" + PROBE)
    assert "started before" in how


def test_describe_names_layer_threads_and_policy():
    line, = _probe("import arraytrain; print(arraytrain.threads.describe())")
    assert "numba layer" in line and "threads" in line
