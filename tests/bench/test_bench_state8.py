"""The 8-bit and float8 state accuracy benchmark runs end to end on tiny settings."""

from __future__ import annotations

import json

import pytest

from arraytrain.bench import state8

pytestmark = pytest.mark.slow  # the slow tier: the benchmarks' smoke runs (tiny settings, real subprocesses)

def test_transformer_and_digits_on_tiny_settings(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    out = tmp_path / "s.json"
    assert state8.main(["--steps", "3", "--epochs", "1", "--seeds", "1", "--transformer-seeds", "2",
                        "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| float32 state |" in text and "| 8-bit state |" in text and "| float8 state |" in text
    assert "mean gap, 8bit:" in text and "mean gap, float8:" in text
    res = json.loads(out.read_text())
    assert len(res["transformer"]["8-bit state"]) == 3 and len(res["transformer"]["float8 state"]) == 3
    assert res["transformer"]["8-bit state"][0] == res["transformer"]["float32 state"][0]  # the same start
    assert all(0 <= a <= 1 for accs in res["digits"].values() for a in accs)
    assert "per seed" in text and sorted(res["transformer_seeds"]) == ["0", "1"]
    assert res["transformer_seeds"]["1"]["float32 state"] != res["transformer_seeds"]["0"]["float32 state"]


def test_unknown_parts_are_refused(capsys):
    assert state8.main(["--parts", "nope"]) == 2
    assert "unknown ['nope']" in capsys.readouterr().err
