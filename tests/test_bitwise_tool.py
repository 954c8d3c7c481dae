"""tools/bitwise.py, the check that a change leaves every buffer's bits as they were: its run is
deterministic, and a run resumed from another run's checkpoints ends with that run's hashes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "bitwise.py"
ONLY = "sgd,adamw-accum-clip-schedule-scaler,adamw-state-8bit,sgd-topk"


def _run(out: Path, *extra) -> dict:
    subprocess.run([sys.executable, str(TOOL), "run", str(out), "--only", ONLY, *extra], check=True,
                   capture_output=True, text=True)
    return json.loads((out / "hashes.1.0.json").read_text())


def test_runs_agree_and_resume_from_each_others_checkpoints(tmp_path):
    first = _run(tmp_path / "a")
    second = _run(tmp_path / "b", "--resume", str(tmp_path / "a"))
    assert set(first) == set(ONLY.split(","))
    for name, runs in first.items():
        assert second[name]["run"] == runs["run"], name
        assert second[name]["resumed"] == runs["run"], name
        assert any(k.startswith("state/") for k in runs["run"]) and "params" in runs["run"]


def test_a_changed_configuration_changes_its_hashes(tmp_path):
    sys.path.insert(0, str(TOOL.parent))
    try:
        import bitwise
    finally:
        sys.path.pop(0)
    import numpy as np

    a, b = {}, {}
    bitwise._hashes({"x": np.zeros(3, np.float32), "n": 1}, "s", a)
    bitwise._hashes({"x": np.array([0, 0, np.float32(1e-45)], np.float32), "n": 1}, "s", b)
    assert a["s/n"] == b["s/n"] and a["s/x"] != b["s/x"]
