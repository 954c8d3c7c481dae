"""Engine.step_together: several engines judged as one gradient (one norm, one NaN/Inf verdict, one clip
factor), as one engine over all their parameters steps."""

from __future__ import annotations

import numpy as np
import pytest

import arraytrain as at
from arraytrain import ArgumentTypeError, Engine, NonFiniteError, optim

SHAPES = {"a.w": (6, 5), "a.b": (5,), "b.w": (5, 4), "b.b": (4,)}
SPLIT = (("a.w", "a.b"), ("b.w", "b.b"))


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s) for k, s in SHAPES.items()}


def _engines(max_grad_norm, **kw):
    p = _params()
    whole = Engine(p, optim.AdamW(lr=1e-2), max_grad_norm=max_grad_norm, **kw)
    parts = [Engine({k: p[k] for k in names}, optim.AdamW(lr=1e-2), max_grad_norm=max_grad_norm, **kw)
             for names in SPLIT]
    return whole, parts


def _feed(whole, parts, grads):
    for k, g in grads.items():
        whole.grads[k][...] = g
        for e in parts:
            if k in e.layout.names:
                e.grads[k][...] = g


@pytest.mark.parametrize("max_grad_norm", [None, 0.5, 1e6])
def test_two_engines_step_as_one(max_grad_norm):
    whole, parts = _engines(max_grad_norm)
    rng = np.random.default_rng(1)
    for _ in range(4):
        grads = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
        _feed(whole, parts, grads)
        want = whole.step()
        got = Engine.step_together(parts)
        assert [r.applied for r in got] == [True, True]
        for r in got:  # every engine reports the global norm and the one clip factor
            np.testing.assert_allclose(r.grad_norm, want.grad_norm, rtol=1e-14)
            np.testing.assert_allclose(r.clip_coef, want.clip_coef, rtol=1e-14)
    if max_grad_norm == 0.5:
        assert want.clip_coef < 1.0  # the clip acted
    for e in parts:
        for k in e.layout.names:
            np.testing.assert_allclose(e.params[k], whole.params[k], rtol=1e-13, atol=1e-15)


def test_a_nonfinite_gradient_in_one_engine_skips_every_engine():
    _, parts = _engines(1.0, max_consecutive_skips=2)
    before = [e.params.flat.copy() for e in parts]
    grads = {k: np.ones(s) for k, s in SHAPES.items()}
    grads["b.b"][1] = np.nan
    for e in parts:
        for k in e.layout.names:
            e.grads[k][...] = grads[k]
    reports = Engine.step_together(parts)
    assert [r.skipped for r in reports] == [True, True]
    for e, b in zip(parts, before):
        np.testing.assert_array_equal(e.params.flat, b)
        assert e.state.step == 0 and e.consecutive_skips == 1
    for e in parts:
        for k in e.layout.names:
            e.grads[k][...] = grads[k]
    with pytest.raises(NonFiniteError, match="2 consecutive steps"):
        Engine.step_together(parts)
    assert all(e.consecutive_skips == 2 for e in parts)  # every engine skipped before the refusal


def test_absent_parameters_per_engine():
    whole, parts = _engines(0.5, missing="skip")
    grads = {k: np.full(s, 0.3) for k, s in SHAPES.items()}
    _feed(whole, parts, grads)
    want = whole.step(absent=["b.b"])
    got = Engine.step_together(parts, absent=[None, ["b.b"]])
    np.testing.assert_allclose(got[1].grad_norm, want.grad_norm, rtol=1e-14)
    np.testing.assert_array_equal(parts[1].params["b.b"], _params()["b.b"])  # left alone, torch's rule
    np.testing.assert_allclose(parts[1].params["b.w"], whole.params["b.w"], rtol=1e-13)


def test_bad_calls_are_refused():
    _, parts = _engines(None)
    with pytest.raises(ArgumentTypeError, match="absent"):
        Engine.step_together(parts, absent=[None])
    acc = Engine(_params(), optim.SGD(lr=0.1), accumulation_steps=2)
    with pytest.raises(ArgumentTypeError, match="one micro-batch"):
        Engine.step_together([acc])
    with pytest.raises(at.UnknownParameterError):
        Engine.step_together(parts, absent=[["nothere"], None])
    for bad, match in (([], "non-empty"), ([parts[0], "x"], "non-empty"), ([parts[0], parts[0]], "twice"),
                       (3, "list of engines")):
        with pytest.raises(ArgumentTypeError, match=match):
            Engine.step_together(bad)
    assert all(e.state.step == 0 and e.micro_batches == 0 for e in parts)


def test_a_schedule_that_fails_changes_no_engine():
    """Every engine's schedule is evaluated before any engine takes its window."""
    p = _params()
    ok = Engine({k: p[k] for k in SPLIT[0]}, optim.SGD(lr=0.1))
    bad = Engine({k: p[k] for k in SPLIT[1]}, optim.SGD(lr=0.1), schedule=at.schedules.ExponentialLR(1e300))
    bad.state.step = 3  # 1e300 ** 3 overflows: a non-finite lr
    before = ok.params.flat.copy()
    with pytest.raises(at.HyperparameterError, match="lr"):
        Engine.step_together([ok, bad])
    np.testing.assert_array_equal(ok.params.flat, before)
    assert ok.micro_batches == 0 and bad.micro_batches == 0 and ok.state.step == 0


def test_sam_engines_take_the_ascent_by_the_global_norm():
    """SAM's first window moves each engine's weights by rho / (global norm); the second updates."""
    p = _params()
    make = lambda: optim.SAM(optim.SGD(lr=0.1, momentum=0.9), rho=0.05)  # noqa: E731
    whole = Engine(p, make(), max_grad_norm=1.0)
    parts = [Engine({k: p[k] for k in names}, make(), max_grad_norm=1.0) for names in SPLIT]
    rng = np.random.default_rng(2)
    for _ in range(3):
        for _window in range(2):  # the ascent window, then the update window
            grads = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
            _feed(whole, parts, grads)
            want = whole.step()
            got = Engine.step_together(parts)
            assert [r.perturbed for r in got] == [want.perturbed] * 2
            assert [r.applied for r in got] == [want.applied] * 2
            for e in parts:
                for k in e.layout.names:
                    np.testing.assert_allclose(e.params[k], whole.params[k], rtol=1e-12, atol=1e-14)
