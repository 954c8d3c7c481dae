"""arraytrain optimizers through the Engine against torch.optim (foreach=False).

One table drives every comparison: a row is (name, arraytrain optimizer
factory, torch optimizer factory); add a row to test a new optimizer. Both
sides start from identical parameters and receive identical large gradients;
parameters are compared after every step. torch's own optimizer test matrix
(``optim_db``) drives a second comparison (the slow tier; see _optim_db below).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import arraytrain
from arraytrain import Engine, HyperparameterError, optim
from conftest import TORCH_CONFIGS, assert_close, tol

torch = pytest.importorskip("torch")
import torch_optim_db  # noqa: E402  (imports torch)

STEPS = 50
GRAD_SCALE = 1e3
SHAPES = {"w": (7, 5), "empty": (0,), "b": (5,), "scalar": (), "conv": (3, 2, 2, 2), "tail_empty": (2, 0)}
DTYPES = {"float32": (np.float32, torch.float32), "float64": (np.float64, torch.float64)}


def _row(name, cls_name, kwargs):
    at_cls, torch_cls = getattr(optim, cls_name), getattr(torch.optim, cls_name)
    return (
        name,
        lambda: at_cls(**kwargs),
        lambda params: torch_cls(params, foreach=False, **kwargs),
    )


# (name, arraytrain factory, torch factory). Rows built from the shared configs,
# plus any optimizer whose construction differs between the two libraries.
OPTIMIZERS = [_row(*cfg) for cfg in TORCH_CONFIGS] + [
    ("adamw_default_wd", lambda: optim.AdamW(lr=1e-2), lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False)),
    ("adam_lr0", lambda: optim.Adam(lr=0.0), lambda ps: torch.optim.Adam(ps, lr=0.0, foreach=False)),
]
optimizers = pytest.mark.parametrize("name, make_at, make_torch", OPTIMIZERS, ids=[r[0] for r in OPTIMIZERS])
dtypes = pytest.mark.parametrize("dtype_name", list(DTYPES))


def _run_both(make_at, make_torch, dtype_name, max_grad_norm=None, seed=0):
    np_dtype, torch_dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(seed)
    init = {k: np.asarray(rng.standard_normal(s), dtype=np_dtype) for k, s in SHAPES.items()}
    engine = Engine(init, make_at(), max_grad_norm=max_grad_norm)
    assert engine.params.dtype == np_dtype
    tparams = {k: torch.tensor(v.copy(), dtype=torch_dtype, requires_grad=True) for k, v in init.items()}
    topt = make_torch(list(tparams.values()))
    clipped = 0
    for t in range(1, STEPS + 1):
        # a varying overall scale, so that clipping is active on some steps only
        scale = GRAD_SCALE * rng.uniform(0.1, 3.0)
        grads = {k: np.asarray(rng.standard_normal(s) * scale, dtype=np_dtype) for k, s in SHAPES.items()}
        report = engine.step(grads)
        for k, p in tparams.items():
            p.grad = torch.from_numpy(grads[k].copy())
        if max_grad_norm is not None:
            tnorm = float(torch.nn.utils.clip_grad_norm_(list(tparams.values()), max_grad_norm, foreach=False))
            assert_close(report.grad_norm, tnorm, np_dtype, err_msg=f"grad norm, step {t}")
            clipped += report.clip_coef < 1.0
        topt.step()
        assert report.applied and not report.skipped and report.step == t
        for k, p in tparams.items():
            expected = p.detach().numpy()
            assert engine.params[k].shape == expected.shape
            assert_close(engine.params[k], expected, np_dtype, err_msg=f"{k!r}, step {t}")
    return engine, topt, tparams, clipped, init


def _compare_state(engine, topt, tparams, np_dtype):
    """Every arraytrain slot against torch's state of the same name (torch's key names)."""
    for k, p in tparams.items():
        tstate = topt.state[p]
        for slot, buf in engine.state.slots.items():
            if slot == "momentum_buffer" and tstate.get(slot) is None:
                continue
            # the slots scale with the gradients (~1e3, their squares ~1e6): elements that cancelled to
            # near zero keep rounding errors of the slot's magnitude, hence a normwise absolute tolerance
            desired = tstate[slot].numpy()
            t = tol(np_dtype)
            atol = t["atol"] + t["rtol"] * float(np.max(np.abs(desired), initial=0.0))
            np.testing.assert_allclose(buf[k], desired, rtol=t["rtol"], atol=atol, err_msg=f"{slot}[{k!r}]")
        if "step" in tstate:
            assert int(tstate["step"]) == engine.state.step
        # scalar state (NAdam's mu_product): one value here, a tensor per parameter in torch, kept in
        # torch's default float32 whatever the parameters' dtype; a product of ~0.5**t, hence relative
        for name, value in engine.state.scalars.items():
            np.testing.assert_allclose(value, float(tstate[name]), rtol=1e-5, atol=0, err_msg=f"{name}[{k!r}]")


@optimizers
@dtypes
def test_matches_torch(name, make_at, make_torch, dtype_name):
    engine, topt, tparams, _, init = _run_both(make_at, make_torch, dtype_name)
    _compare_state(engine, topt, tparams, DTYPES[dtype_name][0])
    moved = max(float(np.max(np.abs(engine.params[k] - v), initial=0.0)) for k, v in init.items())
    if engine.optimizer.lr > 0:  # the comparison is not vacuous: the parameters really moved
        assert moved > 0.1
    else:
        assert moved == 0.0


@optimizers
@pytest.mark.parametrize("dtype_name", ["float32", pytest.param("float64", marks=pytest.mark.slow)])
def test_matches_torch_with_clipping(name, make_at, make_torch, dtype_name):
    # gradient norms range over ~[0.1, 3] * 1e3 * sqrt(82): clipping at 1e4 is active on some steps only
    engine, topt, tparams, clipped, _ = _run_both(make_at, make_torch, dtype_name, max_grad_norm=1e4)
    assert 0 < clipped < STEPS
    _compare_state(engine, topt, tparams, DTYPES[dtype_name][0])


def test_table_covers_every_optimizer_class():
    classes = {type(make_at()) for _, make_at, _ in OPTIMIZERS}
    # every arraytrain optimizer that torch.optim also has is in the table, but Adafactor:
    # torch's divides by zero on the zero-size parameters of SHAPES, so test_adafactor.py
    # compares it with torch on its own shapes; and Muon: torch's takes 2-D parameters only
    # (and no foreach), so test_muon_torch.py compares it with torch's Muon + AdamW
    assert classes == {getattr(optim, n) for n in optim.__all__
                       if n not in ("Optimizer", "OptState", "Adafactor", "Muon") and hasattr(torch.optim, n)}
    for _, make_at, make_torch in OPTIMIZERS:
        assert type(make_torch([torch.zeros(1, requires_grad=True)])).__name__ == type(make_at()).__name__


# -- hyperparameter validation -------------------------------------------------------------

INVALID = [
    ("lr", lambda: optim.SGD(lr=-1e-3)),
    ("lr", lambda: optim.Adam(lr=-1.0)),
    ("lr", lambda: optim.AdamW(lr=float("nan"))),
    ("lr", lambda: optim.SGD(lr=float("inf"))),
    ("lr", lambda: optim.SGD(lr="0.1")),
    ("lr", lambda: optim.Adam(lr=None)),
    ("lr", lambda: optim.SGD(lr=True)),
    ("lr", lambda: optim.Adam(lr=np.bool_(True))),
    ("betas[0]", lambda: optim.Adam(betas=(1.0, 0.999))),
    ("betas[0]", lambda: optim.Adam(betas=(-0.1, 0.999))),
    ("betas[1]", lambda: optim.Adam(betas=(0.9, 1.0))),
    ("betas[1]", lambda: optim.AdamW(betas=(0.9, 1.5))),
    ("betas[1]", lambda: optim.AdamW(betas=(0.9, "0.99"))),
    ("betas[0]", lambda: optim.Adam(betas=(False, 0.99))),
    ("betas", lambda: optim.Adam(betas=0.9)),
    ("betas", lambda: optim.Adam(betas=(0.9, 0.99, 0.999))),
    ("eps", lambda: optim.Adam(eps=0.0)),
    ("eps", lambda: optim.AdamW(eps=-1e-8)),
    ("eps", lambda: optim.Adam(eps="1e-8")),
    ("momentum", lambda: optim.SGD(momentum=-0.1)),
    ("momentum", lambda: optim.SGD(momentum=[0.9])),
    ("dampening", lambda: optim.SGD(momentum=0.9, dampening=-0.5)),
    ("weight_decay", lambda: optim.SGD(weight_decay=-1e-4)),
    ("weight_decay", lambda: optim.Adam(weight_decay=-1e-4)),
    ("weight_decay", lambda: optim.AdamW(weight_decay=-0.01)),
    ("weight_decay", lambda: optim.AdamW(weight_decay=True)),
    ("nesterov", lambda: optim.SGD(lr=0.1, nesterov=True)),
    ("nesterov", lambda: optim.SGD(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)),
    ("nesterov", lambda: optim.SGD(lr=0.1, momentum=0.9, nesterov=1)),
    ("amsgrad", lambda: optim.Adam(amsgrad=1)),
    ("amsgrad", lambda: optim.AdamW(amsgrad="yes")),
    ("max_grad_norm", lambda: Engine({"a": np.zeros(3)}, optim.SGD(), max_grad_norm=0.0)),
    ("max_grad_norm", lambda: Engine({"a": np.zeros(3)}, optim.SGD(), max_grad_norm=-1.0)),
    ("max_grad_norm", lambda: Engine({"a": np.zeros(3)}, optim.SGD(), max_grad_norm=True)),
    ("accumulation_steps", lambda: Engine({"a": np.zeros(3)}, optim.SGD(), accumulation_steps=0)),
]


@pytest.mark.parametrize("param, make", INVALID, ids=[f"{p}-{i}" for i, (p, _) in enumerate(INVALID)])
def test_invalid_hyperparameters_raise(param, make):
    with pytest.raises(HyperparameterError, match=re.escape(param)) as info:
        make()
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, arraytrain.ArrayTrainError)


@pytest.mark.parametrize("make", [
    lambda: optim.SGD(lr=0.0),
    lambda: optim.SGD(lr=1, momentum=0.9, dampening=1.0),
    lambda: optim.SGD(lr=np.float32(0.1), momentum=0.9, nesterov=True, weight_decay=0),
    lambda: optim.Adam(lr=0.0, betas=(0.0, 0.0), eps=1e-30, weight_decay=0.0),
    lambda: optim.AdamW(betas=[0.5, 0.9], amsgrad=True),
], ids=["lr0", "dampening1", "numpy_scalar", "betas0", "betas_list"])
def test_boundary_hyperparameters_are_accepted(make):
    opt = make()
    hp = opt.hyperparameters()
    for value in hp.values():
        assert not isinstance(value, np.generic)  # stored as plain Python numbers
    assert type(opt).__name__ in repr(opt)


# -- torch's optimizer test matrix ----------------------------------------------------------------
#
# Every configuration torch's ``optim_db`` (torch.testing._internal.common_optimizers) lists for
# these optimizers runs here as above: 50 steps of large gradients, params after every step, then
# every slot and scalar (the slow tier: torch's own exhaustive matrix; the table above runs in the
# default tier). The matrix is read once (tests/torch_optim_db.py). The CPU list is run; the
# configurations torch adds for CUDA devices are listed too and skipped, each with the reason
# (arraytrain has no counterpart of the flag).
OPTIM_DB_CLASSES = ("NAdam", "RAdam", "Adamax", "Adadelta")
UNSUPPORTED = {
    "capturable": "capturable: torch's CUDA-graph mode (step and lr on the device); arraytrain forms its "
                  "step-dependent scalars on the host, and its CUDA update needs no such mode",
    "differentiable": "differentiable: autograd through the optimizer step; arraytrain has no autograd",
    "foreach": "foreach: a choice of torch's implementation (the oracle here runs foreach=False)",
    "fused": "fused: a choice of torch's implementation (the oracle here runs foreach=False)",
    "tensor lr": "a tensor lr: arraytrain takes a float lr per parameter (and a schedule)",
}
def _optim_db():
    got = torch_optim_db.rows()
    if isinstance(got, str):
        return [pytest.param(None, id="optim_db", marks=pytest.mark.skip(reason=f"torch's optim_db: {got}"))]
    rows, seen = [], set()
    for r in got:  # each configuration once: the CPU's, then what the CUDA list adds
        key = (r["optimizer"], json.dumps(r["kwargs"], sort_keys=True))
        if r["optimizer"] in OPTIM_DB_CLASSES and key not in seen:
            seen.add(key)
            rows.append(r)
    ids = [f"{r['optimizer']}-{r['device']}-{re.sub(r'[^a-z0-9]+', '_', r['desc'].lower()).strip('_')}" for r in rows]
    return [pytest.param(r, id=i) for r, i in zip(rows, ids)]




def _unsupported(kwargs) -> list[str]:
    found = [UNSUPPORTED[k] for k in kwargs if k in UNSUPPORTED and kwargs[k]]
    if isinstance(kwargs.get("lr"), dict):
        found.append(UNSUPPORTED["tensor lr"])
    return found


def pytest_generate_tests(metafunc):
    """torch's matrix is read only where its tests run: the slow tier (their rows are its ids)."""
    if "optim_db_config" in metafunc.fixturenames:
        slow = metafunc.config.getoption("--tier") != "default"
        metafunc.parametrize("optim_db_config", _optim_db() if slow else [pytest.param(None, id="not-read")])


@pytest.mark.slow  # the slow tier: torch's exhaustive matrix (every optimizer meets torch above)
@dtypes
def test_matches_torch_optim_db(optim_db_config, dtype_name):
    config = optim_db_config
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in config["kwargs"].items()}
    why = _unsupported(kwargs)
    if why:
        pytest.skip("; ".join(why))
    at_cls, torch_cls = getattr(optim, config["optimizer"]), getattr(torch.optim, config["optimizer"])
    engine, topt, tparams, _, init = _run_both(lambda: at_cls(**kwargs),
                                               lambda ps: torch_cls(ps, foreach=False, **kwargs), dtype_name)
    np_dtype = DTYPES[dtype_name][0]
    _compare_state(engine, topt, tparams, np_dtype)
    # not vacuous: the parameters moved well beyond the tolerance (Adadelta at lr 0.01: ~6e-4)
    moved = max(float(np.max(np.abs(engine.params[k] - v), initial=0.0)) for k, v in init.items())
    assert moved > 10 * tol(np_dtype)["atol"]


@pytest.mark.slow  # the slow tier, with the matrix
def test_optim_db_covers_the_classes():
    """The matrix was read and lists each class, on the CPU, at least with its defaults."""
    db = _optim_db()
    rows = [p.values[0] for p in db]
    if rows == [None]:
        pytest.skip(db[0].marks[0].kwargs["reason"])
    for name in OPTIM_DB_CLASSES:
        assert any(r["optimizer"] == name and r["device"] == "cpu" and r["kwargs"] == {} for r in rows), name
    assert all(_unsupported(r["kwargs"]) for r in rows if r["device"] == "cuda")  # CUDA adds only such flags
