"""Batching, splitting, scaling, and the datasets ``arraytrain train`` reads.

Everything random here is a pure function of a seed: the batch order of epoch
``e`` comes from ``numpy.random.default_rng([seed, e])``, so a run resumed at
epoch ``e`` sees exactly the batches the uninterrupted run would have seen,
with no generator state to save.
"""

from __future__ import annotations

import importlib
import math
import os
import zipfile
from dataclasses import dataclass

import numpy as np

from .._checks import check_int, check_number
from ..errors import DataError, LayoutError, MissingDependencyError
from ._array import array_namespace


def require(module: str, extra: str, what: str):
    """Import ``module`` or raise :class:`MissingDependencyError` naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependencyError(f"{what} needs {module.split('.')[0]}: pip install 'arraytrain[{extra}]'") from None


class Batches:
    """Mini-batches of ``(x, y)`` over one epoch at a time.

    ``shuffle``: a fresh permutation per epoch from ``default_rng([seed, epoch])``;
    ``drop_last``: leave out a last batch smaller than ``batch_size``.
    ``len()`` is the number of batches per epoch.
    """

    def __init__(self, x, y=None, batch_size: int = 32, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False):
        n = x.shape[0]
        if y is not None and y.shape[0] != n:
            raise LayoutError(f"y: {y.shape[0]} rows, x has {n}")
        array_namespace(x, y)
        self.x, self.y = x, y
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.seed = check_int("seed", seed, 0)
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        self.n = n

    def __len__(self) -> int:
        return self.n // self.batch_size if self.drop_last else math.ceil(self.n / self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch`` (a permutation, or ``arange`` without shuffle)."""
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng([self.seed, check_int("epoch", epoch, 0)]).permutation(self.n)

    def epoch(self, epoch: int = 0):
        """Yield ``(x_batch, y_batch)`` for ``epoch`` (``y_batch`` None without labels)."""
        order = self.order(epoch) if self.shuffle else None
        xp = array_namespace(self.x)
        if order is not None and xp is not np:
            order = xp.asarray(order)
        for b in range(len(self)):
            lo, hi = b * self.batch_size, min((b + 1) * self.batch_size, self.n)
            if order is None:
                idx = slice(lo, hi)
            else:
                idx = order[lo:hi]
            yield self.x[idx], (None if self.y is None else self.y[idx])

    __iter__ = epoch


class Standardizer:
    """Per-feature ``(x - mean) / s`` with statistics fitted on the training set.

    ``s`` is the feature's standard deviation, floored at ``floor`` times the
    mean standard deviation of all features: a feature that barely varies in
    training (a corner pixel that is almost always 0) would otherwise turn a
    rare value at test time into an input hundreds of deviations out. The floor
    is relative, so the scaling stays independent of the data's units. A
    constant data set (every std 0) is only centred.
    """

    def __init__(self, floor: float = 0.25):
        self.floor = check_number("floor", floor, 0.0)

    def fit(self, x: np.ndarray) -> "Standardizer":
        """Fit the per-feature mean and (floored) standard deviation on ``x``; returns self."""
        self.mean = x.mean(axis=0)
        std = x.std(axis=0)
        std = np.maximum(std, self.floor * std.mean()) if std.size else std
        self.std = np.where(std > 0, std, 1.0)
        return self

    def transform(self, x: np.ndarray, dtype=np.float32) -> np.ndarray:
        """``(x - mean) / std`` with the fitted statistics, as ``dtype``."""
        return ((x - self.mean) / self.std).astype(dtype)


def split_indices(y: np.ndarray, fractions, seed: int = 0) -> list:
    """Stratified split of ``range(len(y))`` into ``len(fractions) + 1`` index sets.

    Each class is permuted (``default_rng(seed)``) and cut by ``fractions``
    (rounded per class); the rest forms the first set. Every set is sorted.
    """
    rng = np.random.default_rng(seed)
    parts = [[] for _ in range(len(fractions) + 1)]
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        start = 0
        cuts = []
        for f in fractions:
            cuts.append((start, start + int(round(f * len(idx)))))
            start = cuts[-1][1]
        parts[0].append(idx[start:])
        for j, (a, b) in enumerate(cuts):
            parts[j + 1].append(idx[a:b])
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]


@dataclass
class Dataset:
    """A classification data set split three ways, features scaled with training statistics."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    classes: np.ndarray

    @property
    def num_features(self) -> int:
        """Columns of the feature matrices."""
        return self.x_train.shape[1]

    def summary(self) -> str:
        """One line: the name, features, classes and the size of each split."""
        return (f"{self.name}: {self.num_features} features, {self.num_classes} classes; "
                f"train {len(self.y_train)}, validation {len(self.y_val)}, test {len(self.y_test)}")


def _make(name, x, y, x_test, y_test, seed, val_fraction, test_fraction, dtype) -> Dataset:
    val_fraction = check_number("val_fraction", val_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
    if x_test is None:
        test_fraction = check_number("test_fraction", test_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
        if val_fraction + test_fraction >= 1.0:
            raise DataError(f"val_fraction + test_fraction must be < 1, got {val_fraction} + {test_fraction}")
    classes, y_enc = np.unique(y, return_inverse=True)
    if len(classes) < 2:
        raise DataError(f"{name}: y holds {len(classes)} class; classification needs at least 2")
    if x_test is None:
        train, val, test = split_indices(y_enc, (val_fraction, test_fraction), seed)
        x_test, y_test_enc = x[test], y_enc[test]
    else:
        train, val = split_indices(y_enc, (val_fraction,), seed)
        unknown = np.setdiff1d(np.unique(y_test), classes)
        if unknown.size:
            raise DataError(f"{name}: y_test holds classes not in y: {unknown[:5].tolist()}")
        y_test_enc = np.searchsorted(classes, y_test)
    for part, idx in (("train", train), ("validation", val)):
        if len(idx) == 0:
            raise DataError(f"{name}: the {part} split is empty ({len(y)} samples); give more data "
                            "or larger fractions")
    if len(y_test_enc) == 0:
        raise DataError(f"{name}: the test split is empty ({len(y)} samples)")
    scaler = Standardizer().fit(x[train].astype(np.float64))
    return Dataset(name, scaler.transform(x[train], dtype), y_enc[train].astype(np.int64),
                   scaler.transform(x[val], dtype), y_enc[val].astype(np.int64),
                   scaler.transform(x_test, dtype), y_test_enc.astype(np.int64), len(classes), classes)


def load_digits(seed: int = 0, val_fraction: float = 0.15, test_fraction: float = 0.2,
                dtype=np.float32) -> Dataset:
    """scikit-learn's handwritten digits (1797 8x8 images, 10 classes; ships with
    scikit-learn, no download), split stratified from ``seed`` and standardised."""
    datasets = require("sklearn.datasets", "train", "the digits data set")
    bunch = datasets.load_digits()
    return _make("digits", bunch.data.astype(np.float64), bunch.target, None, None,
                 seed, val_fraction, test_fraction, dtype)


def _check_array(name, a, path):
    if a.dtype.kind not in "biuf":
        raise DataError(f"{path}: {name} has dtype {a.dtype}; expected numbers")


def load_npz(path, seed: int = 0, val_fraction: float = 0.15, test_fraction: float = 0.2,
             dtype=np.float32) -> Dataset:
    """A classification data set from ``.npz``: ``X`` (n, features), ``y`` (n,) labels,
    optionally ``X_test`` and ``y_test`` (else a test split is cut from ``X``).

    Labels may be any integers (or integral floats); they are mapped to
    ``0..K-1`` in sorted order. Pickled object arrays are refused.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as raw:
            head = raw.read(6)
        # np.load reads anything that is neither a zip (.npz) nor a .npy as a pickle, and then
        # suggests allow_pickle: say what the file is not instead
        if not head.startswith((b"PK\x03\x04", b"PK\x05\x06", b"\x93NUMPY")):
            what = "an empty file" if not head else f"a file starting with {head!r}"
            raise DataError(f"{path}: not an .npz archive (the zip of .npy arrays numpy.savez writes); got {what}")
        f = np.load(path, allow_pickle=False)
        if not isinstance(f, np.lib.npyio.NpzFile):
            raise DataError(f"{path}: not an .npz archive (a single .npy array?)")
        with f:
            arrays = {k: f[k] for k in f.files}
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory") from None
    except DataError:
        raise
    except ValueError as exc:
        if "allow_pickle" in str(exc):  # an object array inside the archive
            raise DataError(f"{path}: holds an object array (pickled Python objects), which is never loaded; "
                            "save numeric arrays") from None
        raise DataError(f"{path}: cannot read as .npz ({exc})") from None
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise DataError(f"{path}: cannot read as .npz ({exc})") from None
    missing = [k for k in ("X", "y") if k not in arrays]
    if missing:
        raise DataError(f"{path}: missing array(s) {missing}; expected X, y and optionally X_test, y_test "
                        f"(found {sorted(arrays)})")
    if ("X_test" in arrays) != ("y_test" in arrays):
        raise DataError(f"{path}: X_test and y_test go together; found only "
                        f"{'X_test' if 'X_test' in arrays else 'y_test'}")
    x, y = arrays["X"], arrays["y"]
    x_test, y_test = arrays.get("X_test"), arrays.get("y_test")
    for name, a in (("X", x), ("y", y), ("X_test", x_test), ("y_test", y_test)):
        if a is None:
            continue
        _check_array(name, a, path)
        want = 2 if name.startswith("X") else 1
        if a.ndim != want:
            raise DataError(f"{path}: {name} must be {want}-D, got shape {a.shape}")
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise DataError(f"{path}: {name} holds NaN or Inf")
        if name.startswith("y") and a.dtype.kind == "f" and not np.array_equal(a, np.round(a)):
            raise DataError(f"{path}: {name} must hold integer class labels, got non-integral values")
    if x.shape[0] != y.shape[0]:
        raise DataError(f"{path}: X has {x.shape[0]} rows, y has {y.shape[0]}")
    if x.shape[1] == 0:
        raise DataError(f"{path}: X has no features")
    if x_test is not None:
        if x_test.shape[0] != y_test.shape[0]:
            raise DataError(f"{path}: X_test has {x_test.shape[0]} rows, y_test has {y_test.shape[0]}")
        if x_test.shape[1] != x.shape[1]:
            raise DataError(f"{path}: X_test has {x_test.shape[1]} features, X has {x.shape[1]}")
        x_test = x_test.astype(np.float64)
        y_test = y_test.astype(np.int64)
    name = os.path.basename(path)
    return _make(name, x.astype(np.float64), y.astype(np.int64), x_test, y_test,
                 seed, val_fraction, test_fraction, dtype)
