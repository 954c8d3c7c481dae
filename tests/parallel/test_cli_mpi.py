"""``mpiexec -n K arraytrain train`` (and ``torchrun``): one data-parallel run, the one-process trajectory, rank 0
alone speaks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from arraytrain.distributed import find_mpiexec
from test_cli import small_npz

# beside this interpreter (the mpich wheel's, in a virtualenv that is not activated), else on PATH
MPIEXEC = find_mpiexec() or shutil.which("mpirun")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install 'arraytrain[mpi]')")


def _train(tmp_path, ranks, *args, name="run"):
    pytest.importorskip("mpi4py")
    js = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "arraytrain", "train", "--no-progress", "--json", str(js), *args]
    if ranks > 1:
        cmd = [MPIEXEC, "-n", str(ranks), *cmd]
    env = {**os.environ, "NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(js.read_text())


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_data_parallel_training_follows_the_one_process_run(tmp_path, ranks):
    data = small_npz(tmp_path / "d.npz", n=120)
    common = ["--data", str(data), "--epochs", "4", "--dtype", "float64", "--batch-size", "16", "--clip", "1.0"]
    _, one = _train(tmp_path, 1, *common, name="one")
    proc, many = _train(tmp_path, ranks, *common, name="many")
    assert many["processes"] == ranks and one["processes"] == 1
    assert proc.stdout.count("test accuracy") == 1  # rank 0 alone prints
    assert f"{ranks} processes" in proc.stdout
    assert many["optimizer_steps"] == one["optimizer_steps"]
    np.testing.assert_allclose([h["loss"] for h in many["history"]], [h["loss"] for h in one["history"]], rtol=1e-9)
    assert many["test_accuracy"] == one["test_accuracy"]


@pytest.mark.slow  # the slow tier: torch and gloo started for one comparison
def test_under_torchrun_it_trains_as_under_mpiexec(tmp_path):
    """``torchrun --nproc-per-node 2 -m arraytrain train``: a TorchComm over gloo; the same run as MPI's, to
    the bit (a sum of two is the same whichever transport adds it)."""
    pytest.importorskip("torch")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    data = small_npz(tmp_path / "d.npz", n=120)
    common = ["--data", str(data), "--epochs", "3", "--batch-size", "16", "--clip", "1.0"]
    _, mpi = _train(tmp_path, 2, *common, name="mpi")
    js = tmp_path / "torch.json"
    env = {**os.environ, "NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "arraytrain", "train",
                           "--no-progress", "--json", str(js), "--comm-timeout", "30", *common],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tr = json.loads(js.read_text())
    assert tr["processes"] == 2 and proc.stdout.count("test accuracy") == 1 and "2 processes" in proc.stdout
    for key in ("optimizer_steps", "test_loss", "test_accuracy", "final_loss"):
        assert tr[key] == mpi[key], key
    assert [(h["loss"], h["val_loss"]) for h in tr["history"]] == [(h["loss"], h["val_loss"]) for h in mpi["history"]]


def test_cuda_under_torchrun_is_refused_before_any_group_starts(capsys, monkeypatch):
    from arraytrain.cli import main

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "--device", "cuda", "--epochs", "1", "--no-progress"]) == 2
    assert "--device cuda under torchrun: not built" in capsys.readouterr().err


@pytest.mark.slow  # the slow tier: the compressors under mpiexec are checked in test_mpi
def test_compressed_data_parallel_training(tmp_path):
    data = small_npz(tmp_path / "d.npz", n=120)
    proc, many = _train(tmp_path, 2, "--data", str(data), "--epochs", "4", "--batch-size", "16",
                        "--compress", "topk:ratio=0.05,ramp=0", "--error-feedback")
    assert many["processes"] == 2 and many["test_accuracy"] > 0.8
    assert many["dense_bytes_per_step"] / many["payload_bytes_per_step"] > 8
    assert "bytes/step sent by each process" in proc.stdout


def test_usage_error_is_printed_once_under_mpiexec(tmp_path):
    """Every rank reads the same arguments and refuses them; rank 0 alone says so."""
    pytest.importorskip("mpi4py")
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "arraytrain", "train", "--prune", "0.5", "--prune-epochs", "4-2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("error:") == 1 and "--prune-epochs" in proc.stderr, proc.stderr


def _gpus() -> int:
    from cuda_family import cuda_usable, device_cupy

    if not cuda_usable():
        return 0
    return device_cupy().cuda.runtime.getDeviceCount()


def test_cuda_under_mpiexec_without_a_gpu_per_process_is_refused_once(tmp_path):
    """--device cuda under mpiexec takes one GPU per process and NCCL: where that cannot be (no GPU here,
    or fewer GPUs than processes), every rank stops before training with one line from rank 0."""
    pytest.importorskip("mpi4py")
    if _gpus() >= 2:
        pytest.skip("this machine has a GPU for each of 2 processes")
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "arraytrain", "train", "--device", "cuda"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("error:") == 1 and "--device cuda under mpiexec:" in proc.stderr, proc.stderr


def test_several_gpus_from_the_command_line(tmp_path):
    """mpiexec -n 2 arraytrain train --device cuda: one GPU per process, NCCL, the one-process trajectory."""
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    data = small_npz(tmp_path / "d.npz", n=120)
    common = ["--data", str(data), "--epochs", "3", "--batch-size", "16", "--dtype", "float64"]
    _, one = _train(tmp_path, 1, *common, "--device", "cuda", name="one")
    _, many = _train(tmp_path, 2, *common, "--device", "cuda", name="many")
    assert many["processes"] == 2
    np.testing.assert_allclose([h["loss"] for h in many["history"]], [h["loss"] for h in one["history"]], rtol=1e-9)



@pytest.mark.slow  # the slow tier: three CLI runs under mpiexec (sharding: tests/parallel/test_shard.py)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "8bit"])
def test_sharded_state_follows_the_replicated_run(tmp_path, precision):
    """--shard-state: each process holds part of the optimizer state (and of the masters under bf16;
    8bit: 8-bit state), and the run follows the replicated one; its checkpoint resumes in one process."""
    data = small_npz(tmp_path / "d.npz", n=120)
    common = ["--data", str(data), "--epochs", "3", "--batch-size", "16", "--clip", "1.0"]
    common += ["--precision", "fp32", "--state-dtype", "8bit"] if precision == "8bit" else ["--precision", precision]
    _, rep = _train(tmp_path, 2, *common, name="rep")
    ckpt = tmp_path / "shard.safetensors"
    proc, sha = _train(tmp_path, 2, *common, "--shard-state", "--save", str(ckpt), name="sha")
    assert "optimizer state sharded" in proc.stdout and sha["processes"] == 2
    if precision == "bf16":
        assert "float32 masters" in proc.stdout
    np.testing.assert_allclose([h["loss"] for h in sha["history"]], [h["loss"] for h in rep["history"]], rtol=1e-4)
    _, more = _train(tmp_path, 1, *common[:3], "4", *common[4:], "--resume", str(ckpt), name="more")
    assert len(more["history"]) == 4 and more["history"][:3] == sha["history"]


@pytest.mark.slow  # the slow tier: usage errors under mpiexec
def test_shard_state_usage_errors(tmp_path):
    pytest.importorskip("mpi4py")
    base = [sys.executable, "-m", "arraytrain", "train"]
    for flag in ("--shard-state", "--overlap"):
        proc = subprocess.run([*base, flag], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and f"{flag} needs several processes" in proc.stderr, proc.stderr
    for extra, words in ((["--optimizer", "adafactor"], "--optimizer adafactor"),
                         (["--compress", "topk:ratio=0.1"], "--compress")):
        cmd = [MPIEXEC, "-n", "2", *base, "--shard-state", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.count("error:") == 1 and words in proc.stderr, proc.stderr


@pytest.mark.slow  # the slow tier: two CLI runs under mpiexec
def test_overlapped_exchange_follows_the_blocking_run(tmp_path):
    data = small_npz(tmp_path / "d.npz", n=120)
    common = ["--data", str(data), "--epochs", "3", "--batch-size", "16", "--dtype", "float64"]
    _, blocking = _train(tmp_path, 2, *common, name="blocking")
    _, overlapped = _train(tmp_path, 2, *common, "--overlap", "--shard-state", name="overlapped")
    _, sharded = _train(tmp_path, 2, *common, "--shard-state", name="sharded")
    assert [h["loss"] for h in overlapped["history"]] == [h["loss"] for h in sharded["history"]]
    np.testing.assert_allclose([h["loss"] for h in overlapped["history"]], [h["loss"] for h in blocking["history"]],
                               rtol=1e-12)
