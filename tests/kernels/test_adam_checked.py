"""The CPU family's one-call Adam/AdamW step (``kernels.cpu.adam_checked``) against its reference twin:
the reference family's norm pass, the judge's clip factor (``ops.clip_factor``) and the reference Adam
update composed as the kernel composes them, for parameters of 0, 1, 7 and odd sizes, both twins (a
buffer under and over ``SERIAL_BELOW``), clipped or not, Adam and AdamW, AMSGrad, maximize, two step-count
groups; and a NaN gradient under ``check``: nothing written."""

import math

import numpy as np
import pytest

from arraytrain import FlatBuffer, Layout
from arraytrain.buffer import segment_addresses
from arraytrain.kernels import cpu, reference
from arraytrain.kernels.cpu import SERIAL_BELOW
from arraytrain.ops import clip_factor

SMALL = {"a": (0,), "b": (1,), "c": (7,), "d": (3, 11)}
LARGE = {**SMALL, "e": (SERIAL_BELOW + 13,)}


def _setup(shapes, seed):
    rng = np.random.default_rng(seed)
    lay = Layout(shapes)
    bufs = {k: FlatBuffer.zeros(lay, np.float32) for k in ("p", "g", "m", "v", "vmax")}
    for k in ("p", "g", "m"):
        bufs[k].flat[...] = rng.standard_normal(lay.size).astype(np.float32)
    bufs["v"].flat[...] = rng.random(lay.size).astype(np.float32)
    bufs["vmax"].flat[...] = bufs["v"].flat * np.float32(1.5)
    rates = np.column_stack([rng.uniform(1e-3, 1e-2, len(lay)), rng.uniform(0, 0.1, len(lay))])
    return lay, bufs, rates


def _reference(lay, b, rates, groups, *, max_norm, eps, decoupled, maximize, amsgrad, beta1=0.9, beta2=0.999):
    """The kernel's composition, step by step, on the reference family (float64 math, one rounding)."""
    total, per_seg = reference.sumsq(b["g"].flat, lay.pieces, nseg=len(lay))
    coef = 1.0 if max_norm is None else clip_factor(math.sqrt(total), max_norm, eps)
    for t, segs in groups:  # one update per step count: its own bias corrections
        rows = lay.pieces[np.isin(lay.pieces[:, 2], segs)]
        lr, wd = rates[:, 0], rates[:, 1]
        step_size = (lr / (1.0 - beta1**t)).astype(np.float32)
        l2 = np.zeros(len(lay), np.float32) if decoupled else wd.astype(np.float32)
        decay = (1.0 - lr * wd).astype(np.float32) if decoupled else np.ones(len(lay), np.float32)
        reference.adam_step(b["p"].flat, b["g"].flat, b["m"].flat, b["v"].flat, b["vmax"].flat if amsgrad else
                            b["vmax"].flat[:0], rows, gscale=(-1.0 if maximize else 1.0) * coef, step_size=step_size,
                            beta1=beta1, beta2=beta2, eps=1e-8, inv_bc2_sqrt=1.0 / math.sqrt(1.0 - beta2**t), l2=l2,
                            decay=decay, amsgrad=amsgrad)
    return total, per_seg


def _kernel(lay, b, rates, groups, *, max_norm, eps, decoupled, maximize, amsgrad, check=True, beta1=0.9, beta2=0.999):
    tables = [lay.pieces[np.isin(lay.pieces[:, 2], segs)] for _, segs in groups]
    upieces = np.concatenate(tables)
    bounds = np.cumsum([0] + [len(t) for t in tables]).astype(np.int64)
    hp_lr, hp_wd = np.full(len(lay), np.nan, np.float32), np.full(len(lay), np.nan, np.float32)
    ts = [t for t, _ in groups]
    return cpu.adam_checked(
        b["p"].flat, b["g"].flat, b["m"].flat, b["v"].flat, b["vmax"].flat if amsgrad else b["vmax"].flat[:0], hp_lr,
        hp_wd, rates, segment_addresses(b["g"]).copy(), np.asarray(lay.offsets, np.int64), upieces, bounds, lay.pieces,
        unscale=1.0, max_norm=max_norm, clip_eps=eps, check=check, maximize=maximize, decoupled=decoupled, beta1=beta1,
        beta2=beta2, eps=1e-8, amsgrad=amsgrad, lr_div=[1.0 - beta1**t for t in ts],
        inv_bc2_sqrt=[1.0 / math.sqrt(1.0 - beta2**t) for t in ts])


@pytest.mark.parametrize("shapes", [SMALL, LARGE], ids=["serial", "parallel"])
@pytest.mark.parametrize("max_norm", [None, 0.5])
@pytest.mark.parametrize("decoupled, maximize, amsgrad", [(True, False, False), (False, True, True)])
def test_the_one_call_step_equals_the_reference_composition(shapes, max_norm, decoupled, maximize, amsgrad):
    lay, b, rates = _setup(shapes, 3)
    want = {k: FlatBuffer(lay, v.flat.copy()) for k, v in b.items()}
    groups = [(5, [0, 1, 3]), (2, [2] + list(range(4, len(lay))))]  # (t, segments) per step count
    kw = dict(max_norm=max_norm, eps=1e-6, decoupled=decoupled, maximize=maximize, amsgrad=amsgrad)
    total_ref, per_ref = _reference(lay, want, rates, groups, **kw)
    total, per_seg, applied = _kernel(lay, b, rates, groups, **kw)
    assert applied
    np.testing.assert_allclose(total, total_ref, rtol=1e-12)
    np.testing.assert_allclose(per_seg, per_ref, rtol=1e-12)
    for k in ("p", "m", "v", "vmax"):
        np.testing.assert_allclose(b[k].flat, want[k].flat, rtol=2e-6, atol=1e-7, err_msg=k)
    np.testing.assert_array_equal(b["g"].flat, want["g"].flat)  # the gradient is read, never written


@pytest.mark.parametrize("shapes", [SMALL, LARGE], ids=["serial", "parallel"])
def test_a_nan_gradient_under_check_writes_nothing(shapes):
    lay, b, rates = _setup(shapes, 4)
    b["g"]["c"][3] = np.nan
    before = {k: v.flat.copy() for k, v in b.items()}
    total, _, applied = _kernel(lay, b, rates, [(1, list(range(len(lay))))], max_norm=1.0, eps=1e-6, decoupled=True,
                                maximize=False, amsgrad=False)
    assert not applied and math.isnan(total)
    for k, v in before.items():
        np.testing.assert_array_equal(b[k].flat, v, err_msg=k)
