"""The drop-ins' common step in one compiled call (``GroupEngine.lean_step``,
``arraytrain.kernels.cpu.optimizers.adam_checked``) is bitwise the staged step's: parameters, state,
step counts, reports and state dicts, for Adam and AdamW (amsgrad, maximize, L2 and decoupled decay),
clipped or not under both clip rules, two param groups with a scheduler changing lr and betas every
step, both twins (a model under and over the serial twin's size), parameters without a gradient
(torch's rule: left alone, each at its own step count) frozen from the start, skipping some steps and
then back; a NaN gradient and a GradScaler's divisor go the staged step, as before. And the drop-ins' own
step wrapper keeps torch's step hooks and the profiler's range."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
att = pytest.importorskip("arraytrain.interop.torch")
from arraytrain.kernels.cpu import SERIAL_BELOW  # noqa: E402


class Net(torch.nn.Module):
    """Two layers and parameters of 0, 1 and 7 elements (every one given a gradient)."""

    def __init__(self, width):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 3))
        self.odd = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(k)) for k in (0, 1, 7)])

    def __getitem__(self, i):
        return self.layers[i]

    def forward(self, x):
        return self.layers(x) + sum((q * q).sum() for q in self.odd)


def model(width):
    torch.manual_seed(0)
    return Net(width)


def groups(m):
    return [{"params": [p for p in m.parameters() if p.ndim >= 2], "weight_decay": 0.05},
            {"params": [p for p in m.parameters() if p.ndim < 2], "weight_decay": 0.0}]


def staged(opt):
    """``opt`` with its engines' one-call step turned off: the staged step the lean one must equal."""
    for c in opt._cohorts:
        c.engine.lean = False
    return opt


def run(cls, kw, width, steps=6, nan_at=None, hole_at=None, lean=True, holes=None):
    """``holes``: the step's parameters (by their place in ``model.parameters()``) whose ``.grad`` is None."""
    m = model(width)
    opt = cls(groups(m), **kw)
    if not lean:
        staged(opt)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=kw.get("lr", 1e-3), total_steps=steps + 5)
    seen, reports = [], []
    real = opt._cohorts[0].engine.lean_step
    opt._cohorts[0].engine.lean_step = lambda *a: (lambda r: (seen.append(r is not None), r)[1])(real(*a))
    for t in range(steps):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(t))
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        if t == nan_at:
            m[0].weight.grad[0, 0] = float("nan")
        if t == hole_at:
            m[2].bias.grad = None
        for i in (holes or {}).get(t, ()):
            list(m.parameters())[i].grad = None
        opt.step()
        reports.append(opt.reports)
        sched.step()
        if not lean:
            staged(opt)  # (a rebuilt cohort starts lean again)
    return m, opt, seen, reports


def same(a, b):
    a, b = np.atleast_1d(a), np.atleast_1d(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def assert_bitwise(run_a, run_b):
    (ma, oa, _, ra), (mb, ob, _, rb) = run_a, run_b
    for p, q in zip(ma.parameters(), mb.parameters()):
        assert same(p.detach().numpy(), q.detach().numpy())
    for p, q in zip(ma.parameters(), mb.parameters()):
        sa, sb = oa.state[p], ob.state[q]
        assert sorted(sa) == sorted(sb)
        for k in sa:
            assert same(sa[k].numpy(), sb[k].numpy()), k
    for a, b in zip(ra, rb):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert (x.applied, x.skipped, x.step, x.lr) == (y.applied, y.skipped, y.step, y.lr)
            assert same(np.float64(x.grad_norm), np.float64(y.grad_norm)) and x.clip_coef == y.clip_coef
            if x.applied:
                gx, gy = x.grad_norms, y.grad_norms
                assert list(gx) == list(gy) and same(np.array(list(gx.values())), np.array(list(gy.values())))
    da, db = oa.state_dict(), ob.state_dict()
    assert da["param_groups"] == db["param_groups"]


CASES = {
    "AdamW": (att.AdamW, {"lr": 1e-2}),
    "AdamW clipped": (att.AdamW, {"lr": 1e-2, "max_grad_norm": 0.05}),
    "AdamW clipped, clip_eps 0": (att.AdamW, {"lr": 1e-2, "max_grad_norm": 0.05, "clip_eps": 0.0}),
    "Adam amsgrad maximize": (att.Adam, {"lr": 1e-2, "amsgrad": True, "maximize": True, "weight_decay": 0.01}),
    "AdamW nonfinite apply": (att.AdamW, {"lr": 1e-2, "nonfinite": "apply"}),  # (no norm pass at all)
    "AdamW nonfinite apply, clipped": (att.AdamW, {"lr": 1e-2, "nonfinite": "apply", "max_grad_norm": 0.05}),
}


@pytest.mark.parametrize("width", [8, SERIAL_BELOW // 16 + 3], ids=["serial", "parallel"])
@pytest.mark.parametrize("case", list(CASES))
def test_one_call_step_is_the_staged_step_bitwise(case, width):
    cls, kw = CASES[case]
    lean, ref = run(cls, kw, width), run(cls, kw, width, lean=False)
    assert all(lean[2]) and len(lean[2]) == 6  # every step took the one call
    assert_bitwise(lean, ref)


def test_nan_a_missing_gradient_and_a_divisor_take_the_staged_step():
    cls, kw = CASES["AdamW clipped"]
    lean = run(cls, kw, 8, steps=8, nan_at=2, hole_at=4)
    ref = run(cls, kw, 8, steps=8, nan_at=2, hole_at=4, lean=False)
    # the NaN step (2): the one call found it and wrote nothing, the staged step skipped it; the step
    # without the bias's gradient (4) leaves it out, and from then on the parameters' step counts differ
    # (torch's rule): the one call takes them all
    assert lean[2] == [True, True, False, True, True, True, True, True]
    assert lean[3][2][0].skipped and not lean[3][2][0].applied
    assert_bitwise(lean, ref)
    for kw in ({"lr": 1e-2, "nonfinite": "apply"}, {"lr": 1e-2, "nonfinite": "apply", "max_grad_norm": 0.05}):
        lean, ref = run(att.AdamW, kw, 8, nan_at=2), run(att.AdamW, kw, 8, nan_at=2, lean=False)
        assert all(lean[2]) and lean[3][2][0].applied  # applied as torch applies it, in one call too
        assert np.isnan(lean[0][0].weight.detach().numpy()).any()
        assert_bitwise(lean, ref)
    m = model(8)
    opt = att.AdamW(groups(m), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    called = []
    real = opt._cohorts[0].engine.lean_step
    opt._cohorts[0].engine.lean_step = lambda *a: called.append(1) or real(*a)
    opt.zero_grad()
    scaler.scale(m(torch.randn(4, 16)).pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    assert not called and opt.reports[0].applied  # the divisor: the staged step


HOLES = {
    # the first layer frozen from the start (never a gradient), nothing else
    "frozen": {t: (0, 1) for t in range(8)},
    # a branch unused for three steps, then used: two step counts from then on; another parameter
    # missing once later (three counts), the 0-element parameter missing too
    "unused, then used": {0: (2, 3), 1: (2, 3), 2: (2, 3, 4), 5: (1, 4)},
    # every parameter but one without a gradient
    "all but one": {3: (0, 1, 2, 4, 5, 6)},
}


@pytest.mark.parametrize("width", [8, SERIAL_BELOW // 16 + 3], ids=["serial", "parallel"])
@pytest.mark.parametrize("holes", list(HOLES))
@pytest.mark.parametrize("case", ["AdamW clipped", "Adam amsgrad maximize", "AdamW nonfinite apply"])
def test_parameters_without_a_gradient_in_one_call_bitwise(case, holes, width):
    cls, kw = CASES[case]
    lean = run(cls, kw, width, steps=8, holes=HOLES[holes])
    ref = run(cls, kw, width, steps=8, holes=HOLES[holes], lean=False)
    assert all(lean[2]) and len(lean[2]) == 8
    assert_bitwise(lean, ref)
    m, opt = lean[0], lean[1]
    counts = [float(opt.state[p]["step"]) for p in m.parameters()]
    expected = [8 - sum(i in HOLES[holes].get(t, ()) for t in range(8)) for i in range(len(counts))]
    assert counts == expected  # (each parameter's own count: torch's rule)


def test_torch_step_hooks_and_the_profiler_range():
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    m = model(8)
    opt = att.AdamW(m.parameters(), lr=1e-2)
    order = []
    h1 = opt.register_step_pre_hook(lambda o, args, kwargs: order.append("pre"))
    h2 = opt.register_step_post_hook(lambda o, args, kwargs: order.append("post"))
    h3 = register_optimizer_step_pre_hook(lambda o, args, kwargs: order.append("global pre"))
    h4 = register_optimizer_step_post_hook(lambda o, args, kwargs: order.append("global post"))
    try:
        m(torch.randn(4, 16)).sum().backward()
        opt.step()
        assert order == ["global pre", "pre", "post", "global post"]  # torch's order
    finally:
        for h in (h1, h2, h3, h4):
            h.remove()
    # a pre-hook's (args, kwargs) replace the step's: here a closure
    calls = []
    h = opt.register_step_pre_hook(lambda o, args, kwargs: (args, {"closure": lambda: calls.append(1) or 0.5}))
    try:
        assert opt.step() == 0.5 and calls == [1]
    finally:
        h.remove()
    bad = opt.register_step_pre_hook(lambda o, args, kwargs: 3)
    try:
        with pytest.raises(RuntimeError, match="must return None or a tuple"):
            opt.step()
    finally:
        bad.remove()
    with torch.profiler.profile() as prof:
        opt.step()
    assert any(e.name == "Optimizer.step#AdamW.step" for e in prof.events())
    assert getattr(type(opt).step, "hooked", False)  # torch does not wrap it a second time
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})  # (torch patches the step there)
    assert not hasattr(type(opt).step.__wrapped__, "__wrapped__")
