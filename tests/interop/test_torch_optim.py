"""The drop-in ``torch.optim.Optimizer`` classes of arraytrain.interop.torch against torch.optim.

Every comparison trains two copies of a small real model (linear, convolution, LayerNorm,
an embedding and a tied head) from the same weights on the same batches: one with the
drop-in class, one with the torch.optim class of the same name (``foreach=False``), and
compares the parameters after every step and the state at the end.
"""

from __future__ import annotations

import copy
import inspect
import io
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import TORCH_CONFIGS, assert_close, tol

import arraytrain
from arraytrain import errors

torch = pytest.importorskip("torch")
import torch_optim_db  # noqa: E402  (imports torch)
from arraytrain.interop import torch as at_torch

STEPS = 12
TOL32 = tol(np.float32)


class Net(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.conv = torch.nn.Conv1d(6, 5, 3, padding=1)
        self.norm = torch.nn.LayerNorm(5)
        self.fc = torch.nn.Linear(5, 7)
        self.head = torch.nn.Linear(7, 1)
        self.to(dtype)

    def forward(self, tokens):
        h = self.emb(tokens).transpose(1, 2)           # (batch, 6, length)
        h = torch.relu(self.conv(h)).transpose(1, 2)   # (batch, length, 5)
        h = torch.tanh(self.fc(self.norm(h)))
        return self.head(h).mean(dim=(1, 2))


def _models(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    a = Net(dtype)
    b = copy.deepcopy(a)
    return a, b


def _batches(n=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 11, (8, 9), generator=g), torch.randn(8, generator=g) * 3) for _ in range(n)]


def _loss(model, batch):
    tokens, y = batch
    return torch.nn.functional.mse_loss(model(tokens), y.to(next(model.parameters()).dtype))


def _train(model, opt, batches, sched=None, scaler=None, after_step=None):
    losses = []
    for i, batch in enumerate(batches):
        opt.zero_grad()
        loss = _loss(model, batch)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
        if after_step is not None:
            after_step(i)
    return losses


def _close(a_model, b_model, rtol=TOL32["rtol"] * 10, atol=TOL32["atol"], msg=""):
    for (n, a), (_, b) in zip(a_model.named_parameters(), b_model.named_parameters()):
        np.testing.assert_allclose(a.detach().float().numpy(), b.detach().float().numpy(), rtol=rtol, atol=atol,
                                   err_msg=f"{n} {msg}")


# -- one table: every drop-in class whose torch.optim twin exists, at the shared configurations ---------

ROWS = [(name, cls, kw) for name, cls, kw in TORCH_CONFIGS]


@pytest.mark.parametrize("name, cls, kwargs", ROWS, ids=[r[0] for r in ROWS])
def test_matches_torch_optim(name, cls, kwargs):
    a, b = _models()
    mine = getattr(at_torch, cls)(a.parameters(), **kwargs)
    theirs = getattr(torch.optim, cls)(b.parameters(), foreach=False, **kwargs)
    assert isinstance(mine, torch.optim.Optimizer)
    batches = _batches()
    for i, batch in enumerate(batches):
        for model, opt in ((a, mine), (b, theirs)):
            opt.zero_grad()
            _loss(model, batch).backward()
            opt.step()
        _close(a, b, msg=f"step {i + 1}")
    moved = max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), _models()[0].parameters()))
    assert moved > 1e-4
    for p, q in zip(a.parameters(), b.parameters()):
        mine_state, their_state = mine.state[p], theirs.state[q]
        for key, value in their_state.items():
            if value is None:
                continue
            np.testing.assert_allclose(mine_state[key].float().numpy(), value.float().numpy(), rtol=1e-4,
                                       atol=1e-6 + 1e-4 * float(value.abs().max()), err_msg=f"{name} {key}")


def test_every_arraytrain_optimizer_has_a_drop_in():
    names = set(arraytrain.optim.__all__) - {"by_name", "Optimizer", "OptState"}
    assert names <= set(at_torch.DROP_INS)
    for name in at_torch.DROP_INS:
        cls = getattr(at_torch, name)
        assert issubclass(cls, torch.optim.Optimizer) and cls.__module__ == "arraytrain.interop.torch"
        if hasattr(torch.optim, name) and name != "Muon":  # torch's names and defaults, then arraytrain's options
            ours = list(inspect.signature(cls).parameters.values())
            theirs = list(inspect.signature(getattr(torch.optim, name)).parameters.values())
            assert [(p.name, p.default) for p in ours[:len(theirs)]] == [(p.name, p.default) for p in theirs]


def test_import_does_not_import_torch():
    code = "import sys, arraytrain.interop.torch as t; print('torch' in sys.modules); t.AdamW; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.stdout.split() == ["False", "True"], out.stderr


# -- groups, schedulers, closure, add_param_group -------------------------------------------------------

def _groups(model):
    """Hugging Face Trainer's split: no weight decay for biases and norms, plus a faster head."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n and "head" not in n]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight") or "norm" in n]
    head = [model.head.weight]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0},
            {"params": head, "lr": 3e-2, "betas": (0.8, 0.99)}]


def test_per_group_settings():
    a, b = _models()
    mine = at_torch.AdamW(_groups(a), lr=1e-2)
    theirs = torch.optim.AdamW(_groups(b), lr=1e-2, foreach=False)
    _train(a, mine, _batches())
    _train(b, theirs, _batches())
    _close(a, b)
    assert len(mine.reports) == 2  # the head's betas differ: an engine of its own


def test_several_engines_clip_and_skip_as_one():
    """Groups that differ in betas run in two engines; the clip and the NaN/Inf skip stay global."""
    a, b = _models()
    mine = at_torch.AdamW(_groups(a), lr=1e-2, max_grad_norm=0.5)
    theirs = torch.optim.AdamW(_groups(b), lr=1e-2, foreach=False)
    for i, batch in enumerate(_batches()):
        for model, opt in ((a, mine), (b, theirs)):
            opt.zero_grad()
            _loss(model, batch).backward()
            if i == 4:
                model.head.weight.grad[0, 0] = float("nan")  # one engine's gradient: both skip
            if opt is theirs and i != 4:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
            elif opt is mine:
                opt.step()
    assert len(mine.reports) == 2
    _close(a, b)
    assert {int(mine.state[p]["step"]) for p in a.parameters()} == {STEPS - 1}


SCHEDULERS = {
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[5e-2, 2e-2, 1e-1], total_steps=STEPS),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5, eta_min=1e-4),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, [lambda s: 0.9 ** s, lambda s: 1.0 / (1 + s),
                                                                lambda s: 1.0]),
}


@pytest.mark.parametrize("sched", list(SCHEDULERS))
@pytest.mark.parametrize("cls", ["AdamW", "SGD"])
def test_schedulers(sched, cls):
    a, b = _models()
    kw = {"lr": 1e-2, "momentum": 0.9} if cls == "SGD" else {"lr": 1e-2}
    mine = getattr(at_torch, cls)(_groups(a) if cls == "AdamW" else _groups(a)[:2] + [{"params": [a.head.weight]}],
                                  **kw)
    theirs = getattr(torch.optim, cls)(_groups(b) if cls == "AdamW" else _groups(b)[:2] + [{"params": [b.head.weight]}],
                                       foreach=False, **kw)
    s1, s2 = SCHEDULERS[sched](mine), SCHEDULERS[sched](theirs)
    _train(a, mine, _batches(), s1)
    _train(b, theirs, _batches(), s2)
    _close(a, b)
    assert [g["lr"] for g in mine.param_groups] == [g["lr"] for g in theirs.param_groups]


@pytest.mark.parametrize("cls, key, good, bad, why", [
    ("AdamW", "betas", (0.85, 0.99), (1.0, 0.999), r"betas\[0\]"),
    ("AdamW", "betas", [0.8, 0.9], (0.9, float("nan")), r"betas\[1\]"),
    ("SGD", "momentum", 0.8, 0.0, "changes the optimizer's state"),
    ("SGD", "momentum", 0.7, -0.1, "momentum"),
])
def test_a_scheduled_beta_or_momentum_is_checked_as_the_constructor_checks_it(cls, key, good, bad, why):
    """The retune path (a scheduler's betas or momentum set without building an optimizer) takes what the
    constructor takes, and refuses the rest with the constructor's error, changing nothing."""
    a, b = _models()
    kw = {"lr": 1e-2, "momentum": 0.9} if cls == "SGD" else {"lr": 1e-2}
    mine = getattr(at_torch, cls)(a.parameters(), **kw)
    theirs = getattr(torch.optim, cls)(b.parameters(), foreach=False, **kw)
    batches = _batches(4)
    for i, batch in enumerate(batches):
        if i == 2:
            for opt in (mine, theirs):
                opt.param_groups[0][key] = good
        for model, opt in ((a, mine), (b, theirs)):
            opt.zero_grad()
            _loss(model, batch).backward()
            opt.step()
    _close(a, b)
    engine = mine._cohorts[0].engine
    assert getattr(engine.optimizer, key) == (tuple(good) if key == "betas" else good)
    before = {n: v.copy() for n, v in engine.params.items()}
    mine.param_groups[0][key] = bad
    with pytest.raises(errors.HyperparameterError, match=why):
        mine.step()
    assert getattr(engine.optimizer, key) == (tuple(good) if key == "betas" else good)
    assert all((engine.params[n] == v).all() for n, v in before.items())


def test_reduce_lr_on_plateau_and_tensor_lr():
    a, b = _models()
    mine = at_torch.Adam(a.parameters(), lr=torch.tensor(2e-2))
    theirs = torch.optim.Adam(b.parameters(), lr=torch.tensor(2e-2), foreach=False)
    s1 = torch.optim.lr_scheduler.ReduceLROnPlateau(mine, patience=0, factor=0.5)
    s2 = torch.optim.lr_scheduler.ReduceLROnPlateau(theirs, patience=0, factor=0.5)
    for i, batch in enumerate(_batches()):
        for model, opt, sched in ((a, mine, s1), (b, theirs, s2)):
            opt.zero_grad()
            loss = _loss(model, batch)
            loss.backward()
            opt.step()
            sched.step(10.0 - (i % 3))  # a plateau every third step
    _close(a, b)
    assert float(mine.param_groups[0]["lr"]) < 2e-2 and float(mine.param_groups[0]["lr"]) == float(
        theirs.param_groups[0]["lr"])


def test_a_tensor_rate_is_read_where_it_lies_and_a_moved_or_bad_one_in_full():
    """A one-element tensor ``lr`` (or ``weight_decay``) is read through a view of its memory: what
    ``fill_``/``copy_`` write is what the step uses; a tensor replaced in the group, its ``.data``
    replaced, a bfloat16 or a tensor holding a bad value take the full read (its checks, its errors)."""
    p = torch.nn.Parameter(torch.zeros(3))
    lr, wd = torch.tensor(1e-3), torch.tensor(0.5, dtype=torch.float64)
    opt = at_torch.AdamW([{"params": [p], "lr": lr, "weight_decay": wd}])
    cohort = opt._cohorts[0]

    def rates():  # (the rates the next step gives the engine)
        opt.read_param_groups()
        return float(cohort.lrs[0]), float(cohort.wds[0])

    assert rates() == (float(lr), 0.5)
    lr.fill_(2e-3)
    wd.copy_(torch.tensor(0.25))
    assert rates() == (float(torch.tensor(2e-3)), 0.25)
    opt.param_groups[0]["lr"] = torch.tensor(3e-3)  # another tensor object
    assert rates()[0] == float(torch.tensor(3e-3))
    opt.param_groups[0]["lr"].data = torch.tensor(4e-3)  # the same object, other memory
    assert rates()[0] == float(torch.tensor(4e-3))
    opt.param_groups[0]["lr"] = torch.tensor(5e-3, dtype=torch.bfloat16)  # no view: .item() each read
    assert rates()[0] == float(torch.tensor(5e-3, dtype=torch.bfloat16))
    opt.param_groups[0]["lr"] = lr
    rates()
    for bad in (-1.0, float("nan"), float("inf")):
        lr.fill_(bad)
        with pytest.raises(errors.HyperparameterError, match=r"param_groups\[0\]\['lr'\]"):
            opt.read_param_groups()
        assert float(cohort.lrs[0]) == float(torch.tensor(2e-3))
    lr.fill_(1e-3)
    assert rates()[0] == float(torch.tensor(1e-3))


def test_closure_returns_the_loss():
    a, b = _models()
    mine = at_torch.SGD(a.parameters(), lr=1e-2, momentum=0.9, nesterov=True)
    theirs = torch.optim.SGD(b.parameters(), lr=1e-2, momentum=0.9, nesterov=True, foreach=False)
    for batch in _batches(6):
        out = []
        for model, opt in ((a, mine), (b, theirs)):
            def closure(model=model, opt=opt, batch=batch):
                opt.zero_grad()
                loss = _loss(model, batch)
                loss.backward()
                return loss
            out.append(opt.step(closure).item())
        assert out[0] == pytest.approx(out[1], rel=1e-5)
    _close(a, b)


def test_add_param_group_mid_training():
    """A group added after step 4 starts at step 1 (torch counts steps per parameter), in an engine of its own."""
    a, b = _models()
    for m in (a, b):
        m.head.requires_grad_(False)
    mine = at_torch.Adam([p for n, p in a.named_parameters() if not n.startswith("head")], lr=1e-2)
    theirs = torch.optim.Adam([p for n, p in b.named_parameters() if not n.startswith("head")], lr=1e-2,
                              foreach=False)

    def unfreeze(model, opt):
        def hook(i):
            if i == 3:
                model.head.requires_grad_(True)
                opt.add_param_group({"params": list(model.head.parameters()), "lr": 5e-2})
        return hook

    _train(a, mine, _batches(), after_step=unfreeze(a, mine))
    _train(b, theirs, _batches(), after_step=unfreeze(b, theirs))
    _close(a, b)
    assert int(mine.state[a.head.weight]["step"]) == STEPS - 4
    assert int(mine.state[a.fc.weight]["step"]) == STEPS


def test_parameters_without_gradients_are_left_alone():
    """A parameter whose .grad is None (unused, frozen) is not decayed, as torch leaves it."""
    a, b = _models()
    mine = at_torch.AdamW(a.parameters(), lr=1e-2, weight_decay=0.5)
    theirs = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.5, foreach=False)
    before = a.head.bias.detach().clone()
    for batch in _batches(5):
        for model, opt in ((a, mine), (b, theirs)):
            opt.zero_grad()
            _loss(model, batch).backward()
            model.head.bias.grad = None
            opt.step()
    assert torch.equal(a.head.bias, before)
    _close(a, b)


# -- clipping, GradScaler, low precision ------------------------------------------------------------------

def test_max_grad_norm_is_torch_clip_grad_norm():
    a, b = _models()
    mine = at_torch.AdamW(a.parameters(), lr=1e-2, max_grad_norm=0.5)
    theirs = torch.optim.AdamW(b.parameters(), lr=1e-2, foreach=False)
    norms = []
    for batch in _batches():
        for model, opt in ((a, mine), (b, theirs)):
            opt.zero_grad()
            _loss(model, batch).backward()
            if opt is theirs:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()
        assert mine.reports[0].grad_norm == pytest.approx(norms[-1], rel=1e-4)
    assert any(n > 0.5 for n in norms)
    _close(a, b)


def test_clip_grad_norm_called_by_a_framework_still_works():
    a, b = _models()
    mine = at_torch.AdamW(a.parameters(), lr=1e-2)
    theirs = torch.optim.AdamW(b.parameters(), lr=1e-2, foreach=False)
    for batch in _batches():
        for model, opt in ((a, mine), (b, theirs)):
            opt.zero_grad(set_to_none=False)
            _loss(model, batch).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
            opt.step()
    _close(a, b)


def _scaler_run(model, opt, batches, inf_at=()):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    scales = []
    for i, batch in enumerate(batches):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(model, batch)
        scaler.scale(loss.float()).backward()
        if i in inf_at:
            model.fc.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_grad_scaler_float16_autocast_on_the_cpu():
    """torch's recipe (float32 model, float16 autocast, GradScaler): unscale and skip fused into the step."""
    a, b = _models()
    mine = at_torch.AdamW(a.parameters(), lr=1e-2)
    theirs = torch.optim.AdamW(b.parameters(), lr=1e-2, foreach=False)
    s1 = _scaler_run(a, mine, _batches(), inf_at=(2, 7))
    s2 = _scaler_run(b, theirs, _batches(), inf_at=(2, 7))
    assert s1 == s2 and min(s1) < 2.0**12
    _close(a, b)
    assert int(mine.state[a.fc.weight]["step"]) == STEPS - 2


def test_grad_scaler_with_unscale_then_clip():
    a, b = _models()
    mine = at_torch.AdamW(a.parameters(), lr=1e-2)
    theirs = torch.optim.AdamW(b.parameters(), lr=1e-2, foreach=False)
    for model, opt in ((a, mine), (b, theirs)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for batch in _batches():
            opt.zero_grad()
            scaler.scale(_loss(model, batch)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
            scaler.step(opt)
            scaler.update()
    _close(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_low_precision_model_on_float32_masters(dtype):
    """A float16/bfloat16 model: float32 master weights in the optimizer; with float16, a GradScaler."""
    a, _ = _models(dtype)
    ref, _ = _models(torch.float32)
    ref.load_state_dict({k: v.float() for k, v in a.state_dict().items()})
    mine = at_torch.AdamW(a.parameters(), lr=1e-2)
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=dtype == torch.float16)
    for batch in _batches():
        mine.zero_grad()
        scaler.scale(_loss(a, batch)).backward()
        grads = [p.grad.float() / scaler.get_scale() for p in a.parameters()]
        scaler.step(mine)
        scaler.update()
        for p, g in zip(ref.parameters(), grads):  # the reference: the same gradients on float32 weights
            p.grad = g
        theirs.step()
        for p, q in zip(a.parameters(), ref.parameters()):
            assert p.dtype == dtype
            # the model's weights are its float32 masters rounded, bit for bit; torch's float32 AdamW
            # rounds its last bit differently now and then, which may move a weight by one ulp of
            # ``dtype`` (whether it does depends on the gradients, so on torch's thread count)
            assert torch.equal(p.detach(), mine.state[p]["master"].to(dtype))
            want = q.detach().to(dtype).float().numpy()
            ulp = np.spacing(np.abs(want).astype(np.float16 if dtype == torch.float16 else np.float32))
            if dtype == torch.bfloat16:
                ulp = np.abs(want) * 2.0**-7 + 1e-38
            assert np.all(np.abs(p.detach().float().numpy() - want) <= ulp)
    masters = [mine.state[p]["master"] for p in a.parameters()]
    for m, q in zip(masters, ref.parameters()):
        np.testing.assert_allclose(m.numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-6)


# -- state ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls, kwargs", [("AdamW", {"lr": 1e-2}), ("NAdam", {"lr": 1e-2}),
                                         ("SGD", {"lr": 1e-2, "momentum": 0.9}),
                                         # "emb.weight" (66 elements) and "conv.weight" (90) in 8 bits
                                         ("AdamW", {"lr": 1e-2, "state_dtype": "8bit", "min_8bit_size": 64}),
                                         pytest.param("NAdam", {"lr": 1e-2, "state_dtype": "8bit", "min_8bit_size": 64},
                                                      marks=pytest.mark.slow)],
                         ids=["AdamW", "NAdam", "SGD", "AdamW-8bit", "NAdam-8bit"])
def test_state_dict_resume_through_torch_save(cls, kwargs):
    """Save at step 6, load into a fresh model and optimizer, continue: bitwise the uninterrupted run."""
    batches = _batches()
    a, _ = _models()
    opt = getattr(at_torch, cls)(a.named_parameters(), **kwargs)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8)
    _train(a, opt, batches[:6], sched)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    _train(a, opt, batches[6:], sched)

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)  # plain tensors and numbers: no pickle needed
    b, _ = _models(seed=5)
    b.load_state_dict(saved["model"])
    opt2 = getattr(at_torch, cls)(b.named_parameters(), **kwargs)
    sched2 = torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=8)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    _train(b, opt2, batches[6:], sched2)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert saved["opt"]["param_groups"][0]["param_names"][0] == "emb.weight"


def test_loading_its_own_live_state_keeps_it():
    """accelerate loads ``opt.state_dict()`` (live views) straight back into ``opt``."""
    a, _ = _models()
    opt = at_torch.NAdam(a.parameters(), lr=1e-2)
    _train(a, opt, _batches(3))
    before = copy.deepcopy({k: {s: v.clone() for s, v in e.items()} for k, e in opt.state_dict()["state"].items()})
    opt.load_state_dict(opt.state_dict())
    after = opt.state_dict()["state"]
    assert all(torch.equal(after[k][s], v) for k, e in before.items() for s, v in e.items())
    assert float(after[0]["step"]) == 3 and float(after[0]["mu_product"]) < 1


def test_load_matches_names_not_positions():
    a, _ = _models()
    opt = at_torch.AdamW(a.named_parameters(), lr=1e-2)
    _train(a, opt, _batches(3))
    sd = opt.state_dict()
    b = copy.deepcopy(a)
    shuffled = list(b.named_parameters())[::-1]
    opt2 = at_torch.AdamW(shuffled, lr=1e-2)
    opt2.load_state_dict(sd)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"]), n
    bad = {**sd, "param_groups": [{**sd["param_groups"][0], "param_names": ["x"] + sd["param_groups"][0]
                                   ["param_names"][1:]}]}
    with pytest.raises(errors.StateDictError, match="names differ"):
        opt2.load_state_dict(bad)


def test_loads_torch_optims_own_state_dict():
    """Moving from torch.optim.AdamW: its state dict (same slot names) loads into the drop-in."""
    a, b = _models()
    theirs = torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=False)
    _train(a, theirs, _batches(4))
    b.load_state_dict(a.state_dict())
    mine = at_torch.AdamW(b.parameters(), lr=1e-2)
    mine.load_state_dict(theirs.state_dict())
    _train(a, theirs, _batches(4, seed=9))
    _train(b, mine, _batches(4, seed=9))
    _close(a, b)


# -- torch's optim_db configurations through the drop-ins -----------------------------------------------

OPTIM_DB_CLASSES = ("Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta")


def _optim_db():
    got = torch_optim_db.rows()  # read once per torch version (tests/torch_optim_db.py)
    if isinstance(got, str):
        return [pytest.param(None, id="optim_db", marks=pytest.mark.skip(reason=f"torch's optim_db: {got}"))]
    return [pytest.param(r, id=f"{r['optimizer']}-{re.sub(r'[^a-z0-9]+', '_', r['desc'].lower()).strip('_')}")
            for r in got if r["optimizer"] in OPTIM_DB_CLASSES and r["device"] == "cpu"]


def pytest_generate_tests(metafunc):
    """torch's matrix is read only where its test runs: the slow tier (its rows are the ids)."""
    if "optim_db_config" in metafunc.fixturenames:
        slow = metafunc.config.getoption("--tier") != "default"
        metafunc.parametrize("optim_db_config", _optim_db() if slow else [pytest.param(None, id="not-read")])


@pytest.mark.slow  # the slow tier: torch's exhaustive matrix (test_matches_torch_optim: every drop-in meets torch)
def test_optim_db_configurations(optim_db_config):
    config = optim_db_config
    kwargs = {k: (torch.tensor(v["tensor"]) if isinstance(v, dict) else tuple(v) if isinstance(v, list) else v)
              for k, v in config["kwargs"].items()}
    kwargs.pop("foreach", None)
    kwargs.pop("fused", None)
    refused = [k for k in ("capturable", "differentiable") if kwargs.get(k)]
    a, b = _models()
    cls = config["optimizer"]
    if refused:
        with pytest.raises(errors.HyperparameterError, match=refused[0]):
            getattr(at_torch, cls)(a.parameters(), **kwargs)
        return
    if cls == "SGD" and "lr" not in kwargs:
        kwargs["lr"] = 1e-2
    mine = getattr(at_torch, cls)(a.parameters(), **kwargs)
    theirs = getattr(torch.optim, cls)(b.parameters(), foreach=False, **kwargs)
    _train(a, mine, _batches(8))
    _train(b, theirs, _batches(8))
    _close(a, b, rtol=1e-4, atol=1e-5)


# -- SAM, Schedule-Free, Sophia ---------------------------------------------------------------------------

def test_sam_matches_davda54_reference():
    a, b = _models()
    mine = at_torch.SAM(a.parameters(), torch.optim.SGD, rho=0.1, lr=1e-2, momentum=0.9)
    base = torch.optim.SGD(b.parameters(), lr=1e-2, momentum=0.9, foreach=False)
    for batch in _batches(6):
        def closure(batch=batch):
            mine.zero_grad()
            loss = _loss(a, batch)
            loss.backward()
            return loss
        mine.step(closure)
        # davda54/sam: e = rho g / (||g|| + 1e-12), gradient at w + e, base step from w
        base.zero_grad()
        _loss(b, batch).backward()
        ps = [p for p in b.parameters()]
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ps]))
        es = [0.1 * p.grad / (norm + 1e-12) for p in ps]
        with torch.no_grad():
            for p, e in zip(ps, es):
                p.add_(e)
        base.zero_grad()
        _loss(b, batch).backward()
        with torch.no_grad():
            for p, e in zip(ps, es):
                p.sub_(e)
        base.step()
    _close(a, b)
    with pytest.raises(errors.ArgumentTypeError, match="closure"):
        mine.step()


def test_schedule_free_train_eval():
    a, _ = _models()
    opt = at_torch.ScheduleFreeAdamW(a.parameters(), lr=1e-2)
    _train(a, opt, _batches(4))
    y = [p.detach().clone() for p in a.parameters()]
    opt.eval()
    x = [p.detach().clone() for p in a.parameters()]
    assert any(not torch.equal(p, q) for p, q in zip(x, y))
    with pytest.raises(errors.ConcurrentUseError, match="train"):
        opt.step()
    opt.train()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), y))


def test_sophia_update_hessian():
    a, _ = _models()
    opt = at_torch.Sophia(a.parameters(), lr=1e-3)
    _loss(a, _batches(1)[0]).backward()
    opt.update_hessian()
    h = opt.state[a.fc.weight]["hessian"]
    np.testing.assert_allclose(h.numpy(), (1 - 0.99) * a.fc.weight.grad.numpy() ** 2, rtol=1e-6)
    batch, losses = _batches(1)[0], []
    for i in range(8):
        opt.zero_grad()
        loss = _loss(a, batch)
        loss.backward()
        if i % 2:
            opt.update_hessian()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_lion_lamb_adafactor_muon_train():
    for cls, kw in (("Lion", {"lr": 1e-3}), ("LAMB", {"lr": 1e-2}), ("Adafactor", {"lr": 1e-2})):
        a, _ = _models()
        opt = getattr(at_torch, cls)(a.parameters(), **kw)
        losses = _train(a, opt, [_batches(1)[0]] * 8)
        assert losses[-1] < losses[0], cls
    a, b = _models()
    mine = at_torch.Muon([p for p in a.parameters() if p.dim() == 2], lr=1e-2)
    theirs = torch.optim.Muon([p for p in b.parameters() if p.dim() == 2], lr=1e-2)
    for batch in _batches(4):
        for model, opt in ((a, mine), (b, theirs)):
            opt.zero_grad()
            _loss(model, batch).backward()
            opt.step()
    # torch's Newton-Schulz runs in bfloat16, arraytrain's in the parameters' dtype
    _close(a, b, rtol=0.05, atol=5e-3)


# -- bad input: a typed error naming the argument, and nothing changes ------------------------------------

def _fresh():
    a, _ = _models()
    return a, at_torch.AdamW(_groups(a)[:2], lr=1e-2)


BAD = [
    ("lr", errors.HyperparameterError, lambda m: at_torch.AdamW(m.parameters(), lr=-1.0)),
    ("betas[1]", errors.HyperparameterError, lambda m: at_torch.Adam(m.parameters(), betas=(0.9, 1.0))),
    ("max_grad_norm", errors.HyperparameterError, lambda m: at_torch.SGD(m.parameters(), max_grad_norm=0.0)),
    ("capturable", errors.HyperparameterError, lambda m: at_torch.AdamW(m.parameters(), capturable=True)),
    ("differentiable", errors.HyperparameterError, lambda m: at_torch.SGD(m.parameters(), differentiable=True)),
    ("state_dtype", errors.HyperparameterError, lambda m: at_torch.SGD(m.parameters(), state_dtype="float16")),
    ("state_dtype", errors.HyperparameterError, lambda m: at_torch.Adafactor(m.parameters(), state_dtype="8bit")),
    ("min_8bit_size", errors.HyperparameterError, lambda m: at_torch.AdamW(m.parameters(), min_8bit_size=64)),
    ("params", errors.ArgumentTypeError, lambda m: at_torch.AdamW(m.fc.weight)),
    ("empty", errors.LayoutError, lambda m: at_torch.AdamW([])),
    ("int64", errors.DTypeError, lambda m: at_torch.AdamW([torch.zeros(3, dtype=torch.int64)])),
    ("non-leaf", errors.ArgumentTypeError, lambda m: at_torch.AdamW([m.fc.weight * 2])),
    ("twice", errors.LayoutError, lambda m: at_torch.AdamW([m.fc.weight, m.fc.weight])),
    ("another param group", errors.LayoutError, lambda m: at_torch.AdamW([{"params": [m.fc.weight]},
                                                                          {"params": [m.fc.weight]}])),
    ("Muon updates matrices", errors.LayoutError, lambda m: at_torch.Muon(m.parameters())),
    ("base_optimizer", errors.HyperparameterError, lambda m: at_torch.SAM(m.parameters(), torch.optim.LBFGS)),
]


@pytest.mark.parametrize("what, error, make", BAD, ids=[b[0] for b in BAD])
def test_bad_construction(what, error, make):
    a, _ = _models()
    before = [p.detach().clone() for p in a.parameters()]
    with pytest.raises(error, match=re.escape(what)):
        make(a)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), before))


def _set_group(key, value):
    def change(m, opt):
        opt.param_groups[1][key] = value
    return change


def _wrong_grad(m, opt):
    m.fc.weight.data = torch.zeros(3, 3)


def _moved_dtype(m, opt):
    m.fc.weight.data = m.fc.weight.data.double()


BAD_STEP = [
    ("param_groups[1]['lr']", errors.HyperparameterError, _set_group("lr", -0.1)),
    ("param_groups[1]['weight_decay']", errors.HyperparameterError, _set_group("weight_decay", float("nan"))),
    ("param_groups[1]: betas[0]", errors.HyperparameterError, _set_group("betas", (1.5, 0.9))),
    ("amsgrad from False to True", errors.HyperparameterError, _set_group("amsgrad", True)),
    ("param_groups[1]['lr']", errors.HyperparameterError, _set_group("lr", torch.ones(2))),
    ("'fc.weight'", errors.ShapeMismatchError, _wrong_grad),
    ("'fc.weight'", errors.DTypeError, _moved_dtype),
]


@pytest.mark.parametrize("what, error, spoil", BAD_STEP, ids=[f"{i}-{b[1].__name__}" for i, b in enumerate(BAD_STEP)])
def test_bad_step_changes_nothing(what, error, spoil):
    a, _ = _models()
    opt = at_torch.AdamW(_groups(a)[:2], lr=1e-2)
    names = {id(p): n for n, p in a.named_parameters()}
    for g in opt.param_groups:  # name them as the model does, for the messages
        g["param_names"] = [names[id(p)] for p in g["params"]]
    opt = at_torch.AdamW([{"params": [(names[id(p)], p) for p in g["params"]],
                           "weight_decay": g["weight_decay"]} for g in _groups(a)[:2]], lr=1e-2)
    _train(a, opt, _batches(2))
    _loss(a, _batches(1, seed=3)[0]).backward()
    state = copy.deepcopy({k: {s: v.clone() for s, v in e.items()} for k, e in opt.state_dict()["state"].items()})
    spoil(a, opt)
    before = [p.detach().clone() for p in a.parameters()]
    with pytest.raises(error, match=re.escape(what)):
        opt.step()
    after = opt.state_dict()["state"]
    assert all(torch.equal(p.detach().to(q.dtype), q) for p, q in zip(a.parameters(), before))
    assert all(torch.equal(after[k][s], v) for k, e in state.items() for s, v in e.items())
    print(f"\n{len(BAD) + len(BAD_STEP)} bad inputs refused")


def test_bad_state_dicts_change_nothing():
    a, opt = _fresh()
    _train(a, opt, _batches(2))
    sd = opt.state_dict()
    good = copy.deepcopy({k: {s: v.clone() for s, v in e.items()} for k, e in sd["state"].items()})
    cases = [
        ("expected the keys", {"state": {}}),
        ("expected 2 groups", {**sd, "param_groups": sd["param_groups"][:1]}),
        ("shape", {**sd, "state": {**sd["state"], 0: {**sd["state"][0], "exp_avg": torch.zeros(2)}}}),
        ("missing ['exp_avg_sq']", {**sd, "state": {**sd["state"], 0: {"step": sd["state"][0]["step"],
                                                                      "exp_avg": sd["state"][0]["exp_avg"]}}}),
        ("'step'", {**sd, "state": {**sd["state"], 0: {**sd["state"][0], "step": torch.tensor(-1.0)}}}),
        ("betas[0]", {**sd, "param_groups": [{**sd["param_groups"][0], "betas": (2.0, 0.9)},
                                             sd["param_groups"][1]]}),
    ]
    for what, bad in cases:
        with pytest.raises(errors.StateDictError, match=re.escape(what)):
            opt.load_state_dict(bad)
        now = opt.state_dict()["state"]
        assert all(torch.equal(now[k][s], v) for k, e in good.items() for s, v in e.items()), what


def test_not_picklable_says_what_to_do():
    _, opt = _fresh()
    with pytest.raises(errors.ArgumentTypeError, match="state_dict"):
        copy.deepcopy(opt)


def test_cuda_drop_in_matches_cpu():
    from cuda_family import require_gpu

    require_gpu()
    a, b = _models()
    a.cuda()
    mine = at_torch.AdamW(a.parameters(), lr=1e-2, max_grad_norm=1.0)
    theirs = at_torch.AdamW(b.parameters(), lr=1e-2, max_grad_norm=1.0)
    for batch in _batches(6):
        for model, opt, dev in ((a, mine, "cuda"), (b, theirs, "cpu")):
            opt.zero_grad()
            tokens, y = batch
            _loss(model, (tokens.to(dev), y.to(dev))).backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert p.device.type == "cuda"
        assert_close(p.detach().cpu().numpy(), q.detach().numpy(), np.float32)
