"""Gradient prediction: trend kernels, GradientPredictor, the phase rule and PhaseTrainer."""

from __future__ import annotations

import time

import numpy as np
import pytest
from builders import mlp_engine
from conftest import assert_close, padded_layout, random_flat

import arraytrain as at
from arraytrain import nn
from arraytrain.errors import (
    AliasingError,
    ArgumentTypeError,
    DTypeError,
    HyperparameterError,
    LayoutError,
    NoGradientsError,
    ReadOnlyError,
    StateDictError,
)
from arraytrain.kernels.reference import trend as trend_reference
from arraytrain.nn.phase import Phase, PhaseSchedule
from arraytrain.phase.predict import GradientPredictor, trend_weights

KERNEL_SIZES = (0, 1, 7, 1037, 70000)  # 70000 > SERIAL_BELOW: the parallel twin
DTYPES = (np.float32, np.float64)


# -- kernels ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", KERNEL_SIZES)
@pytest.mark.parametrize("H", [2, 3, 4, 5, 6])
def test_trend_kernels_match_reference(family, rng, n, dtype, H):
    ring = rng.standard_normal((H, n)).astype(dtype)
    corr = (0.1 * rng.standard_normal(n)).astype(dtype)
    ring_ref, corr_ref = ring.copy(), corr.copy()
    steps = np.cumsum(rng.integers(1, 4, H))
    for j, (count, t) in enumerate([(H, steps[-1] + 3), (H - 1, steps[-2] + 1), (1, 50), (H, steps[-1] + 1)]):
        c = trend_weights(steps, count, t)
        out, out_ref = np.full(n, np.nan, dtype), np.full(n, np.nan, dtype)
        family.trend_predict(ring, c, corr, out)
        trend_reference.trend_predict(ring_ref, c, corr_ref, out_ref)
        assert_close(out, out_ref, dtype)
        g = rng.standard_normal(n).astype(dtype)
        slot = j % H
        family.trend_correct(ring, c, corr, g, slot=slot, beta=0.8)
        trend_reference.trend_correct(ring_ref, c, corr_ref, g, slot=slot, beta=0.8)
        assert np.array_equal(ring, ring_ref)  # the record is a copy
        assert np.array_equal(ring[slot], g)
        assert_close(corr, corr_ref, dtype)


def test_trend_weights_properties():
    steps = np.array([3, 4, 9, 10])
    for t in (0, 10, 11, 25):
        c = trend_weights(steps, 4, t)
        assert c.sum() == pytest.approx(1.0)
        assert (c * steps).sum() == pytest.approx(t)
    np.testing.assert_array_equal(trend_weights(steps, 1, 99), [1, 0, 0, 0])
    np.testing.assert_array_equal(trend_weights(steps, 0, 99), [0, 0, 0, 0])


# -- the predictor -------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", ["numba", "reference"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [2, 3, 4, 5, 6])
@pytest.mark.usefixtures("numba_family")
def test_exact_on_linear_gradients(rng, H, dtype, kernels):
    layout = padded_layout(1037)
    a, b = random_flat(layout, np.float64, rng), random_flat(layout, np.float64, rng, 0.1)
    pred = GradientPredictor(layout, history=H, dtype=dtype, kernels=kernels)
    for t in (0, 2, 3, 7, 8, 11, 15)[: H + 2]:  # more records than slots: the ring wraps
        assert pred.record((a + b * t).astype(dtype), t)
    t = 30
    out = pred.predict(t)
    want = a + b * t
    if dtype == np.float32:  # inputs rounded to float32, then extrapolated: scale the tolerance
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4 * np.abs(b).max() * t)
    else:
        assert_close(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.usefixtures("numba_family")
def test_predictor_against_polyfit(rng, dtype):
    """Independent oracle: np.polyfit (degree 1) per element, and the correction EMA written out."""
    layout, H, beta = padded_layout(300), 4, 0.7
    pred = GradientPredictor(layout, history=H, correction_beta=beta, dtype=dtype)
    kept, corr = [], np.zeros(layout.size)
    for t in range(0, 9):
        g = random_flat(layout, dtype, rng)
        if t % 3 == 2 and kept:
            ts, ys = zip(*kept[-H:])
            fit = np.polyfit(np.array(ts, float), np.array(ys, np.float64), 1) if len(ts) > 1 else None
            trendv = np.polyval(fit, t) if fit is not None else np.asarray(ys[-1], np.float64)
            corr = beta * corr + (1 - beta) * (g.astype(np.float64) - trendv)
            assert pred.correct(g, t)
            assert_close(pred.correction.flat, corr, dtype)
        else:
            assert pred.record(g, t)
        kept.append((t, g.astype(np.float64)))
    ts, ys = zip(*kept[-H:])
    want = np.polyval(np.polyfit(np.array(ts, float), np.array(ys), 1), 12) + corr
    assert_close(pred.predict(12), want, dtype)


def test_one_record_predicts_it_and_none_raises(rng):
    layout = padded_layout(7)
    pred = GradientPredictor(layout, history=3)
    with pytest.raises(NoGradientsError, match="predict"):
        pred.predict(0)
    g = random_flat(layout, np.float32, rng)
    pred.record(g, 5)
    np.testing.assert_array_equal(pred.predict(9), g)
    assert pred.steps == [5] and pred.last_step == 5
    assert pred.nbytes == 4 * layout.size * 4  # (H + 1) * n float32


def test_nonfinite_gradient_is_not_recorded(rng):
    layout = padded_layout(7)
    pred = GradientPredictor(layout, history=2)
    g = random_flat(layout, np.float32, rng)
    pred.record(g, 0)
    bad = g.copy()
    bad[3] = np.nan
    state = pred.state_dict()
    assert not pred.record(bad, 1) and not pred.correct(bad, 1)
    after = pred.state_dict()
    assert after["count"] == state["count"] == 1 and after["steps"] == state["steps"]
    np.testing.assert_array_equal(pred.correction.flat, 0)


@pytest.mark.parametrize("kernels", ["numba", "reference"])
@pytest.mark.usefixtures("numba_family")
def test_state_dict_round_trip_is_bitwise(rng, kernels):
    layout = padded_layout(1037)
    grads = [random_flat(layout, np.float32, rng) for _ in range(12)]

    def drive(p, lo, hi):
        outs = []
        for t in range(lo, hi):
            if t % 4 == 3:
                outs.append(p.predict(t).copy())
            elif t % 4 == 2:
                p.correct(grads[t], t)
            else:
                p.record(grads[t], t)
        return outs

    a = GradientPredictor(layout, history=3, correction_beta=0.5, kernels=kernels)
    drive(a, 0, 6)
    state = a.state_dict()
    b = GradientPredictor(layout, history=3, correction_beta=0.5, kernels=kernels)
    b.load_state_dict(state)
    for x, y in zip(drive(a, 6, 12), drive(b, 6, 12)):
        assert np.array_equal(x, y)
    assert np.array_equal(a.correction.flat, b.correction.flat)
    a.reset()
    assert a.count == 0 and not a.correction.flat.any()


# -- the phase rule ----------------------------------------------------------------------------


def written_out_rule(full, predict, every, n):
    """The first ``n`` phases by the rule written out as a plain loop, apart from PhaseSchedule.

    ``full`` full steps (F); then predicted steps (P), with a correction step (C) whenever the
    number of steps since leaving F is a positive multiple of ``every``; back to F once
    ``predict`` steps have passed since leaving F (a C step returns to P while fewer have).
    The count restarts on entering F and on leaving it.
    """
    phase, ps, out = "F", 0, []
    for _ in range(n):
        if phase == "F":
            nxt = "P" if ps >= full else "F"
        elif phase == "P":
            nxt = "C" if ps > 0 and ps % every == 0 else ("F" if ps >= predict else "P")
        else:
            nxt = "P" if max(predict - ps, 0) > 0 else "F"
        if nxt != phase:
            if nxt == "F" or (nxt == "P" and phase == "F"):
                ps = 0
            phase = nxt
        out.append(phase)
        ps += 1
    return "".join(out)


@pytest.mark.parametrize("full,predict,every", [(2, 4, 2), (2, 6, 3), (1, 3, 3), (3, 5, 10), (1, 1, 1), (4, 12, 4)])
def test_phase_sequence_follows_the_written_out_rule(full, predict, every):
    sched = PhaseSchedule(full, predict, every)
    got = ""
    for _ in range(60):
        got += sched.begin().value[0].upper()
        sched.end(1.0)
    assert got == written_out_rule(full, predict, every, 60)
    if (full, predict, every) == (2, 4, 2):
        assert got.startswith("FFPPCPC" "FFPPCPC")


def test_adaptive_lengths_move_with_the_loss_trend():
    def run(losses, **kw):
        s = PhaseSchedule(10, 40, 10, adaptive=True, **kw)
        for v in losses:
            s.losses.append(v)
        s.adjust()
        return s.full_steps, s.predict_steps

    assert run(np.linspace(1.0, 2.0, 30)) == (15, 30)       # rising: more FULL, less PREDICT
    assert run(np.linspace(2.0, 1.0, 30)) == (8, 45)        # falling: less FULL, more PREDICT
    assert run(np.ones(30)) == (10, 40)                     # flat: unchanged
    assert run(np.linspace(1.0, 2.0, 15)) == (10, 40)       # fewer than 20 losses: unchanged
    assert run(np.linspace(1.0, 2.0, 30), full_bounds=(5, 12), predict_bounds=(35, 100)) == (12, 35)
    # inside the trainer loop: the adjustment happens when a cycle starts
    s = PhaseSchedule(5, 10, 20, adaptive=True)
    loss = 1.0
    while s.cycle < 6:
        if s.begin() is Phase.PREDICT:
            s.end(None)
        else:
            loss *= 0.9
            s.end(loss)
    assert s.full_steps == 5 and s.predict_steps > 10


# -- PhaseTrainer ---------------------------------------------------------------------------------


def blobs(rng, n=192, d=8, k=3):
    centers = 3 * rng.standard_normal((k, d))
    y = rng.integers(0, k, n)
    return (centers[y] + rng.standard_normal((n, d))).astype(np.float32), y


def make(rng):
    model = nn.MLP([8, 16, 3], activation="relu")
    engine = at.Engine(model.init(seed=0), at.optim.AdamW(lr=1e-2), zero_grad_on_step=False)
    return model, engine


class Counting(nn.Callback):
    def __init__(self):
        self.phases = []

    def on_batch_end(self, trainer, step, logs):
        self.phases.append(logs["phase"])


def test_phase_trainer_skips_backward_and_counts(rng):
    x, y = blobs(rng)
    model, engine = make(rng)
    calls = {"forward": 0, "backward": 0}
    fwd, bwd = model.forward, model.backward

    def counted(name, fn):
        def call(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return call

    model.forward, model.backward = counted("forward", fwd), counted("backward", bwd)
    cb = Counting()
    tr = nn.PhaseTrainer(model, engine, full_steps=2, predict_steps=4, correct_every=2, batch_size=16, callbacks=[cb])
    t0 = time.perf_counter()
    hist = tr.fit(x, y, epochs=3)
    wall = time.perf_counter() - t0
    s = tr.stats
    assert s.steps == engine.state.step == 36 == len(cb.phases)
    assert "".join(p[0].upper() for p in cb.phases) == written_out_rule(2, 4, 2, 36)
    assert calls["backward"] == calls["forward"] == s.backward_passes == s.full_steps + s.correct_steps
    assert s.predict_steps == cb.phases.count("predict") > 0
    assert s.step_ratio == pytest.approx(36 / s.backward_passes)
    assert all(v > 0 for v in s.seconds.values()) and s.total_seconds <= wall
    assert hist[-1]["backward_passes"] == s.backward_passes and hist[-1]["loss"] < hist[0]["loss"]
    assert tr.predictor.last_step == max(i for i, p in enumerate(cb.phases) if p != "predict")


def test_phase_trainer_deterministic(rng):
    x, y = blobs(rng)
    runs = []
    for _ in range(2):
        model, engine = make(rng)
        nn.PhaseTrainer(model, engine, full_steps=1, predict_steps=3, correct_every=2, batch_size=16).fit(x, y, epochs=2)
        runs.append(engine.params.flat.copy())
    assert np.array_equal(*runs)


def test_phase_trainer_digits_accuracy():
    pytest.importorskip("sklearn")
    data = nn.load_digits(seed=0)
    model = nn.MLP([data.num_features, 128, 64, data.num_classes], activation="relu")
    engine = at.Engine(model.init(seed=0), at.optim.AdamW(), zero_grad_on_step=False)
    tr = nn.PhaseTrainer(model, engine, full_steps=2, predict_steps=6, correct_every=3, history=4,
                         correction_beta=1.0, batch_size=32)
    tr.fit(data.x_train, data.y_train, epochs=6)
    assert tr.stats.step_ratio > 2
    assert tr.evaluate(data.x_test, data.y_test)["accuracy"] > 0.93


# -- bad arguments ----------------------------------------------------------------------------------

LAYOUT = padded_layout(7)


def _pred(**kw):
    return GradientPredictor(LAYOUT, **kw)


def _trainer(engine_kw=None, **kw):
    model, engine = mlp_engine(**(engine_kw or {}))
    return nn.PhaseTrainer(model, engine, **kw)


def _record(g, step=0, first=None):
    p = _pred()
    if first is not None:
        p.record(np.zeros(LAYOUT.size, np.float32), first)
    return p.record(g, step)


def _predict_into(out):
    p = _pred()
    p.record(np.zeros(LAYOUT.size, np.float32), 0)
    return p.predict(1, out)


def _alias():
    p = _pred()
    return p.record(p.correction.flat, 0)


def _readonly():
    out = np.zeros(LAYOUT.size, np.float32)
    out.flags.writeable = False
    return _predict_into(out)


def _bad_state(**change):
    p = _pred(history=2)
    state = {**p.state_dict(), **change}
    return p.load_state_dict(state)


BAD = [
    ("history", HyperparameterError, lambda: _pred(history=0)),
    ("correction_beta", HyperparameterError, lambda: _pred(correction_beta=1.5)),
    ("kernels", HyperparameterError, lambda: _pred(kernels="cuda")),
    ("layout_or_params", ArgumentTypeError, lambda: GradientPredictor([1, 2])),
    ("dtype", DTypeError, lambda: GradientPredictor(LAYOUT, dtype=np.float16)),
    ("grad_flat", DTypeError, lambda: _record(np.zeros(LAYOUT.size))),
    ("grad_flat", LayoutError, lambda: _record(np.zeros(LAYOUT.size + 1, np.float32))),
    ("grad_flat", ArgumentTypeError, lambda: _record([0.0] * LAYOUT.size)),
    ("grad_flat", AliasingError, _alias),
    ("step", HyperparameterError, lambda: _record(np.zeros(LAYOUT.size, np.float32), 3, first=3)),
    ("step", HyperparameterError, lambda: _record(np.zeros(LAYOUT.size, np.float32), -1)),
    ("out", LayoutError, lambda: _predict_into(np.zeros(3, np.float32))),
    ("out", ReadOnlyError, _readonly),
    ("history_size", StateDictError, lambda: _bad_state(history_size=3)),
    ("head", StateDictError, lambda: _bad_state(head=1)),
    ("steps", StateDictError, lambda: _bad_state(steps=[0])),
    ("full_steps", HyperparameterError, lambda: PhaseSchedule(0, 4, 2)),
    ("predict_steps", HyperparameterError, lambda: PhaseSchedule(2, 0, 2)),
    ("correct_every", HyperparameterError, lambda: PhaseSchedule(2, 4, 0)),
    ("adaptive", HyperparameterError, lambda: PhaseSchedule(2, 4, 2, adaptive="yes")),
    ("loss_threshold", HyperparameterError, lambda: PhaseSchedule(2, 4, 2, loss_threshold=-1)),
    ("full_bounds", HyperparameterError, lambda: PhaseSchedule(2, 4, 2, full_bounds=(5,))),
    ("predict_bounds[1]", HyperparameterError, lambda: PhaseSchedule(2, 4, 2, predict_bounds=(10, 5))),
    ("full_steps", HyperparameterError, lambda: PhaseSchedule(2, 40, 2, adaptive=True)),
    ("accumulation_steps", HyperparameterError, lambda: _trainer({"accumulation_steps": 2})),
    ("loss_scaler", HyperparameterError, lambda: _trainer({"loss_scaler": at.LossScaler()})),
    ("history", HyperparameterError, lambda: _trainer(history=0)),
    ("batch_size", HyperparameterError, lambda: _trainer(batch_size=0)),
]


@pytest.mark.parametrize("name,error,call", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_arguments(name, error, call):
    with pytest.raises(error, match=name.replace("[", r"\[").replace("]", r"\]")):
        call()
