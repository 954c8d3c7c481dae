"""Muon through the Engine against torch.optim.Muon (the matrices) plus torch.optim.AdamW (the rest).

torch's recipe for Muon: AdamW for every parameter that is not a hidden matrix. 50 steps of
large gradients, params compared after every step, the momentum buffers and the fallback's
moments at the end. torch iterates Newton-Schulz in bfloat16, arraytrain in the parameters'
dtype: the float32/float64 comparisons run torch's own iteration in the parameters' dtype
(its ``.bfloat16()`` cast made a plain copy for the step), and a separate test bounds the
distance to unmodified torch.
"""

from __future__ import annotations

import numpy as np
import pytest

import arraytrain as at
from arraytrain import optim
from conftest import assert_close, tol

torch = pytest.importorskip("torch")

TORCH_STEPS = 50
GRAD_SCALE = 1e3
# matrices wide, tall, flattened from 4-D (torch gets the (3, 8) matrix), zero-size ones, and
# 1-D, 0-D and a 2-D "head" that fallback_for routes to AdamW
SHAPES = {"w": (7, 5), "tall": (9, 4), "empty": (0,), "b": (5,), "scalar": (), "conv": (3, 2, 2, 2),
          "tail_empty": (2, 0), "head": (4, 6)}
FALLBACK = {"lr": 1e-2, "weight_decay": 0.5}
# (name, Muon's hyperparameters with torch's names, fallback_for)
MUON_CONFIGS = [
    ("muon", {"lr": 0.02}, ()),
    ("muon_plain_momentum_wd", {"lr": 0.02, "momentum": 0.9, "nesterov": False, "weight_decay": 0.5}, ()),
    ("muon_match_rms_adamw", {"lr": 0.01, "adjust_lr_fn": "match_rms_adamw", "ns_steps": 3}, ("head",)),
    ("muon_coefficients_eps", {"lr": 0.02, "ns_coefficients": (2.0, -1.5, 0.5), "eps": 1e-3}, ("head",)),
]
configs = pytest.mark.parametrize("name, kwargs, fallback_for", MUON_CONFIGS, ids=[c[0] for c in MUON_CONFIGS])
DTYPES = {"float32": (np.float32, torch.float32), "float64": (np.float64, torch.float64)}


def _torch_matrix(a: np.ndarray) -> np.ndarray:
    return a.reshape(a.shape[0], -1) if a.ndim > 2 else a


def _run_both(kwargs, fallback_for, dtype_name, *, max_grad_norm=None, same_dtype_ns=True, monkeypatch=None):
    np_dtype, torch_dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(0)
    init = {k: np.asarray(rng.standard_normal(s), dtype=np_dtype) for k, s in SHAPES.items()}
    engine = at.Engine(init, optim.Muon(**kwargs, fallback=optim.AdamW(**FALLBACK), fallback_for=fallback_for),
                       max_grad_norm=max_grad_norm)
    tparams = {k: torch.tensor(_torch_matrix(v).copy(), dtype=torch_dtype, requires_grad=True) for k, v in init.items()}
    muon_names = [k for k, v in init.items() if v.ndim >= 2 and k not in fallback_for]
    # torch divides by a zero column count in adjust_lr: the (2, 0) matrix stays with arraytrain alone
    tmuon = torch.optim.Muon([tparams[k] for k in muon_names if init[k].size], **kwargs)
    tadam = torch.optim.AdamW([p for k, p in tparams.items() if k not in muon_names], foreach=False, **FALLBACK)
    for t in range(1, TORCH_STEPS + 1):
        scale = GRAD_SCALE * rng.uniform(0.1, 3.0)
        grads = {k: np.asarray(rng.standard_normal(s) * scale, dtype=np_dtype) for k, s in SHAPES.items()}
        report = engine.step(grads)
        assert report.applied
        for k, p in tparams.items():
            p.grad = torch.from_numpy(_torch_matrix(grads[k]).copy())
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(tparams.values()), max_grad_norm, foreach=False)
        if same_dtype_ns:  # torch's own Newton-Schulz, its .bfloat16() a copy in the parameters' dtype
            with monkeypatch.context() as m:
                m.setattr(torch.Tensor, "bfloat16", lambda self: self.clone())
                tmuon.step()
        else:
            tmuon.step()
        tadam.step()
        yield t, engine, tparams, tmuon, tadam, muon_names, init


@configs
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("clip", [None, 1e4], ids=["noclip", "clip"])
def test_matches_torch(name, kwargs, fallback_for, dtype_name, clip, monkeypatch):
    np_dtype = DTYPES[dtype_name][0]
    for t, engine, tparams, tmuon, tadam, muon_names, init in _run_both(kwargs, fallback_for, dtype_name,
                                                                       max_grad_norm=clip, monkeypatch=monkeypatch):
        for k, p in tparams.items():
            assert_close(_torch_matrix(engine.params[k]), p.detach().numpy(), np_dtype, err_msg=f"{k!r}, step {t}")
    for k in muon_names:
        if init[k].size:
            desired = tmuon.state[tparams[k]]["momentum_buffer"].numpy()
            atol = tol(np_dtype)["atol"] + tol(np_dtype)["rtol"] * float(np.abs(desired).max())
            np.testing.assert_allclose(_torch_matrix(engine.state.slots["momentum_buffer"][k]), desired,
                                       rtol=tol(np_dtype)["rtol"], atol=atol, err_msg=k)
    for slot, key in (("fallback.exp_avg", "exp_avg"), ("fallback.exp_avg_sq", "exp_avg_sq")):
        for k, p in tparams.items():
            if k not in muon_names:
                desired = tadam.state[p][key].numpy()
                atol = tol(np_dtype)["atol"] + tol(np_dtype)["rtol"] * float(np.abs(desired).max(initial=0.0))
                np.testing.assert_allclose(engine.state.slots[slot][k], desired, rtol=tol(np_dtype)["rtol"],
                                           atol=atol, err_msg=f"{slot}[{k!r}]")
    assert not np.any(engine.state.slots["momentum_buffer"]["b"])  # the fallback's region of Muon's slot
    moved = min(float(np.abs(engine.params[k] - init[k]).max()) for k in ("w", "tall", "conv", "b"))
    assert moved > 0.05


def test_bfloat16_newton_schulz_of_torch_is_close(monkeypatch):
    """Unmodified torch.optim.Muon iterates in bfloat16: 50 steps stay within a fraction of one step's size."""
    worst = 0.0
    for _, engine, tparams, *_ in _run_both({"lr": 0.02}, (), "float32", same_dtype_ns=False):
        for k, p in tparams.items():
            worst = max(worst, float(np.abs(_torch_matrix(engine.params[k]) - p.detach().numpy()).max(initial=0.0)))
    assert 0.0 < worst < 0.5 * 0.02  # measured 3e-3
