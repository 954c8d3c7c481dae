"""arraytrain.nn metrics (against scikit-learn) and data helpers (split, scaling, .npz loading)."""

from __future__ import annotations

import numpy as np
import pytest

import arraytrain as at
from arraytrain import nn
from arraytrain.nn.data import split_indices


@pytest.mark.parametrize("seed", range(4))
def test_metrics_match_sklearn(seed):
    skm = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(seed)
    k = 6
    t = rng.integers(0, k - 1, 50)          # class 5 never occurs in the labels...
    p = np.where(rng.random(50) < 0.6, t, rng.integers(0, k, 50))  # ...but may be predicted
    report = nn.classification_report(t, p, k)
    np.testing.assert_array_equal(report["confusion_matrix"], skm.confusion_matrix(t, p, labels=range(k)))
    assert report["accuracy"] == pytest.approx(skm.accuracy_score(t, p))
    for name, fn in (("precision", skm.precision_score), ("recall", skm.recall_score), ("f1", skm.f1_score)):
        assert report[name] == pytest.approx(fn(t, p, average="macro", zero_division=0)), name


def test_metrics_edge_cases():
    assert nn.accuracy(np.zeros(0, int), np.zeros(0, int)) == 0.0
    assert nn.precision_recall_f1(np.zeros((3, 3))) == {"precision": 0.0, "recall": 0.0, "f1": 0.0}
    with pytest.raises(at.LayoutError, match=r"y_pred: class indices must lie in \[0, 3\)"):
        nn.confusion_matrix(np.array([0, 1]), np.array([0, 3]), 3)
    with pytest.raises(at.LayoutError, match="y_pred: expected shape"):
        nn.accuracy(np.zeros(3, int), np.zeros(2, int))
    with pytest.raises(at.HyperparameterError, match="num_classes"):
        nn.confusion_matrix(np.zeros(2, int), np.zeros(2, int), 0)


def test_stratified_split_is_deterministic_and_disjoint():
    y = np.repeat(np.arange(4), [40, 20, 20, 20])
    a = split_indices(y, (0.15, 0.2), seed=3)
    b = split_indices(y, (0.15, 0.2), seed=3)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
    assert sorted(np.concatenate(a)) == list(range(len(y)))
    test = a[2]
    assert np.bincount(y[test]).tolist() == [8, 4, 4, 4]  # each class in proportion
    assert not np.array_equal(split_indices(y, (0.15, 0.2), seed=4)[2], test)


def test_standardizer_floor():
    x = np.zeros((100, 3))
    x[:, 0] = np.arange(100)
    x[:, 1] = np.arange(100) * 1e-6  # barely varies
    s = nn.Standardizer().fit(x)
    assert s.std[0] == pytest.approx(x[:, 0].std())
    assert s.std[1] == pytest.approx(0.25 * x.std(axis=0).mean())
    assert s.std[2] == pytest.approx(0.25 * x.std(axis=0).mean())  # constant: floored as well
    z = s.transform(x)
    assert z.dtype == np.float32 and abs(z[:, 0].mean()) < 1e-6
    flat = nn.Standardizer().fit(np.ones((4, 2)))
    np.testing.assert_array_equal(flat.transform(np.ones((4, 2))), 0)


def test_load_npz_maps_labels_and_scales(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((60, 3)) * 50 + 10
    y = np.array([-3, 5, 11] * 20)
    np.savez(tmp_path / "d.npz", X=x, y=y)
    d = nn.load_npz(tmp_path / "d.npz", seed=1)
    assert d.num_classes == 3 and d.classes.tolist() == [-3, 5, 11]
    assert set(np.unique(d.y_train)) == {0, 1, 2}
    assert len(d.y_train) + len(d.y_val) + len(d.y_test) == 60
    assert abs(d.x_train.mean()) < 1e-5 and d.x_train.dtype == np.float32
    np.savez(tmp_path / "pickled.npz", X=np.array([object()], dtype=object), y=np.zeros(1))
    with pytest.raises(nn.DataError, match="pickled.npz"):
        nn.load_npz(tmp_path / "pickled.npz")
    np.save(tmp_path / "single.npy", np.zeros(3))
    with pytest.raises(nn.DataError, match="not an .npz archive"):
        nn.load_npz(tmp_path / "single.npy")
    with pytest.raises(nn.DataError, match="val_fraction"):
        nn.load_npz(tmp_path / "d.npz", val_fraction=0.5, test_fraction=0.5)


def test_load_digits():
    pytest.importorskip("sklearn")
    d = nn.load_digits(seed=0)
    assert d.num_features == 64 and d.num_classes == 10
    assert len(d.y_train) + len(d.y_val) + len(d.y_test) == 1797
    assert "digits" in d.summary()
