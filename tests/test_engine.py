"""Engine: accumulation, reduction, reports, zero-copy path, non-finite skips, missing names, resume."""

from __future__ import annotations

import copy
import math
import pickle

import numpy as np
import pytest

from arraytrain import (
    ArgumentTypeError,
    Engine,
    FlatBuffer,
    LayoutError,
    MissingGradientError,
    StateDictError,
)
from conftest import engine_snapshot

from arraytrain.optim import SGD, Adam, AdamW

D_IN, D_OUT, N = 5, 3, 24

OPTIMIZERS = {
    "sgd-momentum": lambda: SGD(lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd-nesterov": lambda: SGD(lr=0.05, momentum=0.8, nesterov=True),
    "adam-amsgrad": lambda: Adam(lr=0.02, amsgrad=True, weight_decay=0.01),
    "adamw": lambda: AdamW(lr=0.02, weight_decay=0.1),
}
RESUME_OPTIMIZERS = ["sgd-momentum", "adam-amsgrad", "adamw"]


# -- a small linear-regression problem: gradients depend on the parameters ---------------


def _data(seed=0, n=N):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, D_IN))
    Y = X @ rng.standard_normal((D_IN, D_OUT)) + 0.1 * rng.standard_normal((n, D_OUT))
    return X, Y


def _init(seed=1, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return {"W": rng.standard_normal((D_OUT, D_IN)).astype(dtype), "b": rng.standard_normal(D_OUT).astype(dtype)}


def _grad(params, X, Y):
    """Mean-squared-error gradient over the rows of X."""
    r = X @ np.asarray(params["W"], np.float64).T + np.asarray(params["b"], np.float64) - Y
    return {"W": r.T @ X / len(X), "b": r.mean(axis=0)}


def _norm(grads: dict) -> float:
    return math.sqrt(sum(float((g**2).sum()) for g in grads.values()))


# -- accumulation equals one big batch ------------------------------------------------------


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("k", [2, 4])
def test_k_equal_micro_batches_equal_one_big_batch(opt, k):
    X, Y = _data()
    big = Engine(_init(), OPTIMIZERS[opt](), accumulation_steps=1)
    acc = Engine(_init(), OPTIMIZERS[opt](), accumulation_steps=k, reduction="mean")
    for _ in range(5):
        rb = big.step(_grad(big.params, X, Y))
        reports = [acc.step(_grad(acc.params, Xc, Yc)) for Xc, Yc in zip(np.split(X, k), np.split(Y, k))]
        assert [r.applied for r in reports] == [False] * (k - 1) + [True]
        assert reports[-1].grad_norm == pytest.approx(rb.grad_norm, rel=1e-12)
    assert acc.state.step == big.state.step == 5
    for name in ("W", "b"):
        np.testing.assert_allclose(acc.params[name], big.params[name], rtol=1e-10, atol=1e-12)


def test_reduction_sum():
    X, Y = _data()
    k = 3
    micro = [_grad(_init(), Xc, Yc) for Xc, Yc in zip(np.split(X, k), np.split(Y, k))]
    total = {n: sum(g[n] for g in micro) for n in ("W", "b")}
    e = Engine(_init(), SGD(lr=1.0), accumulation_steps=k, reduction="sum")
    for g in micro:
        r = e.step(g)
    assert r.applied
    assert r.grad_norm == pytest.approx(_norm(total), rel=1e-12)
    for n in ("W", "b"):
        np.testing.assert_allclose(e.params[n], _init()[n] - total[n], rtol=1e-13, atol=1e-14)
    # sum of k micro-batches = k times the mean
    m = Engine(_init(), SGD(lr=1.0), accumulation_steps=k, reduction="mean")
    for g in micro:
        rm = m.step(g)
    assert r.grad_norm == pytest.approx(k * rm.grad_norm, rel=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_weights(reduction):
    rng = np.random.default_rng(3)
    lengths = [2, 11, 5]
    tokens = {n: rng.standard_normal((sum(lengths),) + s) for n, s in (("W", (D_OUT, D_IN)), ("b", (D_OUT,)))}
    e = Engine(_init(), SGD(lr=1.0), accumulation_steps=len(lengths), reduction=reduction)
    pos = 0
    for n_tok in lengths:
        r = e.step({n: t[pos: pos + n_tok].mean(axis=0) for n, t in tokens.items()}, weight=n_tok)
        pos += n_tok
    assert r.applied
    for n, t in tokens.items():
        # mean: token-weighted mean over all tokens; sum: the sum over all tokens
        expected = t.mean(axis=0) if reduction == "mean" else t.sum(axis=0)
        np.testing.assert_allclose(_init()[n] - e.params[n], expected, rtol=1e-12, atol=1e-13)


# -- reports ------------------------------------------------------------------------------


def test_report_fields():
    X, Y = _data()
    e = Engine(_init(), SGD(lr=0.1), accumulation_steps=3)
    micro = [_grad(e.params, Xc, Yc) for Xc, Yc in zip(np.split(X, 3), np.split(Y, 3))]
    reports = [e.step(g) for g in micro]
    for i, r in enumerate(reports[:2], start=1):
        assert r.accumulated and not r.applied and not r.skipped
        assert (r.step, r.micro_batches, r.lr) == (0, i, 0.1)
        assert r.grad_norm is None and r.clip_coef is None and r.grad_norms is None
    r = reports[-1]
    assert r.applied and not r.skipped and not r.accumulated
    assert (r.step, r.micro_batches, r.lr) == (1, 0, 0.1)
    mean = {n: sum(g[n] for g in micro) / 3 for n in ("W", "b")}
    assert r.grad_norm == pytest.approx(_norm(mean), rel=1e-12)
    assert r.grad_norms.keys() == {"W", "b"}
    for n in ("W", "b"):
        assert r.grad_norms[n] == pytest.approx(float(np.linalg.norm(mean[n])), rel=1e-12)
    assert math.hypot(*r.grad_norms.values()) == pytest.approx(r.grad_norm, rel=1e-12)
    assert r.clip_coef == 1.0
    assert "_segment_norms" not in repr(r)


@pytest.mark.parametrize("max_norm, clipped", [(0.5, True), (1e6, False)])
def test_clipping(max_norm, clipped):
    g = {"W": np.full((D_OUT, D_IN), 2.0), "b": np.full(D_OUT, -1.0)}
    norm = _norm(g)
    e = Engine(_init(), SGD(lr=1.0), max_grad_norm=max_norm)
    r = e.step(g)
    assert r.grad_norm == pytest.approx(norm, rel=1e-14)  # before clipping
    coef = max_norm / (norm + 1e-6) if clipped else 1.0
    assert r.clip_coef == pytest.approx(coef, rel=1e-14)
    for n in g:
        np.testing.assert_allclose(e.params[n], _init()[n] - coef * g[n], rtol=1e-14, atol=1e-15)
    if clipped:
        assert _norm({n: _init()[n] - e.params[n] for n in g}) == pytest.approx(max_norm, rel=1e-5)


def test_report_lr_follows_optimizer():
    opt = SGD(lr=0.5)
    e = Engine({"x": np.zeros(2)}, opt)
    assert e.step({"x": np.ones(2)}).lr == 0.5
    opt.lr = 0.25
    r = e.step({"x": np.ones(2)})
    assert r.lr == 0.25
    np.testing.assert_allclose(e.params["x"], -0.75)


# -- zero-copy path ----------------------------------------------------------------------------


def test_zero_copy_path_with_torch_views():
    torch = pytest.importorskip("torch")
    X, Y = _data()
    e = Engine(_init(), Adam(lr=0.01), accumulation_steps=2)
    ref = Engine(_init(), Adam(lr=0.01), accumulation_steps=2)
    tp = {n: torch.from_numpy(e.params[n]) for n in ("W", "b")}
    tg = {n: torch.from_numpy(e.grads[n]) for n in ("W", "b")}
    for _ in range(3):
        for Xc, Yc in zip(np.split(X, 2), np.split(Y, 2)):
            g = _grad(e.params, Xc, Yc)
            for n in g:  # what loss.backward() does: add into .grad
                tg[n].add_(torch.from_numpy(g[n]))
            r = e.step()
            ref.step(_grad(ref.params, Xc, Yc))
        assert r.applied
        for n in tg:  # zero_grad_on_step: ready for the next backward
            assert not tg[n].any()
    assert engine_snapshot(e) == engine_snapshot(ref)
    for n in tp:  # the torch tensors saw every update in place
        np.testing.assert_array_equal(tp[n].numpy(), e.params[n])
        assert not np.array_equal(tp[n].numpy(), _init()[n])


def test_zero_copy_overwrite_and_weight():
    e = Engine({"x": np.zeros(3)}, SGD(lr=1.0), accumulation_steps=2, zero_grad_on_step=False)
    # weighted gradients must already be multiplied; weight enters the denominator only
    e.grads["x"][...] = 2.0 * np.array([1.0, 2.0, 3.0])
    e.step(weight=2.0)
    e.grads["x"][...] += 6.0 * np.array([1.0, 0.0, -1.0])
    r = e.step(weight=6.0)
    assert r.applied
    np.testing.assert_allclose(e.params["x"], -(np.array([2.0, 4.0, 6.0]) + [6.0, 0.0, -6.0]) / 8.0)


def test_params_flatbuffer_used_in_place():
    buf = FlatBuffer.from_arrays({"x": np.zeros(3)})
    e = Engine(buf, SGD(lr=1.0))
    assert e.params is buf
    e.step({"x": np.ones(3)})
    np.testing.assert_array_equal(buf["x"], -1.0)
    with pytest.raises(LayoutError, match="dtype"):
        Engine(buf, SGD(), dtype=np.float32)


@pytest.mark.parametrize("dtype", [None, np.float32])
def test_params_mapping_copied(dtype):
    src = _init()
    e = Engine(src, SGD(lr=1.0), dtype=dtype)
    assert e.params.dtype == (np.float64 if dtype is None else dtype)
    e.step({"W": np.ones((D_OUT, D_IN)), "b": np.ones(D_OUT)})
    np.testing.assert_array_equal(src["W"], _init()["W"])


@pytest.mark.parametrize("zero", [True, False])
def test_zero_grad_on_step(zero):
    X, Y = _data()
    e = Engine(_init(), Adam(lr=0.01), accumulation_steps=2, zero_grad_on_step=zero)
    ref = Engine(_init(), Adam(lr=0.01), accumulation_steps=2, zero_grad_on_step=True)
    for _ in range(3):
        window = []
        for Xc, Yc in zip(np.split(X, 2), np.split(Y, 2)):
            g = _grad(e.params, Xc, Yc)
            window.append(g)
            assert e.step(g).applied == (len(window) == 2)
            ref.step(g)
        if zero:
            assert not e.grads.flat.any()
        else:  # the window's sum is left in place ...
            for n in ("W", "b"):
                np.testing.assert_array_equal(e.grads[n], window[0][n] + window[1][n])
    # ... and overwritten by the next window's first micro-batch, so the runs agree
    np.testing.assert_array_equal(e.params.flat, ref.params.flat)
    for k in e.state.slots:
        np.testing.assert_array_equal(e.state.slots[k].flat, ref.state.slots[k].flat)


def test_zero_grad_method_drops_window():
    e = Engine({"x": np.zeros(2)}, SGD(lr=1.0), accumulation_steps=3)
    e.step({"x": np.ones(2)})
    e.zero_grad()
    assert e.micro_batches == 0 and not e.grads.flat.any()
    for _ in range(3):
        r = e.step({"x": np.full(2, 3.0)})
    assert r.applied
    np.testing.assert_array_equal(e.params["x"], -3.0)


# -- non-finite gradients ---------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("position", [0, 1], ids=["first-micro", "last-micro"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_non_finite_window_is_skipped(opt, position, bad):
    X, Y = _data()
    chunks = list(zip(np.split(X, 2), np.split(Y, 2)))
    e = Engine(_init(), OPTIMIZERS[opt](), accumulation_steps=2, max_grad_norm=1.0)
    ref = Engine(_init(), OPTIMIZERS[opt](), accumulation_steps=2, max_grad_norm=1.0)
    for eng in (e, ref):  # one good window so that the optimizer state is not trivial
        for Xc, Yc in chunks:
            eng.step(_grad(eng.params, Xc, Yc))
    before = engine_snapshot(e)
    reports = []
    for i, (Xc, Yc) in enumerate(chunks):
        g = _grad(e.params, Xc, Yc)
        if i == position:
            g["W"][1, 2] = bad
        reports.append(e.step(g))
    assert reports[0].accumulated
    r = reports[1]
    assert r.skipped and not r.applied and not r.accumulated
    assert r.step == before["step"] == 1 and r.micro_batches == 0
    assert math.isnan(r.grad_norm) and r.clip_coef is None and r.grad_norms is None
    after = engine_snapshot(e)
    assert after["params"] == before["params"]
    for k in before["slots"]:
        assert after["slots"][k] == before["slots"][k], k
    assert after["step"] == before["step"]
    assert (after["micro"], after["wsum"]) == (0, 0.0)  # the window was dropped
    assert not e.grads.flat.any()
    # the next finite window proceeds exactly as if the bad one never happened
    for Xc, Yc in chunks:
        r = e.step(_grad(e.params, Xc, Yc))
        ref.step(_grad(ref.params, Xc, Yc))
    assert r.applied and r.step == 2
    assert engine_snapshot(e) == engine_snapshot(ref)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "+inf", "-inf"])
def test_non_finite_zero_copy_path(dtype, bad):
    e = Engine(_init(dtype=dtype), Adam(lr=0.1))
    e.step({"W": np.ones((D_OUT, D_IN)), "b": np.ones(D_OUT)})
    before = engine_snapshot(e)
    e.grads["b"][0] = bad
    r = e.step()
    assert r.skipped
    after = engine_snapshot(e)
    assert after["params"] == before["params"]
    for k in before["slots"]:
        assert after["slots"][k] == before["slots"][k]
    assert after["step"] == 1 and not e.grads.flat.any()


def test_non_finite_in_sum_of_finite_float32():
    # each micro-batch is finite, their float32 sum overflows to inf: skipped, not applied
    e = Engine({"x": np.zeros(2, np.float32)}, SGD(lr=1.0), accumulation_steps=2, reduction="sum")
    big = np.full(2, 3e38, np.float32)
    assert e.step({"x": big}).accumulated
    assert e.step({"x": big}).skipped
    assert not e.params.flat.any() and e.state.step == 0


# -- missing names --------------------------------------------------------------------------------


@pytest.mark.parametrize("mid_window", [False, True])
def test_missing_error_policy(mid_window):
    e = Engine(_init(), Adam(lr=0.01), accumulation_steps=2)
    e.step({"W": np.ones((D_OUT, D_IN)), "b": np.ones(D_OUT)})
    if not mid_window:
        e.step({"W": np.ones((D_OUT, D_IN)), "b": np.ones(D_OUT)})
    before = engine_snapshot(e)
    with pytest.raises(MissingGradientError, match="missing='error'") as info:
        e.step({"W": np.full((D_OUT, D_IN), 5.0)})
    assert "'b'" in str(info.value) and "'W'" not in str(info.value)
    assert isinstance(info.value, KeyError)
    assert engine_snapshot(e) == before


def test_missing_error_names_all_absent():
    e = Engine({"a": np.zeros(1), "b": np.zeros(2), "c": np.zeros(3)}, SGD())
    with pytest.raises(MissingGradientError) as info:
        e.step({"b": np.zeros(2)})
    assert "'a'" in str(info.value) and "'c'" in str(info.value)


def test_missing_zero_policy_counts_as_zero():
    e = Engine({"a": np.zeros(2), "b": np.zeros(2)}, SGD(lr=1.0), accumulation_steps=2,
               missing="zero", zero_grad_on_step=False)
    e.step({"a": np.ones(2), "b": np.full(2, 4.0)})
    r = e.step({"a": np.ones(2)})  # b absent: a zero in the mean, not a skipped micro-batch
    assert r.applied
    np.testing.assert_array_equal(e.params["a"], -1.0)
    np.testing.assert_array_equal(e.params["b"], -2.0)
    # stale grads of an absent name are not reused at the start of the next window
    assert (e.grads["b"] != 0).all()
    e.step({"a": np.ones(2)})
    e.step({"a": np.ones(2)})
    np.testing.assert_array_equal(e.params["b"], -2.0)
    np.testing.assert_array_equal(e.params["a"], -2.0)


# -- state dicts --------------------------------------------------------------------------------------


def _run_calls(e: Engine, calls: range, X, Y):
    """Micro-batch call i uses data chunk i % 4 and weight 1 + i % 3."""
    chunks = list(zip(np.split(X, 4), np.split(Y, 4)))
    for i in calls:
        Xc, Yc = chunks[i % 4]
        e.step(_grad(e.params, Xc, Yc), weight=1 + i % 3)


def _regression_engine(opt, **kw):
    """An engine of ``OPTIMIZERS[opt]`` over the regression's initial weights, accumulating 2 and clipping at 0.5
    by default."""
    kw.setdefault("accumulation_steps", 2)
    kw.setdefault("max_grad_norm", 0.5)
    return Engine(_init(), OPTIMIZERS[opt](), **kw)


@pytest.mark.parametrize("split", [0, 3, 4, 7], ids=lambda k: f"after-{k}-micro")
@pytest.mark.parametrize("opt", RESUME_OPTIMIZERS)
def test_resume_is_bitwise(opt, split):
    X, Y = _data()
    total = 10
    full = _regression_engine(opt)
    _run_calls(full, range(total), X, Y)

    first = _regression_engine(opt)
    _run_calls(first, range(split), X, Y)
    sd = pickle.loads(pickle.dumps(first.state_dict()))
    assert sd["accumulation"]["micro_batches"] == split % 2
    resumed = Engine({n: np.zeros_like(v) for n, v in _init().items()}, OPTIMIZERS[opt](),
                     accumulation_steps=2, max_grad_norm=0.5)
    resumed.load_state_dict(sd)
    assert engine_snapshot(resumed) == engine_snapshot(first)
    _run_calls(resumed, range(split, total), X, Y)
    assert engine_snapshot(resumed) == engine_snapshot(full)
    assert resumed.state.step == total // 2


def test_state_dict_is_a_copy():
    X, Y = _data()
    e = _regression_engine("adam-amsgrad")
    _run_calls(e, range(3), X, Y)
    sd = e.state_dict()
    frozen = copy.deepcopy(sd)
    _run_calls(e, range(3, 6), X, Y)
    for part in ("params",):
        for n in sd[part]:
            np.testing.assert_array_equal(sd[part][n], frozen[part][n])
    for slot, arrays in sd["optimizer"]["slots"].items():
        for n in arrays:
            np.testing.assert_array_equal(arrays[n], frozen["optimizer"]["slots"][slot][n])
    assert sd["optimizer"]["step"] == 1 and sd["accumulation"]["micro_batches"] == 1
    assert sd["optimizer"]["type"] == "Adam"
    assert sd["optimizer"]["hyperparameters"]["amsgrad"] is True
    assert set(sd["optimizer"]["slots"]) == {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}


def test_load_keeps_current_hyperparameters():
    X, Y = _data()
    e = _regression_engine("adamw")
    _run_calls(e, range(2), X, Y)
    other = Engine(_init(), AdamW(lr=0.5, weight_decay=0.1), accumulation_steps=2)
    other.load_state_dict(e.state_dict())
    assert other.optimizer.lr == 0.5
    other.step({"W": np.zeros((D_OUT, D_IN)), "b": np.zeros(D_OUT)})
    assert other.step({"W": np.zeros((D_OUT, D_IN)), "b": np.zeros(D_OUT)}).lr == 0.5


def _rename(sd):
    sd["params"]["W2"] = sd["params"].pop("W")


def _set(path, value):
    def mutate(sd):
        d = sd
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value
    return mutate


def _delete(path):
    def mutate(sd):
        d = sd
        for key in path[:-1]:
            d = d[key]
        del d[path[-1]]
    return mutate


BAD_STATE = {
    "param-renamed": _rename,
    "param-missing": _delete(["params", "b"]),
    "param-extra": _set(["params", "c"], np.zeros(2)),
    "param-shape": _set(["params", "W"], np.zeros((D_IN, D_OUT))),
    "param-int": _set(["params", "b"], np.zeros(D_OUT, dtype=np.int64)),
    "slot-shape": _set(["optimizer", "slots", "exp_avg", "b"], np.zeros(D_OUT + 1)),
    "slot-renamed-param": _set(["optimizer", "slots", "exp_avg_sq", "bb"], np.zeros(D_OUT)),
    "slot-missing": _delete(["optimizer", "slots", "max_exp_avg_sq"]),
    "slot-extra": _set(["optimizer", "slots", "momentum_buffer"], {}),
    "slot-not-mapping": _set(["optimizer", "slots", "exp_avg"], [1, 2]),
    "grads-shape": _set(["accumulation", "grads", "b"], np.zeros((1, D_OUT))),
    "optimizer-type": _set(["optimizer", "type"], "AdamW"),
    "step-negative": _set(["optimizer", "step"], -1),
    "step-float": _set(["optimizer", "step"], 1.5),
    "step-bool": _set(["optimizer", "step"], True),
    "step-str": _set(["optimizer", "step"], "3"),
    "micro-too-big": _set(["accumulation", "micro_batches"], 2),
    "micro-negative": _set(["accumulation", "micro_batches"], -1),
    "weight-sum-nan": _set(["accumulation", "weight_sum"], math.nan),
    "weight-sum-negative": _set(["accumulation", "weight_sum"], -1.0),
    "format": _set(["format"], 1),
    "schedule-absent-in-engine": _set(["schedule"], {"type": "Constant"}),
    "loss-scaler-absent-in-engine": _set(["loss_scaler"], {"scale": 2.0, "growth_tracker": 0}),
    "skips-negative": _set(["consecutive_skips"], -1),
    "perturbed-without-sam": _set(["perturbed"], True),
    "no-schedule-key": _delete(["schedule"]),
    "no-optimizer": _delete(["optimizer"]),
    "no-accumulation": _delete(["accumulation"]),
    "no-params": _delete(["params"]),
}


@pytest.mark.parametrize("case", list(BAD_STATE))
def test_bad_state_dict_changes_nothing(case):
    X, Y = _data()
    source = _regression_engine("adam-amsgrad")
    _run_calls(source, range(5), X, Y)  # differs from target in every buffer
    sd = source.state_dict()
    BAD_STATE[case](sd)
    target = _regression_engine("adam-amsgrad")
    _run_calls(target, range(3), X, Y)
    before = engine_snapshot(target)
    with pytest.raises(StateDictError):
        target.load_state_dict(sd)
    assert engine_snapshot(target) == before


@pytest.mark.parametrize("state", [[], "state", None, {}], ids=["list", "str", "none", "empty"])
def test_non_dict_state(state):
    e = _regression_engine("sgd-momentum")
    before = engine_snapshot(e)
    with pytest.raises(StateDictError):
        e.load_state_dict(state)
    assert engine_snapshot(e) == before


@pytest.mark.parametrize("src, dst", [("sgd-momentum", "adamw"), ("adamw", "adam-amsgrad"),
                                      ("adam-amsgrad", "sgd-momentum")])
def test_state_from_another_optimizer_refused(src, dst):
    X, Y = _data()
    a = _regression_engine(src)
    _run_calls(a, range(2), X, Y)
    b = _regression_engine(dst)
    before = engine_snapshot(b)
    with pytest.raises(StateDictError, match="optimizer"):
        b.load_state_dict(a.state_dict())
    assert engine_snapshot(b) == before


def test_amsgrad_state_refused_without_amsgrad():
    a = _regression_engine("adam-amsgrad")
    b = Engine(_init(), Adam(lr=0.02), accumulation_steps=2, max_grad_norm=0.5)
    before = engine_snapshot(b)
    with pytest.raises(StateDictError, match="slots"):
        b.load_state_dict(a.state_dict())
    assert engine_snapshot(b) == before


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_two_identical_runs_are_bitwise_equal(opt):
    X, Y = _data()
    runs = []
    for _ in range(2):
        e = _regression_engine(opt, accumulation_steps=3)
        _run_calls(e, range(9), X, Y)
        runs.append(engine_snapshot(e))
    assert runs[0] == runs[1]
    assert runs[0]["step"] == 3


@pytest.mark.parametrize("case", ["list-of-callables", "none", "other-engines"])
def test_apply_state_takes_only_this_engines_checked_state(case):
    """The public check/apply pair: apply_state refuses anything else before any write."""
    def make(seed):
        rng = np.random.default_rng(seed)
        e = Engine({"w": rng.standard_normal((3, 4)), "b": rng.standard_normal(4)}, Adam(lr=0.1))
        e.step({"w": rng.standard_normal((3, 4)), "b": rng.standard_normal(4)})
        return e

    e, other = make(0), make(1)
    written = []
    bad = {"list-of-callables": [lambda: written.append(1)], "none": None,
           "other-engines": other.check_state(e.state_dict())}[case]
    before = engine_snapshot(e)
    with pytest.raises(ArgumentTypeError, match="checked"):
        e.apply_state(bad)
    assert engine_snapshot(e) == before and written == []
    e.apply_state(e.check_state(other.state_dict()))  # its own: loads
    assert engine_snapshot(e) == engine_snapshot(other)
