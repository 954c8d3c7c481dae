"""Optimizers with an optax oracle (conftest.OPTAX_CONFIGS), and the checks every new optimizer gets.

* optax: every row whose oracle is optax runs through the Engine and through
  optax side by side for 50 steps of large gradients; params are compared after
  every step, and every state slot optax exposes (with its step count).
  float32, and float64 with jax's 64-bit mode switched on for the optax side.
* convergence beyond the quadratic of test_convergence.py: a parabola and the
  Rosenbrock function reach their minimum for Adagrad, RMSprop, Lion and LAMB.
* LAMB's trust ratio: per parameter, 1 when the parameter or the update is zero.
* ``overrides``: one engine with per-parameter lr / weight_decay equals, step for
  step, single-setting runs of each parameter alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from arraytrain import Engine, optim
from arraytrain.kernels import cpu
from arraytrain.kernels import reference as ref
from conftest import OPTAX_CONFIGS, OPTIMIZER_CONFIGS, assert_close, oracle, rosenbrock, rosenbrock_grad, tiered, tol

STEPS = 50
GRAD_SCALE = 1e3
SHAPES = {"w": (7, 5), "empty": (0,), "b": (5,), "scalar": (), "conv": (3, 2, 2, 2), "tail_empty": (2, 0)}
DTYPES = {"float32": np.float32, "float64": np.float64}
# numba's kernels meet optax in the default tier, the reference twins too in the slow tier (the two
# families meet each other in tests/kernels)
KERNELS = ["numba", pytest.param("reference", marks=pytest.mark.slow)]

optax_rows = pytest.mark.parametrize("name, cls_name, kwargs", OPTAX_CONFIGS, ids=[r[0] for r in OPTAX_CONFIGS])


def _jax_context(dtype_name):
    jax = pytest.importorskip("jax")
    pytest.importorskip("optax")
    # float64 needs jax's 64-bit mode, switched on for the optax side of this test only
    return jax, jax.enable_x64(dtype_name == "float64")


def _slot_close(actual, desired, np_dtype, what):
    # slots scale with the gradients (~1e3, squares ~1e6): a normwise absolute tolerance, as test_optim_torch.py
    desired = np.asarray(desired, np.float64)
    t = tol(np_dtype)
    atol = t["atol"] + t["rtol"] * float(np.max(np.abs(desired), initial=0.0))
    np.testing.assert_allclose(actual, desired, rtol=t["rtol"], atol=atol, err_msg=what)


@optax_rows
@pytest.mark.parametrize("dtype_name", ["float32", pytest.param("float64", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kernels", KERNELS)
def test_matches_optax(name, cls_name, kwargs, dtype_name, kernels):
    jax, x64 = _jax_context(dtype_name)
    import jax.numpy as jnp
    import optax

    np_dtype = DTYPES[dtype_name]
    row = oracle((name, cls_name, kwargs))
    rng = np.random.default_rng(0)
    init = {k: np.asarray(rng.standard_normal(s), dtype=np_dtype) for k, s in SHAPES.items()}
    engine = Engine(init, getattr(optim, cls_name)(**kwargs), kernels=kernels)
    with x64:
        tx = row.make(**kwargs)
        oparams = {k: jnp.asarray(v) for k, v in init.items()}
        assert all(p.dtype == np_dtype for p in oparams.values())
        ostate = tx.init(oparams)
        update = jax.jit(tx.update)
        for t in range(1, STEPS + 1):
            scale = GRAD_SCALE * rng.uniform(0.1, 3.0)
            grads = {k: np.asarray(rng.standard_normal(s) * scale, dtype=np_dtype) for k, s in SHAPES.items()}
            report = engine.step(grads)
            assert report.applied and report.step == t
            updates, ostate = update({k: jnp.asarray(g) for k, g in grads.items()}, ostate, oparams)
            oparams = optax.apply_updates(oparams, updates)
            for k in SHAPES:
                expected = np.asarray(oparams[k])
                assert engine.params[k].shape == expected.shape
                assert_close(engine.params[k], expected, np_dtype, err_msg=f"{k!r}, step {t}")
            slots = row.slots(ostate)
            assert set(slots) == set(engine.state.slots)  # every slot has an optax counterpart
            for slot, tree in slots.items():
                for k in SHAPES:
                    _slot_close(engine.state.slots[slot][k], np.asarray(tree[k]), np_dtype, f"{slot}[{k!r}], step {t}")
            assert row.count(ostate) == engine.state.step
    moved = max(float(np.max(np.abs(engine.params[k] - v), initial=0.0)) for k, v in init.items())
    assert moved > 0.1  # the comparison is not vacuous


def test_optax_rows_cover_lion_lamb_and_schedule_free():
    assert {c for _, c, _ in OPTAX_CONFIGS} == {"Lion", "LAMB", "ScheduleFreeAdamW"}
    for row in OPTIMIZER_CONFIGS:  # every row names an arraytrain optimizer and a known oracle kind
        assert issubclass(getattr(optim, row[1]), optim.Optimizer)
        assert oracle(row).kind in ("torch", "optax", "none")


# -- convergence: parabola and Rosenbrock ------------------------------------------------------


# Lion's sign step has a fixed size, so it only settles within ~lr of the optimum: a small lr.
# LAMB's step is lr * ||p||: it crawls where ||p|| is near 0, and the classic Rosenbrock path
# from (-1.2, 1) passes the origin; its row solves the same problem in coordinates shifted
# by (2, 2) (same gradients, minimum at (3, 3)), the setting of a layer whose norm stays away
# from 0. (name, optimizer factory, steps, shift)
MINIMISERS = [
    ("adagrad", lambda: optim.Adagrad(lr=1.5), 6000, 0.0),
    ("rmsprop_momentum", lambda: optim.RMSprop(lr=1e-4, momentum=0.9), 4000, 0.0),
    ("rmsprop_centered_momentum", lambda: optim.RMSprop(lr=1e-4, momentum=0.9, centered=True), 4000, 0.0),
    ("lion", lambda: optim.Lion(lr=1e-3, weight_decay=0.0), 4000, 0.0),
    ("lamb", lambda: optim.LAMB(lr=3e-4, betas=(0.9, 0.99)), 6000, 2.0),
]
minimisers = pytest.mark.parametrize("name, make_opt, steps, shift", MINIMISERS, ids=[m[0] for m in MINIMISERS])


@pytest.mark.parametrize("kernels", KERNELS)
@minimisers
def test_rosenbrock_minimum(name, make_opt, steps, shift, kernels):
    engine = Engine({"xy": np.array([-1.2, 1.0]) + shift}, make_opt(), kernels=kernels)
    start = rosenbrock(engine.params["xy"] - shift)
    for _ in range(steps):
        engine.step({"xy": rosenbrock_grad(engine.params["xy"] - shift)})
    xy = engine.params["xy"] - shift
    np.testing.assert_allclose(xy, [1.0, 1.0], atol=1e-2)
    assert rosenbrock(xy) < 1e-4 * start


@pytest.mark.parametrize("kernels", KERNELS)
@minimisers
def test_parabola_minimum(name, make_opt, steps, shift, kernels):
    # f(p) = sum(c * (p - target)^2) / 2 with curvatures over two decades
    target = np.array([1.5, -0.5, 2.0, 0.75])
    c = np.array([0.5, 1.0, 5.0, 20.0])
    engine = Engine({"p": np.ones(4)}, make_opt(), kernels=kernels)
    start = 0.5 * float(np.sum(c * (1.0 - target) ** 2))
    for _ in range(steps):
        engine.step({"p": c * (engine.params["p"] - target)})
    np.testing.assert_allclose(engine.params["p"], target, atol=1e-2)
    assert 0.5 * float(np.sum(c * (engine.params["p"] - target) ** 2)) < 1e-4 * start


# -- LAMB's trust ratio ------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", [cpu, ref], ids=["numba", "reference"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_lamb_trust_ratio_zero_norms(kernels, dtype):
    """Ratio 1 for a zero parameter (it still moves by lr * u) and for a zero update."""
    from arraytrain import Layout

    layout = Layout({"zero_p": (6,), "zero_u": (4,), "normal": (5,), "empty": (0,)})
    p = np.zeros(layout.size, dtype)
    g = np.zeros(layout.size, dtype)
    rng = np.random.default_rng(3)
    s = {n: layout.slice(n) for n in layout.names}
    g[s["zero_p"]] = rng.standard_normal(6)  # zero parameter, non-zero update
    p[s["zero_u"]] = rng.standard_normal(4)  # zero gradient and no decay: zero update
    p[s["normal"]] = rng.standard_normal(5)
    g[s["normal"]] = rng.standard_normal(5)
    m, v = np.zeros_like(p), np.zeros_like(p)
    p0 = p.astype(np.float64)
    lr, eps = 0.1, 1e-6
    ratio = kernels.lamb_step(p, g.copy(), m, v, layout.pieces, gscale=1.0, lr=np.full(4, lr), weight_decay=np.zeros(4),
                              beta1=0.9, beta2=0.999, eps=eps, eps_root=0.0, inv_bc1=1 / (1.0 - 0.9),
                              inv_bc2=1 / (1.0 - 0.999))
    u = g.astype(np.float64) / (np.abs(g.astype(np.float64)) + eps)  # step 1: m_hat = g, v_hat = g^2
    pn = np.linalg.norm(p0[s["normal"]])
    un = np.linalg.norm(u[s["normal"]])
    assert ratio.dtype == np.float64
    assert_close(ratio, [1.0, 1.0, pn / un, 1.0], np.float64)
    assert_close(p[s["zero_p"]], -lr * u[s["zero_p"]], dtype)
    np.testing.assert_array_equal(p[s["zero_u"]], p0[s["zero_u"]].astype(dtype))
    assert_close(p[s["normal"]], p0[s["normal"]] - lr * (pn / un) * u[s["normal"]], dtype)


def test_lamb_trust_ratio_is_per_parameter():
    """Scaling one parameter scales its own step only: a ratio per parameter, not per buffer."""
    rng = np.random.default_rng(5)
    grads = {"a": rng.standard_normal(8), "b": rng.standard_normal(3)}
    base = {"a": rng.standard_normal(8), "b": rng.standard_normal(3)}
    moves = {}
    for factor in (1.0, 100.0):
        init = {"a": base["a"] * factor, "b": base["b"].copy()}
        opt = optim.LAMB(lr=0.01)
        engine = Engine(init, opt)
        engine.step(grads)
        moves[factor] = {k: engine.params[k] - init[k] for k in init}
        assert opt.trust_ratio.shape == (2,)
    assert_close(moves[100.0]["a"], 100.0 * moves[1.0]["a"], np.float64)
    assert_close(moves[100.0]["b"], moves[1.0]["b"], np.float64)


# -- per-parameter hyperparameters -----------------------------------------------------------------

OVERRIDE_CASES = [
    ("adagrad", optim.Adagrad, {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 0.5}),
    ("rmsprop", optim.RMSprop, {"lr": 1e-3, "momentum": 0.5, "centered": True, "weight_decay": 0.5}),
    ("lion", optim.Lion, {"lr": 1e-2, "weight_decay": 0.5}),
    ("lamb", optim.LAMB, {"lr": 0.05, "weight_decay": 0.5}),
    ("nadam", optim.NAdam, {"lr": 1e-2, "weight_decay": 0.5}),
    ("nadamw", optim.NAdam, {"lr": 1e-2, "weight_decay": 0.5, "decoupled_weight_decay": True}),
    ("radam", optim.RAdam, {"lr": 1e-3, "betas": (0.9, 0.9), "weight_decay": 0.5}),
    ("radamw", optim.RAdam, {"lr": 1e-3, "betas": (0.9, 0.9), "weight_decay": 0.5, "decoupled_weight_decay": True}),
    ("adamax", optim.Adamax, {"lr": 1e-2, "weight_decay": 0.5}),
    ("adadelta", optim.Adadelta, {"lr": 1.0, "weight_decay": 0.5}),
]


@pytest.mark.parametrize("kernels", [cpu, ref], ids=["numba", "reference"])
@pytest.mark.parametrize("name, cls, kwargs", OVERRIDE_CASES, ids=[c[0] for c in OVERRIDE_CASES])
def test_overrides_equal_separate_runs(name, cls, kwargs, kernels):
    """``*.bias`` without weight decay and ``head.*`` with another lr, in one launch per step,
    equal step for step to each parameter run alone with its own settings."""
    from arraytrain import FlatBuffer

    shapes = {"body.weight": (6, 4), "body.bias": (4,), "head.weight": (4, 3), "head.bias": (3,)}
    head_lr = kwargs["lr"] * 3.0
    overrides = {"*.bias": {"weight_decay": 0.0}, "head.*": {"lr": head_lr}}
    rng = np.random.default_rng(11)
    init = {k: rng.standard_normal(s) for k, s in shapes.items()}
    opt = cls(**kwargs, overrides=overrides)
    params = FlatBuffer.from_arrays(init)
    grads = params.zeros_like()
    state = opt.init(params)
    alone = {}
    for k in shapes:
        own = dict(kwargs, lr=head_lr if k.startswith("head.") else kwargs["lr"],
                   weight_decay=0.0 if k.endswith(".bias") else kwargs["weight_decay"])
        o = cls(**own)
        p = FlatBuffer.from_arrays({k: init[k]})
        alone[k] = (o, p, p.zeros_like(), o.init(p))
    for t in range(1, 8):
        g = {k: rng.standard_normal(s) * 10.0 for k, s in shapes.items()}
        for k in shapes:
            grads[k][...] = g[k]
        opt.update(kernels, params, grads, state, gscale=0.5, zero_grad=True)
        assert not np.any(grads.flat)
        for k, (o, p, gr, st) in alone.items():
            gr[k][...] = g[k]
            o.update(kernels, p, gr, st, gscale=0.5, zero_grad=True)  # the one float64 variant the engines compile
            np.testing.assert_allclose(params[k], p[k], rtol=1e-12, atol=1e-12, err_msg=f"{k!r}, step {t}")
            for slot in st.slots:
                np.testing.assert_allclose(state.slots[slot][k], st.slots[slot][k], rtol=1e-12, atol=1e-12,
                                           err_msg=f"{slot}[{k!r}], step {t}")
        assert state.step == t


MAXIMIZE_CASES = {
    "SGD": {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.1},
    "Adam": {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True},
    "AdamW": {"lr": 1e-2},
    "Adagrad": {"lr": 1e-2, "weight_decay": 0.1},
    "RMSprop": {"lr": 1e-2, "centered": True, "momentum": 0.5},
    "Lion": {"lr": 1e-3, "weight_decay": 0.1},
    "LAMB": {"lr": 1e-2, "weight_decay": 0.1},
    "Adafactor": {"lr": 1e-2, "weight_decay": 0.1},
    "Sophia": {"lr": 1e-2},
    "NAdam": {"lr": 1e-2, "weight_decay": 0.1},
    "RAdam": {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True, "betas": (0.9, 0.9)},
    "Adamax": {"lr": 1e-2, "weight_decay": 0.1},
    "Adadelta": {"lr": 1.0, "weight_decay": 0.1},
}
MAXIMIZE_CASES.update({
    "Muon": {"lr": 1e-2, "fallback": optim.AdamW(lr=1e-2)},  # the fallback takes Muon's sign
    "ScheduleFreeAdamW": {"lr": 1e-2, "weight_decay": 0.1, "warmup_steps": 2},
})


def test_maximize_cases_cover_every_optimizer():
    assert set(MAXIMIZE_CASES) == {n for n in optim.__all__ if n not in ("by_name", "Optimizer", "OptState", "SAM")}


# float32 in the default tier (the kernels the suite's warm-up compiled); float64 in the slow tier
# (its in-place reads are 17 signatures more)
@pytest.mark.parametrize("dtype", [np.float32, pytest.param(np.float64, marks=pytest.mark.slow)], ids=["float32", "float64"])
@pytest.mark.parametrize("kernels", ["numba", "reference"])
@pytest.mark.parametrize("name", list(MAXIMIZE_CASES))
def test_maximize_equals_the_negated_gradient_bitwise(name, kernels, dtype):
    """``maximize=True`` fed g is the plain optimizer fed -g, bit for bit (a sign flip is exact)."""
    rng = np.random.default_rng(3)
    shapes = {"w": (6, 5), "b": (5,), "e": (0,)}
    p0 = {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}
    up = Engine(p0, getattr(optim, name)(maximize=True, **MAXIMIZE_CASES[name]), kernels=kernels)
    down = Engine(p0, getattr(optim, name)(**MAXIMIZE_CASES[name]), kernels=kernels)
    assert up.optimizer.hyperparameters()["maximize"] is True
    for _ in range(6):
        g = {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}
        up.step(g)
        down.step({k: -v for k, v in g.items()})
    assert up.params.flat.tobytes() == down.params.flat.tobytes()
    for slot in up.state.slots:
        assert up.state.slots[slot].flat.tobytes() == down.state.slots[slot].flat.tobytes(), slot


BF16_STATE = {name: kw for name, kw in MAXIMIZE_CASES.items() if name not in ("Adafactor", "Sophia")}
# learning rates that bring the quadratic below half its start in 60 steps
BF16_LR = {"SGD": 0.03, "Adam": 0.03, "AdamW": 0.03, "Adagrad": 0.3, "RMSprop": 0.03, "Lion": 0.03, "LAMB": 0.03,
           "NAdam": 0.03, "RAdam": 0.03, "Adamax": 0.03, "Adadelta": 30.0, "Muon": 0.05, "ScheduleFreeAdamW": 0.03}
# slots state_dtype leaves alone: schedule-free's iterate z and its per-parameter float64 weights
NOT_MOMENTS = {"ScheduleFreeAdamW": {"z", "max_lr", "weight_sum"}}


def test_bfloat16_state_offered_where_moments_are_elementwise():
    """Every optimizer with element-wise state takes state_dtype; Adafactor (factored statistics)
    and Sophia (its Hessian is fed by the accumulate/scale kernels) keep the parameters' dtype."""
    for name in BF16_STATE:
        assert "state_dtype" in getattr(optim, name)(**BF16_STATE[name]).hyperparameters()
    with pytest.raises(TypeError):
        optim.Adafactor(state_dtype="bfloat16")
    from arraytrain.errors import HyperparameterError

    with pytest.raises(HyperparameterError, match="state_dtype"):
        optim.SGD(lr=0.1, momentum=0.9, state_dtype="float16")


# the default tier: four kinds of update (moments; trust ratios; Newton-Schulz with a fallback; the
# schedule-free pair); the slow tier: every optimizer (each its bfloat16 kernel signature to compile)
@pytest.mark.parametrize("name", tiered(BF16_STATE, default=("AdamW", "LAMB", "Muon", "ScheduleFreeAdamW")))
def test_bfloat16_state_trains_like_float32_and_resumes_bitwise(name, tmp_path):
    import arraytrain as at

    rng = np.random.default_rng(5)
    shapes = {"w": (40, 30), "b": (30,)}
    curv = {k: rng.uniform(0.5, 2.0, s) for k, s in shapes.items()}
    p0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    kw = dict(BF16_STATE[name], lr=BF16_LR[name])
    engines = {dt: Engine(p0, getattr(optim, name)(state_dtype=dt, **kw)) for dt in (None, "bfloat16")}
    moments = {k: b for k, b in engines["bfloat16"].state.slots.items() if k not in NOT_MOMENTS.get(name, ())}
    assert moments and all(b.dtype == np.dtype("bfloat16") for b in moments.values())

    def loss(e):
        return sum(float(np.sum(curv[k] * e.params[k].astype(np.float64) ** 2)) for k in shapes)

    start = loss(engines[None])
    for _ in range(60):
        for e in engines.values():
            e.step({k: curv[k] * e.params[k] for k in shapes})
    assert loss(engines["bfloat16"]) < 0.5 * start
    assert loss(engines["bfloat16"]) <= 1.5 * loss(engines[None]) + 1e-3 * start
    # a checkpoint of bfloat16 state resumes bitwise
    e = engines["bfloat16"]
    at.save(tmp_path / "s.safetensors", e)
    back = Engine(p0, getattr(optim, name)(state_dtype="bfloat16", **kw))
    at.load(tmp_path / "s.safetensors", back)
    for x in (e, back):
        x.step({k: curv[k] * x.params[k] for k in shapes})
    assert back.params.flat.tobytes() == e.params.flat.tobytes()
    for slot in e.state.slots:
        assert back.state.slots[slot].flat.tobytes() == e.state.slots[slot].flat.tobytes()
