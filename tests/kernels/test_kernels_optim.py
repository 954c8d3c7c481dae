"""Adagrad, RMSprop, Lion, LAMB, NAdam, RAdam, Adamax and Adadelta kernels of the fast families
(numba, and CUDA where a GPU is usable: the ``family`` fixture) against their reference twins.

STEPS consecutive steps on params and every state slot, at every size in SIZES
with zero-size parameters first, middle and last (conftest.padded_layout), for
float32 and float64, with per-parameter lr / weight_decay arrays that differ
from parameter to parameter, zero_grad alternating (float32; conftest.zero_grad_at), and optionally a bfloat16
or float16 working copy compared with the reference's. A NaN or Inf gradient
propagates exactly as in the reference.
"""

from __future__ import annotations


import ml_dtypes
import numba
import numpy as np
import pytest

from arraytrain.kernels import cpu
from arraytrain.kernels import reference as ref
from arraytrain.optim._base import unused_slot
from conftest import (
    LP_TOL,
    SIZES,
    assert_close,
    assert_padding_zero,
    decoded,
    dtypes,
    live_indices,
    live_mask,
    padded_layout,
    parallel_dtypes,
    random_flat,
    sizes,
    tiered,
    zero_grad_at,
)

STEPS = 8
WORKING = {"none": (None, cpu.LP_NONE), "bf16": ("bfloat16", cpu.LP_BF16), "f16": ("float16", cpu.LP_F16)}


def _seg_values(layout, base, rng):
    """Per-parameter values around ``base``, different for every parameter."""
    return base * rng.uniform(0.5, 1.5, len(layout))


# Each variant: slots it keeps, and a function (kernels, p, g, slots, layout, t, lr, wd, gscale, w, wkind, zg)
# that runs one step. Host-side scalars (decayed lr, bias corrections) are computed here as the optimizers do.
def _adagrad(lr_decay=0.05, eps=1e-10):
    def run(k, p, g, s, layout, t, lr, wd, gscale, w, wkind, zg):
        k.adagrad_step(p, g, s["sum"], layout.pieces, gscale=gscale, lr=lr / (1 + (t - 1) * lr_decay), l2=wd, eps=eps,
                       working=w, kind=wkind, zero_grad=zg)
    return ("sum",), run


# eps 1e-2 for RMSprop: on step 1, u = d / (sqrt(0.1 d^2) + eps), and d = g + wd*p may cancel to
# ~1e-7, where float32 rounding of d (absolute ~6e-8) would move u by up to 6e-8 / eps
def _rmsprop(momentum, centered, alpha=0.9, eps=1e-2):
    slots = ("square_avg",) + (("grad_avg",) if centered else ()) + (("momentum_buffer",) if momentum else ())

    def run(k, p, g, s, layout, t, lr, wd, gscale, w, wkind, zg):
        empty = unused_slot(s["square_avg"])  # what the optimizer passes: one signature for every variant
        k.rmsprop_step(p, g, s["square_avg"], s.get("grad_avg", empty), s.get("momentum_buffer", empty),
                       layout.pieces, gscale=gscale, lr=lr, l2=wd, alpha=alpha, eps=eps, momentum=momentum,
                       centered=centered, working=w, kind=wkind, zero_grad=zg)
    return slots, run


LION_B1 = 0.9


def _lion(b1=LION_B1, b2=0.99):
    def run(k, p, g, s, layout, t, lr, wd, gscale, w, wkind, zg):
        k.lion_step(p, g, s["exp_avg"], layout.pieces, gscale=gscale, lr=lr, decay=1 - lr * wd, beta1=b1, beta2=b2,
                    working=w, kind=wkind, zero_grad=zg)
    return ("exp_avg",), run


def _lamb(b1=0.9, b2=0.99, eps=1e-6, eps_root=1e-8):
    def run(k, p, g, s, layout, t, lr, wd, gscale, w, wkind, zg):
        return k.lamb_step(p, g, s["exp_avg"], s["exp_avg_sq"], layout.pieces, gscale=gscale, lr=lr, weight_decay=wd,
                           beta1=b1, beta2=b2, eps=eps, eps_root=eps_root, inv_bc1=1 / (1 - b1**t),
                           inv_bc2=1 / (1 - b2**t), working=w, kind=wkind, zero_grad=zg)
    return ("exp_avg", "exp_avg_sq"), run


def _sgd(momentum=0.9, nesterov=True):
    def run(k, p, g, s, layout, t, lr, wd, gscale, w, wkind, zg):
        k.sgd_step(p, g, s["momentum_buffer"], layout.pieces, gscale=gscale, lr=lr, l2=wd, momentum=momentum,
                   dampening=0.0, nesterov=nesterov, first=t == 1, working=w, kind=wkind, zero_grad=zg)
    return ("momentum_buffer",), run


def _nadam(decoupled, b1=0.9, b2=0.99, eps=1e-3, psi=4e-3):
    # the optimizer's host side, from torch's formulas: mu_t and the running product over steps 1..t
    def mu(k):
        return b1 * (1.0 - 0.5 * 0.96 ** (k * psi))

    def run(k, p, g, s, layout, t, lr, wd, gscale, w, wkind, zg):
        prod = float(np.prod([mu(i) for i in range(1, t + 1)]))
        k.nadam_step(p, g, s["exp_avg"], s["exp_avg_sq"], layout.pieces, gscale=gscale,
                     grad_step=lr * (1 - mu(t)) / (1 - prod), moment_step=lr * mu(t + 1) / (1 - prod * mu(t + 1)),
                     beta1=b1, beta2=b2, eps=eps, inv_bc2_sqrt=1 / np.sqrt(1 - b2**t),
                     l2=0 * wd if decoupled else wd, decay=1 - lr * wd if decoupled else 1 + 0 * wd,
                     working=w, kind=wkind, zero_grad=zg)
    return ("exp_avg", "exp_avg_sq"), run


# beta2 = 0.9: rho_t crosses 5 at step 6 of STEPS, so both of RAdam's steps are checked
def _radam(decoupled, b1=0.9, b2=0.9, eps=1e-3):
    def run(k, p, g, s, layout, t, lr, wd, gscale, w, wkind, zg):
        rho_inf = 2 / (1 - b2) - 1
        rho = rho_inf - 2 * t * b2**t / (1 - b2**t)
        rectified = rho > 5
        rect = np.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho) * (1 - b2**t)) \
            if rectified else 0.0
        k.radam_step(p, g, s["exp_avg"], s["exp_avg_sq"], layout.pieces, gscale=gscale, step_size=lr / (1 - b1**t),
                     beta1=b1, beta2=b2, eps=eps, rect=rect, rectified=rectified, l2=0 * wd if decoupled else wd,
                     decay=1 - lr * wd if decoupled else 1 + 0 * wd, working=w, kind=wkind, zero_grad=zg)
    return ("exp_avg", "exp_avg_sq"), run


def _adamax(b1=0.9, b2=0.99, eps=1e-3):
    def run(k, p, g, s, layout, t, lr, wd, gscale, w, wkind, zg):
        k.adamax_step(p, g, s["exp_avg"], s["exp_inf"], layout.pieces, gscale=gscale, step_size=lr / (1 - b1**t),
                      beta1=b1, beta2=b2, eps=eps, l2=wd, working=w, kind=wkind, zero_grad=zg)
    return ("exp_avg", "exp_inf"), run


def _adadelta(rho=0.9, eps=1e-2):
    def run(k, p, g, s, layout, t, lr, wd, gscale, w, wkind, zg):
        k.adadelta_step(p, g, s["square_avg"], s["acc_delta"], layout.pieces, gscale=gscale, lr=lr * 100, l2=wd,
                        rho=rho, eps=eps, working=w, kind=wkind, zero_grad=zg)
    return ("square_avg", "acc_delta"), run


VARIANTS = {
    "sgd_nesterov": _sgd(),
    "adagrad": _adagrad(),
    "rmsprop": _rmsprop(0.0, False),
    "rmsprop_momentum": _rmsprop(0.9, False),
    "rmsprop_centered": _rmsprop(0.0, True),
    "rmsprop_centered_momentum": _rmsprop(0.5, True),
    "lion": _lion(),
    "lamb": _lamb(),
    "nadam": _nadam(False),
    "nadam_decoupled": _nadam(True),
    "radam": _radam(False),
    "radam_decoupled": _radam(True),
    "adamax": _adamax(),
    "adadelta": _adadelta(),
}
variants = pytest.mark.parametrize("variant", list(VARIANTS))
# The working-copy and bfloat16-state matrices run these variants in the default tier (one slot;
# two passes; three slots) and every variant in the slow tier: each variant is a kernel signature of
# its own to compile, and the code the matrix adds (the working-copy writer, the state codec) is the
# same in every kernel. The 8-bit matrix runs in the slow tier only (an 8-bit signature compiles in
# ~10 s here): the default tier meets the 8-bit kernels through tests/optim/test_state8.py (AdamW).
LP_DEFAULT = ("sgd_nesterov", "lamb", "rmsprop_centered_momentum")


def _sign_ties(variant, states, g0, gscale, dtype):
    """Lion elements whose ``sign(c)`` is within rounding of 0 (from the reference's state).

    float32 math may give the other sign there (a step of 2*lr apart); the test
    copies the reference's parameter onto these few elements and counts them.
    """
    if variant != "lion":
        return None
    c = LION_B1 * decoded(states["ref"]["slots"]["exp_avg"]) + (1 - LION_B1) * gscale * g0.astype(np.float64)
    # padding is never touched (c = 0 there): only the parameters' elements
    return (np.abs(c) < (1e-6 if np.dtype(dtype) == np.float32 else 1e-12)) & live_mask(states["layout"])


def _resync(states, ties):
    if ties is not None and ties.any():
        states["fast"]["p"][ties] = states["ref"]["p"][ties]
        assert ties.sum() <= 2 + 1e-4 * ties.size  # rare: otherwise the comparison would be hollow


def _init(layout, dtype, slots, rng, variant):
    p0 = random_flat(layout, dtype, rng)
    states = {}
    for k in ("fast", "ref"):
        s = {name: np.zeros(layout.size, dtype) for name in slots}
        if variant == "adagrad":  # a non-zero initial accumulator on the parameters' elements
            s["sum"][live_mask(layout)] = 0.1
        states[k] = {"p": p0.copy(), "slots": s}
    states["layout"] = layout
    return states


def _compare(states, layout, slots, t, lp=None):
    assert_close(states["fast"]["p"], states["ref"]["p"], err_msg=f"params, step {t}")
    assert_padding_zero(states["fast"]["p"], layout, "params")
    for slot in slots:
        a, d = states["fast"]["slots"][slot], states["ref"]["slots"][slot]
        assert_close(a, d, err_msg=f"{slot}, step {t}")
        assert_padding_zero(a, layout, slot)


@sizes
@dtypes
@variants
def test_matches_reference(family, n, dtype, variant, rng):
    """STEPS steps of params and every slot; per-parameter lr/wd; zero_grad alternates (float32)."""
    layout = padded_layout(n)
    slots, run = VARIANTS[variant]
    states = _init(layout, dtype, slots, rng, variant)
    lr = _seg_values(layout, 1e-2, rng)
    wd = _seg_values(layout, 0.1, rng)
    for t in range(1, STEPS + 1):
        zero_grad = zero_grad_at(t, dtype)
        g0 = random_flat(layout, dtype, rng, scale=[1.0, 5.0, 0.1][t % 3])
        ratios = {}
        ties = _sign_ties(variant, states, g0, 0.7, dtype)
        for k, kernels in (("fast", family), ("ref", ref)):
            g = g0.copy()
            ratios[k] = run(kernels, states[k]["p"], g, states[k]["slots"], layout, t, lr, wd, 0.7, None, 0, zero_grad)
            if zero_grad:
                assert not np.any(g)
            else:
                np.testing.assert_array_equal(g, g0)
        _resync(states, ties)
        _compare(states, layout, slots, t)
        if variant == "lamb":
            assert ratios["fast"].shape == (len(layout),)
            assert_close(ratios["fast"], ratios["ref"], np.float64 if dtype == np.float64 else np.float32)
            for seg, size in enumerate(layout.sizes):
                if size == 0:
                    assert ratios["fast"][seg] == 1.0


@pytest.mark.parametrize("n", tiered([7, 1037, 278011], default=(7, 278011)))
@pytest.mark.parametrize("variant", tiered(VARIANTS, default=LP_DEFAULT))
@pytest.mark.parametrize("working", ["bf16", "f16"])
def test_working_copy_matches_reference(family, n, variant, working, rng):
    """float32 master weights with a low-precision working copy written in the same kernel."""
    import ml_dtypes

    layout = padded_layout(n)
    slots, run = VARIANTS[variant]
    states = _init(layout, np.float32, slots, rng, variant)
    lr, wd = _seg_values(layout, 1e-2, rng), _seg_values(layout, 0.1, rng)
    wdtype, wkind = WORKING[working]
    wdtype = np.dtype(ml_dtypes.bfloat16) if wdtype == "bfloat16" else np.dtype(np.float16)
    w = {k: np.zeros(layout.size, np.uint16) for k in ("fast", "ref")}
    live = live_mask(layout)
    for t in range(1, STEPS + 1):
        g0 = random_flat(layout, np.float32, rng)
        ties = _sign_ties(variant, states, g0, 1.0, np.float32)
        for k, kernels in (("fast", family), ("ref", ref)):
            run(kernels, states[k]["p"], g0.copy(), states[k]["slots"], layout, t, lr, wd, 1.0, w[k], wkind, False)
        if ties is not None and ties.any():  # the reference's rounding of the resynchronised weights
            _resync(states, ties)
            w["fast"][ties] = states["fast"]["p"][ties].astype(wdtype).view(np.uint16)
        _compare(states, layout, slots, t)
        wc, wr = (w[k].view(wdtype).astype(np.float64) for k in ("fast", "ref"))
        np.testing.assert_allclose(wc, wr, err_msg=f"working copy, step {t}", **LP_TOL)
        # the working copy is the rounding of the kernel's own new weights, bit for bit
        expected = states["fast"]["p"][live].astype(wdtype).view(np.uint16)
        np.testing.assert_array_equal(w["fast"][live], expected)
        assert not np.any(w["fast"][~live])


@pytest.mark.parametrize("n", tiered([7, 278011], default=(7,)))
@dtypes
@variants
@pytest.mark.parametrize("bad", [np.nan, np.inf, pytest.param(-np.inf, marks=pytest.mark.slow)],
                         ids=["nan", "+inf", "-inf"])
def test_nonfinite_gradient_propagates_as_reference(family, n, dtype, variant, bad, rng):
    layout = padded_layout(n)
    slots, run = VARIANTS[variant]
    states = _init(layout, dtype, slots, rng, variant)
    lr, wd = _seg_values(layout, 1e-2, rng), _seg_values(layout, 0.1, rng)
    live = live_indices(layout)
    zero_grad = zero_grad_at(1, dtype)  # off in float32, on in float64 (the engines' variant)
    for t in range(1, 4):
        g0 = random_flat(layout, dtype, rng)
        if t == 2:
            g0[live[len(live) // 2]] = bad
        ties = _sign_ties(variant, states, g0, 1.0, dtype)
        with np.errstate(invalid="ignore", over="ignore"):
            for k, kernels in (("fast", family), ("ref", ref)):
                run(kernels, states[k]["p"], g0.copy(), states[k]["slots"], layout, t, lr, wd, 1.0, None, 0, zero_grad)
            _resync(states, ties)
        for what in ("p",) + slots:
            a = states["fast"]["p"] if what == "p" else states["fast"]["slots"][what]
            d = states["ref"]["p"] if what == "p" else states["ref"]["slots"][what]
            np.testing.assert_array_equal(np.isnan(a), np.isnan(d), err_msg=f"{what}: NaN pattern, step {t}")
            np.testing.assert_array_equal(np.isposinf(a), np.isposinf(d), err_msg=f"{what}: +inf, step {t}")
            np.testing.assert_array_equal(np.isneginf(a), np.isneginf(d), err_msg=f"{what}: -inf, step {t}")
            fin = np.isfinite(d)
            assert_close(a[fin], d[fin], dtype, err_msg=f"{what}, step {t}")
            assert_padding_zero(a, layout, what)
        if t >= 2:  # the non-finite value reached the state (Lion's sign(+-inf) = +-1 keeps p finite)
            reached = [states["fast"]["p"]] + [states["fast"]["slots"][k] for k in slots]
            assert any(not np.isfinite(a).all() for a in reached)


@parallel_dtypes
def test_lamb_bitwise_independent_of_thread_count(dtype, rng, restore_threads):
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has fewer than 2 threads")
    layout = padded_layout(SIZES[-1])
    assert layout.size >= cpu.SERIAL_BELOW and len(layout.pieces) > 2
    slots, run = VARIANTS["lamb"]
    p0, g0 = random_flat(layout, dtype, rng), random_flat(layout, dtype, rng)
    lr, wd = _seg_values(layout, 1e-2, rng), _seg_values(layout, 0.1, rng)
    out = {}
    for threads in (1, 2):
        numba.set_num_threads(threads)
        p, s = p0.copy(), {name: np.zeros_like(p0) for name in slots}
        ratio = run(cpu, p, g0.copy(), s, layout, 1, lr, wd, 1.0, None, 0, False)
        out[threads] = (ratio.tobytes(), p.tobytes(), s["exp_avg"].tobytes(), s["exp_avg_sq"].tobytes())
    assert out[1] == out[2]


@pytest.mark.parametrize("n", tiered([7, 1037, 278011], default=(7, 278011)))
@pytest.mark.parametrize("variant", tiered(VARIANTS, default=LP_DEFAULT))
def test_bfloat16_state_matches_reference(family, n, variant, rng):
    """Float32 parameters, every slot in bfloat16 (uint16 bits) through the kernels' state accessor.

    Each step starts both twins from the same state (the fast kernel's), so the check is the
    step itself: the new slots within one bfloat16 rounding (the float32 and float64 formulas
    may round to neighbouring bfloat16 values), or 1e-6 absolute where a slot cancels to ~0,
    and the parameters at the low-precision tolerance.
    """
    layout = padded_layout(n)
    slots, run = VARIANTS[variant]
    states = _init(layout, np.float32, slots, rng, variant)
    for k in ("fast", "ref"):
        states[k]["slots"] = {name: a.astype(ml_dtypes.bfloat16).view(np.uint16) for name, a in states[k]["slots"].items()}
    lr, wd = _seg_values(layout, 1e-2, rng), _seg_values(layout, 0.1, rng)
    for t in range(1, STEPS + 1):
        states["ref"]["p"][...] = states["fast"]["p"]
        for name in slots:
            states["ref"]["slots"][name][...] = states["fast"]["slots"][name]
        g0 = random_flat(layout, np.float32, rng)
        ties = _sign_ties(variant, states, g0, 1.0, np.float32)
        for k, kernels in (("fast", family), ("ref", ref)):
            run(kernels, states[k]["p"], g0.copy(), states[k]["slots"], layout, t, lr, wd, 1.0, None, 0, False)
        _resync(states, ties)
        np.testing.assert_allclose(states["fast"]["p"], states["ref"]["p"], err_msg=f"p, step {t}", **LP_TOL)
        for name in slots:
            a, d = decoded(states["fast"]["slots"][name]), decoded(states["ref"]["slots"][name])
            # within 4 bfloat16 steps everywhere (a slot that cancels to ~0 differs by float32
            # rounding of its O(1) terms: atol), within one step but for a few elements, where
            # a slot read by another (RMSprop's momentum reads the rounded square average)
            # inherits a neighbouring rounding
            np.testing.assert_allclose(a, d, rtol=2 ** -5, atol=1e-6, err_msg=f"{name}, step {t}")
            far = np.abs(a - d) > 2 ** -7 * np.abs(d) + 1e-6
            assert far.sum() <= 2 + 1e-4 * far.size, f"{name}, step {t}: {far.sum()} elements beyond one rounding"
            assert not np.any(states["fast"]["slots"][name][~live_mask(layout)]), f"{name}: padding"


# -- 8-bit state (arraytrain.optim.state8) ---------------------------------------------------------
#
# Every variant with its slots in 8 bits (Q8 arguments), the pieces cut at multiples of 16384
# from each parameter's start (as the optimizers cut them), "a" (n elements) in 8 bits with a
# partial last block (but for 768 = 3 blocks) and "b" (15 elements) in float32 beside it. Each
# step starts every family from the same state (the fast family's), so what is checked is the
# step itself: params and the side arrays/absmax at the float32 tolerance, codes equal but for a
# rare one-code-off where float32 rounding moves a value across a decision boundary (as in
# tests/optim/test_state8.py). A NaN gradient at step 5 makes its block's absmax NaN: that block
# decodes to NaN everywhere from then on, in every family (its codes, +-NaN's top code, are not
# compared: the sign of a NaN the hardware makes differs between CPU and GPU).

Q8_SIZES = (7, 768, 1037, 278011)
Q8_THRESHOLD = 16


def _q8_slots(layout, slots, variant):
    from arraytrain.optim import state8
    from arraytrain.optim._base import UNSIGNED_SLOTS

    out = {name: state8.Quant8Buffer(layout, signed=name not in UNSIGNED_SLOTS, threshold=Q8_THRESHOLD)
           for name in slots}
    if variant == "adagrad":
        out["sum"].load({k: np.full(s, 0.1, np.float32) for k, s in zip(layout.names, layout.shapes)})
    return out


def _q8_codes_compared(buf):
    """Elements whose codes are compared: 8-bit segments, in blocks with a finite absmax."""
    from arraytrain.lowbit import BLOCK

    keep = np.zeros(buf.codes.size, bool)
    for seg, (off, n) in enumerate(zip(buf.layout.offsets, buf.layout.sizes)):
        if buf.quant[seg]:
            b = buf.base[seg]
            keep[off : off + n] = np.repeat(np.isfinite(buf.aux[b : b + -(-n // BLOCK)]), BLOCK)[:n]
    return keep


def _q8_compare(a, b, lamb, what):
    same = np.ones(a["p"].size, bool)
    if lamb:  # LAMB's second pass reads the codes back: a one-off code moves its parameter by that code
        for k in a["slots"]:
            same &= a["slots"][k].codes == b["slots"][k].codes
    np.testing.assert_allclose(a["p"][same], b["p"][same], rtol=1.3e-6 * 5, atol=1e-5 * 5, err_msg=f"{what}: params")
    for k, x in a["slots"].items():
        y = b["slots"][k]
        np.testing.assert_allclose(x.aux, y.aux, rtol=1.3e-6 * 5, atol=1e-6, err_msg=f"{what}: {k} absmax/float32")
        keep = _q8_codes_compared(x) & _q8_codes_compared(y)
        diff = x.codes[keep].astype(np.int64) - y.codes[keep]
        assert np.abs(diff).max(initial=0) <= 1, (what, k)
        assert np.count_nonzero(diff) <= max(3, diff.size // 10_000), (what, k, np.count_nonzero(diff))


#: The 8-bit matrix's variants that zero the gradient in the kernel (checked); the others keep it, as the
#: optimizers' flat-buffer reads of tests/optim/test_state8.py do, whose signature they share. So each
#: variant compiles one 8-bit signature at most, not two (the zeroing is the same store, clear_grad, in
#: every kernel; the float32 matrices run both forms of each).
Q8_ZEROES = frozenset({"sgd_nesterov", "adagrad"})


@pytest.mark.slow
@pytest.mark.parametrize("n", Q8_SIZES)
@variants
def test_8bit_state_matches_reference(family, n, variant, rng):
    """8-bit slots, STEPS steps, each from the same state: the fast family against the reference,
    and the CUDA family against the numba one too; the gradient zeroed where the variant says."""
    from types import SimpleNamespace

    from arraytrain.optim import state8
    from arraytrain.layout import REDUCE_CHUNK

    layout = padded_layout(n)
    slots, run = VARIANTS[variant]
    blocks = SimpleNamespace(pieces=state8.block_pieces(layout, REDUCE_CHUNK))
    lr, wd = _seg_values(layout, 1e-2, rng), _seg_values(layout, 0.1, rng)
    families = {"fast": family, "ref": ref}
    if family is not cpu:
        families["numba"] = cpu
    p0 = random_flat(layout, np.float32, rng)
    st = {k: {"p": p0.copy(), "slots": _q8_slots(layout, slots, variant)} for k in families}
    assert n < Q8_THRESHOLD or st["fast"]["slots"][slots[0]].is_quantized("a")
    live = live_indices(layout)
    for t in range(1, STEPS + 1):
        g0 = random_flat(layout, np.float32, rng, scale=[1.0, 5.0, 0.1][t % 3])
        if t == 5:
            g0[live[len(live) // 3]] = np.nan
        for k in families:  # the same start: the fast family's state
            if k != "fast":
                st[k]["p"][...] = st["fast"]["p"]
                for name in slots:
                    st[k]["slots"][name].flat[...] = st["fast"]["slots"][name].flat
        ties = None
        if variant == "lion":  # sign(c) within rounding of 0: float32 and float64 may differ (see _sign_ties)
            m = st["fast"]["slots"]["exp_avg"].to_float32().astype(np.float64)
            ties = (np.abs(LION_B1 * m + (1 - LION_B1) * 0.7 * g0.astype(np.float64)) < 1e-6) & live_mask(layout)
        with np.errstate(invalid="ignore", over="ignore"):
            for k, kernels in families.items():
                args = {name: b.kernel_arg() for name, b in st[k]["slots"].items()}
                g = g0.copy()
                run(kernels, st[k]["p"], g, args, blocks, t, lr, wd, 0.7, None, 0, variant in Q8_ZEROES)
                if variant in Q8_ZEROES:
                    assert not g[live].any(), f"{variant} step {t} ({k}): the gradient is not zeroed"
        if ties is not None and ties.any():
            assert ties.sum() <= 2 + 1e-4 * ties.size
            for k in families:
                st[k]["p"][ties] = st["ref"]["p"][ties]
        _q8_compare(st["fast"], st["ref"], variant == "lamb", f"{variant} step {t}")
        if "numba" in st:
            _q8_compare(st["fast"], st["numba"], variant == "lamb", f"{variant} step {t}, CUDA vs numba")
        assert_padding_zero(st["fast"]["p"], layout, "params")
    if n >= Q8_THRESHOLD:  # the NaN reached the state: its block decodes to NaN
        assert any(np.isnan(b.aux).any() for b in st["fast"]["slots"].values())
