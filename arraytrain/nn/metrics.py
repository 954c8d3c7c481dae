r"""Classification metrics on the host (NumPy), from labels and predictions.

The confusion matrix :math:`C` has rows = true class, columns = predicted class.
Per class :math:`c`: precision :math:`C_{cc} / \sum_r C_{rc}`, recall
:math:`C_{cc} / \sum_k C_{ck}`, F1 their harmonic mean; a 0/0 is taken as 0.
Macro averages run over the classes that occur in the labels or the
predictions (scikit-learn's ``average="macro"`` with its default labels).
"""

from __future__ import annotations

import numpy as np

from .._checks import check_int
from ..errors import LayoutError
from ._array import to_numpy


def _labels(a, name):
    a = np.asarray(to_numpy(a))
    if a.ndim != 1:
        raise LayoutError(f"{name}: expected a 1-D array of class indices, got shape {a.shape}")
    return a.astype(np.int64, copy=False)


def accuracy(y_true, y_pred) -> float:
    """Fraction of equal entries (0.0 for empty input)."""
    t, p = _labels(y_true, "y_true"), _labels(y_pred, "y_pred")
    if t.shape != p.shape:
        raise LayoutError(f"y_pred: expected shape {t.shape}, got {p.shape}")
    return float((t == p).mean()) if t.size else 0.0


def confusion_matrix(y_true, y_pred, num_classes: int) -> np.ndarray:
    """``(num_classes, num_classes)`` int64 counts: ``C[true, predicted]``."""
    k = check_int("num_classes", num_classes, 1)
    t, p = _labels(y_true, "y_true"), _labels(y_pred, "y_pred")
    if t.shape != p.shape:
        raise LayoutError(f"y_pred: expected shape {t.shape}, got {p.shape}")
    for name, a in (("y_true", t), ("y_pred", p)):
        if a.size and (a.min() < 0 or a.max() >= k):
            raise LayoutError(f"{name}: class indices must lie in [0, {k}), got [{a.min()}, {a.max()}]")
    return np.bincount(t * k + p, minlength=k * k).reshape(k, k)


def precision_recall_f1(cm: np.ndarray) -> dict:
    """Macro precision, recall and F1 from a confusion matrix."""
    cm = np.asarray(cm, dtype=np.float64)
    tp = np.diag(cm)
    predicted, actual = cm.sum(axis=0), cm.sum(axis=1)
    present = (predicted + actual) > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        prec = np.where(predicted > 0, tp / predicted, 0.0)
        rec = np.where(actual > 0, tp / actual, 0.0)
        f1 = np.where(prec + rec > 0, 2 * prec * rec / (prec + rec), 0.0)
    if not present.any():
        return {"precision": 0.0, "recall": 0.0, "f1": 0.0}
    return {"precision": float(prec[present].mean()), "recall": float(rec[present].mean()),
            "f1": float(f1[present].mean())}


def classification_report(y_true, y_pred, num_classes: int) -> dict:
    """accuracy, macro precision / recall / F1 and the confusion matrix in one dict."""
    cm = confusion_matrix(y_true, y_pred, num_classes)
    total = cm.sum()
    out = {"accuracy": float(np.trace(cm) / total) if total else 0.0}
    out.update(precision_recall_f1(cm))
    out["confusion_matrix"] = cm
    return out
