"""Schedule-Free AdamW: the kernel against its reference, warm-ups against optax, the evaluation weights.

* kernel: ``schedule_free_adamw_step`` (the fast families: numba, and CUDA where a GPU is
  usable, through the ``family`` fixture) against the reference on y, z, v and the
  per-parameter ``max_lr`` / ``weight_sum`` over STEPS steps at every size in SIZES (zero-size
  parameters first, middle, last), float32 and float64, per-parameter lr / weight decay, a
  weight lr that warms up, a parameter at lr 0 (the weight's 0/0), zero_grad alternating; a
  working copy and a mask; bfloat16 v; NaN/Inf as in the reference.
* optax: warm-ups (the optimizer table's rows have none, see conftest) through
  test_optim_table's comparison.
* evaluation: ``eval_params`` is optax's ``(y - (1 - b1) z) / b1``, in place or not;
  ``Engine.evaluation()`` holds x for a block and puts y back bit for bit; the Trainer
  evaluates at x; evaluating between steps changes nothing about training.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import arraytrain as at
from arraytrain import optim
from arraytrain.errors import ConcurrentUseError, HyperparameterError
from arraytrain.kernels import reference as ref
from conftest import (
    LP_TOL,
    SIZES,
    assert_close,
    assert_padding_zero,
    decoded,
    dtypes,
    live_mask,
    padded_layout,
    random_flat,
    zero_grad_at,
)

STEPS = 8
B1, B2 = 0.9, 0.99
SLOTS = ("z", "v")


def _init(layout, dtype, rng):
    p0 = random_flat(layout, dtype, rng)
    z0 = random_flat(layout, dtype, rng)  # any z: the kernel's math, not only the first step's z = y
    nseg = len(layout)
    return {k: {"p": p0.copy(), "z": z0.copy(), "v": np.zeros(layout.size, dtype), "max_lr": np.zeros(nseg),
                "weight_sum": np.zeros(nseg)} for k in ("fast", "ref")}


def _step(kernels, s, g, layout, t, lr, wd, zg=False, w=None, wkind=0, mask=None, gscale=0.7):
    warm = np.minimum(t, 3) / 3  # a warm-up of the weights' lr
    kernels.schedule_free_adamw_step(s["p"], g, s["z"], s["v"], s["max_lr"], s["weight_sum"], layout.pieces,
                                     gscale=gscale, lr=lr, weight_lr=lr * warm, weight_lr_power=2.0,
                                     weight_decay=wd, beta1=B1, beta2=B2, eps=1e-3,
                                     inv_bc2_sqrt=1.0 / np.sqrt(1.0 - B2**t), working=w, kind=wkind, zero_grad=zg,
                                     mask=mask)


def _per_param(layout, rng):
    lr = 1e-2 * rng.uniform(0.5, 1.5, len(layout))
    lr[1] = 0.0  # "a": no step and no weight (ck = 0/0 -> 0): x and y stay
    return lr, 0.1 * rng.uniform(0.5, 1.5, len(layout))


def _compare(states, layout, t, dtype):
    for what in ("p", "z", "v"):
        assert_close(states["fast"][what], states["ref"][what], err_msg=f"{what}, step {t}")
        assert_padding_zero(states["fast"][what], layout, what)
    for what in ("max_lr", "weight_sum"):  # float64 on both sides
        assert_close(states["fast"][what], states["ref"][what], np.float64, err_msg=f"{what}, step {t}")


@pytest.mark.parametrize("n", SIZES)
@dtypes
def test_kernel_matches_reference(family, n, dtype, rng):
    layout = padded_layout(n)
    states = _init(layout, dtype, rng)
    lr, wd = _per_param(layout, rng)
    p0 = states["fast"]["p"].copy()
    for t in range(1, STEPS + 1):
        zg = zero_grad_at(t, dtype)
        g0 = random_flat(layout, dtype, rng, scale=[1.0, 5.0, 0.1][t % 3])
        for k, kernels in (("fast", family), ("ref", ref)):
            g = g0.copy()
            _step(kernels, states[k], g, layout, t, lr, wd, zg)
            assert not np.any(g) if zg else np.array_equal(g, g0)
        _compare(states, layout, t, dtype)
    a = layout.slice("a")
    assert_close(states["fast"]["p"][a], p0[a])  # lr 0: ck 0, y' = b1 x + (1 - b1) z = y (up to rounding)
    assert states["fast"]["weight_sum"][1] == 0.0
    if n:
        b = layout.slice("b")
        assert np.abs(states["fast"]["p"][b] - p0[b]).max() > 1e-3


@pytest.mark.parametrize("n", [7, 1037, 278011])
@pytest.mark.parametrize("working", ["bf16", "f16"])
def test_working_copy_and_mask(family, n, working, rng):
    """The working copy is the rounding of the new y; pruned elements of y and z are 0 (so x is 0)."""
    layout = padded_layout(n)
    states = _init(layout, np.float32, rng)
    lr, wd = _per_param(layout, rng)
    wdtype, wkind = ((np.dtype(ml_dtypes.bfloat16), family.LP_BF16) if working == "bf16"
                     else (np.dtype(np.float16), family.LP_F16))
    mask = (rng.uniform(size=layout.size) > 0.3).astype(np.uint8)
    w = {k: np.zeros(layout.size, np.uint16) for k in ("fast", "ref")}
    live = live_mask(layout)
    for t in range(1, 4):
        g0 = random_flat(layout, np.float32, rng)
        for k, kernels in (("fast", family), ("ref", ref)):
            _step(kernels, states[k], g0.copy(), layout, t, lr, wd, w=w[k], wkind=wkind, mask=mask)
        _compare(states, layout, t, np.float32)
        pruned = live & (mask == 0)
        assert not np.any(states["fast"]["p"][pruned]) and not np.any(states["fast"]["z"][pruned])
        np.testing.assert_array_equal(w["fast"][live], states["fast"]["p"][live].astype(wdtype).view(np.uint16))


@pytest.mark.parametrize("n", [7, 1037, 278011])
def test_bfloat16_second_moment_matches_reference(family, n, rng):
    """v as bfloat16 bits (state_dtype), y and z float32: each step from the same state."""
    layout = padded_layout(n)
    states = _init(layout, np.float32, rng)
    for k in ("fast", "ref"):
        states[k]["v"] = np.zeros(layout.size, np.uint16)
    lr, wd = _per_param(layout, rng)
    for t in range(1, STEPS + 1):
        for what in ("p", "z", "v", "max_lr", "weight_sum"):
            states["ref"][what][...] = states["fast"][what]
        g0 = random_flat(layout, np.float32, rng)
        for k, kernels in (("fast", family), ("ref", ref)):
            _step(kernels, states[k], g0.copy(), layout, t, lr, wd)
        for what in ("p", "z"):
            np.testing.assert_allclose(states["fast"][what], states["ref"][what], err_msg=f"{what}, step {t}", **LP_TOL)
        a, d = (decoded(states[k]["v"]) for k in ("fast", "ref"))
        np.testing.assert_allclose(a, d, rtol=2**-7, atol=1e-6, err_msg=f"v, step {t}")


@pytest.mark.parametrize("n", [7, 278011])
@dtypes
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "+inf", "-inf"])
def test_nonfinite_propagates_as_in_the_reference(family, n, dtype, bad, rng):
    layout = padded_layout(n)
    states = _init(layout, dtype, rng)
    lr, wd = _per_param(layout, rng)
    lr[1] = 1e-2
    live = np.flatnonzero(live_mask(layout))
    for t in range(1, 4):
        g0 = random_flat(layout, dtype, rng)
        if t == 2:
            g0[live[len(live) // 2]] = bad
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            for k, kernels in (("fast", family), ("ref", ref)):
                _step(kernels, states[k], g0.copy(), layout, t, lr, wd)
        for what in ("p", "z", "v"):
            a, d = states["fast"][what], states["ref"][what]
            np.testing.assert_array_equal(np.isnan(a), np.isnan(d), err_msg=f"{what}: NaN pattern, step {t}")
            np.testing.assert_array_equal(np.isinf(a), np.isinf(d), err_msg=f"{what}: inf pattern, step {t}")
            fin = np.isfinite(d)
            assert_close(a[fin], d[fin], dtype, err_msg=f"{what}, step {t}")
        if t >= 2:
            assert not np.isfinite(states["fast"]["p"]).all()


# -- optax, with warm-ups -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"lr": 2e-2, "warmup_steps": 5},
    {"lr": 1e-2, "betas": (0.8, 0.99), "weight_decay": 0.5, "warmup_steps": 60, "weight_lr_power": 3.0},
], ids=["warmup5", "warmup60_wd_power3"])
@pytest.mark.parametrize("dtype_name", ["float32", pytest.param("float64", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kernels", ["numba", pytest.param("reference", marks=pytest.mark.slow)])
def test_warmup_matches_optax(kwargs, dtype_name, kernels):
    """optax's warm-up: the weights at its count t, the step at t - 1 (the first step holds z)."""
    from test_optim_table import test_matches_optax

    test_matches_optax("schedule_free_warmup", "ScheduleFreeAdamW", kwargs, dtype_name, kernels)


# -- the evaluation weights ---------------------------------------------------------------------------------------

SHAPES = {"w": (6, 5), "empty": (0,), "b": (5,)}


def _trained(steps=6, **kw):
    rng = np.random.default_rng(2)
    p0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    engine = at.Engine(p0, optim.ScheduleFreeAdamW(lr=1e-2, **kw), working_dtype="bfloat16")
    for _ in range(steps):
        engine.step({k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()})
    return engine


def test_eval_params_is_optax_formula_in_place_or_not():
    engine = _trained()
    y, z = engine.params.flat.copy(), engine.state.slots["z"].flat
    expected = (y - np.float32(1.0 - B1) * z) / np.float32(B1)
    x = engine.optimizer.eval_params(engine.params, engine.state)
    np.testing.assert_array_equal(x.flat, expected)
    np.testing.assert_array_equal(engine.params.flat, y)  # untouched
    assert_padding_zero(x.flat, engine.layout, "x")
    inplace = engine.params.copy()
    engine.optimizer.eval_params(inplace, engine.state, out=inplace)
    np.testing.assert_array_equal(inplace.flat, expected)
    with pytest.raises(HyperparameterError, match="out"):
        engine.optimizer.eval_params(engine.params, engine.state, out=engine.params.zeros_like(np.float64))


def test_evaluation_block_holds_x_and_restores_y_bitwise():
    engine = _trained()
    y, w = engine.params.flat.copy(), engine.working.flat.copy()
    x = engine.optimizer.eval_params(engine.params, engine.state).flat.copy()
    assert not np.array_equal(x, y)
    with engine.evaluation() as params:
        assert params is engine.params
        np.testing.assert_array_equal(engine.params.flat, x)
        np.testing.assert_array_equal(engine.working.flat.view(np.uint16),
                                      x.astype(ml_dtypes.bfloat16).view(np.uint16))
        with pytest.raises(ConcurrentUseError, match="inside engine.evaluation"):
            engine.step({k: np.ones(s, np.float32) for k, s in SHAPES.items()})
        with pytest.raises(ConcurrentUseError, match="inside engine.evaluation"):
            engine.state_dict()
        with pytest.raises(ConcurrentUseError, match="already inside"):
            with engine.evaluation():
                pass
    np.testing.assert_array_equal(engine.params.flat, y)
    np.testing.assert_array_equal(engine.working.flat, w)
    assert engine.micro_batches == 0 and engine.state.step == 6


def test_evaluating_between_steps_changes_nothing():
    plain, evaluated = _trained(0), _trained(0)
    draws = {id(e): np.random.default_rng(5) for e in (plain, evaluated)}
    for t in range(12):
        for e in (plain, evaluated):
            e.step({k: draws[id(e)].standard_normal(s).astype(np.float32) for k, s in SHAPES.items()})
        if t % 4 == 1:
            with evaluated.evaluation():
                pass
    assert evaluated.params.flat.tobytes() == plain.params.flat.tobytes()
    assert evaluated.working.flat.tobytes() == plain.working.flat.tobytes()
    for k in plain.state.slots:
        assert evaluated.state.slots[k].flat.tobytes() == plain.state.slots[k].flat.tobytes()


def test_other_optimizers_evaluate_at_their_parameters():
    engine = at.Engine({"w": np.ones((3, 2), np.float32)}, optim.AdamW())
    assert not engine.optimizer.has_eval_params
    with engine.evaluation() as params:
        assert params is engine.params
        engine.step({"w": np.ones((3, 2), np.float32)})  # nothing was swapped: stepping is allowed
    sam = optim.SAM(optim.ScheduleFreeAdamW())
    assert sam.has_eval_params


def test_trainer_evaluates_at_x():
    from arraytrain import nn

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    model = nn.MLP([5, 8, 2])
    engine = at.Engine(model.init(seed=1), optim.ScheduleFreeAdamW(lr=5e-2))
    trainer = nn.Trainer(model, engine, batch_size=16)
    trainer.fit(x, y, epochs=2)
    before = engine.params.flat.copy()
    logs = trainer.evaluate(x, y)
    np.testing.assert_array_equal(engine.params.flat, before)
    with engine.evaluation():
        loss, _ = nn.losses.LOSSES["cross_entropy"](model.predict(x), y)
    assert logs["loss"] == pytest.approx(loss, rel=1e-6)
    at_y, _ = nn.losses.LOSSES["cross_entropy"](model.predict(x), y)
    assert at_y != pytest.approx(loss, rel=1e-6)


def test_bad_hyperparameters():
    with pytest.raises(HyperparameterError, match=r"betas\[0\]"):
        optim.ScheduleFreeAdamW(betas=(0.0, 0.999))
    with pytest.raises(HyperparameterError, match="warmup_steps"):
        optim.ScheduleFreeAdamW(warmup_steps=-1)
    with pytest.raises(HyperparameterError, match="weight_lr_power"):
        optim.ScheduleFreeAdamW(weight_lr_power=-1.0)


def test_state_layout():
    engine = at.Engine({"w": np.ones((3, 2), np.float32), "b": np.zeros(0, np.float32)},
                       optim.ScheduleFreeAdamW(state_dtype="bfloat16"))
    slots = engine.state.slots
    np.testing.assert_array_equal(slots["z"].flat, engine.params.flat)  # z_1 = x_1 = y_1
    assert slots["exp_avg_sq"].dtype == np.dtype(ml_dtypes.bfloat16) and slots["z"].dtype == np.float32
    assert slots["max_lr"].dtype == np.float64 and slots["max_lr"].flat.shape == (2,)
    assert slots["weight_sum"].layout.shapes == ((), ())
