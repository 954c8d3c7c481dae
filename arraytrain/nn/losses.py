r"""Losses with their gradients: ``loss, dlogits = f(logits, target)``.

Every loss is the mean over the batch (``mse`` and ``binary_cross_entropy``:
over every element) and returns it as a Python float together with
:math:`\partial L / \partial \text{logits}` in the logits' dtype and array
module. Classification losses take integer class labels of shape ``(n,)``.

For the softmax losses, with :math:`p = \mathrm{softmax}(z)` and a loss
gradient :math:`g = \partial L / \partial p`, the chain rule through the
softmax Jacobian :math:`\partial p_j / \partial z_k = p_j(\delta_{jk} - p_k)` is

.. math:: \partial L / \partial z = p \odot (g - \langle g, p \rangle),

which is how the focal and Dice gradients below are formed. Triplet loss works
on embeddings of anchor/positive/negative triples, not on a classifier's
logits, and is not provided here.
"""

from __future__ import annotations

from .._checks import check_number
from ..errors import DTypeError, LayoutError
from ._array import array_namespace
from .layers import sigmoid


def _check_logits(logits, name="logits"):
    xp = array_namespace(logits)
    if logits.ndim != 2:
        raise LayoutError(f"{name}: expected shape (n, classes), got {logits.shape}")
    if logits.dtype.kind != "f":
        raise DTypeError(f"{name}: expected a floating array, got {logits.dtype}")
    return xp


def _check_labels(xp, logits, labels):
    labels = xp.asarray(labels)
    array_namespace(logits, labels)
    n, k = logits.shape
    if labels.ndim != 1 or labels.shape[0] != n:
        raise LayoutError(f"labels: expected shape ({n},), got {labels.shape}")
    if labels.dtype.kind not in "iu":
        raise DTypeError(f"labels: expected integer class indices, got {labels.dtype}")
    if n and (int(labels.min()) < 0 or int(labels.max()) >= k):
        raise LayoutError(f"labels: expected class indices in [0, {k}), got values in "
                          f"[{int(labels.min())}, {int(labels.max())}]")
    return labels


def log_softmax(logits):
    """``log softmax`` along the last axis, shifted by the row maximum (no overflow)."""
    xp = array_namespace(logits)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))


def softmax(logits):
    """``softmax`` along the last axis, shifted by the row maximum (no overflow)."""
    xp = array_namespace(logits)
    e = xp.exp(logits - logits.max(axis=-1, keepdims=True))
    e /= e.sum(axis=-1, keepdims=True)
    return e


def _onehot(xp, labels, k, dtype):
    out = xp.zeros((labels.shape[0], k), dtype)
    out[xp.arange(labels.shape[0]), labels] = 1
    return out


def softmax_cross_entropy(logits, labels, label_smoothing: float = 0.0):
    r"""Softmax cross-entropy, mean over the batch.

    With targets :math:`q = (1-\alpha)\,e_y + \alpha/K` (label smoothing
    :math:`\alpha`, Szegedy et al. 2016):
    :math:`L = -\frac1n \sum_i \langle q_i, \log p_i \rangle`, and
    :math:`\partial L / \partial z = (p - q)/n`.
    """
    xp = _check_logits(logits)
    labels = _check_labels(xp, logits, labels)
    alpha = check_number("label_smoothing", label_smoothing, 0.0, 1.0)
    n, k = logits.shape
    logp = log_softmax(logits)
    q = _onehot(xp, labels, k, logits.dtype)
    if alpha:
        q *= 1.0 - alpha
        q += alpha / k
    loss = -float((q * logp).sum()) / max(n, 1)
    d = xp.exp(logp)
    d -= q
    d /= max(n, 1)
    return loss, d


def focal_loss(logits, labels, gamma: float = 2.0, alpha: float = 1.0):
    r"""Multi-class focal loss (Lin et al. 2017, "Focal Loss for Dense Object Detection").

    :math:`L = -\frac1n \sum_i \alpha (1 - p_t)^\gamma \log p_t` with
    :math:`p_t = p_{i, y_i}`; :math:`\gamma = 0, \alpha = 1` is cross-entropy.
    Only :math:`\partial L_i / \partial p_t` is non-zero, so through the softmax

    .. math::
        \partial L_i / \partial z = \alpha \left[\gamma (1-p_t)^{\gamma-1} p_t \log p_t
        - (1-p_t)^\gamma\right] (e_{y} - p) / n.

    The factor :math:`(1-p_t)^{\gamma-1} p_t \log p_t` tends to 0 as
    :math:`p_t \to 1` and is taken as 0 there.
    """
    xp = _check_logits(logits)
    labels = _check_labels(xp, logits, labels)
    gamma = check_number("gamma", gamma, 0.0)
    alpha = check_number("alpha", alpha, 0.0, lo_open=True)
    n, k = logits.shape
    logp = log_softmax(logits)
    p = xp.exp(logp)
    rows = xp.arange(n)
    logpt = logp[rows, labels]
    pt = p[rows, labels]
    one_minus = 1.0 - pt
    loss = -float((alpha * one_minus ** gamma * logpt).sum()) / max(n, 1)
    coef = -(one_minus ** gamma)
    if gamma:
        safe = xp.where(one_minus > 0, one_minus, 1.0)
        coef += xp.where(one_minus > 0, gamma * safe ** (gamma - 1.0) * pt * logpt, 0.0)
    coef *= alpha / max(n, 1)
    d = _onehot(xp, labels, k, logits.dtype)
    d -= p
    d *= coef[:, None]
    return loss, d.astype(logits.dtype, copy=False)


def poly1_cross_entropy(logits, labels, epsilon: float = 1.0):
    r"""Poly-1 loss (Leng et al. 2022, "PolyLoss"): cross-entropy plus
    :math:`\epsilon (1 - p_t)`, mean over the batch.

    :math:`\partial L_i / \partial z = (p - e_y)(1 + \epsilon p_t) / n`.
    """
    xp = _check_logits(logits)
    labels = _check_labels(xp, logits, labels)
    epsilon = check_number("epsilon", epsilon, -1.0)
    n, k = logits.shape
    logp = log_softmax(logits)
    p = xp.exp(logp)
    rows = xp.arange(n)
    pt = p[rows, labels]
    loss = float((-logp[rows, labels] + epsilon * (1.0 - pt)).sum()) / max(n, 1)
    d = p - _onehot(xp, labels, k, logits.dtype)
    d *= ((1.0 + epsilon * pt) / max(n, 1))[:, None]
    return loss, d.astype(logits.dtype, copy=False)


def dice_loss(logits, labels, smooth: float = 1.0):
    r"""Soft multi-class Dice loss on softmax probabilities (Milletari et al. 2016,
    V-Net; Sudre et al. 2017), over the batch:

    .. math::
        D_c = \frac{2 \sum_i p_{ic} t_{ic} + s}{\sum_i p_{ic} + \sum_i t_{ic} + s}, \quad
        L = 1 - \frac1K \sum_c D_c, \quad
        \frac{\partial L}{\partial p_{ic}} = -\frac1K \left(\frac{2 t_{ic}}{B_c}
        - \frac{A_c}{B_c^2}\right)

    with :math:`A_c, B_c` the numerator and denominator of :math:`D_c` and
    :math:`t` the one-hot labels; then through the softmax Jacobian.
    """
    xp = _check_logits(logits)
    labels = _check_labels(xp, logits, labels)
    smooth = check_number("smooth", smooth, 0.0, lo_open=True)
    n, k = logits.shape
    p = softmax(logits)
    t = _onehot(xp, labels, k, logits.dtype)
    num = 2.0 * (p * t).sum(axis=0) + smooth
    den = p.sum(axis=0) + t.sum(axis=0) + smooth
    loss = 1.0 - float((num / den).mean())
    g = -(2.0 * t / den - num / (den * den)) / k
    d = p * (g - (g * p).sum(axis=1, keepdims=True))
    return loss, d.astype(logits.dtype, copy=False)


def _elementwise_target(x, target, name):
    """``target`` as an array of ``x``'s dtype and shape (a column for a 1-D target of an (n, 1) ``x``)."""
    xp = array_namespace(x)
    target = xp.asarray(target)
    array_namespace(x, target)
    if x.dtype.kind != "f":
        raise DTypeError(f"{name}: expected a floating array, got {x.dtype}")
    if target.shape != x.shape:
        if target.ndim == 1 and x.ndim == 2 and x.shape[1] == 1 and target.shape[0] == x.shape[0]:
            target = target[:, None]
        else:
            raise LayoutError(f"target: expected shape {x.shape}, got {target.shape}")
    return target.astype(x.dtype, copy=False)


def mse(pred, target):
    r"""Mean squared error over every element: :math:`L = \frac1N \sum (y - t)^2`,
    :math:`\partial L / \partial y = 2 (y - t) / N`."""
    diff = pred - _elementwise_target(pred, target, "pred")
    size = max(diff.size, 1)
    loss = float((diff * diff).sum()) / size
    diff *= 2.0 / size
    return loss, diff


def binary_cross_entropy(logits, target):
    r"""Sigmoid cross-entropy on logits (binary or multi-label), mean over every element.

    :math:`L = \frac1N \sum \max(z, 0) - z t + \log(1 + e^{-|z|})` (the stable
    form), :math:`\partial L / \partial z = (\sigma(z) - t) / N`.
    """
    xp = array_namespace(logits)
    t = _elementwise_target(logits, target, "logits")
    size = max(logits.size, 1)
    loss = float((xp.maximum(logits, 0) - logits * t + xp.log1p(xp.exp(-xp.abs(logits)))).sum()) / size
    d = sigmoid(logits)
    d -= t
    d /= size
    return loss, d


LOSSES = {
    "cross_entropy": softmax_cross_entropy,
    "focal": focal_loss,
    "poly1": poly1_cross_entropy,
    "dice": dice_loss,
    "mse": mse,
    "binary_cross_entropy": binary_cross_entropy,
}
# losses whose target is a vector of class indices (classification metrics apply)
CLASSIFICATION_LOSSES = ("cross_entropy", "focal", "poly1", "dice")
