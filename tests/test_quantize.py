"""int8 weight quantization: error bounds, storage, torch's quantize_per_tensor/per_channel, bad input."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from arraytrain import (
    ArgumentTypeError,
    DataError,
    DTypeError,
    FlatBuffer,
    HyperparameterError,
    QuantizedTensor,
    ShapeMismatchError,
    UnknownParameterError,
    dequantize_params,
    magnitude_mask,
    nn,
    quantize_params,
)
from arraytrain.prune import apply_mask
from arraytrain.quantize import quantize

SCHEMES = ["symmetric", "asymmetric"]
GRANULARITIES = ["tensor", "channel"]
schemes = pytest.mark.parametrize("scheme", SCHEMES)
granularities = pytest.mark.parametrize("granularity", GRANULARITIES)
shapes = pytest.mark.parametrize("shape", [(), (1,), (7,), (5, 3), (4, 6, 5), (0, 3)], ids=str)


def _data(rng, shape, dtype=np.float32):
    """Heavy-tailed values with an offset and per-row scales: channels differ."""
    x = rng.standard_t(3, shape) * rng.uniform(0.01, 10.0) + rng.uniform(-1, 1)
    if len(shape) >= 1 and shape[0]:
        x = x * np.geomspace(1e-2, 1e2, shape[0]).reshape((-1,) + (1,) * (len(shape) - 1))
    return np.asarray(x, dtype=dtype)


def _per_element_scale(q: QuantizedTensor) -> np.ndarray:
    s = q.scale.astype(np.float64)
    return np.broadcast_to(q._bcast(s), q.shape)


@shapes
@schemes
@granularities
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16], ids=lambda d: np.dtype(d).name)
def test_error_within_half_a_scale(shape, scheme, granularity, dtype, rng):
    if granularity == "channel" and len(shape) == 0:
        pytest.skip("a 0-d array has no channel axis")
    x = _data(rng, shape, dtype)
    for axis in range(len(shape)) if granularity == "channel" else (0,):
        q = quantize(x, scheme=scheme, granularity=granularity, axis=axis)
        assert q.codes.dtype == np.int8 and q.codes.shape == x.shape
        assert q.scale.dtype == np.float32 and q.scale.shape == ((shape[axis],) if granularity == "channel" else ())
        qmin = -127 if scheme == "symmetric" else -128
        assert q.codes.size == 0 or (q.codes.min() >= qmin and q.codes.max() <= 127)
        if scheme == "symmetric":
            assert q.zero_point is None
        else:
            assert q.zero_point.dtype == np.int8 and q.zero_point.shape == q.scale.shape
        deq = q.dequantize()
        assert deq.dtype == x.dtype and deq.shape == x.shape
        err = np.abs(deq.astype(np.float64) - x.astype(np.float64))
        # scale/2, plus the rounding of the dequantized value to the storage dtype
        slack = np.abs(x.astype(np.float64)) * np.finfo(dtype).eps
        assert np.all(err <= _per_element_scale(q) / 2 * (1 + 1e-12) + slack)
        e = q.error(x)
        assert e["max_abs"] <= e["bound"] + (slack.max() if slack.size else 0)
        assert set(e) == {"max_abs", "rms", "relative_rms", "bound"}
        assert e["rms"] <= e["max_abs"] + 1e-300
        nbytes = q.codes.nbytes + q.scale.nbytes + (0 if q.zero_point is None else q.zero_point.nbytes)
        assert q.nbytes == nbytes == x.size + 4 * q.scale.size + (0 if q.zero_point is None else q.scale.size)


@granularities
def test_asymmetric_takes_the_extreme_codes_at_the_min_and_max(granularity, rng):
    x = _data(rng, (6, 40)) - 0.1  # every row holds both signs
    x[:, 0], x[:, 1] = -np.abs(x[:, 0]) - 1e-3, np.abs(x[:, 1]) + 1e-3
    q = quantize(x, scheme="asymmetric", granularity=granularity)
    deq = q.dequantize().astype(np.float64)
    s = _per_element_scale(q)
    rows = range(x.shape[0]) if granularity == "channel" else [slice(None)]
    for r in rows:
        xr, cr = x[r], q.codes[r]
        lo, hi = np.unravel_index(np.argmin(xr), xr.shape), np.unravel_index(np.argmax(xr), xr.shape)
        assert cr[lo] == -128 and cr[hi] == 127  # the whole int8 range is used, nothing clipped
        for at in (lo, hi):
            assert abs(deq[r][at] - xr[at]) <= s[r][at] / 2
    # the range always holds 0 and the zero point is an integer: 0 is exact
    qg = quantize(np.array([-1.5, -0.25, 0.0, 0.5, 2.25], np.float32), scheme="asymmetric")
    assert qg.dequantize()[2] == 0.0
    pos = quantize(np.array([0.5, 1.0, 2.0], np.float32), scheme="asymmetric")  # widened to [0, 2]
    assert pos.zero_point == -128 and pos.codes[-1] == 127
    sym = quantize(np.array([-127.0, 0.0, 62.5, 63.5, 127.0], np.float32))  # scale 1
    np.testing.assert_array_equal(sym.codes, [-127, 0, 62, 64, 127])  # half to even
    assert sym.dequantize()[1] == 0.0


def test_round_half_to_even_and_zero_groups():
    q = quantize(np.array([127.0, 0.5, 1.5, 2.5, -0.5, -2.5], np.float64))  # scale exactly 1
    assert q.scale == 1.0
    np.testing.assert_array_equal(q.codes, [127, 0, 2, 2, 0, -2])
    z = quantize(np.zeros((3, 4), np.float32), granularity="channel")
    np.testing.assert_array_equal(z.scale, np.ones(3, np.float32))
    assert not np.any(z.codes) and not np.any(z.dequantize())
    x = np.array([[0.0, 0.0], [1.0, -3.0]], np.float32)
    for scheme in SCHEMES:
        q = quantize(x, scheme=scheme, granularity="channel")
        assert q.scale[0] == 1.0 and np.all(q.dequantize()[0] == 0)
        e = q.error(x)
        assert np.isfinite(e["relative_rms"])
    assert quantize(np.zeros(4)).error(np.zeros(4))["relative_rms"] == 0.0


def test_scale_rounds_up_so_nothing_clips(rng):
    for _ in range(200):
        x = _data(rng, (int(rng.integers(2, 60)),))
        for scheme in SCHEMES:
            q = quantize(x, scheme=scheme)
            s = float(q.scale)
            if scheme == "symmetric":
                assert s * 127 >= np.abs(x.astype(np.float64)).max()
            else:
                lo, hi = min(x.min(), 0.0), max(x.max(), 0.0)
                assert s * 255 >= float(hi) - float(lo)


# -- against torch ---------------------------------------------------------------------------------


def _torch():
    torch = pytest.importorskip("torch")
    return torch


def _torch_codes(torch, x, q: QuantizedTensor):
    zp = np.zeros(q.scale.shape, np.int64) if q.zero_point is None else q.zero_point.astype(np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized dtypes are deprecated in torch
        t = torch.from_numpy(x.astype(np.float32))
        if q.granularity == "tensor":
            tq = torch.quantize_per_tensor(t, float(q.scale), int(zp), torch.qint8)
        else:
            tq = torch.quantize_per_channel(t, torch.from_numpy(q.scale.astype(np.float64)), torch.from_numpy(zp),
                                            q.axis, torch.qint8)
        return tq.int_repr().numpy(), tq.dequantize().numpy()


@schemes
@granularities
@pytest.mark.parametrize("shape, axis", [((64, 33), 0), ((64, 33), 1), ((8, 5, 7), 2), ((1000,), 0)])
def test_codes_match_torch(scheme, granularity, shape, axis, rng):
    """torch: q = clamp(zp + rint(x * (1/scale)), -128, 127), rint half to even, the
    multiplication in float32. With our scale and zero point, codes agree except where
    x/scale is within float32 rounding of a half-way point (counted, and kept rare)."""
    torch = _torch()
    x = _data(rng, shape)
    q = quantize(x, scheme=scheme, granularity=granularity, axis=axis)
    codes, deq = _torch_codes(torch, x, q)
    s = _per_element_scale(q)
    ratio = x.astype(np.float64) / s
    near_half = np.abs(np.abs(ratio - np.floor(ratio)) - 0.5) < 1e-4
    differ = codes != q.codes
    assert not np.any(differ & ~near_half)
    assert np.all(np.abs(codes.astype(int) - q.codes) <= 1)
    assert differ.sum() <= max(2, 1e-3 * x.size)
    np.testing.assert_allclose(q.dequantize()[~differ], deq[~differ], rtol=1e-6, atol=1e-7)


# -- parameters --------------------------------------------------------------------------------------


def _mlp_params(rng):
    model = nn.MLP([16, 32, 10])
    return model, FlatBuffer.from_arrays(model.init(seed=3))


def test_quantize_params_and_back(rng):
    model, params = _mlp_params(rng)
    q = quantize_params(params, scheme="symmetric", granularity="channel", axis=1)
    assert set(q) == {"fc1.weight", "fc2.weight"}  # weights (ndim >= 2) only by default
    for name, t in q.items():
        assert t.scale.shape == (params[name].shape[1],)
    before = params.copy()
    dequantize_params(q, into=params)
    for name in params.names:
        if name in q:
            np.testing.assert_array_equal(params[name], q[name].dequantize())
            assert np.abs(params[name] - before[name]).max() <= q[name].error(before[name])["bound"] * (1 + 1e-6)
        else:
            np.testing.assert_array_equal(params[name], before[name])
    assert set(quantize_params(params, names=["*.bias"])) == {"fc1.bias", "fc2.bias"}


def test_quantized_mlp_predicts_like_the_float_one(rng):
    """Evaluate an MLP bound to an engine with per-output-channel int8 weights written back."""
    from arraytrain import Engine, optim

    model = nn.MLP([16, 32, 10])
    engine = Engine(model.init(seed=3), optim.SGD(lr=0.0))
    model.bind(engine)
    x = rng.standard_normal((256, 16)).astype(np.float32)
    logits = model.predict(x)
    q = quantize_params(engine, granularity="channel", axis=1)  # Dense weights are (in, out)
    dequantize_params(q, into=engine)
    qlogits = model.predict(x)
    assert np.mean(np.argmax(qlogits, 1) == np.argmax(logits, 1)) >= 0.95
    assert np.abs(qlogits - logits).max() < 0.05 * np.abs(logits).max()
    stored = sum(t.nbytes for t in q.values())
    assert stored == sum(engine.params[n].size + 4 * engine.params[n].shape[1] for n in q)  # int8 + float32 scales


def test_pruned_weights_stay_zero_after_quantization(rng):
    _, params = _mlp_params(rng)
    apply_mask(params, magnitude_mask(params, ratio=0.5))
    for scheme in SCHEMES:
        q = quantize_params(params, scheme=scheme, granularity="channel", axis=1)
        for name, t in q.items():
            assert np.all(t.dequantize()[params[name] == 0] == 0)


BAD = {
    "int-array": (lambda: quantize(np.arange(4)), DTypeError, "array"),
    "bool-array": (lambda: quantize(np.ones(3, bool)), DTypeError, "array"),
    "nan": (lambda: quantize(np.array([1.0, np.nan])), DataError, "non-finite"),
    "inf": (lambda: quantize(np.array([1.0, np.inf])), DataError, "non-finite"),
    "scheme": (lambda: quantize(np.ones(3), scheme="affine"), HyperparameterError, "scheme"),
    "granularity": (lambda: quantize(np.ones(3), granularity="row"), HyperparameterError, "granularity"),
    "axis-out-of-range": (lambda: quantize(np.ones((2, 3)), granularity="channel", axis=2), HyperparameterError,
                          "axis"),
    "axis-float": (lambda: quantize(np.ones((2, 3)), granularity="channel", axis=1.0), HyperparameterError, "axis"),
    "axis-0d": (lambda: quantize(np.float32(1.0), granularity="channel"), HyperparameterError, "axis"),
    "error-shape": (lambda: quantize(np.ones(3)).error(np.ones(4)), HyperparameterError, "original"),
    "params-dict": (lambda: quantize_params({"w": np.ones((2, 2))}), ArgumentTypeError, "params"),
    "names-no-match": (lambda: quantize_params(FlatBuffer.from_arrays({"w": np.ones((2, 2))}), names="x*"),
                       HyperparameterError, "matches no"),
    "unknown-kw": (lambda: quantize_params(FlatBuffer.from_arrays({"w": np.ones((2, 2))}), bits=4), TypeError, "bits"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(case):
    make, error, match = BAD[case]
    with pytest.raises(error, match=match):
        make()


def test_dequantize_params_checks_everything_first(rng):
    params = FlatBuffer.from_arrays({"a": rng.standard_normal((3, 4)), "b": rng.standard_normal((2, 2))})
    before = params.flat.tobytes()
    good = quantize(params["a"])
    cases = [
        ({"a": good, "zz": good}, UnknownParameterError, "zz"),
        ({"a": good, "b": quantize(np.ones((2, 3)))}, ShapeMismatchError, "'b'"),
        ({"a": good, "b": np.ones((2, 2))}, ArgumentTypeError, r"q\['b'\]"),
        ([good], ArgumentTypeError, "q"),
    ]
    for q, error, match in cases:
        with pytest.raises(error, match=match):
            dequantize_params(q, into=params)
        assert params.flat.tobytes() == before
    with pytest.raises(ArgumentTypeError, match="into"):
        dequantize_params({"a": good}, into=np.zeros(3))
