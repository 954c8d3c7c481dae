"""Convergence smoke tests: the optimizers actually minimise, through the Engine.

Gradients are hand-written: a separable quadratic for every shared optimizer
configuration, and the 2-D Rosenbrock function for SGD with momentum and Adam.
"""

from __future__ import annotations

import numpy as np
import pytest

from arraytrain import Engine, optim
from conftest import OPTIMIZER_CONFIGS, rosenbrock, rosenbrock_grad

KERNELS = ["numba", "reference"]
# The shared configurations are tuned for gradients of scale ~1e3, hence the curvature scale.
CURVATURE = 1e3
SHAPES = {"w": (6, 4), "empty": (0,), "b": (4,), "scalar": ()}


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("cls_name, kwargs", [c[1:] for c in OPTIMIZER_CONFIGS], ids=[c[0] for c in OPTIMIZER_CONFIGS])
def test_quadratic_loss_decreases_within_20_steps(cls_name, kwargs, kernels):
    rng = np.random.default_rng(7)
    curv = {k: CURVATURE * rng.uniform(0.5, 2.0, s) for k, s in SHAPES.items()}
    init = {k: 0.1 * rng.standard_normal(s) for k, s in SHAPES.items()}
    engine = Engine(init, getattr(optim, cls_name)(**kwargs), kernels=kernels)

    def loss():
        return sum(0.5 * float(np.sum(curv[k] * engine.params[k] ** 2)) for k in SHAPES)

    start = loss()
    history = []
    sign = -1.0 if kwargs.get("maximize") else 1.0  # maximize: ascend -loss, whose gradient is -grad
    for _ in range(20):
        report = engine.step({k: sign * curv[k] * engine.params[k] for k in SHAPES})
        assert report.applied
        history.append(loss())
    assert np.isfinite(history).all()
    assert max(history) < start  # never worse than the start
    assert history[-1] < 0.1 * start, f"loss {start:.3g} -> {history[-1]:.3g}"


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("make_opt, steps", [
    (lambda: optim.SGD(lr=2e-3, momentum=0.9), 1000),
    (lambda: optim.Adam(lr=1e-2, betas=(0.9, 0.99)), 2000),
], ids=["sgd_momentum", "adam"])
def test_rosenbrock_minimum(make_opt, steps, kernels):
    engine = Engine({"xy": np.array([-1.2, 1.0])}, make_opt(), kernels=kernels)
    start = rosenbrock(engine.params["xy"])
    for _ in range(steps):
        engine.step({"xy": rosenbrock_grad(engine.params["xy"])})
    xy = engine.params["xy"]
    np.testing.assert_allclose(xy, [1.0, 1.0], atol=1e-2)
    assert rosenbrock(xy) < 1e-4 * start
