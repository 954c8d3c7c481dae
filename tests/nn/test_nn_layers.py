"""arraytrain.nn layers: finite-difference gradient checks (float64), binding to an engine, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest

import arraytrain as at
from arraytrain import nn
from arraytrain.nn.layers import ACTIVATIONS


def numeric_grad(f, arr: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences of the scalar ``f()`` with respect to ``arr`` (perturbed in place)."""
    g = np.zeros_like(arr, dtype=np.float64)
    flat, gflat = arr.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        hi = f()
        flat[i] = old - eps
        lo = f()
        flat[i] = old
        gflat[i] = (hi - lo) / (2 * eps)
    return g


def assert_grad(analytic, numeric, what=""):
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8, err_msg=what)


def test_dense_gradients(rng):
    layer = nn.Dense(4, 3, "fc")
    w, b = rng.standard_normal((4, 3)), rng.standard_normal(3)
    gw, gb = np.zeros((4, 3)), np.zeros(3)
    layer.bind(w, b, gw, gb)
    x, r = rng.standard_normal((5, 4)), rng.standard_normal((5, 3))

    def f():
        return float((r * layer.forward(x, cache=False)).sum())

    layer.forward(x)
    dx = layer.backward(r)
    assert_grad(gw, numeric_grad(f, w), "weight")
    assert_grad(gb, numeric_grad(f, b), "bias")
    assert_grad(dx, numeric_grad(f, x), "input")


def test_dense_accumulate_adds(rng):
    layer = nn.Dense(3, 2)
    gw, gb = np.zeros((3, 2)), np.zeros(2)
    layer.bind(rng.standard_normal((3, 2)), rng.standard_normal(2), gw, gb)
    x1, x2, r1, r2 = (rng.standard_normal(s) for s in ((4, 3), (6, 3), (4, 2), (6, 2)))
    layer.forward(x1)
    assert layer.backward(r1, need_dx=False) is None
    layer.forward(x2)
    layer.backward(r2, accumulate=True)
    np.testing.assert_allclose(gw, x1.T @ r1 + x2.T @ r2, rtol=1e-12)
    np.testing.assert_allclose(gb, r1.sum(0) + r2.sum(0), rtol=1e-12)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_gradients(name, rng):
    act = nn.activation(name)
    # keep ReLU's inputs away from its kink at 0
    x = rng.standard_normal((4, 5)) * 2
    x = np.where(np.abs(x) < 0.05, 0.3, x)
    r = rng.standard_normal((4, 5))

    def f():
        return float((r * act.forward(x, cache=False)).sum())

    act.forward(x)
    dx = act.backward(r)
    assert_grad(dx, numeric_grad(f, x), name)
    # the in-place paths compute the same values
    y = act.forward(x.copy(), inplace=True)
    np.testing.assert_array_equal(y, act.forward(x, cache=False))
    np.testing.assert_array_equal(act.backward(r.copy(), inplace=True), dx)


def test_activation_values():
    x = np.linspace(-30, 30, 121)
    np.testing.assert_allclose(nn.Sigmoid().forward(x), 1 / (1 + np.exp(-x)), rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(nn.Tanh().forward(x), np.tanh(x))
    np.testing.assert_array_equal(nn.ReLU().forward(x), np.maximum(x, 0))
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
    assert np.abs(nn.GELU().forward(x) - exact).max() < 1e-3  # the tanh approximation


def test_gelu_matches_torch_tanh_approximation(rng):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal(200) * 3
    want = torch.nn.functional.gelu(torch.from_numpy(x), approximate="tanh").numpy()
    np.testing.assert_allclose(nn.GELU().forward(x), want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_mlp_gradients(name, rng):
    model = nn.MLP([5, 7, 6, 3], activation=name, dtype=np.float64)
    model.init(seed=1)
    x, y = rng.standard_normal((4, 5)), np.array([0, 2, 1, 2])

    def f():
        return nn.softmax_cross_entropy(model.predict(x), y)[0]

    _, d = nn.softmax_cross_entropy(model.forward(x), y)
    dx = model.backward(d, input_grad=True)
    for pname, p in model.params.items():
        assert_grad(model.grads[pname], numeric_grad(f, p), f"{name} {pname}")
    assert_grad(dx, numeric_grad(f, x), f"{name} input")


def test_init_schemes():
    relu = nn.MLP([400, 300, 10]).init(seed=3)
    w = relu["fc1.weight"]
    assert w.dtype == np.float32 and w.shape == (400, 300)
    assert abs(w.std() - math.sqrt(2 / 400)) < 0.02 * math.sqrt(2 / 400)
    assert not relu["fc1.bias"].any()
    tanh = nn.MLP([400, 300, 10], activation="tanh", dtype=np.float64).init(seed=3)
    a = math.sqrt(6 / 700)
    assert np.abs(tanh["fc1.weight"]).max() <= a and np.abs(tanh["fc1.weight"]).max() > 0.99 * a
    # one seed, one draw: the float32 model is the float64 one rounded
    p64 = nn.MLP([6, 5, 2], dtype=np.float64).init(seed=7)
    p32 = nn.MLP([6, 5, 2], dtype=np.float32).init(seed=7)
    for k in p64:
        np.testing.assert_array_equal(p32[k], p64[k].astype(np.float32))
    assert list(p64) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    np.testing.assert_array_equal(nn.MLP([6, 5, 2]).init(seed=7)["fc2.weight"], p32["fc2.weight"])


def test_bound_to_engine_zero_copy_and_accumulation(rng):
    model = nn.MLP([6, 8, 3])
    engine = at.Engine(model.init(seed=0), at.optim.SGD(lr=0.1), accumulation_steps=2, zero_grad_on_step=False)
    model.bind(engine)
    for name in model.shapes:
        assert np.shares_memory(model.params[name], engine.params.flat)
        assert np.shares_memory(model.grads[name], engine.grads.flat)
    xs = [rng.standard_normal((5, 6)).astype(np.float32) for _ in range(2)]
    ys = [rng.integers(0, 3, 5) for _ in range(2)]
    single = []
    for x, y in zip(xs, ys):
        model.backward(nn.softmax_cross_entropy(model.forward(x), y)[1])
        single.append(engine.grads.flat.copy())
        model.backward(nn.softmax_cross_entropy(model.forward(x), y)[1], accumulate=False)
    # inside the window (micro_batches > 0) backward adds to what is there
    model.backward(nn.softmax_cross_entropy(model.forward(xs[0]), ys[0])[1])
    assert engine.step().accumulated
    model.backward(nn.softmax_cross_entropy(model.forward(xs[1]), ys[1])[1])
    np.testing.assert_allclose(engine.grads.flat, single[0] + single[1], rtol=1e-6, atol=1e-7)
    before = engine.params.flat.copy()
    report = engine.step()
    assert report.applied
    np.testing.assert_allclose(before - engine.params.flat, 0.1 * (single[0] + single[1]) / 2, rtol=1e-5, atol=1e-7)
    # the model sees the update without any copy
    np.testing.assert_array_equal(model.params["fc2.bias"], engine.params["fc2.bias"])


def test_forward_casts_input_and_predict_keeps_cache(rng):
    model = nn.MLP([4, 3, 2])
    model.init(seed=0)
    x64 = rng.standard_normal((3, 4))
    out = model.forward(x64)
    assert out.dtype == np.float32
    model.predict(rng.standard_normal((7, 4)))  # must not disturb the cached forward
    model.backward(np.ones((3, 2), np.float32))
    ref = nn.MLP([4, 3, 2])
    ref.init(seed=0)
    ref.forward(x64)
    ref.backward(np.ones((3, 2), np.float32))
    for k in model.grads:
        np.testing.assert_array_equal(model.grads[k], ref.grads[k])


def test_array_namespace():
    assert nn.array_namespace(np.zeros(2), None, np.ones(1)) is np
    with pytest.raises(at.BackendError):
        nn.array_namespace([1, 2])


BAD = [
    ("sizes too short", lambda: nn.MLP([3]), at.HyperparameterError, "sizes"),
    ("zero width", lambda: nn.MLP([3, 0, 2]), at.HyperparameterError, "sizes[1]"),
    ("unknown activation", lambda: nn.MLP([3, 2], activation="swish"), at.HyperparameterError, "activation"),
    ("integer dtype", lambda: nn.MLP([3, 2], dtype=np.int32), at.DTypeError, "dtype"),
    ("unknown init", lambda: nn.MLP([3, 2], init="orthogonal"), at.HyperparameterError, "init"),
    ("negative seed", lambda: nn.MLP([3, 2]).init(seed=-1), at.HyperparameterError, "seed"),
    ("forward before init", lambda: nn.MLP([3, 2]).forward(np.zeros((1, 3))), at.LayoutError, "init()"),
]


def _bound(sizes=(3, 2)):
    m = nn.MLP(list(sizes))
    m.init(seed=0)
    return m


BAD += [
    ("input width", lambda: _bound().forward(np.zeros((2, 4))), at.LayoutError, "x: expected shape (n, 3)"),
    ("1-D input", lambda: _bound().forward(np.zeros(3)), at.LayoutError, "x: expected a 2-D batch"),
    ("backward without forward", lambda: _bound().backward(np.zeros((1, 2), np.float32)), at.LayoutError,
     "without a cached forward"),
    ("dlogits width", lambda: _bound().backward(np.zeros((1, 3), np.float32)), at.LayoutError, "dlogits"),
    ("bind missing name", lambda: _bound().bind({"fc1.weight": np.zeros((3, 2), np.float32)}), at.LayoutError,
     "'fc1.bias'"),
    ("bind wrong shape", lambda: _bound().bind({"fc1.weight": np.zeros((2, 3), np.float32),
                                                "fc1.bias": np.zeros(2, np.float32)}), at.LayoutError,
     "'fc1.weight': params shape (2, 3) != model shape (3, 2)"),
    ("bind wrong dtype", lambda: _bound().bind({"fc1.weight": np.zeros((3, 2)), "fc1.bias": np.zeros(2)}),
     at.DTypeError, "'fc1.weight'"),
    ("bind not a mapping", lambda: _bound().bind([1, 2]), at.ArgumentTypeError, "bind"),
]


@pytest.mark.parametrize("case, call, error, text", BAD, ids=[b[0] for b in BAD])
def test_bad_input(case, call, error, text):
    with pytest.raises(error) as info:
        call()
    assert text in str(info.value)


def test_bad_input_count():
    assert len(BAD) == 15


def test_backward_batch_mismatch_changes_nothing(rng):
    model = _bound((3, 4, 2))
    model.forward(rng.standard_normal((5, 3)))
    before = {k: v.copy() for k, v in model.grads.items()}
    with pytest.raises(at.LayoutError, match="batch of 4 rows"):
        model.backward(np.zeros((4, 2), np.float32))
    for k in before:
        np.testing.assert_array_equal(model.grads[k], before[k])


def test_public_surface():
    assert sorted(nn.__all__) == sorted(name for name in dir(nn) if not name.startswith("_")
                                        and name in nn.__all__)
    for name in ("MLP", "Dense", "ReLU", "GELU", "Tanh", "Sigmoid", "softmax_cross_entropy", "mse", "focal_loss",
                 "Trainer", "Batches", "EarlyStopping", "Checkpoint", "ReduceLROnPlateauCallback", "GradientMonitor",
                 "Profiler", "ProgressBar", "array_namespace"):
        assert name in nn.__all__, name
