"""Mixed precision: loss scaling (GradScaler's rules), skip semantics, low-precision grads,
working copies and bfloat16 optimizer state; the schedule inside the Engine."""

from __future__ import annotations

import math
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from arraytrain import Engine, HyperparameterError, LossScaler, NonFiniteError, optim, schedules
from arraytrain.kernels.interface import LP_BF16, LP_F16
from arraytrain.kernels import reference as ref
from conftest import SIZES, assert_close, decoded, engine_snapshot, padded_layout, random_flat

BF16 = np.dtype(ml_dtypes.bfloat16)


def _params(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((6, 5)).astype(dtype), "empty": np.zeros(0, dtype),
            "b": rng.standard_normal(5).astype(dtype)}


def _grads(rng, scale=1.0, dtype=np.float32):
    return {"w": (rng.standard_normal((6, 5)) * scale).astype(dtype), "empty": np.zeros(0, dtype),
            "b": (rng.standard_normal(5) * scale).astype(dtype)}


# -- the loss scaler against torch's own update rule ------------------------------------------


def test_loss_scaler_sequence_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    found = rng.random(400) < 0.1
    found[100:140] = False  # a run long enough to grow with interval 25
    ours = LossScaler(init_scale=2.0**10, growth_interval=25)
    scale, tracker = torch.full((1,), 2.0**10), torch.zeros(1, dtype=torch.int32)
    for t, inf in enumerate(found):
        ours.update(bool(inf))
        torch._amp_update_scale_(scale, tracker, torch.full((1,), float(inf)), 2.0, 0.5, 25)
        assert ours.scale == float(scale[0]), f"step {t}"
        assert ours.growth_tracker == int(tracker[0]), f"step {t}"


def test_loss_scaler_defaults_and_caps():
    s = LossScaler()
    assert s.scale == 2.0**16 and s.growth_interval == 2000 and s.growth_factor == 2 and s.backoff_factor == 0.5
    for _ in range(2000):
        s.update(False)
    assert s.scale == 2.0**17 and s.growth_tracker == 0
    s.update(True)
    assert s.scale == 2.0**16
    capped = LossScaler(init_scale=4.0, growth_interval=1, max_scale=16.0)
    for _ in range(10):
        capped.update(False)
    assert capped.scale == 16.0
    huge = LossScaler(init_scale=1e308, growth_interval=1)
    huge.update(False)
    assert huge.scale == 1e308  # growing would overflow: the finite cap holds


@pytest.mark.parametrize("kwargs, name", [
    ({"init_scale": 0.0}, "init_scale"), ({"growth_factor": 1.0}, "growth_factor"),
    ({"backoff_factor": 1.0}, "backoff_factor"), ({"backoff_factor": 0.0}, "backoff_factor"),
    ({"growth_interval": 0}, "growth_interval"), ({"max_scale": 1.0}, "max_scale"),
])
def test_loss_scaler_bad_arguments(kwargs, name):
    with pytest.raises(HyperparameterError, match=name):
        LossScaler(**kwargs)


# -- the skip semantics -------------------------------------------------------------------------


def _mp_engine(**kw):
    return Engine(_params(), optim.AdamW(lr=1e-2, weight_decay=0.1), accumulation_steps=2, max_grad_norm=1.0,
                  schedule=schedules.Warmup(3, then=schedules.CosineAnnealingLR(20)), loss_scaler=LossScaler(init_scale=2.0**8),
                  **kw)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_step_changes_nothing_and_scaler_backs_off(bad):
    rng = np.random.default_rng(0)
    e = _mp_engine()
    for _ in range(6):  # three applied steps
        e.step(_grads(rng, e.loss_scale))
    before, lr_before, scale = engine_snapshot(e), e.lr, e.loss_scale
    e.step(_grads(rng, e.loss_scale))
    g = _grads(rng, e.loss_scale)
    g["b"][2] = bad
    r = e.step(g)
    assert r.skipped and not r.applied and math.isnan(r.grad_norm)
    after = engine_snapshot(e)
    for key in ("params", "slots", "step", "micro", "wsum"):
        assert after[key] == before[key], key
    assert e.lr == lr_before  # the schedule did not advance
    assert e.loss_scale == scale * 0.5 and r.loss_scale == e.loss_scale
    assert e.consecutive_skips == 1
    r = [e.step(_grads(rng, e.loss_scale)) for _ in range(2)][-1]
    assert r.applied and r.step == 4 and e.consecutive_skips == 0


def test_skipped_step_then_run_equals_run_without_the_bad_window():
    """The bad window leaves no trace: a run with it equals a run without it (bitwise)."""
    rng = np.random.default_rng(1)
    windows = [[_grads(rng, 256.0) for _ in range(2)] for _ in range(6)]
    bad = [dict(g) for g in windows[0]]
    bad[1] = dict(bad[1], b=np.full(5, np.nan, np.float32))
    a, b = _mp_engine(), _mp_engine()
    for w in windows:
        for g in w:
            a.step(g)
    for g in bad:
        b.step(g)
    b.loss_scaler.scale = a.loss_scaler.scale = 2.0**8  # compare the optimizer path only
    a2 = _mp_engine()
    for w in windows:
        for g in w:
            a2.step(g)
    for w in windows:
        for g in w:
            b.step(g)
    np.testing.assert_array_equal(b.params.flat, a2.params.flat)
    for k in a2.state.slots:
        np.testing.assert_array_equal(b.state.slots[k].flat, a2.state.slots[k].flat)


def test_consecutive_skip_limit_raises_and_changes_nothing():
    e = Engine(_params(), optim.SGD(lr=0.1), loss_scaler=LossScaler(), max_consecutive_skips=3)
    nan = {k: np.full(v.shape, np.nan, np.float32) for k, v in _params().items()}
    e.step(_grads(np.random.default_rng(0)))

    def kept(snap):  # skipping counts the skips and backs the loss scale off, by design
        return {k: v for k, v in snap.items() if k not in ("skips", "loss_scaler")}

    before = kept(engine_snapshot(e))
    assert e.step(nan).skipped and e.step(nan).skipped
    with pytest.raises(NonFiniteError, match="3 consecutive steps"):
        e.step(nan)
    assert kept(engine_snapshot(e)) == before
    assert e.consecutive_skips == 3 and e.loss_scale == 2.0**13


def test_loss_scaler_unscales_inside_the_step():
    """Scaled fp16 gradients with a loss scaler == unscaled fp32 gradients without one."""
    rng = np.random.default_rng(2)
    plain = Engine(_params(), optim.Adam(lr=1e-2), max_grad_norm=0.5)
    scaled = Engine(_params(), optim.Adam(lr=1e-2), max_grad_norm=0.5,
                    loss_scaler=LossScaler(init_scale=2.0**10, growth_interval=3))
    for _ in range(8):
        g = _grads(rng, 1e-2)
        s = scaled.loss_scale
        rp = plain.step({k: v.astype(np.float16).astype(np.float32) for k, v in g.items()})
        rs = scaled.step({k: (v.astype(np.float16).astype(np.float32) * s).astype(np.float16) for k, v in g.items()})
        assert rs.grad_norm == pytest.approx(rp.grad_norm, rel=1e-6)
        assert rs.clip_coef == pytest.approx(rp.clip_coef, rel=1e-6)
    assert scaled.loss_scale == 2.0**12  # grew twice (every 3 finite steps)
    assert_close(scaled.params.flat, plain.params.flat)


def test_bfloat16_gradients_are_accepted():
    rng = np.random.default_rng(4)
    g = _grads(rng)
    e16 = Engine(_params(), optim.SGD(lr=0.1))
    e32 = Engine(_params(), optim.SGD(lr=0.1))
    e16.step({k: v.astype(ml_dtypes.bfloat16) for k, v in g.items()})
    e32.step({k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in g.items()})
    np.testing.assert_array_equal(e16.params.flat, e32.params.flat)


# -- low-precision storage: conversions, working copies, bfloat16 state ---------------------------


def _special_values():
    rng = np.random.default_rng(5)
    f16 = np.finfo(np.float16)
    vals = [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 65504.0, 65520.0, 65519.99, 1e5, -1e5,
            float(f16.tiny), float(f16.tiny) / 2, 6e-8, 5.96e-8, 2.98e-8, 2.99e-8, 1e-9, 3.4e38,
            1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8]
    rand = np.concatenate([rng.standard_normal(5000), rng.standard_normal(5000) * 1e-6,
                           rng.standard_normal(5000) * 1e4, np.exp(rng.uniform(-120, 120, 5000))])
    return np.concatenate([np.array(vals), rand]).astype(np.float32)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("kind, dtype", [(LP_BF16, BF16), (LP_F16, np.dtype(np.float16))],
                         ids=["bfloat16", "float16"])
def test_cast_working_is_bitwise_the_numpy_cast(family, kind, dtype):
    x = _special_values()
    from arraytrain import Layout

    layout = Layout({"x": x.shape})
    p = np.zeros(layout.size, np.float32)
    p[: x.size] = x
    w_fast, w_ref = np.zeros(layout.size, np.uint16), np.zeros(layout.size, np.uint16)
    family.cast_working(w_fast, p, layout.pieces, kind=kind)
    ref.cast_working(w_ref, p, layout.pieces, kind=kind)
    expected = x.astype(dtype).view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(w_fast[: x.size][~nan], expected[~nan])
    np.testing.assert_array_equal(w_ref[: x.size][~nan], expected[~nan])
    assert np.all(np.isnan(w_fast[: x.size][nan].view(dtype).astype(np.float32)))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_bfloat16_state_kernel_matches_reference(family, n, amsgrad, rng):
    layout = padded_layout(n)
    p0 = random_flat(layout, np.float32, rng)
    st = {k: {"p": p0.copy(), "m": np.zeros(layout.size, np.uint16), "v": np.zeros(layout.size, np.uint16),
              "x": np.zeros(layout.size if amsgrad else 0, np.uint16), "w": np.zeros(layout.size, np.uint16)}
          for k in ("fast", "ref")}
    one = np.ones(len(layout))
    for t in range(1, 9):
        g0 = random_flat(layout, np.float32, rng, scale=[1.0, 5.0, 0.1][t % 3])
        # each step starts both from the kernel's state: two rounding paths that differ by
        # one bfloat16 ulp near a tie would otherwise drift apart over the steps
        for slot in st["fast"]:
            st["ref"][slot][...] = st["fast"][slot]
        for k, kern in (("fast", family), ("ref", ref)):
            s = st[k]
            kern.adam_step(s["p"], g0.copy(), s["m"], s["v"], s["x"], layout.pieces, gscale=0.9,
                           step_size=1e-2 / (1 - 0.9**t) * one, beta1=0.9, beta2=0.99, eps=1e-8,
                           inv_bc2_sqrt=1 / math.sqrt(1 - 0.99**t), l2=0.0 * one, decay=(1 - 1e-3) * one,
                           amsgrad=amsgrad, working=s["w"], kind=LP_BF16)
        for slot in ("m", "v", "x"):
            a, b = (decoded(st[k][slot]) for k in ("fast", "ref"))
            # within one bfloat16 ulp (2**-7 relative): the reference rounds float64 -> float32 ->
            # bfloat16, the kernel rounds its float32 math once
            np.testing.assert_allclose(a, b, rtol=2**-7, atol=1e-30, err_msg=f"{slot}, step {t}")
        np.testing.assert_allclose(st["fast"]["p"], st["ref"]["p"], rtol=5e-3, atol=5e-3, err_msg=f"p, step {t}")
        # the working copy is exactly the bfloat16 rounding of the new weights
        np.testing.assert_array_equal(st["fast"]["w"], st["fast"]["p"].astype(ml_dtypes.bfloat16).view(np.uint16))


@pytest.mark.parametrize("make", [lambda: optim.SGD(lr=0.05, momentum=0.9), lambda: optim.AdamW(lr=1e-2)],
                         ids=["sgd", "adamw"])
@pytest.mark.parametrize("wdtype", ["bfloat16", "float16"])
def test_engine_working_copy_follows_the_weights(make, wdtype):
    rng = np.random.default_rng(6)
    e = Engine(_params(), make(), working_dtype=wdtype)
    plain = Engine(_params(), make())
    dt = BF16 if wdtype == "bfloat16" else np.dtype(np.float16)
    assert e.working.dtype == dt
    np.testing.assert_array_equal(e.working["w"], _params()["w"].astype(dt))
    for _ in range(5):
        g = _grads(rng)
        e.step(g)
        plain.step(g)
        for name in e.params:
            np.testing.assert_array_equal(e.working[name], e.params[name].astype(dt))
    np.testing.assert_array_equal(e.params.flat, plain.params.flat)  # the copy changes nothing else


def test_adamw_bfloat16_state_trains_like_float32():
    """Minimise a quadratic: bfloat16 moments end close to float32 moments."""
    target = {k: v * 0.5 + 1.0 for k, v in _params(9).items()}
    runs = {}
    for sd in (None, "bfloat16"):
        e = Engine(_params(), optim.AdamW(lr=5e-2, weight_decay=0.0, state_dtype=sd))
        for _ in range(200):
            e.step({k: e.params[k] - target[k] for k in target})
        runs[sd] = e
    assert runs["bfloat16"].state.slots["exp_avg"].dtype == BF16
    for k in target:
        np.testing.assert_allclose(runs["bfloat16"].params[k], target[k], atol=5e-2)
        np.testing.assert_allclose(runs["bfloat16"].params[k], runs[None].params[k], atol=5e-2)


_FRESH_BF16 = """
import sys
import numpy as np
import arraytrain as at
from arraytrain.buffer import FlatBuffer
from arraytrain.layout import Layout

assert "ml_dtypes" not in sys.modules
params = FlatBuffer.zeros(Layout.from_arrays({"w": np.zeros((3, 4), np.float32)}), np.float32)
state = at.optim.AdamW(lr=1e-3, state_dtype="bfloat16").init(params)
print(state.slots["exp_avg"].dtype, FlatBuffer.zeros(params.layout, "bfloat16").dtype)
"""


def test_bfloat16_by_name_in_a_process_without_ml_dtypes():
    """The name "bfloat16" resolves before anything imported ml_dtypes (NumPy learns it from that
    import): an optimizer's state and a buffer by that name, first thing in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _FRESH_BF16], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["bfloat16", "bfloat16"]


@pytest.mark.parametrize("make, name", [
    (lambda: optim.Adam(state_dtype="float16"), "state_dtype"),
    (lambda: Engine(_params(dtype=np.float64), optim.Adam(state_dtype="bfloat16")), "state_dtype"),
    (lambda: Engine(_params(), optim.SGD(), working_dtype="int8"), "working_dtype"),
    (lambda: Engine(_params(dtype=np.float64), optim.SGD(), working_dtype="bfloat16"), "working_dtype"),
    (lambda: Engine(_params(), optim.SGD(), max_consecutive_skips=0), "max_consecutive_skips"),
    (lambda: optim.SGD(overrides={"*.bias": {"momentum": 0.5}}), "momentum"),
    (lambda: optim.SGD(overrides={"*.bias": {"lr": -1.0}}), "lr"),
    (lambda: Engine(_params(), optim.SGD(overrides={"nothere.*": {"lr": 1.0}})), "nothere"),
])
def test_bad_mixed_precision_and_override_arguments(make, name):
    with pytest.raises(HyperparameterError, match=name):
        make()


# -- the schedule and per-parameter overrides inside the engine ----------------------------------


def test_engine_follows_the_schedule_per_parameter():
    sched = schedules.Warmup(2, then=schedules.StepLR(2, gamma=0.5))
    opt = optim.SGD(lr=0.4, overrides={"b": {"lr": 0.1, "weight_decay": 0.0}}, weight_decay=0.01)
    e = Engine(_params(), opt, schedule=sched)
    rng = np.random.default_rng(7)
    for t in range(7):
        g = _grads(rng)
        p0 = {k: v.astype(np.float64) for k, v in e.params.items()}
        r = e.step(g)
        assert r.lr == pytest.approx(sched(t, 0.4))
        lr_w, lr_b = sched(t, 0.4), sched(t, 0.1)
        assert_close(e.params["w"], p0["w"] - lr_w * (g["w"] + 0.01 * p0["w"]))
        assert_close(e.params["b"], p0["b"] - lr_b * g["b"])


def test_engine_observe_feeds_reduce_on_plateau():
    e = Engine(_params(), optim.SGD(lr=1.0), schedule=schedules.ReduceLROnPlateau(patience=0, factor=0.5))
    e.step(_grads(np.random.default_rng(8)))
    e.observe(1.0)
    e.observe(2.0)  # worse: patience 0 -> halve
    assert e.lr == 0.5
