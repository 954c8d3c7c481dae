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


TORCH_FIRST = "import torch\n" + PROBE + """
from numba.np.ufunc import parallel
print(len(os.listdir("/proc/self/task")))
"""


def test_with_torch_loaded_the_kernels_run_on_torchs_openmp_threads():
    pytest.importorskip("torch")
    # two threads for torch and numba alike (the suite's workers set 1; torch's OpenMP count follows
    # MKL_NUM_THREADS where both are set)
    two = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "NUMBA_NUM_THREADS": "2"}
    layer, how, wait, tasks = _probe(TORCH_FIRST, **two)
    assert layer == "omp" and "torch's OpenMP threads" in how
    assert wait == "None"
    # one pool: torch's main thread and its OpenMP workers, no second team for numba
    import torch

    _, _, _, alone = _probe("import os, torch\ntorch.ones(1 << 20).sum()\nprint(0); print(0); print(0)\n"
                            "print(len(os.listdir('/proc/self/task')))", **two)
    assert int(tasks) == int(alone), torch.__config__.parallel_info()


FORK = """
import os, torch, numpy as np, arraytrain
from arraytrain.kernels import cpu
x = np.ones(cpu.SERIAL_BELOW * 2, np.float32)
cpu.scale(x, factor=2.0)
pid = os.fork()
if pid == 0:  # GNU OpenMP is not fork-safe: numba would end this child at its next parallel region
    cpu.scale(x, factor=3.0)
    os._exit(0 if (x == 6).all() and arraytrain.threads.forked_omp else 1)
print(os.waitpid(pid, 0)[1])
"""


KEEPS_TORCH_THREADS = """
import torch, numpy as np, arraytrain
from arraytrain.kernels import cpu
torch.set_num_threads(1)
x = np.ones(cpu.SERIAL_BELOW * 2, np.float32)
cpu.scale(x, factor=2.0)
print(arraytrain.threads.start_numba_threads())
print(torch.get_num_threads())
"""


def test_torchs_thread_count_is_left_as_it_was():
    """numba's OpenMP launch sets the shared runtime's thread count: torch's is put back."""
    pytest.importorskip("torch")
    how, threads = _probe(KEEPS_TORCH_THREADS, OMP_NUM_THREADS="2", MKL_NUM_THREADS="2", NUMBA_NUM_THREADS="2")
    assert "torch's OpenMP threads" in how and threads == "1"


def test_a_child_forked_after_openmp_kernels_runs_them_serial():
    pytest.importorskip("torch")
    status, = _probe(FORK)
    assert status == "0"


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
