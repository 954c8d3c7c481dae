"""Learning-rate schedules: against torch.optim.lr_scheduler, state round trips, bad arguments.

The torch comparisons record ``param_groups[i]["lr"]`` before every
``optimizer.step()`` and compare it with ``schedule(t, base_lr)`` at the number
``t`` of steps applied so far; each row runs with one parameter group (a float
base lr) and with two groups (an array base lr).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from arraytrain import schedules
from arraytrain.errors import ArgumentTypeError, DTypeError, HyperparameterError, StateDictError
from arraytrain.schedules import (
    Constant,
    CosineAnnealingLR,
    CosineAnnealingWarmRestarts,
    ExponentialLR,
    LinearLR,
    MultiStepLR,
    OneCycleLR,
    PolynomialLR,
    ReduceLROnPlateau,
    Sequential,
    StepLR,
    SCHEDULE_FORMAT,
    Warmup,
    from_state_dict,
)

RTOL, ATOL = 1e-9, 1e-14  # torch uses recursive forms for several schedules
BASES = {"float": 0.1, "array": np.array([0.1, 0.03])}


def _torch():
    return pytest.importorskip("torch")


def _torch_lrs(make, bases, steps):
    """``[steps, groups]`` lrs of a torch scheduler, read before each optimizer step."""
    torch = _torch()
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in bases]
    opt = torch.optim.SGD([{"params": [p], "lr": float(b)} for p, b in zip(params, bases)])
    sched = make(opt, torch.optim.lr_scheduler)
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return np.array(out)


def _ours(schedule, base, steps):
    if isinstance(base, float):
        return np.array([[schedule(t, base)] for t in range(steps)])
    return np.stack([schedule(t, base) for t in range(steps)])


# (id, arraytrain schedule factory, torch factory (optimizer, lr_scheduler module), steps)
TORCH_ROWS = [
    ("step", lambda: StepLR(7, gamma=0.5), lambda o, L: L.StepLR(o, step_size=7, gamma=0.5), 60),
    ("multistep", lambda: MultiStepLR([0, 10, 25, 25, 40], gamma=0.3),
     lambda o, L: L.MultiStepLR(o, milestones=[0, 10, 25, 25, 40], gamma=0.3), 60),
    ("exponential", lambda: ExponentialLR(0.97), lambda o, L: L.ExponentialLR(o, gamma=0.97), 150),
    ("linear", lambda: LinearLR(20, start_factor=0.25, end_factor=0.75),
     lambda o, L: L.LinearLR(o, start_factor=0.25, end_factor=0.75, total_iters=20), 40),
    ("cosine", lambda: CosineAnnealingLR(100), lambda o, L: L.CosineAnnealingLR(o, T_max=100), 101),
    ("cosine_eta_min", lambda: CosineAnnealingLR(80, eta_min=1e-3),
     lambda o, L: L.CosineAnnealingLR(o, T_max=80, eta_min=1e-3), 81),
    ("warm_restarts", lambda: CosineAnnealingWarmRestarts(10, eta_min=1e-3),
     lambda o, L: L.CosineAnnealingWarmRestarts(o, T_0=10, eta_min=1e-3), 200),
    ("warm_restarts_mult2", lambda: CosineAnnealingWarmRestarts(5, T_mult=2),
     lambda o, L: L.CosineAnnealingWarmRestarts(o, T_0=5, T_mult=2), 300),
    ("polynomial", lambda: PolynomialLR(50, power=2.0), lambda o, L: L.PolynomialLR(o, total_iters=50, power=2.0), 80),
    ("polynomial_sqrt", lambda: PolynomialLR(30, power=0.5),
     lambda o, L: L.PolynomialLR(o, total_iters=30, power=0.5), 40),
    ("onecycle_cos", lambda: OneCycleLR(100),
     lambda o, L: L.OneCycleLR(o, max_lr=[g["lr"] for g in o.param_groups], total_steps=100,
                               cycle_momentum=False), 100),
    ("onecycle_linear",
     lambda: OneCycleLR(90, pct_start=0.25, anneal_strategy="linear", div_factor=10, final_div_factor=100),
     lambda o, L: L.OneCycleLR(o, max_lr=[g["lr"] for g in o.param_groups], total_steps=90, pct_start=0.25,
                               anneal_strategy="linear", div_factor=10, final_div_factor=100,
                               cycle_momentum=False), 90),
    ("onecycle_three_phase", lambda: OneCycleLR(120, pct_start=0.4, three_phase=True),
     lambda o, L: L.OneCycleLR(o, max_lr=[g["lr"] for g in o.param_groups], total_steps=120, pct_start=0.4,
                               three_phase=True, cycle_momentum=False), 120),
    ("onecycle_three_phase_linear", lambda: OneCycleLR(61, pct_start=0.3, anneal_strategy="linear", three_phase=True),
     lambda o, L: L.OneCycleLR(o, max_lr=[g["lr"] for g in o.param_groups], total_steps=61, pct_start=0.3,
                               anneal_strategy="linear", three_phase=True, cycle_momentum=False), 61),
    ("warmup_cosine", lambda: Warmup(10, then=CosineAnnealingLR(50, eta_min=1e-3), start_factor=0.1),
     lambda o, L: L.SequentialLR(o, [L.LinearLR(o, start_factor=0.1, total_iters=10),
                                     L.CosineAnnealingLR(o, T_max=50, eta_min=1e-3)], milestones=[10]), 61),
    ("sequential_three", lambda: Sequential([(LinearLR(5, 0.2), 5), (Constant(), 10), (ExponentialLR(0.9), None)]),
     lambda o, L: L.SequentialLR(o, [L.LinearLR(o, start_factor=0.2, total_iters=5),
                                     L.ConstantLR(o, factor=1.0, total_iters=1), L.ExponentialLR(o, gamma=0.9)],
                                 milestones=[5, 15]), 60),
]


@pytest.mark.parametrize("base_kind", list(BASES))
@pytest.mark.parametrize("name, make, make_torch, steps", TORCH_ROWS, ids=[r[0] for r in TORCH_ROWS])
def test_against_torch(name, make, make_torch, steps, base_kind):
    base = BASES[base_kind]
    expected = _torch_lrs(make_torch, np.atleast_1d(base), steps)
    np.testing.assert_allclose(_ours(make(), base, steps), expected, rtol=RTOL, atol=ATOL, err_msg=name)


# -- reduce on plateau against torch ---------------------------------------------------------------------
PLATEAU_ROWS = [
    ("min_rel", dict(mode="min", patience=2)),
    ("min_abs_cooldown_min_lr", dict(mode="min", factor=0.5, patience=3, threshold=1e-2, threshold_mode="abs",
                                     cooldown=2, min_lr=1e-3)),
    ("max_rel_cooldown", dict(mode="max", factor=0.3, patience=1, threshold=1e-3, cooldown=3)),
    ("max_abs_patience0", dict(mode="max", factor=0.7, patience=0, threshold=0.05, threshold_mode="abs",
                               min_lr=2e-3)),
    ("eps_rule", dict(mode="min", factor=0.5, patience=0, eps=1e-3)),
    ("factor0_min_lr", dict(mode="min", factor=0.0, patience=1, min_lr=5e-3)),
]


def _metrics(rng, n, mode):
    """A loss-like sequence: occasional improvements, long noisy plateaus, one NaN."""
    m, out = 1.0, []
    for i in range(n):
        m *= 0.8 if rng.random() < 0.25 else 1.0 + 0.02 * rng.standard_normal()
        out.append(m if mode == "min" else 1.0 / m)
    out[n // 3] = math.nan  # never an improvement, in either mode
    return out


@pytest.mark.parametrize("base_kind", list(BASES))
@pytest.mark.parametrize("name, kwargs", PLATEAU_ROWS, ids=[r[0] for r in PLATEAU_ROWS])
def test_reduce_on_plateau_against_torch(name, kwargs, base_kind, rng):
    torch = _torch()
    base = BASES[base_kind]
    bases = np.atleast_1d(base)
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in bases]
    opt = torch.optim.SGD([{"params": [p], "lr": float(b)} for p, b in zip(params, bases)])
    ref = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **kwargs)
    ours = ReduceLROnPlateau(**kwargs)
    reductions = 0
    for epoch, metric in enumerate(_metrics(rng, 80, kwargs["mode"])):
        step = 7 * epoch  # the lr of a plateau schedule over a constant does not depend on the step
        np.testing.assert_allclose(np.atleast_1d(ours(step, base)), [g["lr"] for g in opt.param_groups],
                                   rtol=0, atol=0, err_msg=f"{name} epoch {epoch}")
        ref.step(metric)
        ours.observe(metric)
        assert (ours.num_bad_epochs, ours.cooldown_counter, ours.last_epoch) == \
               (ref.num_bad_epochs, ref.cooldown_counter, ref.last_epoch)
        assert ours.best == ref.best or (math.isinf(ours.best) and ours.best == ref.best)
        reductions = ours.num_reductions
    assert reductions >= 3, "the metric sequence must trigger several reductions"


# -- semantics beyond torch -----------------------------------------------------------------------------
def test_cosine_holds_eta_min_past_t_max():
    s = CosineAnnealingLR(20, eta_min=0.01)
    assert [s(t, 1.0) for t in (20, 21, 39, 40, 1000)] == [0.01] * 5
    np.testing.assert_array_equal(s(25, BASES["array"]), [0.01, 0.01])


def test_onecycle_holds_final_lr_past_total_steps():
    s = OneCycleLR(50, div_factor=10, final_div_factor=100)
    final = 1.0 / 10 / 100
    assert s(49, 1.0) == pytest.approx(final, rel=1e-15)
    assert [s(t, 1.0) for t in (50, 51, 10**6)] == [s(49, 1.0)] * 3


def test_warm_restarts_restart_exactly_at_cycle_starts():
    s = CosineAnnealingWarmRestarts(3, T_mult=3, eta_min=0.5)
    for start in (0, 3, 12, 39, 120):  # cycles of 3, 9, 27, 81
        assert s(start, 2.0) == 2.0
    assert s(38, 2.0) > 0.5 and s(38, 2.0) < s(37, 2.0)


def test_warmup_start_factor_zero_and_zero_steps():
    s = Warmup(4, then=ExponentialLR(0.5))
    assert [s(t, 1.0) for t in range(7)] == [0.0, 0.25, 0.5, 0.75, 1.0, 0.5, 0.25]
    assert [Warmup(0, then=StepLR(2))(t, 1.0) for t in range(4)] == [StepLR(2)(t, 1.0) for t in range(4)]


def test_result_kind_and_no_aliasing():
    base = np.array([0.5, 0.0, 2.0])
    for s in (Constant(), CosineAnnealingLR(10), ReduceLROnPlateau(), Warmup(3)):
        out = s(4, base)
        assert isinstance(out, np.ndarray) and out.dtype == np.float64 and out.shape == (3,)
        assert not np.shares_memory(out, base)
        assert type(s(4, 0.5)) is float and type(s(4, np.float32(0.5))) is float and type(s(4, 1)) is float
    assert Constant()(0, np.zeros(0)).shape == (0,)
    np.testing.assert_array_equal(CosineAnnealingLR(10)(3, base.astype(np.float32)), CosineAnnealingLR(10)(3, base))


def test_plateau_composes_with_warmup():
    """The plateau part sees its own step and only the metrics observed after the warm-up."""
    kwargs = dict(patience=1, factor=0.5)
    composed = Warmup(5, then=ReduceLROnPlateau(CosineAnnealingLR(40), **kwargs), start_factor=0.2)
    alone = ReduceLROnPlateau(CosineAnnealingLR(40), **kwargs)
    metrics = [1.0, 1.0, 1.0, 1.0, 0.9, 0.9, 0.9, 0.9, 0.8, 0.8, 0.8]
    for epoch, m in enumerate(metrics):
        step = 2 * epoch  # two optimizer steps per epoch
        if step >= 5:
            alone.observe(m)
        composed.observe(m, step=step)
        for t in range(step, step + 2):
            expected = 0.1 * (0.2 + 0.8 * t / 5) if t < 5 else alone(t - 5, 0.1)
            assert composed(t, 0.1) == expected
    assert composed.then.num_reductions == alone.num_reductions >= 2
    assert composed.then.last_epoch == alone.last_epoch == len(metrics) - 3


def test_plateau_in_sequential_and_over_a_schedule():
    seq = Sequential([(Constant(), 3), (ReduceLROnPlateau(StepLR(4, 0.5), patience=0, factor=0.1), None)])
    seq.observe(1.0, step=2)  # during the first segment: not counted
    assert seq.segments[1][0].last_epoch == 0
    seq.observe(1.0, step=3)
    seq.observe(1.0, step=5)  # not better: one reduction
    plateau = seq.segments[1][0]
    assert plateau.num_reductions == 1
    for t in range(3, 20):
        assert seq(t, 1.0) == pytest.approx(0.5 ** ((t - 3) // 4) * 0.1, rel=1e-15)


def test_nested_composites_route_metrics_by_local_step():
    plateau = ReduceLROnPlateau(patience=0)
    s = Warmup(5, then=Sequential([(Constant(), 10), (plateau, None)]))
    s.observe(1.0, step=12)  # local step 7 of the Sequential: its first segment, not counted
    assert plateau.last_epoch == 0
    s.observe(1.0, step=15)  # local step 10: the plateau segment's step 0
    s.observe(1.0, step=16)
    assert plateau.last_epoch == 2 and plateau.num_reductions == 1
    assert s(14, 1.0) == 1.0 and s(15, 1.0) == pytest.approx(0.1, rel=1e-15)


def test_plateau_min_lr_never_raises_the_inner_lr():
    s = ReduceLROnPlateau(Warmup(10), patience=0, min_lr=0.05)
    for m in (1.0, 1.0, 1.0):
        s.observe(m)
    assert s.num_reductions == 2
    assert s(0, 1.0) == 0.0  # the warm-up's 0 stays 0
    assert s(2, 1.0) == 0.05  # inner 0.2 reduced to 0.02, floored at 0.05
    assert s(30, 1.0) == 0.05  # inner 1.0 -> 0.1 -> 0.05 (floored)


def test_observe_routing_and_validation():
    closed = CosineAnnealingLR(10)
    closed.observe(1.0)  # a no-op on closed-form schedules, with or without a step
    closed.observe(1.0, step=3)
    composite = Warmup(2, then=ReduceLROnPlateau(patience=0))
    before = composite.state_dict()
    with pytest.raises(HyperparameterError, match="step"):
        composite.observe(1.0)
    with pytest.raises(HyperparameterError, match="step"):
        composite.observe(1.0, step=-1)
    with pytest.raises(ArgumentTypeError, match="metric"):
        composite.observe("1.0", step=3)
    assert composite.state_dict() == before
    ReduceLROnPlateau().observe(np.float32(2.0))  # numpy scalars are metrics
    assert not Warmup(2).stateful and composite.stateful and ReduceLROnPlateau().stateful


# -- state ------------------------------------------------------------------------------------------------
def _all_schedules():
    return [
        Constant(), StepLR(3, 0.5), MultiStepLR([2, 5, 5]), ExponentialLR(0.9), LinearLR(6, 0.0, 0.5),
        CosineAnnealingLR(9, 1e-3), CosineAnnealingWarmRestarts(4, 2, 1e-4), PolynomialLR(8, 1.5),
        OneCycleLR(20, three_phase=True, anneal_strategy="linear"),
        Warmup(3, then=CosineAnnealingLR(10), start_factor=0.1),
        Sequential([(LinearLR(2, 0.5), 2), (ReduceLROnPlateau(ExponentialLR(0.95), patience=1), 10), (Constant(), None)]),
        ReduceLROnPlateau(mode="max", cooldown=1, patience=1, factor=0.5, min_lr=1e-3, threshold_mode="abs"),
        Warmup(4, then=ReduceLROnPlateau(Sequential([(StepLR(2), 6), (CosineAnnealingLR(12), None)]), patience=0,
                                         cooldown=2)),
    ]


def _json_only(x):
    if isinstance(x, dict):
        return all(isinstance(k, str) and _json_only(v) for k, v in x.items())
    if isinstance(x, list):
        return all(_json_only(v) for v in x)
    return x is None or type(x) in (str, int, float, bool)


def _drive(s, rng, epochs, start, steps_per_epoch=3):
    """Observe ``epochs`` metrics; return the lrs (float and array base) at every step in between."""
    lrs = []
    for e in range(start, start + epochs):
        for t in range(e * steps_per_epoch, (e + 1) * steps_per_epoch):
            lrs.append((s(t, 0.2), s(t, BASES["array"]).tolist()))
        s.observe(float(rng.choice([1.0, 0.99, 0.5 ** (e // 4)])), step=(e + 1) * steps_per_epoch)
    return lrs


@pytest.mark.parametrize("index", range(len(_all_schedules())))
def test_state_round_trip_continues_identically(index, rng):
    s = _all_schedules()[index]
    _drive(s, rng, 8, 0)
    d = s.state_dict()
    assert _json_only(d)
    text = json.dumps(d, allow_nan=False)
    rebuilt = from_state_dict(json.loads(text))
    loaded = _all_schedules()[index]
    loaded.load_state_dict(json.loads(text))
    assert rebuilt.state_dict() == loaded.state_dict() == d
    assert repr(rebuilt) == repr(loaded) == repr(s)
    seed = int(rng.integers(1 << 30))
    runs = [_drive(x, np.random.default_rng(seed), 10, 8) for x in (s, rebuilt, loaded)]
    assert runs[0] == runs[1] == runs[2]
    assert s.state_dict() == rebuilt.state_dict() == loaded.state_dict()


# state dicts of format 1, saved before the renames (class names and fields of the previous release)
OLD_STATES = [
    ({"type": "Cosine", "format": 1, "total_steps": 10, "min_lr": 0.01}, CosineAnnealingLR(10, eta_min=0.01)),
    ({"type": "Linear", "format": 1, "total_steps": 6, "start_factor": 0.0, "end_factor": 0.5}, LinearLR(6, 0.0, 0.5)),
    ({"type": "Polynomial", "format": 1, "total_steps": 8, "power": 1.5}, PolynomialLR(8, 1.5)),
    ({"type": "OneCycle", "format": 1, "total_steps": 20, "pct_start": 0.3, "anneal": "linear", "div_factor": 25.0,
      "final_div_factor": 1e4, "three_phase": True}, OneCycleLR(20, three_phase=True, anneal_strategy="linear")),
    ({"type": "MultiStep", "format": 1, "milestones": [2, 5], "gamma": 0.1}, MultiStepLR([2, 5])),
    ({"type": "Exponential", "format": 1, "gamma": 0.9}, ExponentialLR(0.9)),
    ({"type": "CosineWarmRestarts", "format": 1, "T_0": 4, "T_mult": 2, "eta_min": 1e-4},
     CosineAnnealingWarmRestarts(4, 2, 1e-4)),
    ({"type": "Warmup", "format": 1, "steps": 3, "start_factor": 0.1,
      "then": {"type": "ReduceOnPlateau", "format": 1, "mode": "min", "factor": 0.5, "patience": 0,
               "threshold": 1e-4, "threshold_mode": "rel", "cooldown": 0, "min_lr": 0.0, "eps": 1e-8, "best": 1.0,
               "num_bad_epochs": 0, "cooldown_counter": 0, "num_reductions": 2, "last_epoch": 3,
               "inner": {"type": "Cosine", "format": 1, "total_steps": 30, "min_lr": 0.0}}},
     Warmup(3, then=ReduceLROnPlateau(CosineAnnealingLR(30), factor=0.5, patience=0), start_factor=0.1)),
]


@pytest.mark.parametrize("old, new", OLD_STATES, ids=[d["type"] for d, _ in OLD_STATES])
def test_a_state_dict_of_the_previous_names_loads(old, new):
    """Saved with the old class and field names: rebuilt, and loaded into today's schedule, silently."""
    rebuilt = from_state_dict(old)
    assert type(rebuilt) is type(new)
    new.load_state_dict(old)
    assert rebuilt.state_dict() == new.state_dict()
    assert new.state_dict()["type"] == type(new).__name__  # saved again under today's names
    if isinstance(new, Warmup):
        assert new.then.num_reductions == 2 and new.then.inner.T_max == 30
    assert [rebuilt(t, 0.5) for t in range(12)] == [new(t, 0.5) for t in range(12)]


def test_a_state_dict_with_old_and_new_field_names_is_refused():
    bad = {"type": "CosineAnnealingLR", "format": 1, "T_max": 10, "eta_min": 0.0, "min_lr": 0.1}
    with pytest.raises(StateDictError, match="unknown keys \\['min_lr'\\]"):
        from_state_dict(bad)


@pytest.mark.parametrize("old", [d for d, _ in OLD_STATES[:4]], ids=[d["type"] for d, _ in OLD_STATES[:4]])
def test_the_old_names_are_read_in_format_1_only(old):
    """Today's format has one spelling of every name: the previous release's are refused there."""
    assert CosineAnnealingLR(10).state_dict()["format"] == SCHEDULE_FORMAT == 2
    with pytest.raises(StateDictError, match="schedule.type: expected one of"):
        from_state_dict({**old, "format": SCHEDULE_FORMAT})
    with pytest.raises(StateDictError, match="unknown keys"):  # today's type name, the old field names
        from_state_dict({**old, "format": SCHEDULE_FORMAT, "type": type(from_state_dict(old)).__name__})


def test_plateau_best_infinities_round_trip():
    for mode, text in (("min", "inf"), ("max", "-inf")):
        d = ReduceLROnPlateau(mode=mode).state_dict()
        assert d["best"] == text
        assert from_state_dict(json.loads(json.dumps(d, allow_nan=False))).best == float(text)
    s = ReduceLROnPlateau()
    s.observe(-math.inf)
    assert s.state_dict()["best"] == "-inf" and from_state_dict(s.state_dict()).best == -math.inf


def test_load_state_dict_keeps_nested_objects():
    plateau = ReduceLROnPlateau(patience=0)
    s = Warmup(2, then=plateau)
    other = Warmup(5, then=ReduceLROnPlateau(patience=0, factor=0.5))
    for m in (1.0, 1.0, 1.0):
        other.observe(m, step=9)
    s.load_state_dict(other.state_dict())
    assert s.then is plateau and plateau.num_reductions == 2 and plateau.factor == 0.5 and s.steps == 5
    assert s(9, 1.0) == other(9, 1.0) == 0.25


def _corrupt(path, value=KeyError):
    """A function that corrupts a copy of a state dict at ``path`` (KeyError: delete the key)."""
    def apply(d):
        d = json.loads(json.dumps(d))
        node = d
        for key in path[:-1]:
            node = node[key]
        if value is KeyError:
            del node[path[-1]]
        else:
            node[path[-1]] = value
        return d
    return apply


NESTED = lambda: Warmup(4, then=ReduceLROnPlateau(Sequential([(StepLR(2), 6), (CosineAnnealingLR(12), None)]),
                                                  patience=2))
BAD_STATES = [
    # (id, schedule factory, corruption, message fragment)
    ("not_a_dict", NESTED, lambda d: [d], "schedule: expected a dict"),
    ("unknown_type", NESTED, _corrupt(("type",), "Linearly"), "schedule.type"),
    ("wrong_format", NESTED, _corrupt(("format",), 3), "schedule.format"),
    ("missing_key", NESTED, _corrupt(("start_factor",)), "lacks ['start_factor']"),
    ("unknown_key", NESTED, _corrupt(("extra",), 1), "unknown keys ['extra']"),
    ("bad_hyperparameter", NESTED, _corrupt(("steps",), -1), "schedule: steps"),
    ("nested_bad_patience", NESTED, _corrupt(("then", "patience"), 1.5), "schedule.then: patience"),
    ("bad_counter", NESTED, _corrupt(("then", "num_bad_epochs"), 3), "schedule.then.num_bad_epochs"),
    ("bool_counter", NESTED, _corrupt(("then", "cooldown_counter"), True), "schedule.then.cooldown_counter"),
    ("bad_best", NESTED, _corrupt(("then", "best"), "infinity"), "schedule.then.best"),
    ("deep_bad_gamma", NESTED, _corrupt(("then", "inner", "segments", 0, "schedule", "gamma"), 0.0),
     "schedule.then.inner.segments[0].schedule: gamma"),
    ("bad_segment", NESTED, _corrupt(("then", "inner", "segments", 1), [1, 2]), "schedule.then.inner.segments[1]"),
    ("last_segment_finite", NESTED, _corrupt(("then", "inner", "segments", 1, "steps"), 5), "segments[1]"),
    ("other_type", lambda: CosineAnnealingLR(10), lambda d: StepLR(3).state_dict(), "state is for StepLR"),
    ("other_structure", NESTED, lambda d: Warmup(4, then=ReduceLROnPlateau(Sequential(
        [(StepLR(2), 6), (Constant(), 2), (CosineAnnealingLR(12), None)]))).state_dict(), "nested schedules"),
    ("other_nested_type", NESTED, lambda d: Warmup(4, then=CosineAnnealingLR(3)).state_dict(),
     "state is for CosineAnnealingLR"),
]


@pytest.mark.parametrize("name, make, corrupt, fragment", BAD_STATES, ids=[r[0] for r in BAD_STATES])
def test_bad_state_dict_raises_and_changes_nothing(name, make, corrupt, fragment):
    s = make()
    if s.stateful:
        s.observe(1.0, step=5)
        s.observe(1.0, step=6)
    before = s.state_dict()
    bad = corrupt(s.state_dict())
    with pytest.raises(StateDictError) as info:
        s.load_state_dict(bad)
    assert fragment in str(info.value)
    assert s.state_dict() == before
    if name not in ("other_type", "other_structure", "other_nested_type"):
        with pytest.raises(StateDictError):
            from_state_dict(bad)


def test_repr_rebuilds_closed_form_schedules():
    for s in _all_schedules():
        if not s.stateful:
            assert eval(repr(s), vars(schedules)).state_dict() == s.state_dict()
    assert "num_reductions=0" in repr(ReduceLROnPlateau())


# -- bad arguments ---------------------------------------------------------------------------------------
BAD_ARGS = [
    # (id, call, exception, fragment of the message: the parameter's name)
    ("step_size_0", lambda: StepLR(0), HyperparameterError, "step_size"),
    ("step_size_float", lambda: StepLR(2.0), HyperparameterError, "step_size"),
    ("step_gamma_0", lambda: StepLR(3, gamma=0.0), HyperparameterError, "gamma"),
    ("multistep_unsorted", lambda: MultiStepLR([5, 3]), HyperparameterError, "milestones"),
    ("multistep_negative", lambda: MultiStepLR([-1, 3]), HyperparameterError, "milestones[0]"),
    ("multistep_not_a_list", lambda: MultiStepLR(5), HyperparameterError, "milestones"),
    ("multistep_gamma_negative", lambda: MultiStepLR([1], gamma=-0.1), HyperparameterError, "gamma"),
    ("exponential_gamma_0", lambda: ExponentialLR(0.0), HyperparameterError, "gamma"),
    ("exponential_gamma_nan", lambda: ExponentialLR(math.nan), HyperparameterError, "gamma"),
    ("linear_total_0", lambda: LinearLR(0), HyperparameterError, "total_iters"),
    ("linear_start_factor", lambda: LinearLR(5, start_factor=1.5), HyperparameterError, "start_factor"),
    ("linear_end_factor", lambda: LinearLR(5, end_factor=-0.5), HyperparameterError, "end_factor"),
    ("cosine_total_negative", lambda: CosineAnnealingLR(-5), HyperparameterError, "T_max"),
    ("cosine_eta_min_negative", lambda: CosineAnnealingLR(5, eta_min=-1e-3), HyperparameterError, "eta_min"),
    ("restarts_T_0", lambda: CosineAnnealingWarmRestarts(0), HyperparameterError, "T_0"),
    ("restarts_T_mult", lambda: CosineAnnealingWarmRestarts(5, T_mult=0), HyperparameterError, "T_mult"),
    ("restarts_T_mult_float", lambda: CosineAnnealingWarmRestarts(5, T_mult=1.5), HyperparameterError, "T_mult"),
    ("restarts_eta_min", lambda: CosineAnnealingWarmRestarts(5, eta_min=-1.0), HyperparameterError, "eta_min"),
    ("polynomial_power", lambda: PolynomialLR(5, power=0.0), HyperparameterError, "power"),
    ("polynomial_total", lambda: PolynomialLR(True), HyperparameterError, "total_iters"),
    ("onecycle_pct_0", lambda: OneCycleLR(100, pct_start=0.0), HyperparameterError, "pct_start"),
    ("onecycle_pct_1", lambda: OneCycleLR(100, pct_start=1.0), HyperparameterError, "pct_start"),
    ("onecycle_pct_short", lambda: OneCycleLR(3, pct_start=0.3), HyperparameterError, "pct_start"),
    ("onecycle_three_phase_pct", lambda: OneCycleLR(100, pct_start=0.6, three_phase=True), HyperparameterError,
     "pct_start"),
    ("onecycle_anneal", lambda: OneCycleLR(100, anneal_strategy="cosine"), HyperparameterError, "anneal_strategy"),
    ("onecycle_div", lambda: OneCycleLR(100, div_factor=0), HyperparameterError, "div_factor"),
    ("onecycle_final_div", lambda: OneCycleLR(100, final_div_factor=-1.0), HyperparameterError, "final_div_factor"),
    ("onecycle_three_phase_type", lambda: OneCycleLR(100, three_phase=1), HyperparameterError, "three_phase"),
    ("onecycle_total", lambda: OneCycleLR(1), HyperparameterError, "total_steps"),
    ("warmup_steps", lambda: Warmup(-1), HyperparameterError, "steps"),
    ("warmup_start_factor", lambda: Warmup(5, start_factor=2.0), HyperparameterError, "start_factor"),
    ("warmup_then", lambda: Warmup(5, then=lambda t, b: b), ArgumentTypeError, "then"),
    ("sequential_empty", lambda: Sequential([]), HyperparameterError, "segments"),
    ("sequential_pair", lambda: Sequential([Constant()]), HyperparameterError, "segments[0]"),
    ("sequential_last_finite", lambda: Sequential([(Constant(), 5)]), HyperparameterError, "segments[0]"),
    ("sequential_middle_none", lambda: Sequential([(Constant(), None), (Constant(), None)]), HyperparameterError,
     "segments[0] n_steps"),
    ("sequential_middle_zero", lambda: Sequential([(Constant(), 0), (Constant(), None)]), HyperparameterError,
     "segments[0] n_steps"),
    ("sequential_schedule", lambda: Sequential([(0.1, 3), (Constant(), None)]), ArgumentTypeError, "segments[0]"),
    ("plateau_mode", lambda: ReduceLROnPlateau(mode="minimum"), HyperparameterError, "mode"),
    ("plateau_factor_1", lambda: ReduceLROnPlateau(factor=1.0), HyperparameterError, "factor"),
    ("plateau_factor_negative", lambda: ReduceLROnPlateau(factor=-0.1), HyperparameterError, "factor"),
    ("plateau_patience", lambda: ReduceLROnPlateau(patience=-1), HyperparameterError, "patience"),
    ("plateau_threshold", lambda: ReduceLROnPlateau(threshold=-1e-4), HyperparameterError, "threshold"),
    ("plateau_threshold_mode", lambda: ReduceLROnPlateau(threshold_mode="relative"), HyperparameterError,
     "threshold_mode"),
    ("plateau_cooldown", lambda: ReduceLROnPlateau(cooldown=-2), HyperparameterError, "cooldown"),
    ("plateau_min_lr", lambda: ReduceLROnPlateau(min_lr=-1.0), HyperparameterError, "min_lr"),
    ("plateau_eps", lambda: ReduceLROnPlateau(eps=-1e-8), HyperparameterError, "eps"),
    ("plateau_inner", lambda: ReduceLROnPlateau(inner="cosine"), ArgumentTypeError, "inner"),
    ("call_step_negative", lambda: CosineAnnealingLR(10)(-1, 0.1), HyperparameterError, "step"),
    ("call_step_float", lambda: CosineAnnealingLR(10)(1.0, 0.1), HyperparameterError, "step"),
    ("call_step_bool", lambda: Constant()(True, 0.1), HyperparameterError, "step"),
    ("call_base_negative", lambda: StepLR(3)(0, -0.1), HyperparameterError, "base_lr"),
    ("call_base_nan", lambda: StepLR(3)(0, math.nan), HyperparameterError, "base_lr"),
    ("call_base_array_negative", lambda: StepLR(3)(0, np.array([0.1, -0.1])), HyperparameterError, "base_lr[1]"),
    ("call_base_array_inf", lambda: StepLR(3)(0, np.array([np.inf])), HyperparameterError, "base_lr[0]"),
    ("call_base_int_array", lambda: StepLR(3)(0, np.array([1, 2])), DTypeError, "base_lr"),
    ("call_base_2d", lambda: StepLR(3)(0, np.ones((2, 2))), ArgumentTypeError, "base_lr"),
    ("call_base_list", lambda: StepLR(3)(0, [0.1, 0.2]), ArgumentTypeError, "base_lr"),
    ("call_base_str", lambda: StepLR(3)(0, "0.1"), ArgumentTypeError, "base_lr"),
    ("call_lr_overflow", lambda: ExponentialLR(1.5)(10_000, 0.1), HyperparameterError, "lr: ExponentialLR(gamma=1.5)"),
    ("call_lr_overflow_array", lambda: StepLR(1, gamma=1e10)(40, np.array([0.0, 1.0])), HyperparameterError, "lr:"),
    ("observe_metric", lambda: ReduceLROnPlateau().observe(None), ArgumentTypeError, "metric"),
    ("observe_metric_bool", lambda: ReduceLROnPlateau().observe(True), ArgumentTypeError, "metric"),
    ("observe_step", lambda: ReduceLROnPlateau().observe(1.0, step=-3), HyperparameterError, "step"),
]


@pytest.mark.parametrize("name, call, exc, fragment", BAD_ARGS, ids=[r[0] for r in BAD_ARGS])
def test_bad_arguments(name, call, exc, fragment):
    with pytest.raises(exc) as info:
        call()
    assert fragment in str(info.value), str(info.value)


def test_module_all():
    assert sorted(schedules.__all__) == sorted(
        ["Schedule", "Constant", "StepLR", "MultiStepLR", "ExponentialLR", "LinearLR", "CosineAnnealingLR",
         "CosineAnnealingWarmRestarts", "PolynomialLR", "OneCycleLR", "Warmup", "Sequential", "ReduceLROnPlateau",
         "from_state_dict", "SCHEDULE_FORMAT"])
    for name in schedules.__all__:
        assert hasattr(schedules, name)
