"""torch.distributed as the transport: TorchComm's checks under ``torchrun``, each launch bounded.

Every multi-rank test launches ``torchrun --standalone --nproc-per-node K`` (the torchrun beside
this interpreter) on ``tests/parallel/torchrun/checks.py GROUP...`` or on the example, with a
timeout (a distributed bug is a hang until proven otherwise): past it torchrun is sent SIGTERM,
on which it ends its ranks, then SIGKILL; each rank also ends itself, printing its stacks, a
little before (``ARRAYTRAIN_RANK_TIMEOUT``). Skipped without torch or torchrun. One launch runs
every gloo check (start-up and the imports of torch, numba and JAX are the cost).
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import arraytrain
from arraytrain.errors import BackendUnavailableError

HERE = Path(__file__).resolve().parent
CHECKS = HERE / "torchrun" / "checks.py"
EXAMPLE = HERE.parents[1] / "examples" / "torchrun_train.py"
SOURCE = str(Path(arraytrain.__file__).resolve().parents[1])
TIMEOUT = 240  # seconds per launch; the gloo checks take about 15 s on 2 cores


def torchrun_exe() -> Path:
    """The torchrun beside this interpreter; skip without torch or torchrun."""
    exe = Path(sys.executable).parent / "torchrun"
    if importlib.util.find_spec("torch") is None or not exe.is_file():
        pytest.skip("needs torch and its torchrun beside this interpreter (pip install torch)")
    return exe


def rank_env(timeout: float, **extra) -> dict:
    path = os.pathsep.join(p for p in (SOURCE, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                ARRAYTRAIN_RANK_TIMEOUT=str(max(1, int(timeout - 15))), **extra)


def torchrun(n: int, *argv, timeout: float = TIMEOUT, **env) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node n argv...`` to completion within ``timeout`` seconds."""
    cmd = [str(torchrun_exe()), "--standalone", f"--nproc-per-node={n}", *map(str, argv)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=rank_env(timeout, **env), start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # torchrun's agent ends its ranks
            try:
                out, err = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
            pytest.fail(f"torchrun -n {n} {argv} did not finish in {timeout} s (a hang?)\n"
                        f"stdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def helpers(name: str):
    """A checks module of tests/parallel/torchrun (or ../mpi) imported in this process."""
    for folder in (HERE / "torchrun", HERE / "mpi"):
        sys.path.insert(0, str(folder))
    try:
        return __import__(name)
    finally:
        del sys.path[:2]


def test_gloo_collectives_on_2_ranks():
    """TorchComm's collectives, nonblocking handles and bad input under torchrun on 2 ranks (gloo)."""
    proc = torchrun(2, CHECKS, "comm")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("all ") and "checks passed on 2 ranks" in summary, proc.stdout + proc.stderr


@pytest.mark.slow  # the slow tier: every engine check under torchrun (about 25 s here)
def test_every_gloo_engine_check_on_2_ranks_and_their_checkpoints_in_one_process(tmp_path):
    """The engine (dense, compressed, sharded), the torch and JAX bindings and checkpoints, under
    torchrun on 2 ranks; then one process resumes the sharded checkpoints they wrote and continues
    the one-process trajectory."""
    t0 = time.monotonic()
    proc = torchrun(2, CHECKS, "engine", "shard", "bindings",
                    ARRAYTRAIN_SHARD_DIR=str(tmp_path), ARRAYTRAIN_TORCHRUN_DIR=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("all ") and "checks passed on 2 ranks" in summary, proc.stdout + proc.stderr
    print(f"{summary} in {time.monotonic() - t0:.1f} s")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved-by-2.safetensors", "sharded.safetensors"]

    # a LAMB engine with sharded bfloat16 working state, written by 2 ranks over TorchComm
    shard_checks = helpers("shard_checks")
    os.environ["ARRAYTRAIN_SHARD_DIR"] = str(tmp_path)
    try:
        assert shard_checks.check_a_checkpoint_resumes_on_any_number_of_ranks(None) == 2
    finally:
        del os.environ["ARRAYTRAIN_SHARD_DIR"]

    # the torch binding's sharded checkpoint after 2 steps, resumed by one process with the global batch
    import torch

    import arraytrain as at
    from arraytrain.interop import torch as at_torch

    bc = helpers("binding_checks")
    want, _ = bc.torch_one_process()
    m = bc.model(3)
    eng = at_torch.bind(m, at.optim.AdamW(lr=1e-2, weight_decay=0.01), max_grad_norm=0.5,
                        schedule=at.schedules.CosineAnnealingLR(10))
    at.load(tmp_path / "sharded.safetensors", eng)
    assert eng.state.step == 2
    for t in range(2, bc.STEPS):
        x, y = bc.batch(t)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        eng.step()
    np.testing.assert_allclose(bc.flat_params(m), bc.flat_params(want), rtol=1e-10, atol=1e-12)


@pytest.mark.slow  # the slow tier: a crash under torchrun (test_mpi checks one under mpiexec)
def test_a_crashing_rank_ends_the_job_with_its_error():
    """The last rank fails before a collective the other waits in: torchrun ends both, non-zero."""
    t0 = time.monotonic()
    proc = torchrun(2, CHECKS, "crash", timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 100
    out = proc.stdout + proc.stderr
    assert "ArgumentTypeError: x: expected a C-contiguous array" in out, out
    assert "unreachable" not in out


@pytest.mark.slow  # the slow tier: an example script under torchrun
def test_the_example_under_torchrun_prints_the_one_process_losses():
    """examples/torchrun_train.py on 2 ranks prints the losses it prints alone (float32 rounding)."""
    proc = torchrun(2, EXAMPLE, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "40 AdamW steps on 2 rank(s) over gloo" in proc.stdout, proc.stdout
    alone = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=180,
                           env=rank_env(180))
    assert alone.returncode == 0, alone.stdout + alone.stderr
    assert "40 AdamW steps on 1 rank(s) over gloo" in alone.stdout, alone.stdout

    def losses(text):
        return [float(v) for v in re.findall(r"loss (\d+\.\d+)", text)]

    got, want = losses(proc.stdout), losses(alone.stdout)
    assert len(got) == len(want) == 5 and got[-1] < got[0]
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_nccl_over_cupy_buffers_one_rank_per_gpu():
    """CuPy buffers through NCCL (DLPack views, CuPy's stream): needs torch with CUDA, CuPy and a GPU."""
    torchrun_exe()
    import torch
    import torch.distributed as dist

    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        pytest.skip("needs torch built with CUDA and NCCL, and a GPU")
    from cuda_family import require_gpu

    require_gpu()
    n = min(2, torch.cuda.device_count())
    proc = torchrun(n, CHECKS, "nccl", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"checks passed on {n} ranks" in proc.stdout.strip().splitlines()[-1], proc.stdout + proc.stderr


def test_without_torch_or_an_initialised_group_a_clear_error(monkeypatch, tmp_path):
    from arraytrain.parallel.torch_dist import TorchComm

    torchrun_exe()
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this process has a torch.distributed group")
    with pytest.raises(BackendUnavailableError, match=r"init_process_group\('gloo'\).*torchrun"):
        TorchComm()
    # a group of one process here: the identity; after destroy_process_group a clear error, not a crash
    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        comm = TorchComm()
        x = np.arange(5.0)
        comm.allreduce(x)
        assert comm.is_local and x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and comm.gather_objects(1) == [1]
    finally:
        dist.destroy_process_group()
    with pytest.raises(BackendUnavailableError, match="destroy_process_group"):
        comm.allreduce(x)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    with pytest.raises(BackendUnavailableError, match=r"pip install torch"):
        TorchComm()
    with pytest.raises(ImportError):  # the builtin a caller would catch
        TorchComm()


def test_import_arraytrain_does_not_import_torch():
    code = ("import sys, arraytrain, arraytrain.distributed, arraytrain.parallel.torch_dist; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=SOURCE)).stdout
    assert out.split() == ["False"]
