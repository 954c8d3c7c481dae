"""GradientAccumulator: per-parameter sums, counts and weighted means over micro-batches, on a flat buffer."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from arraytrain import (
    AccumulationConfig,
    AccumulationError,
    AccumulationStats,
    AccumulatorFullError,
    ArrayTrainError,
    DTypeError,
    GradientAccumulator,
    HyperparameterError,
    NoGradientsError,
    ShapeMismatchError,
    UnknownParameterError,
)
from arraytrain.ops import CLIP_EPS


def _acc(steps=4, reduction="mean", max_grad_norm=None, clip_eps=0.0, **shapes):
    """An accumulator over ``shapes``; clipping (if any) to exactly ``max_grad_norm`` unless ``clip_eps`` says."""
    acc = GradientAccumulator(AccumulationConfig(steps, reduction, max_grad_norm, clip_eps))
    for name, shape in (shapes or {"w": (2, 3), "b": (3,)}).items():
        acc.register(name, shape)
    return acc


def _state(acc):
    return (acc._buf.flat.copy(), acc._counts.copy(), acc._weights.copy(),
            acc.total_micro_batches, acc.total_updates, acc._buf.layout)


def _assert_same_state(acc, snap):
    flat, counts, weights, micro, updates, layout = snap
    np.testing.assert_array_equal(acc._buf.flat, flat)
    np.testing.assert_array_equal(acc._counts, counts)
    np.testing.assert_array_equal(acc._weights, weights)
    assert (acc.total_micro_batches, acc.total_updates, acc._buf.layout) == (micro, updates, layout)


# -- config ----------------------------------------------------------------------------------


def test_config_defaults():
    cfg = AccumulationConfig()
    assert (cfg.accumulation_steps, cfg.reduction, cfg.max_grad_norm, cfg.clip_eps) == (4, "mean", None, 1e-6)
    assert cfg.effective_batch_size(32) == 128
    assert AccumulationConfig(accumulation_steps=3).effective_batch_size(10) == 30
    assert cfg.effective_batch_size(0) == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.accumulation_steps = 2  # type: ignore[misc]


def test_default_accumulator_config():
    acc = GradientAccumulator()
    assert acc.config == AccumulationConfig()
    with pytest.raises(TypeError, match="AccumulationConfig"):
        GradientAccumulator({"accumulation_steps": 2})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"accumulation_steps": 0}, "accumulation_steps"),
        ({"accumulation_steps": -1}, "accumulation_steps"),
        ({"accumulation_steps": 2.0}, "accumulation_steps"),
        ({"accumulation_steps": True}, "accumulation_steps"),
        ({"reduction": "avg"}, "reduction"),
        ({"reduction": True}, "reduction"),
        ({"clip_eps": -1e-6}, "clip_eps"),
        ({"clip_eps": float("nan")}, "clip_eps"),
        ({"clip_eps": None}, "clip_eps"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"max_grad_norm": float("inf")}, "max_grad_norm"),
        ({"max_grad_norm": float("nan")}, "max_grad_norm"),
        ({"max_grad_norm": "5"}, "max_grad_norm"),
    ],
)
def test_config_rejects(kwargs, match):
    with pytest.raises(HyperparameterError, match=match):
        AccumulationConfig(**kwargs)


@pytest.mark.parametrize("bad", [-1, 2.5, True, "8"])
def test_effective_batch_size_rejects(bad):
    with pytest.raises(HyperparameterError, match="micro_batch_size"):
        AccumulationConfig().effective_batch_size(bad)


# -- register -----------------------------------------------------------------------------------


def test_register_same_shape_is_noop():
    acc = _acc(w=(2, 3))
    acc.accumulate("w", np.ones((2, 3)))
    snap = _state(acc)
    acc.register("w", (2, 3))
    acc.register("w", [2, 3])
    _assert_same_state(acc, snap)
    assert acc.stats().registered_params == 1


@pytest.mark.parametrize("shape", [(3, 2), (6,), (2, 3, 1), ()])
def test_register_different_shape_raises(shape):
    acc = _acc(w=(2, 3))
    snap = _state(acc)
    with pytest.raises(ShapeMismatchError, match="'w'") as info:
        acc.register("w", shape)
    assert info.value.name == "w" and info.value.expected == (2, 3) and info.value.got == tuple(shape)
    _assert_same_state(acc, snap)


def test_register_after_accumulating_keeps_sums():
    acc = _acc(w=(2,))
    acc.accumulate("w", np.array([1.0, 2.0]))
    acc.register("b", (3,))
    acc.accumulate("b", np.array([4.0, 5.0, 6.0]))
    g = acc.get_gradients()
    np.testing.assert_array_equal(g["w"], [1.0, 2.0])
    np.testing.assert_array_equal(g["b"], [4.0, 5.0, 6.0])


# -- accumulate / get_gradients -------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_mean_or_sum(reduction, k):
    rng = np.random.default_rng(k)
    grads = [{"w": rng.standard_normal((2, 3)), "b": rng.standard_normal(3)} for _ in range(k)]
    acc = _acc(steps=4, reduction=reduction)
    for g in grads:
        acc.step(g)
    out = acc.get_gradients()
    for name in ("w", "b"):
        total = sum(g[name] for g in grads)
        np.testing.assert_allclose(out[name], total / k if reduction == "mean" else total, rtol=1e-14, atol=1e-15)


def test_mean_is_per_parameter():
    acc = _acc(steps=4)
    acc.step({"w": np.full((2, 3), 2.0), "b": np.full(3, 6.0)})
    acc.step({"w": np.full((2, 3), 4.0)})
    acc.accumulate("w", np.full((2, 3), 6.0))
    out = acc.get_gradients()
    np.testing.assert_array_equal(out["w"], 4.0)  # mean over its 3 micro-batches
    np.testing.assert_array_equal(out["b"], 6.0)  # mean over its 1 micro-batch


def test_param_without_gradient_is_zero():
    acc = _acc()
    acc.accumulate("w", np.ones((2, 3)))
    out = acc.get_gradients()
    np.testing.assert_array_equal(out["b"], 0.0)
    np.testing.assert_array_equal(out["w"], 1.0)


def test_get_gradients_returns_fresh_copies():
    acc = _acc()
    acc.accumulate("w", np.ones((2, 3)))
    first = acc.get_gradients()
    first["w"][...] = 100
    second = acc.get_gradients()
    np.testing.assert_array_equal(second["w"], 1.0)
    assert not np.shares_memory(first["w"], second["w"])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_clip_eps_0_scales_to_max_norm(reduction):
    """``clip_eps=0.0``: optax's clip_by_global_norm, exactly ``max_grad_norm`` after."""
    acc = _acc(steps=4, reduction=reduction, max_grad_norm=5.0, clip_eps=0.0, g=(2,))
    acc.accumulate("g", np.array([30.0, 40.0]))
    out = acc.get_gradients()["g"]
    np.testing.assert_allclose(out, [3.0, 4.0], rtol=0, atol=1e-10)


def test_clip_default_is_torchs_rule_as_the_engines():
    """The default ``clip_eps`` is the Engine's: ``max_norm / (norm + 1e-6)`` (torch's clip_grad_norm_)."""
    acc = GradientAccumulator(AccumulationConfig(2, max_grad_norm=5.0))
    acc.register("g", (2,))
    acc.accumulate("g", np.array([30.0, 40.0]))
    coef = 5.0 / (50.0 + 1e-6)
    np.testing.assert_array_equal(acc.get_gradients()["g"], np.array([30.0, 40.0]) * coef)
    assert AccumulationConfig().clip_eps == CLIP_EPS == 1e-6


def test_clip_is_global_across_parameters():
    acc = _acc(steps=2, max_grad_norm=1.0, a=(1,), b=(1,))
    acc.step({"a": np.array([6.0]), "b": np.array([8.0])})
    acc.step({"a": np.array([6.0]), "b": np.array([8.0])})
    out = acc.get_gradients()
    np.testing.assert_allclose([out["a"][0], out["b"][0]], [0.6, 0.8], rtol=0, atol=1e-12)


def test_no_clip_below_max_norm():
    acc = _acc(max_grad_norm=100.0, g=(2,))
    acc.accumulate("g", np.array([30.0, 40.0]))
    np.testing.assert_array_equal(acc.get_gradients()["g"], [30.0, 40.0])


def test_clip_after_normalisation():
    # mean of [30,40] and [90,120] is [60,80] (norm 100) -> clipped to norm 10
    acc = _acc(steps=2, max_grad_norm=10.0, g=(2,))
    acc.step({"g": np.array([30.0, 40.0])})
    acc.step({"g": np.array([90.0, 120.0])})
    np.testing.assert_allclose(acc.get_gradients()["g"], [6.0, 8.0], rtol=0, atol=1e-10)


def test_global_norm_of_raw_sums():
    acc = _acc(steps=2, g=(2,))
    acc.step({"g": np.array([3.0, 0.0])})
    acc.step({"g": np.array([0.0, 4.0])})
    assert acc.global_norm() == pytest.approx(5.0)


# -- should_update / step / reset / stats -------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3])
def test_step_returns_should_update(k):
    acc = _acc(steps=k)
    results = [acc.step({"w": np.ones((2, 3)), "b": np.ones(3)}) for _ in range(k)]
    assert results == [False] * (k - 1) + [True]
    assert acc.should_update()


def test_should_update_when_any_param_is_full():
    acc = _acc(steps=2)
    assert not acc.should_update()
    acc.accumulate("w", np.ones((2, 3)))
    assert not acc.should_update()
    acc.accumulate("w", np.ones((2, 3)))
    assert acc.should_update()  # b has none, w is full


def test_reset():
    acc = _acc(steps=2)
    acc.step({"w": np.ones((2, 3)), "b": np.ones(3)}, weight=3.0)
    acc.step({"w": np.ones((2, 3)), "b": np.ones(3)})
    assert acc.should_update()
    acc.reset()
    assert not acc._buf.flat.any()
    assert not acc._counts.any() and not acc._weights.any()
    assert not acc.should_update()
    assert acc.stats().total_updates == 1
    with pytest.raises(NoGradientsError):
        acc.get_gradients()
    # accumulation starts afresh: the old weight does not linger
    acc.step({"w": np.full((2, 3), 5.0)})
    np.testing.assert_array_equal(acc.get_gradients()["w"], 5.0)
    acc.reset()
    acc.reset()
    assert acc.stats().total_updates == 3


def test_stats():
    acc = _acc(steps=3, w=(2, 3), b=(3,), z=(0,))
    s = acc.stats()
    assert isinstance(s, AccumulationStats)
    assert s == AccumulationStats(total_micro_batches=0, total_updates=0, accumulation_steps=3,
                                  registered_params=3, total_param_elements=9)
    assert s.effective_batch_multiplier() == 3
    acc.step({"w": np.ones((2, 3))})
    acc.accumulate("b", np.ones(3))  # single-parameter accumulate is not a micro-batch
    acc.step({"w": np.ones((2, 3)), "b": np.ones(3)})
    acc.reset()
    s = acc.stats()
    assert (s.total_micro_batches, s.total_updates) == (2, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.total_updates = 5  # type: ignore[misc]


def test_zero_size_parameter():
    acc = _acc(steps=2, z=(0, 3), w=(2,))
    acc.step({"z": np.zeros((0, 3)), "w": np.array([1.0, 3.0])})
    out = acc.get_gradients()
    assert out["z"].shape == (0, 3)
    np.testing.assert_array_equal(out["w"], [1.0, 3.0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sum_dtype(dtype):
    acc = GradientAccumulator(AccumulationConfig(2), dtype=dtype)
    acc.register("w", (3,))
    acc.step({"w": np.array([1.0, 2.0, 3.0])})
    out = acc.get_gradients()["w"]
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, [1.0, 2.0, 3.0])


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["step", "accumulate"])
def test_accumulator_full(how):
    acc = _acc(steps=2)
    for _ in range(2):
        acc.step({"w": np.ones((2, 3)), "b": np.ones(3)})
    snap = _state(acc)
    with pytest.raises(AccumulatorFullError, match="reset"):
        if how == "step":
            acc.step({"w": np.ones((2, 3)), "b": np.ones(3)})
        else:
            acc.accumulate("b", np.ones(3))
    _assert_same_state(acc, snap)
    acc.reset()
    assert acc.step({"w": np.ones((2, 3))}) is False


def test_full_parameter_blocks_whole_step():
    acc = _acc(steps=2)
    acc.accumulate("w", np.ones((2, 3)))
    acc.accumulate("w", np.ones((2, 3)))
    snap = _state(acc)
    with pytest.raises(AccumulatorFullError, match="'w'"):
        acc.step({"b": np.ones(3), "w": np.ones((2, 3))})
    _assert_same_state(acc, snap)
    acc.step({"b": np.ones(3)})  # b alone still has room


def test_no_gradients_nothing_registered():
    with pytest.raises(NoGradientsError, match="registered"):
        GradientAccumulator().get_gradients()


def test_no_gradients_nothing_accumulated():
    acc = _acc()
    with pytest.raises(NoGradientsError, match="accumulated"):
        acc.get_gradients()


@pytest.mark.parametrize("how", ["step", "accumulate"])
def test_unknown_name(how):
    acc = _acc()
    acc.accumulate("w", np.ones((2, 3)))
    snap = _state(acc)
    with pytest.raises(UnknownParameterError, match="'nope'") as info:
        if how == "step":
            acc.step({"w": np.ones((2, 3)), "nope": np.ones(3)})
        else:
            acc.accumulate("nope", np.ones(3))
    assert isinstance(info.value, KeyError)
    assert str(info.value).startswith("'nope'")  # a sentence, not KeyError's repr
    _assert_same_state(acc, snap)


@pytest.mark.parametrize(
    "exc", [ShapeMismatchError, UnknownParameterError, NoGradientsError, AccumulatorFullError],
)
def test_errors_are_accumulation_errors(exc):
    assert issubclass(exc, AccumulationError)
    assert issubclass(exc, ArrayTrainError)


@pytest.mark.parametrize("weight", [0, -1.0, float("nan"), float("inf"), True, "2"])
@pytest.mark.parametrize("how", ["step", "accumulate"])
def test_bad_weight(weight, how):
    acc = _acc()
    acc.accumulate("w", np.ones((2, 3)))
    snap = _state(acc)
    with pytest.raises(HyperparameterError, match="weight"):
        if how == "step":
            acc.step({"w": np.ones((2, 3))}, weight=weight)
        else:
            acc.accumulate("w", np.ones((2, 3)), weight=weight)
    _assert_same_state(acc, snap)


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        ({"b": np.ones(4)}, ShapeMismatchError, "'b'"),
        ({"b": np.ones(3, dtype=np.int64)}, DTypeError, "'b'"),
        ({"b": np.ones(3, dtype=np.complex128)}, DTypeError, "'b'"),
        ({"nope": np.ones(3)}, UnknownParameterError, "'nope'"),
    ],
    ids=["shape", "int", "complex", "unknown"],
)
def test_refused_step_changes_nothing(bad, exc, match):
    acc = _acc(steps=3)
    acc.step({"w": np.ones((2, 3)), "b": np.ones(3)}, weight=2.0)
    snap = _state(acc)
    # good gradients come first: a write-as-you-go step would have added them
    with pytest.raises(exc, match=match):
        acc.step({"w": np.full((2, 3), 7.0), **bad})
    _assert_same_state(acc, snap)
    with pytest.raises(TypeError, match="mapping"):
        acc.step([np.ones((2, 3))])
    _assert_same_state(acc, snap)


# -- weighted mode -------------------------------------------------------------------------------


def test_weighted_average_exact():
    acc = _acc(steps=4, g=(1,))
    for v in (1.0, 2.0, 3.0, 4.0):
        acc.step({"g": np.array([v])})
    assert acc.get_gradients()["g"][0] == 2.5


def test_weights_give_weighted_mean():
    acc = _acc(steps=3, g=(2,))
    acc.step({"g": np.array([1.0, 0.0])}, weight=1)
    acc.step({"g": np.array([4.0, 2.0])}, weight=3)
    np.testing.assert_allclose(acc.get_gradients()["g"], [13 / 4, 6 / 4], rtol=1e-15)


def test_unit_weight_equals_no_weight():
    rng = np.random.default_rng(1)
    gs = [rng.standard_normal(5) for _ in range(3)]
    a, b = _acc(steps=3, g=(5,)), _acc(steps=3, g=(5,))
    for g in gs:
        a.step({"g": g})
        b.step({"g": g}, weight=1.0)
    np.testing.assert_array_equal(a.get_gradients()["g"], b.get_gradients()["g"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_weighted_mean_of_variable_length_batch(seed):
    rng = np.random.default_rng(seed)
    lengths = [3, 17, 1, 9]  # unequal micro-batches
    tokens = rng.standard_normal((sum(lengths), 4, 2))  # a gradient per token
    acc = _acc(steps=len(lengths), g=(4, 2))
    pos = 0
    for n in lengths:
        micro = tokens[pos: pos + n]
        pos += n
        acc.step({"g": micro.mean(axis=0)}, weight=n)
    np.testing.assert_allclose(acc.get_gradients()["g"], tokens.mean(axis=0), rtol=1e-12, atol=1e-14)
    # the unweighted mean of micro-batch means is a different (wrong) answer here
    plain = _acc(steps=len(lengths), g=(4, 2))
    pos = 0
    for n in lengths:
        plain.step({"g": tokens[pos: pos + n].mean(axis=0)})
        pos += n
    assert not np.allclose(plain.get_gradients()["g"], tokens.mean(axis=0))


def test_weighted_sum():
    acc = _acc(steps=2, reduction="sum", g=(1,))
    acc.step({"g": np.array([1.0])}, weight=2)
    acc.step({"g": np.array([3.0])}, weight=0.5)
    assert acc.get_gradients()["g"][0] == 3.5
