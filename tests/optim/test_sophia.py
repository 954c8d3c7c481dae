"""Sophia: fast kernels (numba, CUDA) == reference twin, the Hessian EMA, NaN, convergence."""

from __future__ import annotations

import numpy as np
import pytest

from arraytrain import Engine, FlatBuffer, HyperparameterError, optim
from arraytrain.kernels import cpu
from arraytrain.kernels import reference as ref
from conftest import SIZES, assert_close, assert_padding_zero, dtypes, padded_layout, random_flat, zero_grad_at

STEPS = 8


def _hessian_items(layout, dtype, rng, scale):
    return {name: np.abs(rng.standard_normal(layout.sizes[i])).astype(dtype) * scale
            for i, name in enumerate(layout.names)}


@pytest.mark.parametrize("n", SIZES)
@dtypes
@pytest.mark.parametrize("cfg", [{}, {"maximize": True, "betas": (0.9, 0.95), "weight_decay": 0.0}],
                         ids=["defaults", "maximize"])
def test_kernel_matches_reference(family, n, dtype, cfg, rng):
    """STEPS steps of params and both slots, a Hessian estimate every 2nd step, zero_grad alternating.

    rho*bs*h is drawn around |m| so that both branches of the clip (ratio < 1 and = 1) occur.
    """
    layout = padded_layout(n)
    opt = optim.Sophia(lr=0.05, rho=0.05, bs=10.0, overrides={"b": {"lr": 0.01, "weight_decay": 0.5}}, **cfg)
    p0 = FlatBuffer(layout, random_flat(layout, dtype, rng))
    runs = {k: (p0.copy(),) for k in ("fast", "ref")}
    runs = {k: (p, opt.init(p)) for k, (p,) in runs.items()}
    for t in range(STEPS):
        if t % 2 == 0:
            items = _hessian_items(layout, dtype, rng, [0.1, 2.0][t % 4 // 2])
            for name, kernels in (("fast", family), ("ref", ref)):
                opt.update_hessian(kernels, runs[name][1], items, layout)
        zero_grad = zero_grad_at(t, dtype, odd=True)
        g0 = random_flat(layout, dtype, rng)
        for name, kernels in (("fast", family), ("ref", ref)):
            p, state = runs[name]
            g = FlatBuffer(layout, g0.copy())
            opt.update(kernels, p, g, state, gscale=0.8, zero_grad=zero_grad)
            assert not np.any(g.flat) if zero_grad else np.array_equal(g.flat, g0)
        (pc, sc), (pr, sr) = runs["fast"], runs["ref"]
        assert_close(pc.flat, pr.flat, dtype, err_msg=f"params, step {t}")
        assert_padding_zero(pc.flat, layout, "params")
        for slot in ("exp_avg", "hessian"):
            assert_close(sc.slots[slot].flat, sr.slots[slot].flat, dtype, err_msg=f"{slot}, step {t}")
            assert_padding_zero(sc.slots[slot].flat, layout, slot)
        assert sc.step == sr.step == t + 1


@pytest.mark.parametrize("kernels", [cpu, ref], ids=["numba", "reference"])
def test_update_formula(kernels, rng):
    """One step by hand: m, decoupled decay, the clipped ratio, and h = b2 h + (1 - b2) h_hat."""
    layout = padded_layout(1037)
    opt = optim.Sophia(lr=0.1, betas=(0.9, 0.8), rho=0.5, bs=2.0, weight_decay=0.2, eps=1e-12)
    p = FlatBuffer(layout, random_flat(layout, np.float64, rng))
    state = opt.init(p)
    items = _hessian_items(layout, np.float64, rng, 1.0)
    opt.update_hessian(kernels, state, items, layout)
    h = 0.2 * np.concatenate([items[k] for k in layout.names])
    g = FlatBuffer(layout, random_flat(layout, np.float64, rng))
    live = np.concatenate([np.arange(layout.slice(k).start, layout.slice(k).stop) for k in layout.names])
    pp, gg = p.flat[live].copy(), g.flat[live].copy()
    opt.update(kernels, p, g, state, gscale=1.0)
    m = 0.1 * gg
    expected = pp * (1 - 0.1 * 0.2) - 0.1 * np.sign(m) * np.minimum(np.abs(m) / np.maximum(0.5 * 2.0 * h, 1e-12), 1)
    np.testing.assert_allclose(state.slots["hessian"].flat[live], h, rtol=1e-12)
    np.testing.assert_allclose(state.slots["exp_avg"].flat[live], m, rtol=1e-12)
    np.testing.assert_allclose(p.flat[live], expected, rtol=1e-12, atol=1e-15)
    clipped = np.abs(m) >= 0.5 * 2.0 * h
    assert 0 < np.count_nonzero(clipped) < clipped.size  # both branches taken


@dtypes
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["g", "h"])
def test_nonfinite_propagates_as_in_the_reference(family, dtype, bad, where, rng):
    layout = padded_layout(1037)
    opt = optim.Sophia(lr=0.1, bs=1.0)
    runs = {}
    p0 = random_flat(layout, dtype, rng)
    g0 = random_flat(layout, dtype, rng)
    items = _hessian_items(layout, dtype, rng, 1.0)
    i = layout.slice("a").start + 5
    if where == "g":
        g0[i] = bad
    else:
        items["a"][5] = bad
    for name, kernels in (("fast", family), ("ref", ref)):
        p = FlatBuffer(layout, p0.copy())
        state = opt.init(p)
        opt.update_hessian(kernels, state, items, layout)
        opt.update(kernels, p, FlatBuffer(layout, g0.copy()), state)
        runs[name] = (p.flat, state.slots["exp_avg"].flat, state.slots["hessian"].flat)
    for a, b in zip(runs["fast"], runs["ref"]):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_array_equal(np.isinf(a), np.isinf(b))
        ok = np.isfinite(b)
        assert_close(a[ok], b[ok], dtype)
    p = runs["fast"][0]
    if where == "g":
        # NaN m: a NaN parameter; infinite m: the clip bounds the move to lr (m stays inf)
        assert np.isnan(p[i]) == np.isnan(bad)
        assert not np.isfinite(runs["fast"][1][i])
        assert np.count_nonzero(~np.isfinite(p)) == int(np.isnan(bad))
    else:  # an infinite h gives ratio 0 (no move), a NaN h a NaN parameter
        assert np.isnan(p[i]) == np.isnan(bad)


def test_update_hessian_through_the_engine(rng):
    shapes = {"w": (3, 4), "e": (0,), "b": (4,)}
    engine = Engine({k: rng.standard_normal(s) for k, s in shapes.items()}, optim.Sophia(bs=1.0))
    est = {k: np.abs(rng.standard_normal(s)) for k, s in shapes.items() if k != "e"}
    engine.update_hessian(est)
    engine.update_hessian(est)
    for k, v in est.items():
        assert_close(engine.state.slots["hessian"][k], (0.01 + 0.0099) * v)


@pytest.mark.parametrize("kernels", ["numba", "reference"])
def test_quadratic_converges_with_exact_hessian(kernels):
    rng = np.random.default_rng(7)
    shapes = {"w": (6, 4), "empty": (0,), "b": (4,), "scalar": ()}
    curv = {k: 1e3 * rng.uniform(0.5, 2.0, s) for k, s in shapes.items()}
    engine = Engine({k: 0.1 * rng.standard_normal(s) for k, s in shapes.items()},
                    optim.Sophia(lr=0.05, rho=1.0, bs=1.0, betas=(0.5, 0.9), weight_decay=0.0), kernels=kernels)

    def loss():
        return sum(0.5 * float(np.sum(curv[k] * engine.params[k] ** 2)) for k in shapes)

    start, history = loss(), []
    for t in range(20):
        if t % 5 == 0:
            engine.update_hessian({k: v for k, v in curv.items() if k != "empty"})
        engine.step({k: curv[k] * engine.params[k] for k in shapes})
        history.append(loss())
    assert max(history) < start
    assert history[-1] < 1e-2 * start, f"loss {start:.3g} -> {history[-1]:.3g}"


@pytest.mark.parametrize("kernels", ["numba", "reference"])
def test_rosenbrock_minimum(kernels):
    """The exact Hessian diagonal every 5 steps; lr == rho: Newton steps capped at lr."""
    from conftest import rosenbrock, rosenbrock_grad

    def hess_diag(p):
        x, y = p
        return np.array([2.0 - 400.0 * (y - x * x) + 800.0 * x * x, 200.0])

    engine = Engine({"xy": np.array([-1.2, 1.0])},
                    optim.Sophia(lr=0.1, rho=0.1, bs=1.0, betas=(0.9, 0.5), weight_decay=0.0), kernels=kernels)
    start = rosenbrock(engine.params["xy"])
    for t in range(5000):
        if t % 5 == 0:
            engine.update_hessian({"xy": hess_diag(engine.params["xy"])})
        engine.step({"xy": rosenbrock_grad(engine.params["xy"])})
    np.testing.assert_allclose(engine.params["xy"], [1.0, 1.0], atol=1e-2)
    assert rosenbrock(engine.params["xy"]) < 1e-4 * start


@pytest.mark.parametrize("kwargs, name", [
    ({"lr": -1.0}, "lr"), ({"betas": (1.0, 0.9)}, "betas[0]"), ({"betas": (0.9, -0.1)}, "betas[1]"),
    ({"betas": 0.9}, "betas"), ({"rho": 0.0}, "rho"), ({"weight_decay": -0.1}, "weight_decay"),
    ({"eps": 0.0}, "eps"), ({"bs": -1}, "bs"), ({"maximize": "no"}, "maximize"),
])
def test_bad_hyperparameters(kwargs, name):
    with pytest.raises(HyperparameterError, match=name.replace("[", r"\[").replace("]", r"\]")):
        optim.Sophia(**kwargs)
