"""The compiled per-parameter rates (arraytrain.optim._rates) equal the NumPy expressions bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import arraytrain as at
from arraytrain.optim._base import OptState


def _state(rng, n, overrides):
    hp = {k: np.full(n, np.nan) for k in ("lr", "weight_decay")}
    if overrides:
        for k, scale in (("lr", 1e-2), ("weight_decay", 0.3)):
            hit = rng.random(n) < 0.5
            hp[k][hit] = rng.random(hit.sum()) * scale
            hp[k][rng.integers(0, n)] = 0.0
    return OptState(slots={}, step=0, hp=hp)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cls", [at.optim.Adam, at.optim.AdamW])
@pytest.mark.parametrize("overrides", [False, True])
def test_adam_rates_equal_the_numpy_expressions(dtype, cls, overrides):
    rng = np.random.default_rng(0)
    opt = cls(lr=3.7e-3, weight_decay=0.0123)
    for n in (1, 7, 300):
        state = _state(rng, n, overrides)
        for t in (1, 2, 10, 1000):
            bc1 = 1.0 - opt.betas[0] ** t
            got = opt.rates(state, None, bc1, np.dtype(dtype))
            # the NumPy form, as the step computed it before (and computes it with a schedule's rates)
            want = opt.rates(state, opt.per_param(state, "lr"), bc1, np.dtype(dtype))
            for g, w, what in zip(got, want, ("step_size", "l2", "decay")):
                assert g.dtype == dtype and g.flags.c_contiguous and g.flags.writeable, what
                w = np.ascontiguousarray(w, dtype)  # (the kernels' cast: arraytrain.kernels.cpu.optimizers.seg_array)
                assert np.array_equal(g.view(f"u{g.itemsize}"), w.view(f"u{w.itemsize}")), (what, n, t)
