"""arraytrain.nn losses: finite-difference gradient checks (float64), oracles, stability, bad input."""

from __future__ import annotations

import numpy as np
import pytest

import arraytrain as at
from arraytrain import nn
from test_nn_layers import assert_grad, numeric_grad

N, K = 6, 4

# (id, loss function with its options, target kind)
CASES = [
    ("cross_entropy", nn.softmax_cross_entropy, "labels"),
    ("cross_entropy_smoothing", lambda z, y: nn.softmax_cross_entropy(z, y, label_smoothing=0.2), "labels"),
    ("focal_gamma2", nn.focal_loss, "labels"),
    ("focal_gamma0.5_alpha", lambda z, y: nn.focal_loss(z, y, gamma=0.5, alpha=0.25), "labels"),
    ("focal_gamma0", lambda z, y: nn.focal_loss(z, y, gamma=0.0), "labels"),
    ("poly1", nn.poly1_cross_entropy, "labels"),
    ("poly1_eps", lambda z, y: nn.poly1_cross_entropy(z, y, epsilon=-0.5), "labels"),
    ("dice", nn.dice_loss, "labels"),
    ("dice_smooth", lambda z, y: nn.dice_loss(z, y, smooth=1e-3), "labels"),
    ("mse", nn.mse, "values"),
    ("binary_cross_entropy", nn.binary_cross_entropy, "binary"),
]


def _target(kind, rng):
    if kind == "labels":
        return np.array([0, 3, 1, 1, 2, 3])
    if kind == "values":
        return rng.standard_normal((N, K))
    return (rng.random((N, K)) < 0.5).astype(np.float64)


@pytest.mark.parametrize("name, fn, kind", CASES, ids=[c[0] for c in CASES])
def test_loss_gradient(name, fn, kind, rng):
    z = rng.standard_normal((N, K)) * 2
    t = _target(kind, rng)
    loss, d = fn(z, t)
    assert isinstance(loss, float) and d.shape == z.shape and d.dtype == np.float64
    assert_grad(d, numeric_grad(lambda: fn(z, t)[0], z), name)


@pytest.mark.parametrize("name, fn, kind", CASES, ids=[c[0] for c in CASES])
def test_loss_float32_and_stable(name, fn, kind, rng):
    z = (rng.standard_normal((N, K)) * 1e4).astype(np.float32)  # saturating logits
    loss, d = fn(z, _target(kind, rng))
    assert d.dtype == np.float32
    assert np.isfinite(loss) and np.isfinite(d).all()


def test_cross_entropy_matches_torch(rng):
    torch = pytest.importorskip("torch")
    z, y = rng.standard_normal((N, K)), np.array([0, 3, 1, 1, 2, 3])
    for smoothing in (0.0, 0.1):
        zt = torch.from_numpy(z).requires_grad_()
        ref = torch.nn.functional.cross_entropy(zt, torch.from_numpy(y), label_smoothing=smoothing)
        ref.backward()
        loss, d = nn.softmax_cross_entropy(z, y, label_smoothing=smoothing)
        assert abs(loss - ref.item()) < 1e-12
        np.testing.assert_allclose(d, zt.grad.numpy(), rtol=1e-10, atol=1e-15)


def test_bce_and_mse_match_torch(rng):
    torch = pytest.importorskip("torch")
    z, t = rng.standard_normal((N, K)), (rng.random((N, K)) < 0.5).astype(np.float64)
    ref = torch.nn.functional.binary_cross_entropy_with_logits(torch.from_numpy(z), torch.from_numpy(t))
    assert abs(nn.binary_cross_entropy(z, t)[0] - ref.item()) < 1e-12
    ref = torch.nn.functional.mse_loss(torch.from_numpy(z), torch.from_numpy(t))
    assert abs(nn.mse(z, t)[0] - ref.item()) < 1e-12


def test_special_cases_reduce_to_cross_entropy(rng):
    z, y = rng.standard_normal((N, K)), np.array([0, 3, 1, 1, 2, 3])
    ce, dce = nn.softmax_cross_entropy(z, y)
    for loss, d in (nn.focal_loss(z, y, gamma=0.0), nn.poly1_cross_entropy(z, y, epsilon=0.0)):
        assert abs(loss - ce) < 1e-12
        np.testing.assert_allclose(d, dce, rtol=1e-12, atol=1e-15)
    # focal down-weights confident examples: with gamma > 0 it is below cross-entropy
    assert nn.focal_loss(z, y, gamma=2.0)[0] < ce
    # a perfect prediction: dice -> 0, focal gradient stays finite at p_t = 1
    perfect = np.eye(K)[y] * 100.0
    assert nn.dice_loss(perfect, y)[0] < 1e-6
    assert np.isfinite(nn.focal_loss(perfect, y, gamma=0.5)[1]).all()


def test_mse_column_target(rng):
    pred = rng.standard_normal((5, 1))
    t = rng.standard_normal(5)
    assert nn.mse(pred, t)[0] == pytest.approx(float(((pred[:, 0] - t) ** 2).mean()))


LOGITS = np.zeros((3, 4))
BAD = [
    ("1-D logits", lambda: nn.softmax_cross_entropy(np.zeros(4), np.array([0])), at.LayoutError, "logits"),
    ("integer logits", lambda: nn.softmax_cross_entropy(np.zeros((3, 4), int), np.zeros(3, int)), at.DTypeError,
     "logits"),
    ("label count", lambda: nn.softmax_cross_entropy(LOGITS, np.zeros(2, int)), at.LayoutError,
     "labels: expected shape (3,)"),
    ("float labels", lambda: nn.focal_loss(LOGITS, np.zeros(3)), at.DTypeError, "labels"),
    ("label out of range", lambda: nn.dice_loss(LOGITS, np.array([0, 4, 1])), at.LayoutError, "[0, 4)"),
    ("negative label", lambda: nn.poly1_cross_entropy(LOGITS, np.array([0, -1, 1])), at.LayoutError, "labels"),
    ("smoothing > 1", lambda: nn.softmax_cross_entropy(LOGITS, np.zeros(3, int), label_smoothing=2.0),
     at.HyperparameterError, "label_smoothing"),
    ("negative gamma", lambda: nn.focal_loss(LOGITS, np.zeros(3, int), gamma=-1.0), at.HyperparameterError, "gamma"),
    ("zero alpha", lambda: nn.focal_loss(LOGITS, np.zeros(3, int), alpha=0.0), at.HyperparameterError, "alpha"),
    ("dice smooth 0", lambda: nn.dice_loss(LOGITS, np.zeros(3, int), smooth=0.0), at.HyperparameterError, "smooth"),
    ("mse shape", lambda: nn.mse(LOGITS, np.zeros((3, 3))), at.LayoutError, "target"),
    ("bce shape", lambda: nn.binary_cross_entropy(LOGITS, np.zeros(4)), at.LayoutError, "target"),
]


@pytest.mark.parametrize("case, call, error, text", BAD, ids=[b[0] for b in BAD])
def test_bad_input(case, call, error, text):
    with pytest.raises(error) as info:
        call()
    assert text in str(info.value)


def test_bad_input_count():
    assert len(BAD) == 12
