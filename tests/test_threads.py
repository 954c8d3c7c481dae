"""The threading policy is applied at import, respects the environment, and can be switched off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = ("import os, arraytrain; from arraytrain import threads; "
         "print(os.environ.get('OMP_WAIT_POLICY')); print(threads.apply_policy())")


def _probe(code=PROBE, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "ARRAYTRAIN_THREAD_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env},
                         capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()


def test_import_sets_passive_wait_policy():
    wait, how = _probe()
    assert wait == "PASSIVE" and "set by arraytrain" in how


def test_environment_setting_is_kept():
    wait, how = _probe(OMP_WAIT_POLICY="ACTIVE")
    assert wait == "ACTIVE" and "from the environment" in how


def test_opt_out_leaves_environment_alone():
    wait, how = _probe(ARRAYTRAIN_THREAD_POLICY="off")
    assert wait == "None" and "policy off" in how


def test_too_late_when_numba_threads_already_started():
    code = ("import numba; numba.get_num_threads(); import os, arraytrain; from arraytrain import threads; "
            "print(os.environ.get('OMP_WAIT_POLICY')); print(threads.apply_policy())")
    wait, how = _probe(code)
    assert wait == "None" and "already started" in how


def test_describe_names_layer_threads_and_policy():
    threads = pytest.importorskip("arraytrain.threads")
    line = threads.describe()
    assert "numba layer" in line and "threads" in line
