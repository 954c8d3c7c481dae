"""The engine's plain boundary (one process on the host, replicated, blocking, no compressor, SAM,
working copy or mask, every parameter present at one step count) runs the staged boundary's norm pass,
verdict and kernel without the exchange, placement and step-count groups in between: every result,
report and refusal is the staged boundary's, bit for bit."""

import math

import numpy as np
import pytest

import arraytrain as at
from conftest import engine_snapshot

SHAPES = {"w": (40, 30), "b": (30,), "big": (5000,), "one": (1,)}

OPTIMIZERS = {
    "AdamW": lambda: at.optim.AdamW(1e-2, weight_decay=0.1),
    "Adam-amsgrad": lambda: at.optim.Adam(1e-2, weight_decay=0.01, amsgrad=True),
    "SGD": lambda: at.optim.SGD(1e-2, momentum=0.9, nesterov=True, overrides={"b": {"lr": 0.5}}),
    "LAMB": lambda: at.optim.LAMB(1e-2),
    "NAdam": lambda: at.optim.NAdam(1e-2),
    "Muon": lambda: at.optim.Muon(0.02, fallback=at.optim.AdamW(1e-2)),
    "ScheduleFree": lambda: at.optim.ScheduleFreeAdamW(1e-2),
}


def params(dtype):
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}


def grads(t, dtype, bad=False):
    rng = np.random.default_rng(10 + t)
    g = {n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}
    if bad:
        g["big"][17] = np.nan
    return g


def pair(make, dtype, settings):
    """An engine on the plain boundary and one forced onto the staged one, same settings (made twice)."""
    a, b = at.Engine(params(dtype), make(), **settings()), at.Engine(params(dtype), make(), **settings())
    assert a._plain
    b._plain = False
    return a, b


def same_report(ra, rb):
    for field in ("applied", "skipped", "step", "micro_batches", "lr", "loss_scale", "perturbed"):
        assert getattr(ra, field) == getattr(rb, field), field
    for field in ("grad_norm", "clip_coef"):
        x, y = getattr(ra, field), getattr(rb, field)
        assert (x is None and y is None) or (math.isnan(x) and math.isnan(y)) or x == y, field
    assert (ra.grad_norms is None) == (rb.grad_norms is None)
    if ra.grad_norms is not None:
        np.testing.assert_array_equal(list(ra.grad_norms.values()), list(rb.grad_norms.values()))


SETTINGS = {
    "plain": lambda: {},
    "clip-schedule": lambda: {"max_grad_norm": 0.5,
                              "schedule": at.schedules.Warmup(2, then=at.schedules.CosineAnnealingLR(10))},
    "apply-sum": lambda: {"nonfinite": "apply", "reduction": "sum"},
    "loss-scaler": lambda: {"loss_scaler": at.LossScaler(init_scale=2.0**4)},
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("settings", sorted(SETTINGS))
def test_the_plain_boundary_gives_the_staged_boundarys_bits(name, dtype, settings):
    a, b = pair(OPTIMIZERS[name], dtype, SETTINGS[settings])
    bad_step = None if settings == "apply-sum" else 2
    for t in range(5):
        g = grads(t, dtype, bad=t == bad_step)
        if t % 2:  # the zero-copy path and the dict path (read where they lie)
            a.grads.load(g)
            b.grads.load(g)
            ra, rb = a.step(), b.step()
        else:
            ra, rb = a.step(g), b.step(g)
        same_report(ra, rb)
        assert engine_snapshot(a) == engine_snapshot(b)
    if bad_step is not None:
        assert a.state.step == 4  # the NaN step was skipped on both


def test_a_mask_or_an_absent_parameter_takes_the_staged_boundary():
    a = at.Engine(params(np.float32), at.optim.AdamW(1e-2), missing="skip")
    staged = []
    real = a._placement.update
    a._placement.update = lambda *args, **kw: (staged.append(True), real(*args, **kw))[1]
    a.step(grads(0, np.float32))
    assert staged == []  # everything present: the plain boundary
    g = grads(1, np.float32)
    del g["b"]
    a.step(g)
    assert staged == [True]
    mask = at.prune.magnitude_mask(a.params, ratio=0.5)
    a.set_mask(mask)
    assert a.state.counts is not None  # "b" is a step behind: the step runs per step count, on subsets
    a.step(grads(2, np.float32))  # (a mask over a subset of the pieces was refused as another layout)
    assert staged == [True, True]
    assert not a.params.flat[mask.flat == 0].any()


def test_engines_that_exchange_or_compress_never_take_the_plain_boundary():
    p = params(np.float32)
    assert not at.Engine(p, at.optim.AdamW(1e-2), accumulation_steps=2, compressor=at.compress.TopK(ratio=0.5))._plain
    assert not at.Engine(p, at.optim.AdamW(1e-2), working_dtype="bfloat16")._plain
    assert not at.Engine(p, at.optim.SAM(at.optim.SGD(1e-2)))._plain
