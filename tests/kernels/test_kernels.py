"""The fast kernel families against their NumPy reference twins: numba, and CUDA where a GPU is
usable (the ``family`` fixture of conftest.py), with the same cases and tolerances.

Every kernel runs on the padded flat buffer of a layout with zero-size
parameters first, middle and last, at every size in SIZES and for float32 and
float64. Writing kernels must leave the padding zero; reductions must not read it.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest

from arraytrain import Engine, Layout, optim
from arraytrain.kernels import cpu
from arraytrain.kernels import reference as ref
from arraytrain.ops import clip_coef, norm_pass
from conftest import (
    SIZES,
    assert_close,
    assert_padding_zero,
    dtypes,
    live_indices,
    live_mask,
    padded_layout,
    parallel_dtypes,
    random_flat,
    sizes,
    zero_grad_at,
)

NONFINITE = (np.nan, np.inf, -np.inf)
# the reference's first pass overflows on purpose in the huge-gradient tests
overflow_expected = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
POSITIONS = ("first", "middle", "last")
STEPS = 8


def _position(layout, where):
    live = live_indices(layout)
    return int(live[{"first": 0, "middle": len(live) // 2, "last": -1}[where]])


def _segment_of(layout, index):
    for seg, name in enumerate(layout.names):
        s = layout.slice(name)
        if s.start <= index < s.stop:
            return seg
    raise AssertionError(f"{index} is padding")


# -- accumulate / scale --------------------------------------------------------------------


@sizes
@dtypes
@pytest.mark.parametrize("overwrite", [True, False])
@pytest.mark.parametrize("w", [1.0, 0.37, -2.5])
def test_accumulate_matches_reference(family, n, dtype, overwrite, w, rng):
    layout = padded_layout(n)
    acc0, g = random_flat(layout, dtype, rng), random_flat(layout, dtype, rng)
    fast, slow = acc0.copy(), acc0.copy()
    g_before = g.copy()
    family.accumulate(fast, g, w=w, overwrite=overwrite)
    ref.accumulate(slow, g, w=w, overwrite=overwrite)
    assert fast.dtype == np.dtype(dtype)
    assert_close(fast, slow)
    expected = w * g.astype(np.float64) + (0.0 if overwrite else acc0.astype(np.float64))
    assert_close(fast, expected, dtype)
    np.testing.assert_array_equal(g, g_before)  # the input is read-only for the kernel
    assert_padding_zero(fast, layout)


@sizes
@dtypes
@pytest.mark.parametrize("s", [0.0, 0.5, -3.0, 1e-3])
def test_scale_matches_reference(family, n, dtype, s, rng):
    layout = padded_layout(n)
    x0 = random_flat(layout, dtype, rng)
    fast, slow = x0.copy(), x0.copy()
    family.scale(fast, factor=s)
    ref.scale(slow, factor=s)
    assert_close(fast, slow)
    assert_close(fast, x0.astype(np.float64) * s, dtype)
    assert_padding_zero(fast, layout)


# -- reductions -----------------------------------------------------------------------------


@sizes
@dtypes
def test_all_finite_true_on_finite_data(family, n, dtype, rng):
    layout = padded_layout(n)
    x = random_flat(layout, dtype, rng, scale=1e3)
    x[live_indices(layout)[-1]] = np.finfo(dtype).max  # the largest finite value is finite
    assert family.all_finite(x) is True
    assert ref.all_finite(x) is True


@dtypes
def test_all_finite_empty_buffer(family, dtype):
    assert family.all_finite(np.zeros(0, dtype)) is True
    assert ref.all_finite(np.zeros(0, dtype)) is True


@sizes
@dtypes
@pytest.mark.parametrize("bad", NONFINITE, ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("where", POSITIONS)
def test_all_finite_detects_nonfinite(family, n, dtype, bad, where, rng):
    layout = padded_layout(n)
    x = random_flat(layout, dtype, rng)
    x[_position(layout, where)] = bad
    assert family.all_finite(x) is False
    assert ref.all_finite(x) is False


@sizes
@dtypes
def test_sumsq_matches_reference(family, n, dtype, rng):
    layout = padded_layout(n)
    x = random_flat(layout, dtype, rng, scale=3.0)
    total, per_seg = family.sumsq(x, layout.pieces, nseg=len(layout))
    rtotal, rper_seg = ref.sumsq(x, layout.pieces, nseg=len(layout))
    assert isinstance(total, float)
    assert per_seg.dtype == np.float64 and per_seg.shape == (len(layout),)
    # float64 accumulation in both: compare at the float64 tolerance for either storage dtype
    assert_close(total, rtotal, np.float64)
    assert_close(per_seg, rper_seg, np.float64)
    assert_close(total, float(np.sum(x.astype(np.float64) ** 2)), np.float64)
    for seg, name in enumerate(layout.names):  # zero-size parameters have a zero norm
        if layout.sizes[seg] == 0:
            assert per_seg[seg] == 0.0 and rper_seg[seg] == 0.0
    assert_close(math.fsum(per_seg), total, np.float64)


@sizes
@dtypes
@pytest.mark.parametrize("kernels", [cpu, ref], ids=["numba", "reference"])
def test_reductions_do_not_read_padding(n, dtype, kernels, rng):
    layout = padded_layout(n)
    clean = random_flat(layout, dtype, rng)
    dirty = clean.copy()
    dirty[~live_mask(layout)] = np.nan
    dirty_before = dirty.copy()
    t_clean, s_clean = kernels.sumsq(clean, layout.pieces, nseg=len(layout))
    t_dirty, s_dirty = kernels.sumsq(dirty, layout.pieces, nseg=len(layout))
    assert t_clean == t_dirty
    np.testing.assert_array_equal(s_clean, s_dirty)
    assert kernels.max_abs(dirty, layout.pieces) == kernels.max_abs(clean, layout.pieces)
    assert kernels.sumsq_scaled(dirty, layout.pieces, nseg=len(layout), inv=0.5)[0] == \
        kernels.sumsq_scaled(clean, layout.pieces, nseg=len(layout), inv=0.5)[0]
    np.testing.assert_array_equal(dirty, dirty_before)  # read-only


@sizes
@dtypes
@pytest.mark.parametrize("bad", NONFINITE, ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("where", POSITIONS)
def test_sumsq_nonfinite_total(family, n, dtype, bad, where, rng):
    layout = padded_layout(n)
    x = random_flat(layout, dtype, rng)
    i = _position(layout, where)
    x[i] = bad
    seg = _segment_of(layout, i)
    for name, kernels in (("fast", family), ("reference", ref)):
        total, per_seg = kernels.sumsq(x, layout.pieces, nseg=len(layout))
        assert not math.isfinite(total), name
        assert not np.isfinite(per_seg[seg]), name
        others = np.delete(per_seg, seg)
        assert np.isfinite(others).all(), name


@sizes
@dtypes
def test_max_abs_matches_reference(family, n, dtype, rng):
    layout = padded_layout(n)
    x = random_flat(layout, dtype, rng, scale=7.0)
    i = _position(layout, "middle")
    x[i] = -1e4  # the peak is negative: the absolute value must be taken
    fast, slow = family.max_abs(x, layout.pieces), ref.max_abs(x, layout.pieces)
    assert fast == slow == 1e4


def test_reductions_without_elements(family):
    layout = Layout({"e0": (0,), "e1": (0, 4)})
    assert layout.pieces.shape == (0, 3)
    x = np.zeros(layout.size)
    assert family.max_abs(x, layout.pieces) == ref.max_abs(x, layout.pieces) == 0.0
    for kernels in (family, ref):
        total, per_seg = kernels.sumsq(x, layout.pieces, nseg=2)
        assert total == 0.0 and per_seg.tolist() == [0.0, 0.0]


@sizes
@dtypes
@pytest.mark.parametrize("bad", [np.inf, -np.inf], ids=["+inf", "-inf"])
@pytest.mark.parametrize("where", POSITIONS)
def test_max_abs_with_inf(family, n, dtype, bad, where, rng):
    layout = padded_layout(n)
    x = random_flat(layout, dtype, rng)
    x[_position(layout, where)] = bad
    assert family.max_abs(x, layout.pieces) == math.inf
    assert ref.max_abs(x, layout.pieces) == math.inf


@sizes
@dtypes
@pytest.mark.parametrize("inv", [1.0, 1e-3, 37.5])
def test_sumsq_scaled_matches_reference(family, n, dtype, inv, rng):
    layout = padded_layout(n)
    x = random_flat(layout, dtype, rng)
    total, per_seg = family.sumsq_scaled(x, layout.pieces, nseg=len(layout), inv=inv)
    rtotal, rper_seg = ref.sumsq_scaled(x, layout.pieces, nseg=len(layout), inv=inv)
    assert_close(total, rtotal, np.float64)
    assert_close(per_seg, rper_seg, np.float64)
    assert_close(total, ref.sumsq(x, layout.pieces, nseg=len(layout))[0] * inv * inv, np.float64)


# -- optimizer kernels ------------------------------------------------------------------------

SGD_CONFIGS = [
    {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
    {"momentum": 0.0, "dampening": 0.0, "weight_decay": 0.1, "nesterov": False},
    {"momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
    {"momentum": 0.9, "dampening": 0.5, "weight_decay": 0.1, "nesterov": False},
    {"momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": True},
    {"momentum": 0.7, "dampening": 0.0, "weight_decay": 0.1, "nesterov": True},
]


def _per_seg(layout, value):
    """A per-segment hyperparameter array that differs between parameters."""
    return value * (1.0 + 0.25 * np.arange(len(layout)))


def _sgd_id(cfg):
    return "mom{momentum}-damp{dampening}-wd{weight_decay}-nest{nesterov:d}".format(**cfg)


def _check_grad_after_step(g_after, g_before, zero_grad, layout):
    if zero_grad:
        assert not np.any(g_after), "zero_grad: the gradient buffer was not zeroed"
    else:
        np.testing.assert_array_equal(g_after, g_before)
    assert_padding_zero(g_after, layout, "grad")


@sizes
@dtypes
@pytest.mark.parametrize("cfg", SGD_CONFIGS, ids=_sgd_id)
def test_sgd_step_matches_reference(family, n, dtype, cfg, rng):
    """STEPS consecutive steps; zero_grad alternates off/on from step to step (float32; see zero_grad_at)."""
    layout = padded_layout(n)
    lr, gscale = 0.05, 0.8
    has_buf = cfg["momentum"] != 0
    p = {k: random_flat(layout, dtype, rng) for k in ("fast", "ref")}
    p["ref"][...] = p["fast"]
    buf = {k: (np.zeros(layout.size, dtype) if has_buf else p[k][:0]) for k in ("fast", "ref")}
    for t in range(STEPS):
        zero_grad = zero_grad_at(t, dtype, odd=True)
        g0 = random_flat(layout, dtype, rng)
        for k, kernels in (("fast", family), ("ref", ref)):
            g = g0.copy()
            kernels.sgd_step(p[k], g, buf[k], layout.pieces, gscale=gscale, lr=_per_seg(layout, lr),
                             l2=_per_seg(layout, cfg["weight_decay"]), momentum=cfg["momentum"],
                             dampening=cfg["dampening"], nesterov=cfg["nesterov"], first=t == 0, zero_grad=zero_grad)
            _check_grad_after_step(g, g0, zero_grad, layout)
        assert_close(p["fast"], p["ref"], err_msg=f"params, step {t}")
        assert_padding_zero(p["fast"], layout, "params")
        if has_buf:
            assert_close(buf["fast"], buf["ref"], err_msg=f"momentum buffer, step {t}")
            assert_padding_zero(buf["fast"], layout, "momentum buffer")
        else:
            assert buf["fast"].size == 0


@pytest.mark.parametrize("kernels", [cpu, ref], ids=["numba", "reference"])
@pytest.mark.parametrize("n", [7, 278011])
@dtypes
def test_sgd_first_step_semantics(kernels, n, dtype, rng):
    """First step: buf = d (not (1-dampening)*d), whatever buf held; then the EMA."""
    layout = padded_layout(n)
    lr, wd, mom, damp, gscale = 0.1, 0.2, 0.9, 0.5, 0.5
    p = random_flat(layout, dtype, rng)
    buf = random_flat(layout, dtype, rng, scale=1e3)  # stale contents must be ignored
    buf[~live_mask(layout)] = 0
    g1 = random_flat(layout, dtype, rng)
    p0 = p.astype(np.float64)
    d1 = gscale * g1.astype(np.float64) + wd * p0
    one = np.ones(len(layout))
    kernels.sgd_step(p, g1.copy(), buf, layout.pieces, gscale=gscale, lr=lr * one, l2=wd * one, momentum=mom,
                     dampening=damp, nesterov=False, first=True)
    assert_close(buf, d1, dtype, err_msg="first step: buf must equal d")
    assert_close(p, p0 - lr * d1, dtype)
    # second step: b = momentum*b + (1 - dampening)*d
    g2 = random_flat(layout, dtype, rng)
    p1, b1 = p.astype(np.float64), buf.astype(np.float64)
    d2 = gscale * g2.astype(np.float64) + wd * p1
    b2 = mom * b1 + (1 - damp) * d2
    kernels.sgd_step(p, g2.copy(), buf, layout.pieces, gscale=gscale, lr=lr * one, l2=wd * one, momentum=mom,
                     dampening=damp, nesterov=False, first=False)
    assert_close(buf, b2, dtype)
    assert_close(p, p1 - lr * b2, dtype)


@pytest.mark.parametrize("kernels", [cpu, ref], ids=["numba", "reference"])
def test_sgd_nesterov_formula(kernels, rng):
    layout = padded_layout(1037)
    p = random_flat(layout, np.float64, rng)
    g = random_flat(layout, np.float64, rng)
    buf = np.zeros(layout.size)
    p0 = p.copy()
    one = np.ones(len(layout))
    kernels.sgd_step(p, g, buf, layout.pieces, gscale=1.0, lr=0.1 * one, l2=0.0 * one, momentum=0.9, dampening=0.0,
                     nesterov=True, first=True)
    # first step: b = g, update d = g + 0.9 * b = 1.9 g
    assert_close(p, p0 - 0.1 * 1.9 * g)


def _adam_scalars(t, lr, betas, wd, decoupled, layout):
    """Host-side Adam scalars; lr and wd differ per parameter (as name-pattern overrides make them)."""
    b1, b2 = betas
    lr, wd = _per_seg(layout, lr), _per_seg(layout, wd)
    l2, decay = (0.0 * wd, 1.0 - lr * wd) if decoupled else (wd, 1.0 + 0.0 * wd)
    return dict(step_size=lr / (1 - b1**t), beta1=b1, beta2=b2, inv_bc2_sqrt=1 / math.sqrt(1 - b2**t), l2=l2,
                decay=decay)


@sizes
@dtypes
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("decoupled", [False, True], ids=["l2", "decoupled"])
def test_adam_step_matches_reference(family, n, dtype, amsgrad, decoupled, rng):
    """STEPS consecutive steps of params and every slot; zero_grad alternates off/on (float32; see zero_grad_at)."""
    layout = padded_layout(n)
    lr, betas, eps, wd, gscale = 1e-2, (0.9, 0.99), 1e-8, 0.1, 0.7
    p0 = random_flat(layout, dtype, rng)
    states = {}
    for k in ("fast", "ref"):
        z = lambda: np.zeros(layout.size, dtype)  # noqa: E731
        states[k] = {"p": p0.copy(), "m": z(), "v": z(), "vmax": z() if amsgrad else None}
        states[k]["vmax_arg"] = states[k]["vmax"] if amsgrad else states[k]["p"][:0]
    for t in range(1, STEPS + 1):
        zero_grad = zero_grad_at(t, dtype)
        # the gradient scale varies so that AMSGrad's running max matters
        g0 = random_flat(layout, dtype, rng, scale=[1.0, 5.0, 0.1][t % 3])
        sc = _adam_scalars(t, lr, betas, wd, decoupled, layout)
        for k, kernels in (("fast", family), ("ref", ref)):
            s, g = states[k], g0.copy()
            kernels.adam_step(s["p"], g, s["m"], s["v"], s["vmax_arg"], layout.pieces, gscale=gscale, eps=eps,
                              amsgrad=amsgrad, zero_grad=zero_grad, **sc)
            _check_grad_after_step(g, g0, zero_grad, layout)
        slots = ("p", "m", "v", "vmax") if amsgrad else ("p", "m", "v")
        for slot in slots:
            assert_close(states["fast"][slot], states["ref"][slot], err_msg=f"{slot}, step {t}")
            assert_padding_zero(states["fast"][slot], layout, slot)
        if amsgrad:
            assert np.all(states["fast"]["vmax"] >= states["fast"]["v"])


@pytest.mark.parametrize("kernels", [cpu, ref], ids=["numba", "reference"])
def test_adam_first_step_formula(kernels, rng):
    """Step 1 of bias-corrected Adam moves every element by about lr * sign(g)."""
    layout = padded_layout(1037)
    p = random_flat(layout, np.float64, rng)
    g = random_flat(layout, np.float64, rng)
    p0 = p.copy()
    m, v = np.zeros_like(p), np.zeros_like(p)
    lr, eps = 1e-3, 1e-8
    sc = _adam_scalars(1, lr, (0.9, 0.999), 0.0, False, layout)
    one = np.ones(len(layout))
    kernels.adam_step(p, g, m, v, p[:0], layout.pieces, gscale=1.0, step_size=lr / (1 - 0.9) * one, beta1=0.9,
                      beta2=0.999, eps=eps, inv_bc2_sqrt=sc["inv_bc2_sqrt"], l2=0.0 * one, decay=one, amsgrad=False)
    live = live_mask(layout)
    expected = p0[live] - lr * g[live] / (np.abs(g[live]) + eps)
    np.testing.assert_allclose(p[live], expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(m, 0.1 * g, rtol=1e-12)
    np.testing.assert_allclose(v, 0.001 * g * g, rtol=1e-12)


# -- determinism --------------------------------------------------------------------------------


@parallel_dtypes
def test_sumsq_bitwise_independent_of_thread_count(dtype, rng, restore_threads):
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has fewer than 2 threads")
    layout = padded_layout(SIZES[-1])
    assert layout.size >= cpu.SERIAL_BELOW and len(layout.pieces) > 2  # the parallel path, several chunks
    x = random_flat(layout, dtype, rng, scale=1e3)
    results = {}
    for threads in (1, 2):
        numba.set_num_threads(threads)
        total, per_seg = cpu.sumsq(x, layout.pieces, nseg=len(layout))
        scaled, scaled_seg = cpu.sumsq_scaled(x, layout.pieces, nseg=len(layout), inv=1e-3)
        results[threads] = (total, per_seg.tobytes(), scaled, scaled_seg.tobytes(), cpu.max_abs(x, layout.pieces))
    assert results[1] == results[2]


@pytest.mark.parametrize("kernel", ["sumsq", "sgd_step", "adam_step"])
@parallel_dtypes
def test_identical_runs_are_bitwise_equal(family, kernel, dtype, rng):
    layout = padded_layout(SIZES[-1])
    p0 = random_flat(layout, dtype, rng)
    grads = [random_flat(layout, dtype, rng) for _ in range(3)]

    def run():
        p, m, v = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
        out = []
        for t, g in enumerate(grads, 1):
            if kernel == "sumsq":
                total, per_seg = family.sumsq(g, layout.pieces, nseg=len(layout))
                out.append((total, per_seg.tobytes()))
                continue
            if kernel == "sgd_step":
                family.sgd_step(p, g.copy(), m, layout.pieces, gscale=0.9, lr=_per_seg(layout, 0.1),
                                l2=_per_seg(layout, 0.01), momentum=0.9, dampening=0.0, nesterov=True, first=t == 1,
                                zero_grad=True)
            else:
                sc = _adam_scalars(t, 1e-2, (0.9, 0.999), 0.0, False, layout)
                family.adam_step(p, g.copy(), m, v, v, layout.pieces, gscale=0.9, eps=1e-8, amsgrad=True,
                                 zero_grad=True, **sc)
            out.append((p.tobytes(), m.tobytes(), v.tobytes()))
        return out

    assert run() == run()


# -- overflow-safe norms and clipping -------------------------------------------------------


@overflow_expected
@pytest.mark.parametrize("n", [1, 1037, 278011])
@pytest.mark.parametrize("kernels", [cpu, ref], ids=["numba", "reference"])
def test_norm_pass_huge_float64_gradients(n, kernels, rng):
    layout = padded_layout(n)
    x = random_flat(layout, np.float64, rng, scale=1e200)
    live = live_mask(layout)
    assert not math.isfinite(kernels.sumsq(x, layout.pieces, nseg=len(layout))[0])  # the first pass overflows
    peak = np.max(np.abs(x[live]))
    expected = peak * math.sqrt(np.sum((x[live] / peak) ** 2))
    found = norm_pass(kernels, x, layout)
    assert not found.nonfinite
    assert math.isfinite(found.norm)
    assert_close(found.norm, expected, np.float64)
    for seg, name in enumerate(layout.names):
        part = x[layout.slice(name)]
        seg_expected = peak * math.sqrt(np.sum((part / peak) ** 2)) if part.size else 0.0
        assert_close(found.segment_norms[seg], seg_expected, np.float64, err_msg=name)


@overflow_expected
@pytest.mark.parametrize("kernels", [cpu, ref], ids=["numba", "reference"])
@pytest.mark.parametrize("bad", NONFINITE, ids=["nan", "+inf", "-inf"])
def test_norm_pass_huge_float64_with_nonfinite_is_flagged(kernels, bad, rng):
    layout = padded_layout(1037)
    x = random_flat(layout, np.float64, rng, scale=1e200)
    x[_position(layout, "last")] = bad
    found = norm_pass(kernels, x, layout)
    assert found.nonfinite
    assert math.isnan(found.norm)


@pytest.mark.parametrize("n", [1037, 278011])
@pytest.mark.parametrize("kernels", [cpu, ref], ids=["numba", "reference"])
def test_norm_pass_float32_1e20(n, kernels, rng):
    layout = padded_layout(n)
    x = random_flat(layout, np.float32, rng, scale=1e20)
    found = norm_pass(kernels, x, layout)
    assert not found.nonfinite and math.isfinite(found.norm)
    assert_close(found.norm, np.sqrt(np.sum(x.astype(np.float64) ** 2)), np.float64)
    assert np.isfinite(found.segment_norms).all()


@pytest.mark.parametrize("kernels", ["numba", "reference"])
@pytest.mark.parametrize("make_opt", [
    lambda: optim.SGD(lr=0.1),
    lambda: optim.SGD(lr=0.1, momentum=0.9, nesterov=True),
    lambda: optim.Adam(lr=0.1),
    lambda: optim.AdamW(lr=0.1, amsgrad=True),
], ids=["sgd", "sgd_nesterov", "adam", "adamw_amsgrad"])
def test_engine_clips_float32_1e20_gradients(kernels, make_opt, rng):
    shapes = {"empty": (0,), "w": (37, 28), "b": (28,)}
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    engine = Engine(params, make_opt(), max_grad_norm=1.0, kernels=kernels)
    for _ in range(3):
        grads = {k: (rng.standard_normal(s) * 1e20).astype(np.float32) for k, s in shapes.items()}
        norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
        before = {k: v.copy() for k, v in engine.params.items()}
        report = engine.step(grads)
        assert report.applied and not report.skipped
        assert_close(report.grad_norm, norm, np.float64)
        assert 0 < report.clip_coef < 1e-19
        assert_close(report.clip_coef, 1.0 / (norm + 1e-6), np.float64)
        for k, v in engine.params.items():
            assert np.isfinite(v).all(), k
        assert np.isfinite(engine.grads.flat).all()
        for slot in engine.state.slots.values():
            assert np.isfinite(slot.flat).all()
        if isinstance(engine.optimizer, optim.SGD) and engine.optimizer.momentum == 0:
            for k in shapes:  # p -= lr * coef * g: a step of length lr * max_grad_norm overall
                expected = before[k].astype(np.float64) - 0.1 * report.clip_coef * grads[k].astype(np.float64)
                assert_close(engine.params[k], expected, np.float32)


# -- clip_coef ---------------------------------------------------------------------------------


def test_clip_coef_none_is_one():
    assert clip_coef(1e30, None) == 1.0
    assert clip_coef(0.0, None, eps=0.0) == 1.0


@pytest.mark.parametrize("norm, max_norm", [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (10.0, 1.0), (3e5, 2.5), (1e-7, 1e-6)])
def test_clip_coef_torch_rule(norm, max_norm):
    got = clip_coef(norm, max_norm)
    assert got == min(1.0, max_norm / (norm + 1e-6))
    assert 0 < got <= 1.0
    if norm == max_norm:
        assert got < 1.0  # torch clips slightly even at the threshold, because of eps


@pytest.mark.parametrize("norm, max_norm", [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (10.0, 1.0), (3e5, 2.5), (1e-7, 1e-6)])
def test_clip_coef_exact_rule(norm, max_norm):
    got = clip_coef(norm, max_norm, eps=0.0)
    if norm <= max_norm:
        assert got == 1.0
    else:
        assert got == max_norm / norm
        assert math.isclose(norm * got, max_norm, rel_tol=1e-15)  # lands exactly on max_norm


def test_clip_coef_custom_eps():
    assert clip_coef(1.0, 0.5, eps=1.0) == 0.25
    assert clip_coef(0.0, 1.0, eps=1e-6) == 1.0
