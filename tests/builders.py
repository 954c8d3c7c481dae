"""Builders shared by the test files: random parameters, the engines over them, a small model's engine, and a
comparison of named arrays relative to their scale.

Import them with ``from builders import ...``, as ``from conftest import ...`` (pytest puts this directory on
``sys.path`` when it loads conftest.py, for the test files of every folder below it too).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

import arraytrain as at


def random_params(shapes: Mapping, seed=0, dtype=np.float64, scale: float = 1.0) -> dict:
    """``{name: standard normal * scale}`` of each shape in ``shapes``, cast to ``dtype``, drawn in ``shapes``'
    order from ``np.random.default_rng(seed)`` (``seed``: an int, or a Generator that is drawn from)."""
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(s) * scale).astype(dtype) for n, s in shapes.items()}


def random_engine(shapes: Mapping, optimizer, *, seed=0, param_dtype=np.float64, scale: float = 1.0,
                  **kw) -> at.Engine:
    """An Engine of ``optimizer`` over :func:`random_params` ``(shapes, seed, param_dtype, scale)``; ``kw``:
    the Engine's keyword arguments (its own ``dtype`` among them)."""
    return at.Engine(random_params(shapes, seed, param_dtype, scale), optimizer, **kw)


def mlp_engine(**kw) -> tuple:
    """``(model, engine)``: an ``nn.MLP([8, 16, 3])`` and an Engine of AdamW's defaults over its weights (seed 0),
    ``kw``: the Engine's keyword arguments. The model is not bound to the engine."""
    from arraytrain import nn

    model = nn.MLP([8, 16, 3])
    return model, at.Engine(model.init(seed=0), at.optim.AdamW(), **kw)


def assert_close_to_scale(got: Mapping, want: Mapping, *, rtol: float = 1e-5, atol_scale: float = 1e-5) -> None:
    """Each array of ``want`` against ``got``'s of the same name, element-wise:
    ``|got - want| <= rtol * |want| + atol_scale * max|want|`` (``np.testing.assert_allclose`` with an ``atol``
    of ``atol_scale`` times the array's largest magnitude). With ``rtol=0``: the largest error relative to the
    largest magnitude, ``max|got - want| / max|want|``, is at most ``atol_scale``."""
    for n, w in want.items():
        w = np.asarray(w)
        np.testing.assert_allclose(got[n], w, rtol=rtol, atol=atol_scale * np.abs(w).max(), err_msg=n)


def rank_windows(shapes, steps: int, ranks: int, micro: int, *, seed=1, nan_at=None, nan_in=None):
    """Gradients ``grads[step][rank][micro]`` (name -> 3 x standard normal) and micro-batch weights
    (uniform in [0.5, 2)) for a group of ``ranks``, drawn in that order from ``default_rng(seed)``; with
    ``nan_at`` a NaN in parameter ``nan_in`` at ``[1, 2]`` of the last rank's first micro-batch at that step."""
    rng = np.random.default_rng(seed)
    grads = [[[{n: 3 * rng.standard_normal(s) for n, s in shapes.items()} for _ in range(micro)]
              for _ in range(ranks)] for _ in range(steps)]
    weights = rng.uniform(0.5, 2.0, size=(steps, ranks, micro))
    if nan_at is not None:
        grads[nan_at][ranks - 1][0][nan_in][1, 2] = np.nan
    return grads, weights
