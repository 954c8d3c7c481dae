"""The comparison benchmark compares like with like: every contestant computes the same step."""

from __future__ import annotations

import json

import numpy as np
import pytest

from arraytrain.bench import common, compare

pytestmark = pytest.mark.slow  # the slow tier: the benchmarks' smoke runs (tiny settings, real subprocesses)

PAIRS = [(name, opt) for opt in common.OPTIMIZERS for name in compare.CONTESTANTS
         if not name.startswith("arraytrain") and (name, opt) not in common.NOT_AVAILABLE]
BF16 = [opt for opt in common.OPTIMIZERS if ("arraytrain-bf16", opt) not in common.NOT_AVAILABLE]
BFLOAT16_NEWTON_SCHULZ = {("torch-forloop", "muon")}
# DeepSpeed's Adagrad writes its update into the gradient where its SIMD loop leaves a tail (the last
# n % 16 elements of a tensor: "STORE UPDATE TERM TO GRAD'S MEMORY", csrc/adagrad/cpu_adagrad.cpp),
# so its second step from the same gradients differs there: compared after the one step it takes
ONE_STEP = {(c, "adagrad") for c in ("deepspeed", "deepspeed-working-bf16", "deepspeed-working-f16")}
NOT_MOMENTS = {"z", "max_lr", "weight_sum"}  # schedule-free's iterate and float64 weights stay as they are


@pytest.mark.parametrize("name,opt", PAIRS, ids=[f"{n}-{o}" for n, o in PAIRS])
def test_contestant_matches_arraytrain(name, opt):
    """4 clipped steps (the factories take one; see ONE_STEP) of 100 tensors: the same parameters.

    rtol 1e-4 covers float32 rounding and the clip factor's form (torch and the
    others: max_norm / (norm + 1e-6); optax: max_norm / norm).
    """
    n = 3000 if opt == "adafactor" else 2000  # 30-element tensors: 5 x 6 matrices
    ours = compare.make_arraytrain(opt, n)
    try:
        theirs = compare.CONTESTANTS[name](opt, n)
    except ImportError as exc:
        pytest.skip(f"{name}: {exc}")
    for _ in range(0 if (name, opt) in ONE_STEP else 3):  # the factories took one step already
        ours()
        theirs()
    start, _ = compare.make_data(n, opt=opt)
    if (name, opt) in BFLOAT16_NEWTON_SCHULZ:
        # torch.optim.Muon iterates Newton-Schulz in bfloat16 (arraytrain and the NumPy contestant
        # in float32): the same steps to bfloat16's precision, per matrix (measured 2% of the displacement)
        for a, b, a0 in zip(ours.params(), theirs.params(), start, strict=True):
            assert np.linalg.norm((b - a0) - (a - a0)) <= 5e-2 * np.linalg.norm(a - a0)
        return
    for a, b, a0 in zip(ours.params(), theirs.params(), start, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
        # the displacements too: clipped steps are small next to the parameters, so the
        # check above alone would pass a contestant that barely moved
        np.testing.assert_allclose(b - a0, a - a0, rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("opt", BF16)
def test_bfloat16_state_contestant_follows_arraytrain(opt):
    """arraytrain with bfloat16 state: the same steps to the moments' precision (2**-8 relative)."""
    n = 2000
    ours, bf16 = compare.make_arraytrain(opt, n), compare.make_arraytrain_bf16(opt, n)
    for _ in range(3):
        ours()
        bf16()
    start, _ = compare.make_data(n, opt=opt)
    for a, b, a0 in zip(ours.params(), bf16.params(), start, strict=True):
        if opt == "muon":  # the orthogonalised update is a matrix's: compared per matrix
            assert np.linalg.norm((b - a0) - (a - a0)) <= 2e-2 * np.linalg.norm(a - a0)
        else:
            np.testing.assert_allclose(b - a0, a - a0, rtol=2e-2, atol=2e-5)
    slots = bf16.engine.state.slots
    assert all(s.dtype == np.dtype("bfloat16") for k, s in slots.items() if k not in NOT_MOMENTS)


def test_every_optimizer_has_an_outside_contestant():
    for opt in common.OPTIMIZERS:
        outside = [c for c in compare.CONTESTANTS
                   if not c.startswith("arraytrain") and (c, opt) not in common.NOT_AVAILABLE]
        assert outside, opt
    # every (contestant, optimizer) pair that the matching test checks (bnb-8bit: 5; the three DeepSpeed
    # contestants: 4 each, skipped where DeepSpeed is not installed or its op cannot build)
    assert len(PAIRS) == 64


@pytest.mark.parametrize("name,opt", sorted(common.NOT_AVAILABLE))
def test_unavailable_pairs_say_why(name, opt):
    with pytest.raises(compare.NotAvailable, match=r"\w"):
        compare.CONTESTANTS[name](opt, 100)


def test_adafactor_contestants_get_matrices():
    params, _ = compare.make_data(3000, opt="adafactor")
    assert len(params) == 100 and all(p.ndim == 2 for p in params)
    assert sum(p.size for p in params) == 3000


def test_step_bytes():
    assert common.step_bytes("adamw") == 32  # norm read 4 + read p,g,m,v 16 + write p,m,v 12
    assert common.step_bytes("sgd") == 24
    assert common.step_bytes("lamb") == 44  # norm 4 + (read p,g,m,v; write m,v) 24 + (read p,m,v; write p) 16
    assert common.step_bytes("adafactor") == 28  # norm 4 + read g 4 + read p,g 8 + read p,g, write p 12


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
    assert {r["optimizer"] for r in doc["rows"]} == {"sgd"} and doc["triad_gbs"] > 0 and doc["inplace_gbs"] > 0
    assert all(0 < r["inplace_gbs"] <= doc["inplace_gbs"] for r in doc["rows"])  # each row's own reference
    printed = capsys.readouterr().out
    assert "| sgd | 1e+03 | arraytrain |" in printed and "| % in-place |" in printed
    slow = dict(doc, rows=[dict(r, times={"arraytrain": [t / 10 for t in r["times"]["arraytrain"]]})
                           for r in doc["rows"]])
    (tmp_path / "fast.json").write_text(json.dumps(slow))
    rc = compare.main(["--optimizers", "sgd", "--sizes", "1000", "--contestants", "arraytrain", "--reps", "3",
                       "--baseline", str(tmp_path / "fast.json")])
    assert rc == 1 and "slower relative to the triad" in capsys.readouterr().out


def test_cli_rejects_unknown_names():
    with pytest.raises(SystemExit):
        compare.main(["--optimizers", "sophia"])
    with pytest.raises(SystemExit):
        compare.main(["--contestants", "jax"])


def test_cuda_cli_rejects_unknown_contestants_before_needing_a_gpu(capsys):
    from arraytrain.bench import cuda

    for names in ("arraytrain,jax", "arraytrain-8bit,bnb-8bit"):  # unknown; no arraytrain to compare with
        with pytest.raises(SystemExit):
            cuda.main(["--contestants", names])
    assert "the table compares with arraytrain" in capsys.readouterr().err
    assert set(cuda.OPTIONAL) <= set(compare.CONTESTANTS)  # the same names as the CPU comparison's


def test_cli_lists_unavailable_pairs(tmp_path, capsys):
    out = tmp_path / "run.json"
    rc = compare.main(["--optimizers", "lion", "--sizes", "1000", "--contestants", "arraytrain,torch-fused",
                       "--reps", "3", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["unavailable"] == {"torch-fused/lion": "torch.optim has no Lion"}
    assert "not available: torch-fused/lion: torch.optim has no Lion" in capsys.readouterr().out


def test_intake_times_torch_in_rounds_of_its_own(monkeypatch):
    """bench intake: every figure, and torch's step timed apart from arraytrain's contestants (its
    spinning OpenMP threads would take the cores from whichever one followed it)."""
    pytest.importorskip("torch")
    from arraytrain.bench import common, intake

    groups = []
    real = common.best_of
    monkeypatch.setattr(common, "best_of", lambda fns, calls, repeats: (groups.append(set(fns)), real(fns, calls, repeats))[1])
    out = intake.measure(10, 10_000, calls=1, repeats=1)
    assert {"dict", "zero-copy", "torch-fused"} <= set(out["step_s"]) and out["tensors"] == 10
    assert {"torch-fused"} in groups and not any("torch-fused" in g and len(g) > 1 for g in groups)
    assert all(v > 0 for v in out["step_s"].values())
