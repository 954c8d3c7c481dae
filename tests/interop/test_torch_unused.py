"""A branch without gradients (GANs, mixture-of-experts, multi-task heads, frozen-then-unfrozen layers):
the drop-ins and ``bind`` follow torch.optim (foreach=False) to 1e-5 relative: the parameter is not
touched by a step where its ``.grad`` is None, and keeps its own step count, in state dicts too."""

import copy

import numpy as np
import pytest

import arraytrain as at
from builders import assert_close_to_scale

torch = pytest.importorskip("torch")
att = pytest.importorskip("arraytrain.interop.torch")

UNUSED = range(5, 15)  # steps at which the branch takes no part: weights unused for 10, then used for 10
STEPS = 25


def model():
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"trunk": torch.nn.Linear(8, 8), "branch": torch.nn.Linear(8, 4),
                                "head": torch.nn.Linear(8, 4)})


def loss_at(m, step: int):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
    h = torch.relu(m["trunk"](x))
    loss = m["head"](h).pow(2).mean()
    if step not in UNUSED:
        loss = loss + m["branch"](h).pow(2).mean()
    return loss


def train(m, opt, steps=range(STEPS)):
    for t in steps:
        opt.zero_grad()
        loss_at(m, t).backward()
        opt.step()


def weights(m) -> dict:
    return {n: p.detach().numpy() for n, p in m.named_parameters()}


def assert_follows(want, got):
    """Each of ``got``'s parameters is ``want``'s to 1e-5 of its largest magnitude (the max-norm relative error)."""
    assert_close_to_scale(weights(got), weights(want), rtol=0.0, atol_scale=1e-5)


HP = {
    "AdamW": {"lr": 1e-2, "weight_decay": 0.01},
    "Adam": {"lr": 1e-2, "weight_decay": 0.01, "amsgrad": True},
    "SGD": {"lr": 1e-2, "momentum": 0.9, "nesterov": True},
    "RMSprop": {"lr": 1e-3, "momentum": 0.5},
    "Adagrad": {"lr": 1e-2},
    "RAdam": {"lr": 1e-2, "decoupled_weight_decay": True, "weight_decay": 0.1},
    "Adamax": {"lr": 1e-2},
    "Adadelta": {"lr": 1.0},
    "NAdam": {"lr": 1e-2, "weight_decay": 0.01},
}


@pytest.mark.parametrize("name", list(HP))
def test_dropin_skips_a_parameter_without_gradient_as_torch(name):
    want, got = model(), model()
    topt = getattr(torch.optim, name)(want.parameters(), foreach=False, **HP[name])
    opt = getattr(att, name)(got.parameters(), **HP[name])
    train(want, topt)
    train(got, opt)
    assert_follows(want, got)
    if name != "SGD":  # torch's SGD keeps no step
        assert [float(s["step"]) for s in opt.state_dict()["state"].values()] == \
            [float(s["step"]) for s in topt.state_dict()["state"].values()]


def test_dropin_state_dict_round_trip_with_torch_per_parameter_steps():
    """torch's state dict after an unused stretch (the branch 10 steps behind) loads into the drop-in, and
    the drop-in's into torch; both continue as the uninterrupted torch run."""
    want = model()
    topt = torch.optim.AdamW(want.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    train(want, topt)
    half, ours = model(), None
    hopt = torch.optim.AdamW(half.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    train(half, hopt, range(12))
    ours = model()
    ours.load_state_dict(half.state_dict())
    opt = att.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.01)
    opt.load_state_dict(hopt.state_dict())
    assert sorted({float(s["step"]) for s in opt.state_dict()["state"].values()}) == [5.0, 12.0]
    train(ours, opt, range(12, STEPS))
    assert_follows(want, ours)
    back = model()
    back.load_state_dict(ours.state_dict())
    bopt = torch.optim.AdamW(back.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    bopt.load_state_dict(opt.state_dict())
    assert [float(s["step"]) for s in bopt.state_dict()["state"].values()] == \
        [float(s["step"]) for s in topt.state_dict()["state"].values()]


def test_dropin_nadam_keeps_each_parameters_momentum_product_as_torch():
    """NAdam's mu_product per parameter (torch's state): the branch's product stops while it has no
    gradient, in state[p], in state_dict(), through torch's own NAdam and back."""
    want, got = model(), model()
    topt = torch.optim.NAdam(want.parameters(), lr=1e-2, foreach=False)
    opt = att.NAdam(got.parameters(), lr=1e-2)
    train(want, topt, range(12))
    train(got, opt, range(12))
    assert_follows(want, got)
    ours = [float(s["mu_product"]) for s in opt.state_dict()["state"].values()]
    theirs = [float(s["mu_product"]) for s in topt.state_dict()["state"].values()]
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    assert len(set(ours)) == 2  # the branch's differs
    assert [float(opt.state[p]["mu_product"]) for p in got.parameters()] == ours
    back, again = model(), model()
    back.load_state_dict(got.state_dict())
    again.load_state_dict(want.state_dict())
    bopt = torch.optim.NAdam(back.parameters(), lr=1e-2, foreach=False)
    bopt.load_state_dict(copy.deepcopy(opt.state_dict()))  # ours into torch's (a copy: ours are live views)
    aopt = att.NAdam(again.parameters(), lr=1e-2)
    aopt.load_state_dict(topt.state_dict())  # torch's into ours
    assert [float(s["mu_product"]) for s in aopt.state_dict()["state"].values()] == theirs
    for m, o in ((want, topt), (got, opt), (back, bopt), (again, aopt)):
        train(m, o, range(12, STEPS))
    for m in (got, back, again):
        assert_follows(want, m)


@pytest.mark.parametrize("name", ["AdamW", "NAdam"])
def test_bind_skips_a_parameter_without_gradient_as_torch(name):
    want, got = model(), model()
    topt = getattr(torch.optim, name)(want.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    engine = att.bind(got, getattr(at.optim, name)(1e-2, weight_decay=0.01))
    train(want, topt)
    for t in range(STEPS):
        got.zero_grad()
        loss_at(got, t).backward()
        engine.step()
    assert_follows(want, got)
    names = engine.layout.names
    assert dict(zip(names, engine.state.counts.tolist()))["branch.weight"] == STEPS - len(UNUSED)


def test_bind_zero_policy_when_asked():
    m = model()
    engine = att.bind(m, at.optim.AdamW(1e-2, weight_decay=0.1), missing="zero")
    for t in range(8):
        m.zero_grad()
        loss_at(m, t).backward()
        engine.step()
    assert engine.state.counts is None  # every parameter took every step, the branch with zero gradients


def test_bind_missing_error_changes_nothing():
    m = model()
    engine = att.bind(m, at.optim.AdamW(1e-2), missing="error")
    m.zero_grad()
    loss_at(m, UNUSED[0]).backward()
    w = {n: p.detach().clone() for n, p in m.named_parameters()}
    with pytest.raises(at.errors.MissingGradientError, match="branch.weight"):
        engine.step()
    assert all(torch.equal(p.detach(), w[n]) for n, p in m.named_parameters())
    assert engine.micro_batches == 0


def test_dropin_that_steps_all_together_refuses_a_group_at_different_steps():
    m = model()
    opt = att.Adafactor(m.parameters(), lr=1e-2)
    train(m, opt, range(3))
    sd = opt.state_dict()
    bad = {**sd, "state": {**sd["state"], 0: {**sd["state"][0], "step": torch.tensor(7.0)}}}
    before = [float(s["step"]) for s in opt.state_dict()["state"].values()]
    with pytest.raises(at.errors.StateDictError, match="different steps"):
        opt.load_state_dict(bad)
    assert [float(s["step"]) for s in opt.state_dict()["state"].values()] == before


def test_dropin_comm_refusals_name_the_argument():
    """Under a group: sharded 8-bit state is not built for the drop-ins; param groups that need two
    engines are refused on every rank (typed errors, before any collective)."""
    from thread_group import ThreadGroup

    def build(rank, comm, **kw):
        m = model()
        with pytest.raises(at.errors.HyperparameterError, match=kw.pop("match")):
            att.AdamW(**kw, comm=comm) if "params" in kw else att.AdamW(m.parameters(), comm=comm, **kw)
        return True

    group = ThreadGroup(2)
    assert all(group.run(lambda r, c: build(r, c, shard_state=True, state_dtype="8bit", match="shard_state")))
    m = model()
    groups = [{"params": list(m["trunk"].parameters()), "betas": (0.9, 0.99)},
              {"params": list(m["head"].parameters())}]
    assert all(group.run(lambda r, c: build(r, c, params=groups, match="2 engines")))
    with pytest.raises(at.errors.HyperparameterError, match="overlap"):
        att.AdamW(model().parameters(), overlap=True)
    with pytest.raises(at.errors.HyperparameterError, match="overlap"):
        att.AdamW(model().parameters(), overlap="yes")
