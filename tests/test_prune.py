"""Pruning masks inside every optimizer kernel, and arraytrain.prune's magnitude masks.

Kernels: the fast families (numba, and CUDA where a GPU is usable: the ``family``
fixture) == reference with a random mask for every optimizer (params and every
slot, STEPS steps, zero-size parameters first/middle/last, float32 and float64, with and
without a working copy); pruned weights exactly +0 after many steps with momentum and
weight decay; an all-ones mask == mask=None; the unpruned weights of an
element-wise optimizer follow the unmasked run (to rounding: separately compiled loops).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from arraytrain import (
    ArgumentTypeError,
    DTypeError,
    Engine,
    FlatBuffer,
    HyperparameterError,
    Layout,
    LayoutError,
    magnitude_mask,
    optim,
    sparsity,
)
from arraytrain.kernels import cpu
from arraytrain.kernels import reference as ref
from arraytrain.prune import MaskBuffer, apply_mask
from conftest import assert_close, assert_padding_zero, live_mask, padded_shapes, random_flat, tiered

STEPS = 8
KERNELS = ("sgd_step", "adam_step", "adagrad_step", "rmsprop_step", "lion_step", "lamb_step", "adafactor_step",
           "sophia_step", "sam_perturb", "nadam_step", "radam_step", "adamax_step", "adadelta_step")

# every optimizer kernel through its optimizer class (SAM: perturb + update each step)
OPTIMIZERS = {
    "sgd_momentum_wd": lambda: optim.SGD(lr=1e-2, momentum=0.9, weight_decay=0.1, nesterov=True),
    "adam_amsgrad": lambda: optim.Adam(lr=1e-2, weight_decay=0.1, amsgrad=True, betas=(0.9, 0.9)),
    "adamw": lambda: optim.AdamW(lr=1e-2, weight_decay=0.5),
    "adamw_bf16_state": lambda: optim.AdamW(lr=1e-2, weight_decay=0.5, state_dtype="bfloat16"),
    "adagrad": lambda: optim.Adagrad(lr=5e-2, weight_decay=0.1),
    "rmsprop_centered_momentum": lambda: optim.RMSprop(lr=1e-3, momentum=0.5, centered=True, eps=1e-2,
                                                       weight_decay=0.1),
    "lion": lambda: optim.Lion(lr=1e-2, betas=(0.5, 0.99), weight_decay=0.5),
    "lamb": lambda: optim.LAMB(lr=1e-2, weight_decay=0.1),
    "adafactor": lambda: optim.Adafactor(lr=0.1, weight_decay=0.1),
    "sophia": lambda: optim.Sophia(lr=1e-2, rho=0.05, bs=10.0, weight_decay=0.1),
    "sam_adamw": lambda: optim.SAM(optim.AdamW(lr=1e-2, weight_decay=0.5), rho=0.05),
    "asam_sgd": lambda: optim.SAM(optim.SGD(lr=1e-2, momentum=0.9, weight_decay=0.1), rho=0.5, adaptive=True),
    "nadamw": lambda: optim.NAdam(lr=1e-2, weight_decay=0.5, decoupled_weight_decay=True),
    "radam_wd": lambda: optim.RAdam(lr=1e-2, betas=(0.9, 0.9), weight_decay=0.1),  # rectified from step 6
    "adamax_wd": lambda: optim.Adamax(lr=1e-2, weight_decay=0.1),
    "adadelta_wd": lambda: optim.Adadelta(lr=1.0, eps=1e-2, weight_decay=0.1),
}
# The masked matrices run these in the default tier (one fused pass; LAMB's two passes, whose norms
# and trust ratios must ignore nothing) and every optimizer in the slow tier: the masked store is the
# same code in every kernel, and each optimizer, dtype and twin is a kernel signature to compile.
MASK_DEFAULT = ("adamw", "lamb")
# element-wise updates: an unpruned weight's trajectory does not depend on the pruned ones
ELEMENTWISE = ("sgd_momentum_wd", "adam_amsgrad", "adamw", "adagrad", "rmsprop_centered_momentum", "lion", "sophia",
               "nadamw", "radam_wd", "adamax_wd", "adadelta_wd")


def _layout(n):
    """Zero-size parameters first/middle/last, an n-vector, and matrices (Adafactor factors them)."""
    return Layout({**padded_shapes(n), "mat": (37, 29), "wide": (3, n // 3 + 1)})


def _random_mask(layout, rng, keep=0.6):
    mask = MaskBuffer.ones(layout)
    live = live_mask(layout)
    mask.flat[live] = rng.random(int(live.sum())) < keep
    return mask


def _step(opt, kernels, run, g0, mask, t, working=None):
    """One optimizer step of ``run = (params, state)`` (SAM: both windows with the same gradient)."""
    p, state = run
    g = FlatBuffer(p.layout, g0.copy())
    if isinstance(opt, optim.SAM):
        opt.perturb(kernels, p, g, state, gscale=0.9, mask=mask)
        if mask is not None:  # the ascent point keeps pruned weights at 0
            assert not np.any(p.flat[mask.flat == 0])
        g = FlatBuffer(p.layout, g0.copy())
    opt.update(kernels, p, g, state, gscale=0.9, zero_grad=t % 2 == 1, mask=mask, working=working)
    return g


def _runs(name, layout, dtype, rng, kernels=cpu):
    """The optimizer and two runs from the same parameters (Sophia's Hessian fed by ``kernels``)."""
    opt = OPTIMIZERS[name]()
    p0 = FlatBuffer(layout, random_flat(layout, dtype, rng))
    h = {n: np.abs(rng.standard_normal(layout.sizes[i])).astype(dtype) for i, n in enumerate(layout.names)}
    runs = {}
    for k in ("fast", "ref"):
        p = p0.copy()
        state = opt.init(p)
        if name == "sophia":
            opt.update_hessian(kernels, state, h, layout)  # the same h in both runs
        runs[k] = (p, state)
    return opt, runs


@pytest.mark.parametrize("n", tiered([0, 7, 1037, 278011], default=(7, 278011)))
@pytest.mark.parametrize("dtype", tiered([np.float32, np.float64], default=(np.float32,)), ids=["float32", "float64"])
@pytest.mark.parametrize("name", tiered(OPTIMIZERS, default=MASK_DEFAULT))
def test_masked_kernel_matches_reference(family, name, dtype, n, rng):
    if name == "adamw_bf16_state" and dtype == np.float64:
        pytest.skip("bfloat16 moments need float32 parameters")
    layout = _layout(n)
    opt, runs = _runs(name, layout, dtype, rng, family)
    mask = _random_mask(layout, rng)
    pruned = (mask.flat == 0) & live_mask(layout)
    lowp = name == "adamw_bf16_state"
    (pc, sc), (pr, sr) = runs["fast"], runs["ref"]
    for t in range(STEPS):
        g0 = random_flat(layout, dtype, rng, scale=[1.0, 5.0, 0.1][t % 3])
        if lowp:  # as test_amp: both start each step from the kernel's state (bfloat16 ties drift)
            pr.flat[:] = pc.flat
            for slot, buf in sc.slots.items():
                sr.slots[slot].flat[:] = buf.flat
        for k, kernels in (("fast", family), ("ref", ref)):
            _step(opt, kernels, runs[k], g0, mask, t)
            p = runs[k][0]
            assert not np.any(p.flat[pruned]) and not np.any(np.signbit(p.flat[pruned]))  # exact +0
        if lowp:
            np.testing.assert_allclose(pc.flat, pr.flat, rtol=5e-3, atol=5e-3, err_msg=f"params, step {t}")
        else:
            assert_close(pc.flat, pr.flat, dtype, err_msg=f"params, step {t}")
        assert_padding_zero(pc.flat, layout, "params")
        for slot, buf in sc.slots.items():
            a, d = buf.flat.astype(np.float64), sr.slots[slot].flat.astype(np.float64)
            if lowp:  # one bfloat16 ulp (absolute near a cancelling EMA)
                np.testing.assert_allclose(a, d, rtol=2**-7, atol=1e-5, err_msg=f"{slot}, step {t}")
            else:
                assert_close(a, d, dtype, err_msg=f"{slot}, step {t}")
        assert sc.step == sr.step == t + 1


@pytest.mark.parametrize("working", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", tiered(["adamw", "lamb", "adafactor", "sam_adamw"], default=("adamw",)))
def test_working_copy_sees_the_masked_weights(family, name, working, rng):
    import ml_dtypes

    from arraytrain.kernels.interface import LP_BF16, LP_F16

    wdtype, kind = (np.dtype(ml_dtypes.bfloat16), LP_BF16) if working == "bfloat16" else (np.dtype(np.float16), LP_F16)
    layout = _layout(1037)
    opt, runs = _runs(name, layout, np.float32, rng, family)
    mask = _random_mask(layout, rng)
    live = live_mask(layout)
    w = {k: np.full(layout.size, 0x3F80, np.uint16) * live for k in runs}  # 1.0 where weights live
    for t in range(3):
        g0 = random_flat(layout, np.float32, rng)
        for k, kernels in (("fast", family), ("ref", ref)):
            _step(opt, kernels, runs[k], g0, mask, t, working=(w[k], kind))
        p = runs["fast"][0].flat
        np.testing.assert_array_equal(w["fast"][live], p[live].astype(wdtype).view(np.uint16))
        assert not np.any(w["fast"][(mask.flat == 0) & live])
        wc, wr = (w[k].view(wdtype).astype(np.float64) for k in ("fast", "ref"))
        np.testing.assert_allclose(wc, wr, rtol=5e-3, atol=5e-3)  # roundings of nearly equal weights
        assert_close(p, runs["ref"][0].flat, np.float32)


@pytest.mark.parametrize("kernels", [cpu, ref], ids=["numba", "reference"])
@pytest.mark.parametrize("name", tiered(OPTIMIZERS, default=MASK_DEFAULT))
def test_all_ones_mask_equals_no_mask(name, kernels, rng):
    """An all-ones mask changes nothing. The masked and mask-free loops are compiled
    separately and fastmath's ``contract`` lets LLVM fuse multiply-adds differently in
    each, so the numba runs agree to rounding (1 ulp seen), not always to the bit."""
    layout = _layout(70001)  # the parallel twins
    opt, runs = _runs(name, layout, np.float32, rng)
    runs = {"none": runs["fast"], "ones": (runs["fast"][0].copy(), opt.init(runs["fast"][0]))}
    if name == "sophia":
        runs["ones"][1].slots["hessian"].flat[:] = runs["none"][1].slots["hessian"].flat
    ones = MaskBuffer.ones(layout)
    for t in range(4):
        g0 = random_flat(layout, np.float32, rng)
        _step(opt, kernels, runs["none"], g0, None, t)
        _step(opt, kernels, runs["ones"], g0, ones, t)
        assert_close(runs["ones"][0].flat, runs["none"][0].flat, np.float32, err_msg=f"params, step {t}")
        for slot, buf in runs["none"][1].slots.items():
            assert_close(runs["ones"][1].slots[slot].flat, buf.flat, np.float32, err_msg=f"{slot}, step {t}")


@pytest.mark.parametrize("name", tiered(ELEMENTWISE, default=("adamw",)))
def test_pruned_weights_stay_zero_and_the_rest_follow_the_unmasked_run(name, rng):
    """60 steps with momentum and weight decay: pruned weights exactly 0, the others equal
    to a run without a mask (element-wise updates do not couple weights; to rounding, as
    the two loops are compiled separately: see test_all_ones_mask_equals_no_mask)."""
    layout = _layout(5000)
    opt, runs = _runs(name, layout, np.float32, rng)
    mask = _random_mask(layout, rng, keep=0.5)
    pruned, kept = (mask.flat == 0) & live_mask(layout), mask.flat == 1
    for t in range(60):
        g0 = random_flat(layout, np.float32, rng)
        _step(opt, cpu, runs["fast"], g0, mask, t)
        _step(opt, cpu, runs["ref"], g0, None, t)  # same kernels, no mask
    p, unmasked = runs["fast"][0].flat, runs["ref"][0].flat
    assert np.all(p[pruned] == 0) and not np.any(np.signbit(p[pruned]))
    assert np.any(unmasked[pruned] != 0)  # without the mask momentum and decay move them
    assert_close(p[kept], unmasked[kept], np.float32)


def test_engine_free_training_keeps_the_pattern(rng):
    """magnitude_mask -> apply_mask -> optimizer steps: sparsity holds exactly."""
    params = FlatBuffer.from_arrays({"w": rng.standard_normal((40, 30)), "b": rng.standard_normal(30)})
    mask = magnitude_mask(params, ratio=0.7)
    apply_mask(params, mask)
    opt = optim.AdamW(lr=1e-2, weight_decay=0.1)
    state = opt.init(params)
    for _ in range(20):
        opt.update(cpu, params, FlatBuffer(params.layout, random_flat(params.layout, np.float64, rng)), state,
                   mask=mask)
    s = sparsity(params)
    assert s["parameters"]["w"] == pytest.approx(0.7, abs=1 / 1200) and s["parameters"]["b"] == 0.0
    assert sparsity(mask) == s


@pytest.mark.parametrize("name", KERNELS)
def test_twins_take_the_mask_last(name):
    for module in (cpu, ref):
        params = list(inspect.signature(getattr(module, name)).parameters.values())
        assert params[-1].name == "mask" and params[-1].default is None
    fast, slow = (list(inspect.signature(getattr(m, name)).parameters) for m in (cpu, ref))
    assert fast == slow


def _bad_masks(layout):
    other = Layout({"x": (3,)})
    noncontig = np.ones(2 * layout.size, np.uint8)[::2]
    return {
        "float": (np.ones(layout.size, np.float32), DTypeError, "uint8"),
        "bool": (np.ones(layout.size, bool), DTypeError, "uint8"),
        "short": (np.ones(layout.size - 1, np.uint8), LayoutError, "shape"),
        "2-d": (np.ones((1, layout.size), np.uint8), LayoutError, "shape"),
        "non-contiguous": (noncontig, LayoutError, "contiguous"),
        "other-layout": (MaskBuffer.ones(other), LayoutError, "layout"),
        "list": ([1] * layout.size, ArgumentTypeError, "mask"),
    }


@pytest.mark.parametrize("case", list(_bad_masks(Layout({"a": (4,)}))))
@pytest.mark.parametrize("name", ["adamw", "sam_adamw"])
def test_bad_mask_is_refused_and_nothing_changes(name, case, rng):
    layout = _layout(7)
    mask, error, match = _bad_masks(layout)[case]
    opt, runs = _runs(name, layout, np.float32, rng)
    p, state = runs["fast"]
    g = FlatBuffer(layout, random_flat(layout, np.float32, rng))
    before = (p.flat.tobytes(), g.flat.tobytes(), {k: v.flat.tobytes() for k, v in state.slots.items()}, state.step)
    calls = [lambda: opt.update(cpu, p, g, state, mask=mask)]
    if isinstance(opt, optim.SAM):
        calls.append(lambda: opt.perturb(cpu, p, g, state, mask=mask))
    for call in calls:
        with pytest.raises(error, match=match):
            call()
        after = (p.flat.tobytes(), g.flat.tobytes(), {k: v.flat.tobytes() for k, v in state.slots.items()}, state.step)
        assert after == before


# -- magnitude_mask ------------------------------------------------------------------------------

SHAPES = {"fc1.weight": (8, 5), "fc1.bias": (5,), "empty": (0, 4), "fc2.weight": (6, 3), "fc2.bias": (3,)}


def _params(rng, dtype=np.float32):
    return FlatBuffer.from_arrays({k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()})


def _pruned(mask, name):
    return mask[name] == 0


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 0.9])
def test_global_ratio_prunes_the_smallest_weights(ratio, rng):
    params = _params(rng)
    mask = magnitude_mask(params, ratio=ratio)
    weights = ("fc1.weight", "fc2.weight")
    mags = np.concatenate([np.abs(params[n]).ravel() for n in weights])
    k = int(np.floor(ratio * mags.size))
    pruned = np.concatenate([_pruned(mask, n).ravel() for n in weights])
    assert pruned.sum() == k
    if 0 < k < mags.size:
        assert mags[pruned].max() <= mags[~pruned].min()  # one global cut
    for name in ("fc1.bias", "fc2.bias", "empty"):  # not selected by default: kept
        assert np.all(mask[name] == 1)
    assert mask.flat.dtype == np.uint8 and mask.layout == params.layout
    assert np.all(mask.flat[~live_mask(params.layout)] == 1)  # padding: 1, documented


def test_parameter_scope_cuts_each_parameter(rng):
    params = _params(rng)
    params["fc2.weight"][...] *= 1e4  # a global cut would prune fc1 only
    glob = magnitude_mask(params, ratio=0.5)
    per = magnitude_mask(params, ratio=0.5, scope="parameter")
    assert _pruned(glob, "fc2.weight").sum() == 0 and _pruned(glob, "fc1.weight").sum() == 29
    assert _pruned(per, "fc1.weight").sum() == 20 and _pruned(per, "fc2.weight").sum() == 9
    for name in ("fc1.weight", "fc2.weight"):
        m, p = _pruned(per, name), np.abs(params[name])
        assert p[m].max() <= p[~m].min()


def test_threshold_prunes_at_or_below(rng):
    params = _params(rng)
    params["fc1.weight"][0, :3] = [0.0, 0.25, -0.25]
    mask = magnitude_mask(params, threshold=0.25)
    for name in ("fc1.weight", "fc2.weight"):
        np.testing.assert_array_equal(_pruned(mask, name), np.abs(params[name]) <= 0.25)
    assert np.all(_pruned(mask, "fc1.weight")[0, :3])
    zeros = magnitude_mask(params, threshold=0.0)
    assert _pruned(zeros, "fc1.weight").sum() == 1  # only the exact zero
    assert magnitude_mask(params, threshold=0.25, scope="parameter").flat.tobytes() == mask.flat.tobytes()
    # float32 weights are compared in float64: float32(0.3) = 0.30000001 is above 0.3
    params["fc1.weight"][0, 1] = 0.3
    assert magnitude_mask(params, threshold=0.3)["fc1.weight"][0, 1] == 1


def test_ties_at_the_cut_go_to_earlier_elements():
    params = FlatBuffer.from_arrays({"w": np.array([[1.0, 2.0, 1.0], [1.0, 3.0, 1.0]])})
    mask = magnitude_mask(params, ratio=0.5)  # k = 3 of four tied 1.0s
    np.testing.assert_array_equal(mask["w"], [[0, 1, 0], [0, 1, 1]])


@pytest.mark.parametrize("scope", ["global", "parameter"])
def test_rows_prune_whole_rows_by_l2_norm(scope, rng):
    params = _params(rng)
    params["fc1.weight"][[1, 4]] *= 1e-3
    params["fc2.weight"][2] *= 1e-3
    mask = magnitude_mask(params, ratio=0.25, structure="rows", scope=scope)
    rows1, rows2 = mask["fc1.weight"].min(axis=1), mask["fc2.weight"].min(axis=1)
    assert np.all(mask["fc1.weight"] == rows1[:, None]) and np.all(mask["fc2.weight"] == rows2[:, None])
    if scope == "global":  # floor(0.25 * 14 rows) = 3: the three small rows
        assert set(np.flatnonzero(rows1 == 0)) == {1, 4} and set(np.flatnonzero(rows2 == 0)) == {2}
    else:  # floor(0.25 * 8) = 2 and floor(0.25 * 6) = 1
        assert set(np.flatnonzero(rows1 == 0)) == {1, 4} and set(np.flatnonzero(rows2 == 0)) == {2}
    norms = np.linalg.norm(params["fc1.weight"].astype(np.float64), axis=1)
    assert norms[rows1 == 0].max() <= norms[rows1 == 1].min()
    thr = magnitude_mask(params, threshold=1e-2, structure="rows", names=["*"])  # biases: 1-D, not row-pruned
    assert np.all(thr["fc1.bias"] == 1) and set(np.flatnonzero(thr["fc1.weight"].min(axis=1) == 0)) == {1, 4}


def test_names_select_parameters(rng):
    params = _params(rng)
    mask = magnitude_mask(params, ratio=0.5, names=["fc1.*"])
    assert _pruned(mask, "fc1.weight").sum() + _pruned(mask, "fc1.bias").sum() == 22
    assert np.all(mask["fc2.weight"] == 1)
    only = magnitude_mask(params, ratio=0.5, names="fc2.weight")
    assert _pruned(only, "fc2.weight").sum() == 9 and np.all(only["fc1.weight"] == 1)


def test_engine_params_accepted_and_sparsity(rng):
    engine = Engine({k: rng.standard_normal(s) for k, s in SHAPES.items()}, optim.SGD(lr=0.1))
    mask = magnitude_mask(engine, ratio=0.5)
    s = sparsity(mask)
    assert s["parameters"]["fc1.weight"] + s["parameters"]["fc2.weight"] > 0
    assert s["parameters"]["empty"] == 0.0 and s["parameters"]["fc1.bias"] == 0.0
    assert s["total"] == pytest.approx(29 / engine.layout.num_elements)
    assert set(s["parameters"]) == set(SHAPES)
    assert sparsity(FlatBuffer.from_arrays({"e": np.zeros(0)})) == {"total": 0.0, "parameters": {"e": 0.0}}


def test_mask_buffer_is_checked():
    layout = Layout({"a": (3,)})
    with pytest.raises(DTypeError, match="uint8"):
        MaskBuffer(layout, np.ones(layout.size, np.float32))
    with pytest.raises(LayoutError, match="1-D"):
        MaskBuffer(layout, np.ones(layout.size + 1, np.uint8))
    m = MaskBuffer.ones(layout)
    c = m.copy()
    c.flat[0] = 0
    assert m.flat[0] == 1 and isinstance(c, MaskBuffer) and isinstance(c, FlatBuffer)


BAD_PRUNE = {
    "no-ratio-no-threshold": (dict(), HyperparameterError, "exactly one"),
    "both": (dict(ratio=0.5, threshold=0.1), HyperparameterError, "exactly one"),
    "ratio-one": (dict(ratio=1.0), HyperparameterError, "ratio"),
    "ratio-negative": (dict(ratio=-0.1), HyperparameterError, "ratio"),
    "ratio-nan": (dict(ratio=float("nan")), HyperparameterError, "ratio"),
    "ratio-str": (dict(ratio="0.5"), HyperparameterError, "ratio"),
    "threshold-negative": (dict(threshold=-1.0), HyperparameterError, "threshold"),
    "threshold-inf": (dict(threshold=float("inf")), HyperparameterError, "threshold"),
    "scope": (dict(ratio=0.5, scope="layer"), HyperparameterError, "scope"),
    "structure": (dict(ratio=0.5, structure="columns"), HyperparameterError, "structure"),
    "names-no-match": (dict(ratio=0.5, names=["fc9.*"]), HyperparameterError, r"names\['fc9.\*'\]: matches no"),
    "names-empty": (dict(ratio=0.5, names=[]), HyperparameterError, "names"),
    "names-int": (dict(ratio=0.5, names=3), HyperparameterError, "names"),
}


@pytest.mark.parametrize("case", list(BAD_PRUNE))
def test_bad_pruning_arguments(case, rng):
    params = _params(rng)
    before = params.flat.tobytes()
    kw, error, match = BAD_PRUNE[case]
    with pytest.raises(error, match=match):
        magnitude_mask(params, **kw)
    assert params.flat.tobytes() == before


def test_bad_params_and_masks(rng):
    with pytest.raises(ArgumentTypeError, match="params"):
        magnitude_mask({"w": np.ones((2, 2))}, ratio=0.5)
    params = _params(rng)
    with pytest.raises(ArgumentTypeError, match="mask"):
        apply_mask(params, params)
    with pytest.raises(LayoutError, match="layout"):
        apply_mask(params, MaskBuffer.ones(Layout({"x": (2,)})))
    with pytest.raises(ArgumentTypeError, match="buf"):
        sparsity(np.zeros(3))
