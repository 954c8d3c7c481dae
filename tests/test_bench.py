"""The comparison benchmark compares like with like: every contestant computes the same step."""

from __future__ import annotations

import json

import numpy as np
import pytest

from arraytrain.bench import compare


@pytest.mark.parametrize("opt", sorted(compare.SLOTS))
@pytest.mark.parametrize("name", [c for c in compare.CONTESTANTS if c != "arraytrain"])
def test_contestant_matches_arraytrain(opt, name):
    ours = compare.make_arraytrain(opt, 2000)
    try:
        theirs = compare.CONTESTANTS[name](opt, 2000)
    except ImportError as exc:
        pytest.skip(f"{name}: {exc}")
    for _ in range(3):  # the factories took one step already
        ours()
        theirs()
    for a, b in zip(ours.params(), theirs.params()):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_step_bytes():
    assert compare.step_bytes("adamw") == 32  # norm read 4 + read p,g,m,v 16 + write p,m,v 12
    assert compare.step_bytes("sgd") == 24


def _doc(seconds, triad):
    return {"triad_gbs": triad, "rows": [{"optimizer": "adamw", "n": 10, "times": {"arraytrain": [seconds]}}]}


def test_regressions_are_relative_to_the_triad():
    old = _doc(1.0, 40.0)
    assert compare.regressions(_doc(2.0, 20.0), old) == []  # machine half as fast: not a regression
    assert compare.regressions(_doc(1.2, 40.0), old) == ["adamw n=1e+01: 1.20x slower relative to the triad"]


def test_cli_writes_json_and_flags_baseline(tmp_path, capsys):
    out = tmp_path / "run.json"
    rc = compare.main(["--optimizers", "sgd", "--sizes", "1000", "--contestants", "arraytrain,numpy",
                       "--reps", "3", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert {r["optimizer"] for r in doc["rows"]} == {"sgd"} and doc["triad_gbs"] > 0
    assert "| sgd | 1e+03 | arraytrain |" in capsys.readouterr().out
    slow = dict(doc, rows=[dict(r, times={"arraytrain": [t / 10 for t in r["times"]["arraytrain"]]})
                           for r in doc["rows"]])
    (tmp_path / "fast.json").write_text(json.dumps(slow))
    rc = compare.main(["--optimizers", "sgd", "--sizes", "1000", "--contestants", "arraytrain", "--reps", "3",
                       "--baseline", str(tmp_path / "fast.json")])
    assert rc == 1 and "slower relative to the triad" in capsys.readouterr().out


def test_cli_rejects_unknown_names():
    with pytest.raises(SystemExit):
        compare.main(["--optimizers", "lion"])
