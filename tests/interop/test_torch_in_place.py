"""The drop-ins read fresh ``.grad`` tensors where they lie (after ``zero_grad()``'s default
``set_to_none=True``): bitwise the step of gradients in the buffer, nothing copied, and ``.grad`` kept as
torch.optim keeps it (so two backward passes before a step add up, as torch's do)."""

import numpy as np
import pytest

from arraytrain.errors import HyperparameterError

torch = pytest.importorskip("torch")
att = pytest.importorskip("arraytrain.interop.torch")


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Tanh(), torch.nn.Linear(200, 10))


def loss_at(m, t):
    x = torch.randn(32, 300, generator=torch.Generator().manual_seed(t))
    return m(x).pow(2).mean()


@pytest.mark.parametrize("name", ["AdamW", "SGD", "RAdam", "LAMB"])
def test_fresh_grads_are_read_in_place_bitwise_as_the_buffer(name):
    kw = {"lr": 1e-2, "max_grad_norm": 0.5} | ({"momentum": 0.9} if name == "SGD" else {})
    fresh, kept = model(), model()
    a = getattr(att, name)(fresh.parameters(), **kw)
    b = getattr(att, name)(kept.parameters(), **kw)
    engine = a._cohorts[0].engine
    seen = []  # steps that read the fresh .grad tensors in place: staged, or AdamW's one compiled call
    real, lean = engine.read_in_place, engine.lean_step
    engine.read_in_place = lambda bases: (seen.append(True), real(bases))[1]
    engine.lean_step = lambda *a: (lambda r: (r is not None and seen.append(True), r)[1])(lean(*a))
    for t in range(5):
        a.zero_grad()                      # set_to_none=True: backward allocates .grad
        b.zero_grad(set_to_none=False)     # .grad stays the buffer's view
        loss_at(fresh, t).backward()
        loss_at(kept, t).backward()
        grads = [p.grad for p in fresh.parameters()]
        a.step()
        b.step()
        assert all(p.grad is g for p, g in zip(fresh.parameters(), grads))  # kept, as torch.optim keeps it
    assert len(seen) == 5 and not engine.grads.flat.any()
    for p, q in zip(fresh.parameters(), kept.parameters()):
        assert torch.equal(p, q)


def test_two_backward_passes_before_a_step_add_up_as_torch():
    ours, theirs = model(), model()
    a = att.AdamW(ours.parameters(), lr=1e-2)
    b = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    for t in range(4):
        for m, o in ((ours, a), (theirs, b)):
            o.zero_grad()
            loss_at(m, 2 * t).backward()
            loss_at(m, 2 * t + 1).backward()
            o.step()
            if t == 1:  # and a step without zero_grad before it: the gradients carry over, as torch's
                loss_at(m, 100).backward()
                o.step()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_nonfinite_apply_is_torchs_choice():
    """nonfinite="apply": a NaN gradient reaches the weights as with torch.optim.AdamW (no GradScaler);
    the default skips the step."""
    ours, theirs, skipping = model(), model(), model()
    a = att.AdamW(ours.parameters(), lr=1e-2, nonfinite="apply")
    b = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    c = att.AdamW(skipping.parameters(), lr=1e-2)
    for m, o in ((ours, a), (theirs, b), (skipping, c)):
        o.zero_grad()
        loss_at(m, 0).backward()
        m[0].weight.grad[3, 4] = float("nan")
        o.step()
    w, v = ours[0].weight.detach(), theirs[0].weight.detach()
    assert torch.isnan(w[3, 4]) and torch.isnan(v[3, 4]) and int(torch.isnan(w).sum()) == 1
    np.testing.assert_allclose(ours[2].weight.detach().numpy(), theirs[2].weight.detach().numpy(), rtol=1e-5,
                               atol=1e-7)
    assert torch.equal(skipping[0].weight.detach(), model()[0].weight.detach())  # skipped: unchanged
    with pytest.raises(HyperparameterError, match="nonfinite"):
        att.AdamW(model().parameters(), nonfinite="propagate")
