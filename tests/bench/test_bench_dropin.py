"""``python -m arraytrain.bench dropin``: its contestants take the same step, and it runs end to end.

Correctness only: the timings are the benchmark's business (a test never fails because the
machine was busy).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from arraytrain.bench import common, dropin

pytestmark = pytest.mark.slow  # the slow tier: the benchmarks' smoke runs (tiny settings, real subprocesses)

@pytest.mark.parametrize("clipped", [False, True], ids=["plain", "clipped"])
def test_contestants_take_the_same_step(clipped):
    """Three steps of each contestant from the same model and gradients: the same parameters.

    The drop-in keeps its gradients in the engine's buffer, which each step zeroes; torch keeps
    them. So after the first step the drop-in's own runs on zero gradients: compared here is the
    first step, then the fresh-gradient contestant (gradients given anew each step) for three.
    """
    n = 20_000
    fns = dropin.contestants(n, clipped)
    start, _ = dropin.make_model(n)
    (fresh, fresh_params), (torch_step, torch_params) = fns["drop-in, fresh .grad"], fns["torch fused"]
    for _ in range(3):
        fresh()
        torch_step()
    assert len(torch_params) == common.N_TENSORS
    for a, b, a0 in zip(fresh_params, torch_params, start, strict=True):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-5, atol=1e-6)
        assert float((a - a0).detach().abs().max()) > 1e-4  # it moved
    # the in-place contestant took one step at construction, from the same gradients
    one, _ = dropin.make_model(n)
    ref = torch.optim.AdamW(one, lr=common.LR, betas=common.BETAS, eps=common.EPS, weight_decay=common.WD,
                            foreach=False)
    _, grads = dropin.make_model(n)
    for p, g in zip(one, grads):
        p.grad = g
    if clipped:
        torch.nn.utils.clip_grad_norm_(one, common.MAX_NORM)
    ref.step()
    for a, b in zip(fns["drop-in"][1], one, strict=True):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_group_reading_is_measured_per_group():
    out = dropin.measure_groups(10, calls=20, repeats=2)
    assert out["groups"] == 10
    assert set(out["us_per_group"]) == {"unchanged", "lr set every step", "0-d tensor lr"}
    assert all(np.isfinite(v) for v in out["us_per_group"].values())


@pytest.mark.parametrize("kind", ["transformer-128", "cnn-bn", "transformer-128-frozen"])
def test_everyday_loop_contestants_train_alike(kind):
    """The everyday loop's three contestants (torch fused + clip_grad_norm_, the drop-in + clip_grad_norm_,
    the drop-in with max_grad_norm) take the same steps from the same model; frozen parameters (given to the
    optimizer, never a gradient) stay as they were in all of them."""
    made = dropin.loop_contestants(kind, steps=4, total=10)
    start = {n: p.detach().numpy().copy() for n, p in dropin.loop_model(kind)[0].named_parameters()}
    assert any(not p.requires_grad for p in made["drop-in"][1].parameters()) == kind.endswith("frozen")
    models = {}
    for name, (round_, m) in made.items():
        assert round_() > 0
        models[name] = m
    ref = dict(models["torch fused"].named_parameters())
    for name in ("drop-in", "drop-in, apply", "drop-in, max_grad_norm"):
        for n, p in models[name].named_parameters():
            a, b = p.detach().numpy(), ref[n].detach().numpy()
            # Adam turns float rounding into steps of up to lr (1e-3) where a gradient is near 0: every weight
            # within one such step, and all but a few in a thousand within a tenth of it
            if not p.requires_grad:
                assert np.array_equal(a, b) and np.array_equal(a, start[n]), f"{name}: {n}"
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3, err_msg=f"{name}: {n}")
            assert np.mean(~np.isclose(a, b, rtol=1e-3, atol=1e-4)) < 2e-3, f"{name}: {n}"


def test_main_runs_and_writes_json(tmp_path, capsys):
    path = tmp_path / "dropin.json"
    assert dropin.main(["--sizes", "1e4", "--tensors", "10", "--calls", "1", "--repeats", "1", "--group-calls", "5",
                        "--loops", "cnn-bn", "--loop-steps", "1", "--parts", "--cold", "--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert "torch fused" in text and "read_param_groups" in text and "everyday loop" in text
    assert "whole iteration" in text and "in parts" in text and "where the step runs" in text
    data = json.loads(path.read_text())
    assert data["steps"][0]["elements"] == 10_000 and data["steps"][0]["tensors"] == 10
    assert len(data["groups"]) == len(dropin.GROUPS) and data["loops"][0]["model"] == "cnn-bn"
    loop = data["loops"][0]
    assert set(loop["iteration_median"]) == set(dropin.LOOP_CONTESTANTS)
    parts = loop["drop_in_parts_us"]
    assert set(parts) == {what for what, _, _ in dropin.PARTS}
    # every part ran inside the step, and the wrappers are gone again
    assert all(0 < v <= parts["step"] for v in parts.values())
    from arraytrain.interop._torch_engine import GroupEngine
    assert GroupEngine.lean_step.__name__ == "lean_step" and GroupEngine.check.__name__ == "check"
    # --cold: every probe timed in the loop and warm, each a positive time
    cold = data["cold"]
    probes = set(dropin.cold_probes()) | {"the parameters' .grad dtype and shape"}
    assert cold["model"] == "cnn-bn" and set(cold["in_the_loop"]) == set(cold["warm"]) == probes
    for where in ("in_the_loop", "warm"):
        assert all(0 < q["p25_us"] <= q["median_us"] < 1e6 for q in cold[where].values())


def test_a_baseline_checkout_runs_beside_this_one(tmp_path):
    """--baseline: another checkout's drop-in, imported beside this one under another package name, runs
    in the loop (a minimal checkout here, whose AdamW is torch's, records how it was built: no kernel of a
    second copy of arraytrain to compile)."""
    checkout = tmp_path / "checkout"
    (checkout / "arraytrain" / "interop").mkdir(parents=True)
    (checkout / "arraytrain" / "__init__.py").write_text("")
    (checkout / "arraytrain" / "interop" / "__init__.py").write_text("")
    (checkout / "arraytrain" / "interop" / "torch.py").write_text(
        "import torch\nBUILT = []\n\n\ndef AdamW(groups, max_grad_norm=None, nonfinite='skip', **kw):\n"
        "    BUILT.append((max_grad_norm, nonfinite))\n    return torch.optim.AdamW(groups, **kw)\n")
    module = dropin.baseline_torch(str(checkout))
    assert module.__name__ == "arraytrain_baseline.interop.torch"
    made = dropin.loop_contestants("cnn-bn", 1, 3, module)
    assert set(made) == set(dropin.LOOP_CONTESTANTS + dropin.BASELINE_CONTESTANTS)
    assert module.BUILT == [(None, "skip"), (dropin.MAX_NORM, "skip")]  # its default and its max_grad_norm form
    for name in dropin.BASELINE_CONTESTANTS:
        assert made[name][0]() > 0  # a round of the loop
    with pytest.raises(SystemExit, match="no arraytrain"):
        dropin.baseline_torch(str(tmp_path))
