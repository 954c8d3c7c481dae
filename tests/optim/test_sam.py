"""SAM / ASAM: fast kernels (numba, CUDA) == reference twins, the engine's two windows == a NumPy SAM from the paper."""

from __future__ import annotations

import math

import numpy as np
import pytest

from arraytrain import Engine, HyperparameterError, optim
from arraytrain.kernels import reference as ref
from conftest import SIZES, assert_close, assert_padding_zero, dtypes, live_mask, padded_layout, random_flat


@pytest.mark.parametrize("n", SIZES)
@dtypes
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
def test_perturb_kernel_matches_reference(family, n, dtype, adaptive, rng):
    layout = padded_layout(n)
    p0, g0 = random_flat(layout, dtype, rng), random_flat(layout, dtype, rng)
    for t, zero_grad in enumerate((False, True)):
        out = {}
        for name, kernels in (("fast", family), ("ref", ref)):
            p, g, backup = p0.copy(), g0.copy(), np.zeros_like(p0)
            kernels.sam_perturb(p, g, backup, layout.pieces, scale=0.3, adaptive=adaptive, zero_grad=zero_grad)
            out[name] = (p, g, backup)
            np.testing.assert_array_equal(backup, p0)
            assert not np.any(g) if zero_grad else np.array_equal(g, g0)
            assert_padding_zero(p, layout)
        assert_close(out["fast"][0], out["ref"][0], dtype)
    expected = p0.astype(np.float64) + 0.3 * g0 * (p0.astype(np.float64) ** 2 if adaptive else 1.0)
    assert_close(out["fast"][0], expected, dtype)


@pytest.mark.parametrize("n", SIZES)
@dtypes
def test_sumsq_product_matches_reference(family, n, dtype, rng):
    layout = padded_layout(n)
    x, y = random_flat(layout, dtype, rng), random_flat(layout, dtype, rng, scale=3.0)
    dirty = x.copy()
    dirty[~live_mask(layout)] = np.nan  # padding is never read
    total, per_seg = family.sumsq_product(dirty, y, layout.pieces, nseg=len(layout))
    rtotal, rper_seg = ref.sumsq_product(x, y, layout.pieces, nseg=len(layout))
    assert_close(total, rtotal, np.float64)
    assert_close(per_seg, rper_seg, np.float64)
    assert_close(total, float(np.sum((x.astype(np.float64) * y) ** 2)), np.float64)
    x[np.flatnonzero(live_mask(layout))[-1:]] = np.nan
    if n:
        assert math.isnan(family.sumsq_product(x, y, layout.pieces, nseg=len(layout))[0])
        assert math.isnan(ref.sumsq_product(x, y, layout.pieces, nseg=len(layout))[0])


# -- the engine's two windows against a NumPy SAM -----------------------------------------------

SHAPES = {"w": (6, 4), "empty": (0,), "b": (4,), "scalar": ()}


def _numpy_base(name):
    """A plain NumPy base step (torch's SGD with momentum / Adam), state in a dict."""
    if name == "sgd":
        lr, mom = 1e-3, 0.9

        def step(w, g, s, t):
            s["buf"] = g.copy() if t == 1 else mom * s["buf"] + g
            return w - lr * s["buf"]
        return optim.SGD(lr=lr, momentum=mom), step
    lr, b1, b2, eps = 1e-2, 0.9, 0.999, 1e-8

    def step(w, g, s, t):
        s["m"] = b1 * s.get("m", 0.0) + (1 - b1) * g
        s["v"] = b2 * s.get("v", 0.0) + (1 - b2) * g * g
        return w - lr / (1 - b1**t) * s["m"] / (np.sqrt(s["v"]) / math.sqrt(1 - b2**t) + eps)
    return optim.Adam(lr=lr), step


@pytest.mark.parametrize("kernels", ["numba", "reference"])
@pytest.mark.parametrize("base", ["sgd", "adam"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
def test_engine_matches_numpy_sam(kernels, base, adaptive, dtype):
    """Foret et al. 2021, Algorithm 1 (ASAM: Kwon et al. 2021), on a quadratic with a cubic term."""
    rng = np.random.default_rng(5)
    rho = 0.05 if not adaptive else 0.5
    curv = {k: rng.uniform(0.5, 2.0, s) * 100 for k, s in SHAPES.items()}

    def grad(w):  # L = sum(curv * w^2 / 2 + w^3 / 3): the gradient is not linear in w
        return {k: curv[k] * v + v * v for k, v in w.items()}

    init = {k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()}
    at_base, np_step = _numpy_base(base)
    engine = Engine(init, optim.SAM(at_base, rho=rho, adaptive=adaptive), kernels=kernels)
    w = {k: v.astype(np.float64) for k, v in init.items()}
    states = {k: {} for k in SHAPES}
    for t in range(1, 8):
        g = grad(w)
        if adaptive:
            norm = math.sqrt(sum(float(np.sum((w[k] * g[k]) ** 2)) for k in SHAPES))
            e = {k: rho * w[k] ** 2 * g[k] / (norm + 1e-12) for k in SHAPES}
        else:
            norm = math.sqrt(sum(float(np.sum(g[k] ** 2)) for k in SHAPES))
            e = {k: rho * g[k] / (norm + 1e-12) for k in SHAPES}
        report = engine.step({k: v.astype(dtype) for k, v in grad({k: engine.params[k] for k in SHAPES}).items()})
        assert report.perturbed and not report.applied and engine.perturbed
        for k in SHAPES:
            assert_close(engine.params[k], w[k] + e[k], dtype, err_msg=f"perturbed {k!r}, step {t}")
        g2 = grad({k: w[k] + e[k] for k in SHAPES})
        report = engine.step({k: v.astype(dtype) for k, v in grad({k: engine.params[k] for k in SHAPES}).items()})
        assert report.applied and report.step == t and not engine.perturbed
        w = {k: np_step(w[k], g2[k], states[k], t) for k in SHAPES}
        for k in SHAPES:
            assert_close(engine.params[k], w[k], dtype, err_msg=f"{k!r}, step {t}")
    assert set(engine.state.slots) == set(at_base.slot_names) | {"sam_backup"}


def test_skipped_second_window_restores_the_weights(rng):
    init = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
    engine = Engine(init, optim.SAM(optim.SGD(lr=0.1, momentum=0.9)))
    engine.step({k: np.ones(s) for k, s in SHAPES.items()})
    assert engine.perturbed
    bad = {k: np.full(s, np.nan) for k, s in SHAPES.items()}
    report = engine.step(bad)
    assert report.skipped and not engine.perturbed
    for k, v in init.items():
        np.testing.assert_array_equal(engine.params[k], v)
    assert engine.state.step == 0


def test_delegation_to_the_base():
    base = optim.Adam(lr=1e-3, weight_decay=0.1, overrides={"b": {"lr": 0.5}})
    sam = optim.SAM(base, rho=0.1, adaptive=True)
    assert sam.lr == 1e-3 and sam.weight_decay == 0.1 and sam.overrides == base.overrides
    assert sam.slot_names == ("exp_avg", "exp_avg_sq", "sam_backup")
    hp = sam.hyperparameters()
    assert hp["base"] == "Adam" and hp["base_hyperparameters"] == base.hyperparameters()
    assert hp["rho"] == 0.1 and hp["adaptive"] is True
    engine = Engine({k: np.zeros(s) for k, s in SHAPES.items()}, sam)
    np.testing.assert_array_equal(sam.per_param(engine.state, "lr"), base.per_param(engine.state, "lr"))
    assert sam.per_param(engine.state, "lr")[list(SHAPES).index("b")] == 0.5


@pytest.mark.parametrize("kernels", ["numba", "reference"])
@pytest.mark.parametrize("make", [lambda: optim.SAM(optim.SGD(lr=2e-4, momentum=0.9), rho=0.01),
                                  lambda: optim.SAM(optim.Adam(lr=1e-2), rho=0.05, adaptive=True)],
                         ids=["sam_sgd", "asam_adam"])
def test_quadratic_loss_decreases(kernels, make):
    rng = np.random.default_rng(7)
    curv = {k: 1e3 * rng.uniform(0.5, 2.0, s) for k, s in SHAPES.items()}
    engine = Engine({k: 0.1 * rng.standard_normal(s) for k, s in SHAPES.items()}, make(), kernels=kernels)

    def loss():
        return sum(0.5 * float(np.sum(curv[k] * engine.params[k] ** 2)) for k in SHAPES)

    start, history = loss(), []
    for _ in range(40):  # 20 steps, two windows each
        report = engine.step({k: curv[k] * engine.params[k] for k in SHAPES})
        if report.applied:
            history.append(loss())
    assert len(history) == 20 and max(history) < start
    assert history[-1] < 0.1 * start, f"loss {start:.3g} -> {history[-1]:.3g}"


@pytest.mark.parametrize("kernels", ["numba", "reference"])
def test_rosenbrock_minimum(kernels):
    from conftest import rosenbrock, rosenbrock_grad

    engine = Engine({"xy": np.array([-1.2, 1.0])}, optim.SAM(optim.Adam(lr=1e-2, betas=(0.9, 0.99)), rho=1e-3),
                    kernels=kernels)
    start = rosenbrock(engine.params["xy"])
    for _ in range(2 * 2000):
        engine.step({"xy": rosenbrock_grad(engine.params["xy"])})
    np.testing.assert_allclose(engine.params["xy"], [1.0, 1.0], atol=1e-2)
    assert rosenbrock(engine.params["xy"]) < 1e-4 * start


@pytest.mark.parametrize("make, name", [
    (lambda: optim.SAM(optim.SGD(), rho=0.0), "rho"),
    (lambda: optim.SAM(optim.SGD(), rho=-0.1), "rho"),
    (lambda: optim.SAM(optim.SGD(), rho=float("nan")), "rho"),
    (lambda: optim.SAM(optim.SGD(), adaptive=1), "adaptive"),
    (lambda: optim.SAM("sgd"), "base"),
    (lambda: optim.SAM(optim.SAM(optim.SGD())), "base"),
])
def test_bad_hyperparameters(make, name):
    with pytest.raises(HyperparameterError, match=name):
        make()
