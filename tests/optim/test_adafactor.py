"""Adafactor: fast kernels (numba, CUDA) == reference twin, == torch.optim.Adafactor, NaN, convergence."""

from __future__ import annotations

import numpy as np
import pytest

from arraytrain import Engine, FlatBuffer, Layout, optim
from arraytrain.kernels import reference as ref
from arraytrain.optim._adafactor import slot_layouts
from conftest import (
    SIZES,
    assert_close,
    assert_padding_zero,
    decoded,
    dtypes,
    padded_layout,
    parallel_dtypes,
    random_flat,
    tol,
    zero_grad_at,
)

STEPS = 8
SLOTS = ("row_var", "col_var", "variance")

# Matrices whose rows straddle the reduction chunks (531 does not divide 2**14), more than one
# column block (531, 1037 > 256), one-row / one-column matrices, >2-D (factored over the last
# two dims) and zero-size matrices first, in the middle and last.
MATRIX_LAYOUTS = {
    "matrices": Layout({"e0": (0, 5), "big": (523, 531), "v": (1037,), "e1": (2, 0), "s": (), "e2": (0,)}),
    "thin": Layout({"e0": (0,), "row": (1, 1037), "e1": (0, 3), "col": (1037, 1), "t": (2, 3, 5, 7),
                    "e2": (3, 0, 4)}),
}
LAYOUTS = {f"padded-{n}": (padded_layout(n), {"b": {"lr": 0.03, "weight_decay": 0.0}}) for n in SIZES}
LAYOUTS.update({k: (lay, {"v" if "v" in lay else "t": {"lr": 0.02, "weight_decay": 0.5}})
                for k, lay in MATRIX_LAYOUTS.items()})


def _setup(layout, dtype, opt, rng, scale=1.0):
    params = FlatBuffer(layout, random_flat(layout, dtype, rng))
    runs = {}
    for name in ("fast", "ref"):
        p = params.copy()
        runs[name] = (p, opt.init(p))
    return runs


def _compare(runs, layout, dtype, what):
    (pc, sc), (pr, sr) = runs["fast"], runs["ref"]
    assert_close(pc.flat, pr.flat, dtype, err_msg=f"params, {what}")
    assert_padding_zero(pc.flat, layout, "params")
    for slot in SLOTS:
        assert sc.slots[slot].layout == slot_layouts(layout)[slot]
        assert_close(sc.slots[slot].flat, sr.slots[slot].flat, dtype, err_msg=f"{slot}, {what}")
    assert sc.step == sr.step


@pytest.mark.parametrize("layout, overrides", LAYOUTS.values(), ids=list(LAYOUTS))
@dtypes
@pytest.mark.parametrize("cfg", [
    {},
    {"lr": 0.5, "beta2_decay": -0.5, "eps": (1e-6, 1e-2), "d": 2.0, "weight_decay": 0.1, "maximize": True},
], ids=["defaults", "options"])
def test_kernel_matches_reference(family, layout, overrides, dtype, cfg, rng):
    """STEPS steps of params and every slot; zero_grad alternates (float32); per-parameter lr/wd overrides."""
    opt = optim.Adafactor(**cfg, overrides=overrides)
    runs = _setup(layout, dtype, opt, rng)
    for t in range(STEPS):
        zero_grad = zero_grad_at(t, dtype, odd=True)
        g0 = random_flat(layout, dtype, rng, scale=[1.0, 30.0, 0.01][t % 3])
        for name, kernels in (("fast", family), ("ref", ref)):
            p, state = runs[name]
            g = FlatBuffer(layout, g0.copy())
            opt.update(kernels, p, g, state, gscale=0.7, zero_grad=zero_grad)
            if zero_grad:
                assert not np.any(g.flat)
            else:
                np.testing.assert_array_equal(g.flat, g0)
        _compare(runs, layout, dtype, f"step {t}")
    moved = np.abs(runs["fast"][0].flat - runs["ref"][0].flat)  # sanity: both moved the same way
    assert np.all(moved <= 1.0)


def test_working_copy_written_in_the_same_pass(family, rng):
    layout = MATRIX_LAYOUTS["thin"]
    opt = optim.Adafactor(lr=0.1)
    runs = _setup(layout, np.float32, opt, rng)
    work = {k: np.zeros(layout.size, np.uint16) for k in runs}
    for _ in range(3):
        g0 = random_flat(layout, np.float32, rng)
        for name, kernels in (("fast", family), ("ref", ref)):
            p, state = runs[name]
            opt.update(kernels, p, FlatBuffer(layout, g0.copy()), state, working=(work[name], family.LP_BF16))
    for name in runs:
        np.testing.assert_allclose(decoded(work[name]), runs[name][0].flat, rtol=5e-3, atol=1e-6)


@parallel_dtypes
@pytest.mark.parametrize("where", ["big", "v"])
def test_nan_propagates_as_in_the_reference(family, dtype, where, rng):
    """A NaN gradient element stays inside its parameter, with the reference's NaN pattern."""
    layout = MATRIX_LAYOUTS["matrices"]
    opt = optim.Adafactor()
    runs = _setup(layout, dtype, opt, rng)
    g0 = random_flat(layout, dtype, rng)
    g0[layout.slice(where).start + 600] = np.nan
    for name, kernels in (("fast", family), ("ref", ref)):
        p, state = runs[name]
        opt.update(kernels, p, FlatBuffer(layout, g0.copy()), state)
    (pc, sc), (pr, sr) = runs["fast"], runs["ref"]
    for a, b, what in [(pc.flat, pr.flat, "params")] + [(sc.slots[k].flat, sr.slots[k].flat, k) for k in SLOTS]:
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=what)
        ok = ~np.isnan(b)
        assert_close(a[ok], b[ok], dtype, err_msg=what)
    if where == "big":  # the row mean of row_var is NaN: every element of the matrix
        assert np.isnan(pc[where]).all()
    else:  # torch's max(1, NaN) = 1 keeps the clipping finite: only the element itself
        assert np.count_nonzero(np.isnan(pc[where])) == 1 and np.isnan(pc[where][600])
    for name in layout.names:
        if name != where:
            assert np.isfinite(pc[name]).all(), name


# -- torch.optim.Adafactor ---------------------------------------------------------------------

torch_cases = [
    ("defaults", {}),
    ("lr_wd", {"lr": 1e-1, "weight_decay": 0.5}),
    ("options", {"lr": 0.3, "beta2_decay": -0.5, "eps": (1e-6, 1e-2), "d": 2.0}),
    ("maximize", {"lr": 5e-2, "maximize": True, "weight_decay": 0.1}),
]
TORCH_SHAPES = {"w": (7, 5), "empty": (0,), "b": (5,), "scalar": (), "conv": (3, 2, 2, 2), "tail_empty": (2, 0),
                "wide": (3, 300)}


def _torch_state(tstate, slot, shape):
    x = tstate[slot].numpy()
    if slot == "row_var":
        return x.reshape(shape[:-1])
    if slot == "col_var":
        return x.reshape(shape[:-2] + shape[-1:])
    return x


@pytest.mark.parametrize("kwargs", [c[1] for c in torch_cases], ids=[c[0] for c in torch_cases])
@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
@pytest.mark.parametrize("use_overrides", [False, True], ids=["", "overrides"])
def test_matches_torch(kwargs, dtype_name, use_overrides):
    """50 steps of large gradients: params after every step, then every state slot."""
    torch = pytest.importorskip("torch")
    np_dtype, torch_dtype = getattr(np, dtype_name), getattr(torch, dtype_name)
    rng = np.random.default_rng(3)
    init = {k: np.asarray(rng.standard_normal(s), dtype=np_dtype) for k, s in TORCH_SHAPES.items()}
    over = {"conv": {"lr": 0.02, "weight_decay": 0.3}, "b": {"weight_decay": 0.0}} if use_overrides else None
    engine = Engine(init, optim.Adafactor(**kwargs, overrides=over))
    tparams = {k: torch.tensor(v.copy(), dtype=torch_dtype, requires_grad=True) for k, v in init.items()}
    live = [k for k in TORCH_SHAPES if tparams[k].numel()]  # torch divides by numel: no zero-size params
    if use_overrides:
        groups = [{"params": [tparams[k] for k in live if k not in over]}]
        groups += [{"params": [tparams[k]], **v} for k, v in over.items()]
    else:
        groups = [tparams[k] for k in live]
    topt = torch.optim.Adafactor(groups, foreach=False, **kwargs)
    for t in range(1, 51):
        scale = 1e3 * rng.uniform(0.1, 3.0)
        grads = {k: np.asarray(rng.standard_normal(s) * scale, dtype=np_dtype) for k, s in TORCH_SHAPES.items()}
        report = engine.step(grads)
        assert report.applied and report.step == t
        for k in live:
            tparams[k].grad = torch.from_numpy(grads[k].copy())
        topt.step()
        for k in live:
            assert_close(engine.params[k], tparams[k].detach().numpy(), np_dtype, err_msg=f"{k!r}, step {t}")
    for k in live:
        shape, tstate = TORCH_SHAPES[k], topt.state[tparams[k]]
        assert int(tstate["step"]) == engine.state.step
        for slot in SLOTS:
            if slot not in tstate:
                assert engine.state.slots[slot][k].size == 0
                continue
            desired = _torch_state(tstate, slot, shape)
            tl = tol(np_dtype)  # second moments ~1e6: a normwise absolute tolerance, as in test_optim_torch
            atol = tl["atol"] + tl["rtol"] * float(np.max(np.abs(desired)))
            np.testing.assert_allclose(engine.state.slots[slot][k], desired, rtol=tl["rtol"], atol=atol,
                                       err_msg=f"{slot}[{k!r}]")
    moved = max(float(np.max(np.abs(engine.params[k] - init[k]))) for k in live)
    assert moved > 1e-2


# -- convergence ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kernels", ["numba", "reference"])
@pytest.mark.parametrize("kwargs", [{"lr": 0.3}, {"lr": 0.3, "weight_decay": 0.1}], ids=["plain", "wd"])
def test_quadratic_loss_decreases(kernels, kwargs):
    rng = np.random.default_rng(7)
    shapes = {"w": (6, 4), "empty": (0,), "b": (4,), "scalar": (), "t": (2, 3, 4)}
    curv = {k: 1e3 * rng.uniform(0.5, 2.0, s) for k, s in shapes.items()}
    engine = Engine({k: 0.1 * rng.standard_normal(s) for k, s in shapes.items()}, optim.Adafactor(**kwargs),
                    kernels=kernels)

    def loss():
        return sum(0.5 * float(np.sum(curv[k] * engine.params[k] ** 2)) for k in shapes)

    start, history = loss(), []
    for _ in range(20):
        engine.step({k: curv[k] * engine.params[k] for k in shapes})
        history.append(loss())
    assert max(history) < start
    assert history[-1] < 0.1 * start, f"loss {start:.3g} -> {history[-1]:.3g}"


@pytest.mark.parametrize("kernels", ["numba", pytest.param("reference", marks=pytest.mark.slow)])
def test_rosenbrock_approaches_minimum(kernels):
    """Adafactor's step is relative (RMS(p) * min(lr, 1/sqrt(t))) and its second moment keeps
    the early, large gradients (beta2 -> 1): along the curved valley it closes in on the
    minimum at a sublinear rate (loss ~1/t here), so the bound is 0.05 after 12000 steps."""
    from conftest import rosenbrock, rosenbrock_grad

    engine = Engine({"xy": np.array([-1.2, 1.0])}, optim.Adafactor(lr=0.1), kernels=kernels)
    start = rosenbrock(engine.params["xy"])
    for _ in range(12000):
        engine.step({"xy": rosenbrock_grad(engine.params["xy"])})
    np.testing.assert_allclose(engine.params["xy"], [1.0, 1.0], atol=5e-2)
    assert rosenbrock(engine.params["xy"]) < 1e-3 * start


def test_slot_layouts_follow_torch():
    lay = Layout({"m": (4, 5), "t": (2, 3, 4), "v": (7,), "s": (), "e": (2, 0)})
    got = {k: dict(zip(l.names, l.shapes)) for k, l in slot_layouts(lay).items()}
    assert got["row_var"] == {"m": (4,), "t": (2, 3), "v": (0,), "s": (0,), "e": (2,)}
    assert got["col_var"] == {"m": (5,), "t": (2, 4), "v": (0,), "s": (0,), "e": (0,)}
    assert got["variance"] == {"m": (0,), "t": (0,), "v": (7,), "s": (), "e": (0,)}


def test_hyperparameters_and_validation():
    from arraytrain import HyperparameterError

    opt = optim.Adafactor(lr=0.1, eps=(1e-30, 1e-3))
    assert opt.hyperparameters()["eps"] == (1e-30, 1e-3)
    for kwargs, name in [({"lr": -1.0}, "lr"), ({"beta2_decay": 0.1}, "beta2_decay"), ({"eps": (-1.0, 1e-3)}, "eps[0]"),
                         ({"eps": (None, -1.0)}, "eps[1]"), ({"eps": 1e-3}, "eps"), ({"d": 0.5}, "d"),
                         ({"weight_decay": -1.0}, "weight_decay"), ({"maximize": 1}, "maximize")]:
        with pytest.raises(HyperparameterError, match=name.replace("[", r"\[").replace("]", r"\]")):
            optim.Adafactor(**kwargs)
