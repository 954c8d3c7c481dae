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
            if n:
                hp[k][rng.integers(0, n)] = 0.0
    return OptState(slots={}, step=0, hp=hp)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("overrides", [False, True])
def test_step_rates_equal_the_numpy_expressions(dtype, decoupled, overrides):
    rng = np.random.default_rng(0)
    opt = at.optim.AdamW(lr=3.7e-3, weight_decay=0.0123)
    for n in (0, 1, 7, 301):
        state = _state(rng, n, overrides)
        # Adam's bias correction at a few steps, Adagrad's decayed rate, the others' 1
        for lr_div in [1.0 - opt.betas[0] ** t for t in (1, 2, 10, 1000)] + [1.0 + 9 * 0.01, 1.0]:
            got = opt._step_rates(state, None, lr_div, np.dtype(dtype), decoupled)
            # the NumPy form, as the step computed it before (and computes it with a schedule's rates)
            want = opt._step_rates(state, opt.per_param(state, "lr"), lr_div, np.dtype(dtype), decoupled)
            for g, w, what in zip(got, want, ("step_size", "l2", "decay")):
                assert g.dtype == dtype and g.flags.c_contiguous and g.flags.writeable, what
                w = np.ascontiguousarray(w, dtype)  # (the kernels' cast: arraytrain.kernels.cpu.optimizers.seg_array)
                assert np.array_equal(g.view(f"u{g.itemsize}"), w.view(f"u{w.itemsize}")), (what, n, lr_div)
