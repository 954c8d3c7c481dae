"""Muon: the kernels against their float64 reference, the routing, hyperparameters and state.

* kernels: ``muon_step`` (the fast families: numba, and CUDA where a GPU is usable, through
  the ``family`` fixture) against the reference on params and the momentum buffer
  over STEPS steps, on matrices of every size in SIZES (0, 1, 7, 1037, 278011 elements, wide
  and tall) with zero-size matrices first, middle and last and a 1-D parameter the step must
  not touch; per-parameter lr and decay, zero_grad alternating, Nesterov or not, a working
  copy, a mask, bfloat16 momentum; NaN/Inf propagate as in the reference.
* routing: which parameters Muon takes and which go to the fallback; the fallback inside
  Muon equals that optimizer alone on its parameters; overrides, schedules, state dtypes.

test_muon_torch.py compares the optimizer with torch.optim.Muon.
"""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest

import arraytrain as at
from arraytrain import Layout, optim
from arraytrain.errors import HyperparameterError
from arraytrain.kernels import reference as ref
from arraytrain.optim._muon import routing
from conftest import (LP_TOL, SIZES, assert_close, assert_padding_zero, decoded, dtypes, live_mask, random_flat,
                      zero_grad_at)

STEPS = 6


def _shape(n: int, tall: bool) -> tuple[int, int]:
    """``n`` elements as a matrix as square as its divisors allow (278011 = 173 x 1607)."""
    if n == 0:
        return (5, 0) if tall else (0, 5)
    r = max(int(math.isqrt(n)), 1)
    while n % r:
        r -= 1
    return (n // r, r) if tall else (r, n // r)


def _layout(n: int, tall: bool) -> Layout:
    # "small2" and "flat" share the shapes of "small" and "conv" (as a matrix): the CUDA family
    # iterates each such pair as one stack
    return Layout({"empty0": (0, 3), "m": _shape(n, tall), "bias": (6,), "empty1": (0,), "small": (5, 3),
                   "empty2": (4, 0), "conv": (2, 3, 2), "small2": (5, 3), "flat": (2, 6)})


def _run(kernels, p, g, buf, layout, work, t, alr, dec, nesterov, zg, w=None, wkind=0, mask=None):
    route = routing(layout)
    kernels.muon_step(p, g, buf, work, route.mats, route.pieces, gscale=0.7, momentum=0.9, nesterov=nesterov,
                      adjusted_lr=alr, decay=dec, eps_norm=1e-7, ns_coefficients=optim._muon.NS_COEFFICIENTS,
                      ns_steps=5, working=w, kind=wkind, zero_grad=zg, mask=mask)


def _muon_live(layout):
    keep = np.zeros(layout.size, bool)
    for name, shape in zip(layout.names, layout.shapes):
        if len(shape) >= 2:
            keep[layout.slice(name)] = True
    return keep


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("tall", [False, True], ids=["wide", "tall"])
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@dtypes
def test_kernel_matches_reference(family, n, tall, nesterov, dtype, rng):
    layout = _layout(n, tall)
    route = routing(layout)
    p0 = random_flat(layout, dtype, rng)
    state = {k: {"p": p0.copy(), "buf": np.zeros(layout.size, dtype)} for k in ("fast", "ref")}
    work = np.empty(route.work, dtype)
    alr, dec = 1e-2 * rng.uniform(0.5, 1.5, len(layout)), 1.0 - 1e-3 * rng.uniform(0.5, 1.5, len(layout))
    muon = _muon_live(layout)
    for t in range(1, STEPS + 1):
        zg = zero_grad_at(t, dtype)
        g0 = random_flat(layout, dtype, rng, scale=[1.0, 5.0, 0.1][t % 3])
        for k, kernels in (("fast", family), ("ref", ref)):
            g = g0.copy()
            _run(kernels, state[k]["p"], g, state[k]["buf"], layout, work, t, alr, dec, nesterov, zg)
            np.testing.assert_array_equal(g[~muon], g0[~muon])  # only Muon's elements are zeroed
            assert not np.any(g[muon]) if zg else np.array_equal(g, g0)
        for what in ("p", "buf"):
            assert_close(state["fast"][what], state["ref"][what], err_msg=f"{what}, step {t}")
            assert_padding_zero(state["fast"][what], layout, what)
        np.testing.assert_array_equal(state["fast"]["p"][~muon], p0[~muon])  # the 1-D parameter is not Muon's
    if n > 1:
        assert np.abs(state["fast"]["p"] - p0).max() > 1e-3


@pytest.mark.parametrize("n", [7, 1037, 278011])
@pytest.mark.parametrize("working", ["bf16", "f16"])
def test_working_copy_and_mask(family, n, working, rng):
    """float32 weights, a working copy written by the apply kernel and a mask: pruned weights exactly 0."""
    layout = _layout(n, False)
    route = routing(layout)
    wdtype, wkind = ((np.dtype(ml_dtypes.bfloat16), family.LP_BF16) if working == "bf16"
                     else (np.dtype(np.float16), family.LP_F16))
    mask = (rng.uniform(size=layout.size) > 0.3).astype(np.uint8)
    p0 = random_flat(layout, np.float32, rng)
    state = {k: {"p": p0.copy(), "buf": np.zeros(layout.size, np.float32),
                 "w": np.zeros(layout.size, np.uint16)} for k in ("fast", "ref")}
    work = np.empty(route.work, np.float32)
    alr, dec = np.full(len(layout), 1e-2), np.full(len(layout), 0.999)
    muon = _muon_live(layout)
    for t in range(1, 4):
        g0 = random_flat(layout, np.float32, rng)
        for k, kernels in (("fast", family), ("ref", ref)):
            s = state[k]
            _run(kernels, s["p"], g0.copy(), s["buf"], layout, work, t, alr, dec, True, False, s["w"], wkind, mask)
        assert_close(state["fast"]["p"], state["ref"]["p"], err_msg=f"p, step {t}")
        assert_close(state["fast"]["buf"], state["ref"]["buf"], err_msg=f"buf, step {t}")
        pruned = muon & (mask == 0)
        assert not np.any(state["fast"]["p"][pruned])
        live = live_mask(layout) & muon
        expected = state["fast"]["p"][live].astype(wdtype).view(np.uint16)
        np.testing.assert_array_equal(state["fast"]["w"][live], expected)
        assert not np.any(state["fast"]["w"][~muon])  # the 1-D parameter's copy is the fallback's to write


@pytest.mark.parametrize("n", [7, 1037, 278011])
def test_bfloat16_momentum_matches_reference(family, n, rng):
    """The momentum buffer as bfloat16 bits: each step from the same state, within one bfloat16 rounding."""
    layout = _layout(n, True)
    route = routing(layout)
    p0 = random_flat(layout, np.float32, rng)
    state = {k: {"p": p0.copy(), "buf": np.zeros(layout.size, np.uint16)} for k in ("fast", "ref")}
    work = np.empty(route.work, np.float32)
    alr, dec = np.full(len(layout), 1e-2), np.full(len(layout), 0.999)
    for t in range(1, 5):
        state["ref"]["p"][...] = state["fast"]["p"]
        state["ref"]["buf"][...] = state["fast"]["buf"]
        g0 = random_flat(layout, np.float32, rng)
        for k, kernels in (("fast", family), ("ref", ref)):
            _run(kernels, state[k]["p"], g0.copy(), state[k]["buf"], layout, work, t, alr, dec, True, False)
        np.testing.assert_allclose(state["fast"]["p"], state["ref"]["p"], **LP_TOL)
        a, d = (decoded(state[k]["buf"]) for k in ("fast", "ref"))
        np.testing.assert_allclose(a, d, rtol=2**-7, atol=1e-6, err_msg=f"momentum, step {t}")


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
@dtypes
def test_nonfinite_propagates_as_in_the_reference(family, bad, dtype, rng):
    """A non-finite gradient element spreads over its matrix (the GEMMs), as in the reference; others stay finite."""
    layout = _layout(1037, False)
    route = routing(layout)
    g0 = random_flat(layout, dtype, rng)
    g0[layout.slice("m")][5] = bad
    out = {}
    for k, kernels in (("fast", family), ("ref", ref)):
        p, buf = random_flat(layout, dtype, np.random.default_rng(1)), np.zeros(layout.size, dtype)
        with np.errstate(invalid="ignore", over="ignore"):
            _run(kernels, p, g0.copy(), buf, layout, np.empty(route.work, dtype), 1, np.full(len(layout), 1e-2),
                 np.full(len(layout), 1.0), True, False)
        out[k] = p
    np.testing.assert_array_equal(np.isnan(out["fast"]), np.isnan(out["ref"]))
    assert np.isnan(out["fast"][layout.slice("m")]).all()
    fin = np.isfinite(out["ref"])
    assert_close(out["fast"][fin], out["ref"][fin], dtype)
    assert np.isfinite(out["fast"][layout.slice("small")]).all()


# -- routing, hyperparameters, state -----------------------------------------------------------------------------

def test_routing_by_shape_and_pattern():
    layout = Layout({"embed": (10, 4), "h.weight": (4, 4), "h.bias": (4,), "conv": (2, 3, 3), "gain": (), "head": (4, 3)})
    route = routing(layout, ("embed", "head*"))
    assert route.muon.tolist() == [False, True, False, True, False, False]
    assert route.mats[:, 0].tolist() == [1, 3] and route.mats[:, 2:4].tolist() == [[4, 4], [2, 9]]
    assert {int(s) for s in route.fallback_pieces[:, 2]} == {0, 2, 4, 5}  # the gain (0-D) has one element
    with pytest.raises(HyperparameterError, match=re.escape("fallback_for: 'emb' matches no parameter")):
        routing(layout, ("emb",))


def test_non_matrices_need_a_fallback():
    params = {"w": np.ones((3, 4), np.float32), "b": np.ones(4, np.float32), "none": np.ones(0, np.float32)}
    with pytest.raises(HyperparameterError, match=re.escape("['b'] have fewer: pass fallback=AdamW")):
        at.Engine(params, optim.Muon())
    at.Engine({"w": params["w"], "none": params["none"]}, optim.Muon())  # an empty 1-D parameter is nothing to do


@pytest.mark.parametrize("make, match", [
    (lambda: optim.Muon(fallback=optim.Adafactor()), "fallback: expected an optimizer with element-wise state"),
    (lambda: optim.Muon(fallback=optim.Muon()), "fallback: expected an optimizer with element-wise state"),
    (lambda: optim.Muon(fallback=optim.SAM(optim.AdamW())), "fallback"),
    (lambda: optim.Muon(fallback=optim.ScheduleFreeAdamW()), "fallback"),
    (lambda: optim.Muon(fallback=optim.AdamW(maximize=True)), "build it with maximize=False"),
    (lambda: optim.Muon(fallback={"type": "Nope", "hyperparameters": {}}), "fallback"),
    (lambda: optim.Muon(fallback_for=("embed",)), "fallback_for"),
    (lambda: optim.Muon(fallback=optim.AdamW(), fallback_for=("",)), "fallback_for"),
    (lambda: optim.Muon(momentum=1.0), "momentum"),
    (lambda: optim.Muon(ns_steps=100), "ns_steps"),
    (lambda: optim.Muon(ns_coefficients=(1.0, 2.0)), "ns_coefficients"),
    (lambda: optim.Muon(eps=0.0), "eps"),
    (lambda: optim.Muon(adjust_lr_fn="other"), "adjust_lr_fn"),
    (lambda: optim.Muon(lr=-1.0), "lr"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_hyperparameters(make, match):
    with pytest.raises(HyperparameterError, match=re.escape(match)):
        make()


def test_hyperparameters_rebuild_with_a_fallback():
    opt = optim.Muon(lr=0.02, fallback=optim.Lion(lr=1e-4, betas=(0.9, 0.95)), fallback_for=["embed"],
                     overrides={"*.weight": {"lr": 0.01}})
    hp = opt.hyperparameters()
    assert hp["fallback"] == {"type": "Lion", "hyperparameters": optim.Lion(lr=1e-4, betas=(0.9, 0.95)).hyperparameters()}
    assert hp["fallback_for"] == ("embed",)
    again = optim.Muon(**hp)
    assert type(again.fallback) is optim.Lion and again.hyperparameters() == hp
    assert opt.slot_names == ("momentum_buffer", "fallback.exp_avg")


def test_overrides_reach_both_optimizers_and_a_schedule_scales_both():
    """Muon's overrides apply to whatever parameter they match (winning over the fallback's); a
    schedule's factor applies to Muon's and the fallback's rates alike."""
    params = {"h.weight": np.ones((4, 4)), "h.bias": np.ones(4), "o.bias": np.ones(3)}
    opt = optim.Muon(lr=0.02, fallback=optim.AdamW(lr=1e-3, overrides={"*.bias": {"weight_decay": 0.0}}),
                     overrides={"o.*": {"lr": 0.5}})
    engine = at.Engine(params, opt)
    assert opt.per_param(engine.state, "lr").tolist() == [0.02, 1e-3, 0.5]
    assert opt.per_param(engine.state, "weight_decay").tolist() == [0.1, 0.0, 0.0]
    sched = at.Engine(params, optim.Muon(lr=0.02, fallback=optim.AdamW(lr=1e-3)),
                      schedule=at.schedules.LinearLR(4, start_factor=0.5))
    lrs = sched.schedule(0, sched.optimizer.per_param(sched.state, "lr"))
    np.testing.assert_allclose(lrs, [0.01, 5e-4, 5e-4])


def test_fallback_state_dtype_follows_muon():
    params = {"w": np.ones((4, 3), np.float32), "b": np.ones(3, np.float32)}
    engine = at.Engine(params, optim.Muon(fallback=optim.AdamW(), state_dtype="bfloat16"))
    assert {k: str(b.dtype) for k, b in engine.state.slots.items()} == {
        "momentum_buffer": "bfloat16", "fallback.exp_avg": "bfloat16", "fallback.exp_avg_sq": "bfloat16"}
    own = at.Engine(params, optim.Muon(fallback=optim.AdamW(state_dtype="float32"), state_dtype="bfloat16"))
    assert own.state.slots["fallback.exp_avg"].dtype == np.float32
    with pytest.raises(HyperparameterError, match="state_dtype"):
        at.Engine({k: v.astype(np.float64) for k, v in params.items()}, optim.Muon(fallback=optim.AdamW(),
                                                                                  state_dtype="bfloat16"))


@pytest.mark.parametrize("fallback", [optim.SGD(lr=1e-2, momentum=0.9),
                                      pytest.param(optim.Adagrad(lr=1e-2), marks=pytest.mark.slow),
                                      pytest.param(optim.LAMB(lr=1e-2), marks=pytest.mark.slow),
                                      pytest.param(optim.RMSprop(lr=1e-3, centered=True), marks=pytest.mark.slow),
                                      optim.NAdam(lr=1e-2)],
                         ids=["sgd", "adagrad", "lamb", "rmsprop", "nadam"])
def test_any_elementwise_fallback_equals_running_it_alone(fallback):
    """The fallback on its parameters inside Muon == the same optimizer on those parameters alone."""
    rng = np.random.default_rng(4)
    shapes = {"w": (5, 4), "b": (4,), "v": (3, 2), "c": (7,)}
    p0 = {k: rng.standard_normal(s) for k, s in shapes.items()}
    both = at.Engine(p0, optim.Muon(lr=0.02, fallback=fallback, fallback_for=("v",)))
    alone = at.Engine({k: p0[k] for k in ("b", "v", "c")}, type(fallback)(**fallback.hyperparameters()))
    for _ in range(5):
        g = {k: rng.standard_normal(s) for k, s in shapes.items()}
        both.step(g)
        alone.step({k: g[k] for k in ("b", "v", "c")})
    for k in ("b", "v", "c"):
        np.testing.assert_array_equal(both.params[k], alone.params[k])
        for slot in alone.state.slots:
            np.testing.assert_array_equal(both.state.slots["fallback." + slot][k], alone.state.slots[slot][k])
    # a scalar state (NAdam's mu_product) is the fallback's, advanced with it, in checkpoints
    assert both.state.scalars == {"fallback." + k: v for k, v in alone.state.scalars.items()}


@pytest.mark.parametrize("tall", [False, True], ids=["wide", "tall"])
def test_newton_schulz_on_a_stack_equals_each_matrix_alone(tall, rng):
    """The CUDA family iterates same-shape matrices as one stack (batched GEMMs); stacked or one
    at a time, each matrix gets the same iterate (NumPy's stacked matmul: to rounding)."""
    from arraytrain.kernels import newton_schulz as ns

    rows, cols = (9, 4) if tall else (4, 9)
    x = rng.standard_normal((3, rows, cols)).astype(np.float32)
    x /= np.linalg.norm(x, axis=(1, 2), keepdims=True)
    work = np.empty(3 * ns.work_size(rows, cols), np.float32)
    stacked = ns.iterate(x.copy(), work, optim._muon.NS_COEFFICIENTS, 5).copy()
    for j in range(3):
        one = np.empty(ns.work_size(rows, cols), np.float32)
        alone = ns.iterate(x[j].copy(), one, optim._muon.NS_COEFFICIENTS, 5)
        np.testing.assert_allclose(stacked[j], alone, rtol=1e-5, atol=1e-6)


def test_cuda_stacks_group_same_shapes_and_are_cut_at_the_limit(monkeypatch):
    """Which matrices the CUDA family iterates together (pure table work: runs without a GPU)."""
    from arraytrain.kernels.cuda import optimizers as cuda_opt

    layout = _layout(1037, tall=False)
    route = routing(layout)
    sizes = route.pieces[:, 1] - route.pieces[:, 0]
    first = np.concatenate([[0], np.cumsum(-(-sizes // cuda_opt.CHUNK))])
    offsets = {layout.offsets[layout.names.index(k)]: k for k in layout.names}
    grouped = [(shape, [offsets[off] for off, _, _ in batch]) for shape, batch in cuda_opt._muon_batches(route.mats, first)]
    assert grouped == [(_shape(1037, False), ["m"]), ((5, 3), ["small", "small2"]), ((2, 6), ["conv", "flat"])]
    for shape, batch in cuda_opt._muon_batches(route.mats, first):  # each matrix's own chunk range
        for off, c0, c1 in batch:
            assert c1 > c0
    monkeypatch.setattr(cuda_opt, "MUON_BATCH_ELEMENTS", 24)  # one 5x3 matrix, two 2x6 ones
    cut = [[offsets[off] for off, _, _ in batch] for _, batch in cuda_opt._muon_batches(route.mats, first)]
    assert cut == [["m"], ["small"], ["small2"], ["conv", "flat"]]
