"""Compression inside the engine: what the optimizer sees, skips, resume of residuals; pruning masks."""

from __future__ import annotations

import numpy as np
import pytest

import arraytrain as at
from arraytrain import compress as C
from arraytrain.errors import (
    ArgumentTypeError,
    CheckpointError,
    DTypeError,
    LayoutError,
    StateDictError,
)
from arraytrain.kernels import cpu
from arraytrain.ops import clip_coef, norm_pass
from builders import random_engine
from conftest import engine_snapshot

SHAPES = {"fc1.weight": (24, 16), "fc1.bias": (24,), "fc2.weight": (5, 24), "fc2.bias": (5,)}

FACTORIES = {
    "topk": lambda ef=False: C.TopK(ratio=0.1, min_size=32, ramp=0),
    "randomk": lambda ef=False: C.RandomK(ratio=0.25, seed=3, rescale=not ef, ramp=0),  # EF: the contraction
    "int8": lambda ef=False: C.Int8Block(block=64, stochastic_rounding=True, seed=1),
    "sign": lambda ef=False: C.Sign(min_size=32),
    "ternary": lambda ef=False: C.Ternary(seed=2),
    "powersgd": lambda ef=False: C.PowerSGD(rank=2, seed=4),
    "vsa": lambda ef=False: C.VSA(ratio=0.5, seed=5, unbiased=not ef),
}


def _grads(rng, dtype=np.float64, scale=1.0):
    return {n: (scale * rng.standard_normal(s)).astype(dtype) for n, s in SHAPES.items()}


def _compressed_engine(compressor, dtype=np.float64, seed=0, optimizer=None, **kw):
    """An engine of ``optimizer`` (default: AdamW) over random parameters of SHAPES with ``compressor`` (None: none)."""
    return random_engine(SHAPES, optimizer or at.optim.AdamW(lr=1e-2, weight_decay=0.01), seed=seed, param_dtype=dtype,
                         compressor=compressor, **kw)


def _stream(steps, dtype=np.float64, seed=7):
    rng = np.random.default_rng(seed)
    return [_grads(rng, dtype) for _ in range(steps)]


@pytest.mark.parametrize("ef", [False, True], ids=["plain", "ef"])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_the_optimizer_steps_with_the_decoded_gradient(name, ef):
    """An engine with a compressor == an engine without, fed what a twin compressor decodes."""
    make = FACTORIES[name]
    comp = C.ErrorFeedback(make(ef)) if ef else make()
    twin = C.ErrorFeedback(make(ef)) if ef else make()
    a = _compressed_engine(comp, max_grad_norm=3.0, accumulation_steps=2)
    b = _compressed_engine(None, max_grad_norm=3.0)
    twin.bind(b.layout, b.params.dtype)
    stream = _stream(12)
    for k in range(0, 12, 2):
        for g in stream[k:k + 2]:
            rep = a.step(g)
        # the reference path: the window's sum, the mean, compress, then the engine's clip of
        # the decoded gradient (what torch's DDP hooks followed by clip_grad_norm_ do)
        mean = b.params.zeros_like()
        for n in SHAPES:
            mean[n][...] = stream[k][n]
            mean[n][...] += stream[k + 1][n]
        cpu.scale(mean.flat, factor=0.5)
        payload = twin.roundtrip(mean.flat)
        coef = clip_coef(norm_pass(cpu, mean.flat, b.layout).norm, 3.0)
        rb = b.step({n: mean[n] for n in SHAPES})
        assert rep.clip_coef == rb.clip_coef == coef and rep.grad_norm == rb.grad_norm
        assert rep.applied and rep.payload_bytes == payload.nbytes
        assert rep.dense_bytes == sum(int(np.prod(s)) for s in SHAPES.values()) * 8
        np.testing.assert_array_equal(a.params.flat, b.params.flat)
    if ef:
        np.testing.assert_array_equal(comp.residual.flat, twin.residual.flat)


def test_payload_bytes_are_smaller_and_reported():
    eng = _compressed_engine(C.ErrorFeedback(C.TopK(ratio=0.05, ramp=0)), dtype=np.float32)
    rep = eng.step(_stream(1, np.float32)[0])
    k = int(np.ceil(0.05 * eng.layout.num_elements))
    assert rep.payload_bytes == k * (4 + 4) and rep.compression == "compressed"  # uint32 index + float32 value
    assert rep.dense_bytes == eng.layout.num_elements * 4


def test_a_nonfinite_boundary_keeps_residuals_and_call_count():
    comp = C.ErrorFeedback(C.Int8Block(block=32, stochastic_rounding=True, seed=9))
    eng = _compressed_engine(comp, loss_scaler=None)
    ref = _compressed_engine(C.ErrorFeedback(C.Int8Block(block=32, stochastic_rounding=True, seed=9)))
    stream = _stream(6)
    bad = {n: g.copy() for n, g in stream[2].items()}
    bad["fc2.weight"][1, 1] = np.nan
    for i, g in enumerate(stream):
        if i == 3:
            before = (comp.residual.flat.copy(), comp.step)
            assert eng.step(bad).skipped
            np.testing.assert_array_equal(comp.residual.flat, before[0])
            assert comp.step == before[1]
        eng.step(g)
        ref.step(g)
    np.testing.assert_array_equal(eng.params.flat, ref.params.flat)
    np.testing.assert_array_equal(comp.residual.flat, ref.compressor.residual.flat)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_resume_through_a_checkpoint_restores_residuals_bitwise(name, tmp_path):
    make = FACTORIES[name]
    stream = _stream(10)
    full = _compressed_engine(C.ErrorFeedback(make(True)), schedule=at.schedules.CosineAnnealingLR(10))
    for g in stream:
        full.step(g)
    first = _compressed_engine(C.ErrorFeedback(make(True)), schedule=at.schedules.CosineAnnealingLR(10))
    for g in stream[:5]:
        first.step(g)
    assert np.abs(first.compressor.residual.flat).max() > 0  # something to lose
    at.save(tmp_path / "ck.safetensors", first)
    second = _compressed_engine(C.ErrorFeedback(make(True)), seed=1, schedule=at.schedules.CosineAnnealingLR(10))
    at.load(tmp_path / "ck.safetensors", second)
    np.testing.assert_array_equal(second.compressor.residual.flat, first.compressor.residual.flat)
    assert second.compressor.step == 5
    for g in stream[5:]:
        second.step(g)
    snap_a, snap_b = engine_snapshot(full), engine_snapshot(second)
    for key in snap_a:
        np.testing.assert_array_equal(snap_a[key], snap_b[key], err_msg=key)
    np.testing.assert_array_equal(second.compressor.residual.flat, full.compressor.residual.flat)


def test_mismatched_compression_state_is_refused_and_changes_nothing():
    src = _compressed_engine(C.ErrorFeedback(C.TopK(ratio=0.1)))
    src.step(_stream(1)[0])
    state = src.state_dict()
    for target, match in [
        (_compressed_engine(None), "compression"),
        (_compressed_engine(C.TopK(ratio=0.1)), "error-feedback"),
        (_compressed_engine(C.ErrorFeedback(C.TopK(ratio=0.2))), "TopK"),
        (_compressed_engine(C.ErrorFeedback(C.Sign())), "Sign"),
    ]:
        before = engine_snapshot(target)
        with pytest.raises(StateDictError, match=match):
            target.load_state_dict(state)
        after = engine_snapshot(target)
        for key in before:
            np.testing.assert_array_equal(before[key], after[key])


def test_checkpoint_of_a_compressed_run_refuses_an_engine_without_one(tmp_path):
    src = _compressed_engine(C.ErrorFeedback(C.Sign()))
    src.step(_stream(1)[0])
    at.save(tmp_path / "ck.safetensors", src)
    with pytest.raises(CheckpointError, match="compression"):
        at.load(tmp_path / "ck.safetensors", _compressed_engine(None))


def test_bad_compressor_arguments():
    with pytest.raises(ArgumentTypeError, match="compressor"):
        _compressed_engine("topk")
    with pytest.raises(ArgumentTypeError, match="compressor"):
        C.ErrorFeedback(object())
    used = C.TopK(ratio=0.1)
    _compressed_engine(used)
    with pytest.raises(LayoutError, match="already bound"):
        at.Engine({"w": np.zeros(3)}, at.optim.SGD(lr=0.1), compressor=used)


def test_warmup_sends_everything_and_leaves_no_residual():
    comp = C.ErrorFeedback(C.Sign(warmup=3))
    eng = _compressed_engine(comp)
    plain = _compressed_engine(None)
    for i, g in enumerate(_stream(5)):
        rep = eng.step(g)
        plain.step(g)
        if i < 3:
            assert rep.payload_bytes == rep.dense_bytes
            assert not comp.residual.flat.any()
            np.testing.assert_array_equal(eng.params.flat, plain.params.flat)
        else:
            assert rep.payload_bytes < rep.dense_bytes / 10


# -- pruning masks --------------------------------------------------------------------------


def test_set_mask_zeroes_now_and_keeps_pruned_weights_zero(tmp_path):
    eng = _compressed_engine(None, optimizer=at.optim.AdamW(lr=1e-2, weight_decay=0.1))
    mask = at.prune.magnitude_mask(eng.params, ratio=0.5)
    eng.set_mask(mask)
    pruned = mask.flat == 0
    live = np.zeros(eng.layout.size, bool)
    for n in SHAPES:
        live[eng.layout.slice(n)] = True
    assert (pruned & live).sum() > 0 and not eng.params.flat[pruned & live].any()
    for g in _stream(5):
        eng.step(g)
    assert not eng.params.flat[pruned & live].any()
    assert eng.params.flat[~pruned & live].all()
    at.save(tmp_path / "m.safetensors", eng)
    other = _compressed_engine(None, seed=3, optimizer=at.optim.AdamW(lr=1e-2, weight_decay=0.1))
    with pytest.raises(CheckpointError, match="mask"):
        at.load(tmp_path / "m.safetensors", other)
    other.set_mask({"fc1.weight": np.ones((24, 16), bool)})
    at.load(tmp_path / "m.safetensors", other)
    np.testing.assert_array_equal(other.mask.flat, eng.mask.flat)


def test_mask_mapping_and_bad_masks_change_nothing():
    eng = _compressed_engine(None)
    m = np.ones((5, 24), np.int64)
    m[:, :3] = 0
    eng.set_mask({"fc2.weight": m})
    assert not eng.params["fc2.weight"][:, :3].any()
    assert eng.mask["fc1.weight"].all()
    before = engine_snapshot(eng)
    mask_before = eng.mask.flat.copy()
    bad = [
        ({"nope": np.ones(3)}, LayoutError),
        ({"fc2.weight": np.ones((24, 5))}, LayoutError),
        ({"fc2.weight": np.full((5, 24), 0.5)}, DTypeError),
        ({"fc2.weight": np.full((5, 24), 2)}, DTypeError),
        (eng.params.zeros_like(np.float32), DTypeError),
        ("half", ArgumentTypeError),
    ]
    for mask, err in bad:
        with pytest.raises(err, match="mask"):
            eng.set_mask(mask)
    np.testing.assert_array_equal(eng.mask.flat, mask_before)
    after = engine_snapshot(eng)
    for key in before:
        np.testing.assert_array_equal(before[key], after[key])
    eng.set_mask(None)
    assert eng.mask is None
