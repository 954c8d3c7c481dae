"""Asking for the CUDA backend without CuPy or without a GPU: a clear error that says what to install."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import arraytrain as at
from arraytrain.errors import BackendUnavailableError
from arraytrain.kernels.cuda import core


@pytest.fixture
def no_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    monkeypatch.delenv("ARRAYTRAIN_CUDA", raising=False)  # not the CPU executor standing for CuPy
    monkeypatch.setattr(core, "_cupy", None)


def test_missing_cupy_names_the_extras(no_cupy):
    with pytest.raises(BackendUnavailableError, match=r"arraytrain\[cuda12\].*arraytrain\[cuda13\]"):
        at.Engine({"w": np.zeros(3, np.float32)}, at.optim.SGD(lr=0.1), device="cuda")


def test_missing_cupy_from_the_cli(no_cupy, capsys):
    from arraytrain.cli import main

    assert main(["train", "--device", "cuda", "--epochs", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cuda13" in err and len(err.strip().splitlines()) == 1


def test_no_gpu_is_a_clear_error(monkeypatch):
    pytest.importorskip("cupy")
    monkeypatch.setattr(core, "probe", lambda: False)
    with pytest.raises(BackendUnavailableError, match="no CUDA device"):
        at.Engine({"w": np.zeros(3, np.float32)}, at.optim.SGD(lr=0.1), device="cuda")
