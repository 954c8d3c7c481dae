"""Parameters without a gradient (``missing="skip"``, torch.optim's rule): untouched by the step, each
at its own step count; against torch.optim (foreach=False), replicated, under a group of ranks
(present where any rank had a gradient), sharded and overlapped, and through state dicts."""

import numpy as np
import pytest

import arraytrain as at
from arraytrain.errors import (ArgumentTypeError, HyperparameterError, MissingGradientError, StateDictError,
                               UnknownParameterError)
from builders import assert_close_to_scale
from thread_group import ThreadGroup

torch = pytest.importorskip("torch")

SHAPES = {"a": (6, 5), "b": (7,), "c": (3, 4)}
UNUSED = range(4, 11)  # steps at which "b" has no gradient


def params():
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def grads_at(step: int, rank: int = 0) -> dict:
    rng = np.random.default_rng(100 + 7 * step + rank)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


# torch.optim's class and hyperparameters, arraytrain's optimizer of the same update
CASES = {
    "AdamW": (lambda: at.optim.AdamW(1e-2, weight_decay=0.1), torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "Adam-amsgrad": (lambda: at.optim.Adam(1e-2, weight_decay=0.01, amsgrad=True), torch.optim.Adam,
                     {"lr": 1e-2, "weight_decay": 0.01, "amsgrad": True}),
    "SGD": (lambda: at.optim.SGD(1e-2, momentum=0.9, weight_decay=0.01), torch.optim.SGD,
            {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.01}),
    "RMSprop": (lambda: at.optim.RMSprop(1e-2, momentum=0.5, centered=True), torch.optim.RMSprop,
                {"lr": 1e-2, "momentum": 0.5, "centered": True}),
    "Adagrad": (lambda: at.optim.Adagrad(1e-2, lr_decay=0.01), torch.optim.Adagrad, {"lr": 1e-2, "lr_decay": 0.01}),
    "RAdam": (lambda: at.optim.RAdam(1e-2), torch.optim.RAdam, {"lr": 1e-2}),
    "Adamax": (lambda: at.optim.Adamax(1e-2), torch.optim.Adamax, {"lr": 1e-2}),
    "Adadelta": (lambda: at.optim.Adadelta(1.0), torch.optim.Adadelta, {"lr": 1.0}),
    "NAdam": (lambda: at.optim.NAdam(1e-2, weight_decay=0.01), torch.optim.NAdam, {"lr": 1e-2, "weight_decay": 0.01}),
    "NAdamW": (lambda: at.optim.NAdam(1e-2, weight_decay=0.1, momentum_decay=0.05, decoupled_weight_decay=True),
               torch.optim.NAdam, {"lr": 1e-2, "weight_decay": 0.1, "momentum_decay": 0.05,
                                   "decoupled_weight_decay": True}),
}


def torch_run(cls, hp, steps: int, unused=UNUSED):
    ts = {n: torch.tensor(v, requires_grad=True) for n, v in params().items()}
    opt = cls(ts.values(), foreach=False, **hp)
    for t in range(steps):
        opt.zero_grad()
        for n, g in grads_at(t).items():
            if not (n == "b" and t in unused):
                ts[n].grad = torch.tensor(g)
        opt.step()
    return {n: v.detach().numpy() for n, v in ts.items()}, opt


def engine_run(make, steps: int, unused=UNUSED, **kw):
    engine = at.Engine(params(), make(), missing="skip", **kw)
    for t in range(steps):
        g = grads_at(t)
        if t in unused:
            del g["b"]
        engine.step(g)
    return engine


@pytest.mark.parametrize("case", list(CASES))
def test_dict_path_skips_the_missing_parameter_as_torch(case):
    make, cls, hp = CASES[case]
    want, topt = torch_run(cls, hp, 20)
    engine = engine_run(make, 20)
    assert_close_to_scale(engine.params.as_dict(), want)
    assert engine.state.step == 20
    assert engine.state.counts.tolist() == [20, 20 - len(UNUSED), 20]
    if "step" in topt.state[next(iter(topt.state))]:
        assert [int(s["step"]) for s in topt.state.values()] == engine.state.counts.tolist()


def test_an_untouched_parameter_keeps_weights_and_state_bitwise():
    engine = engine_run(lambda: at.optim.AdamW(1e-2, weight_decay=0.1), 4, unused=())
    before = {k: np.array(v) for k, v in engine.state_dict()["optimizer"]["slots"]["exp_avg"].items()}
    b = engine.params["b"].copy()
    g = grads_at(5)
    del g["b"]
    engine.step(g)
    assert np.array_equal(engine.params["b"], b)
    assert np.array_equal(engine.state.slots["exp_avg"]["b"], before["b"])
    assert not np.array_equal(engine.state.slots["exp_avg"]["a"], before["a"])


def test_all_present_again_steps_in_one_launch_per_count():
    engine = engine_run(lambda: at.optim.AdamW(1e-2), 20)
    assert engine.state.counts is not None  # "b" is behind for good: its bias correction is its own
    fresh = engine_run(lambda: at.optim.AdamW(1e-2), 20, unused=())
    assert fresh.state.counts is None


def test_accumulation_window_absent_only_when_absent_from_every_micro_batch():
    make, cls, hp = CASES["AdamW"]
    engine = at.Engine(params(), make(), missing="skip", accumulation_steps=2)
    ts = {n: torch.tensor(v, requires_grad=True) for n, v in params().items()}
    opt = cls(ts.values(), foreach=False, **hp)
    for t in range(6):
        # window t: "b" missing from both micro-batches at t = 1, from the first one only at t = 3
        parts = [grads_at(2 * t), grads_at(2 * t + 1)]
        if t == 1:
            del parts[0]["b"], parts[1]["b"]
        if t == 3:
            del parts[0]["b"]
        for g in parts:
            engine.step(g)
        opt.zero_grad()
        for n in SHAPES:
            have = [g[n] for g in parts if n in g]
            if have:
                ts[n].grad = torch.tensor(sum(have) / 2)
        opt.step()
    assert_close_to_scale(engine.params.as_dict(), {n: v.detach().numpy() for n, v in ts.items()})
    assert engine.state.counts.tolist() == [6, 5, 6]


def test_zero_copy_path_takes_absent_names():
    make, cls, hp = CASES["AdamW"]
    want, _ = torch_run(cls, hp, 20)
    engine = at.Engine(params(), make(), missing="skip")
    for t in range(20):
        g = grads_at(t)
        for n in SHAPES:
            engine.grads[n][...] = g[n]
        if t in UNUSED:
            engine.grads["b"][...] = np.nan  # not read: an absent gradient is zeroed, never seen
        engine.step(absent=["b"] if t in UNUSED else None)
    assert_close_to_scale(engine.params.as_dict(), want)


def test_policies_and_bad_input_change_nothing():
    with pytest.raises(HyperparameterError, match="ScheduleFreeAdamW"):
        at.Engine(params(), at.optim.ScheduleFreeAdamW(), missing="skip")
    with pytest.raises(HyperparameterError, match="missing"):
        at.Engine(params(), at.optim.AdamW(), missing="drop")
    engine = at.Engine(params(), at.optim.AdamW(), missing="error")
    before = engine.state_dict()
    with pytest.raises(MissingGradientError, match="missing='skip'"):
        engine.step(absent=["b"])
    with pytest.raises(ArgumentTypeError, match="absent"):
        engine.step(grads_at(0), absent=["b"])
    with pytest.raises(UnknownParameterError, match="'z'"):
        engine.step(absent=["z"])
    with pytest.raises(ArgumentTypeError, match="absent"):
        engine.step(absent=3)
    after = engine.state_dict()
    assert after["optimizer"]["step"] == before["optimizer"]["step"] == 0
    assert engine.micro_batches == 0


def test_zero_policy_moves_the_missing_parameter():
    engine = at.Engine(params(), at.optim.AdamW(1e-2, weight_decay=0.1), missing="zero")
    for t in range(6):
        g = grads_at(t)
        if t >= 3:
            del g["b"]
        engine.step(g)
    assert engine.state.counts is None  # every parameter took every step (a zero gradient at 3-5)


#: steps at which each parameter has no gradient: "b" and "c" end at one count by different steps
APART = {"b": range(2, 5), "c": range(6, 9)}


def nadam_beta1(t: int) -> float:
    """A beta1 that changes every step (OneCycleLR cycles it), so that NAdam's mu_t depends on when a
    parameter took its steps, not only on how many."""
    return 0.85 + 0.01 * (t % 5)


def test_nadam_keeps_a_momentum_product_per_parameter_as_torch():
    """torch keeps mu_product per parameter: parameters at one step count whose steps fell at different
    times (beta1 changing) have different products; each step launches once per product."""
    ts = {n: torch.tensor(v, requires_grad=True) for n, v in params().items()}
    topt = torch.optim.NAdam(ts.values(), lr=1e-2, weight_decay=0.01, foreach=False)
    engine = at.Engine(params(), at.optim.NAdam(1e-2, weight_decay=0.01), missing="skip")
    for t in range(12):
        topt.param_groups[0]["betas"] = (nadam_beta1(t), 0.999)
        engine.optimizer.betas = (nadam_beta1(t), 0.999)
        g = grads_at(t)
        topt.zero_grad()
        for n in list(g):
            if t in APART.get(n, ()):
                del g[n]
            else:
                ts[n].grad = torch.tensor(g[n])
        topt.step()
        engine.step(g)
    assert_close_to_scale(engine.params.as_dict(), {n: v.detach().numpy() for n, v in ts.items()})
    assert engine.state.counts.tolist() == [12, 9, 9]
    products = [float(topt.state[ts[n]]["mu_product"]) for n in SHAPES]
    each = engine.state.param_scalars["mu_product"]
    np.testing.assert_allclose(each, products, rtol=1e-6)
    assert each[1] != each[2]  # one count, two histories
    saved = engine.state_dict()["optimizer"]
    assert saved["param_scalars"] == {"mu_product": dict(zip(SHAPES, each.tolist()))}


def test_nadam_products_agree_again_into_one_scalar():
    engine = engine_run(CASES["NAdam"][0], 4, unused=(1,))
    assert "mu_product" in engine.state.param_scalars  # "b" took 3 steps, the others 4
    fresh = engine_run(CASES["NAdam"][0], 4, unused=())
    assert not fresh.state.param_scalars and fresh.state.scalars["mu_product"] == \
        engine.state.param_scalars["mu_product"][0]
    state = engine.state_dict()
    for n in SHAPES:  # a file whose per-parameter products all agree loads as the one scalar
        state["optimizer"]["param_scalars"]["mu_product"][n] = 0.5
    engine.load_state_dict(state)
    assert not engine.state.param_scalars and engine.state.scalars["mu_product"] == 0.5


@pytest.mark.parametrize("case", ["Adam-amsgrad", "NAdam"])
def test_state_dict_and_checkpoint_resume_bitwise(tmp_path, case):
    make = CASES[case][0]
    whole = engine_run(make, 20)
    part = engine_run(make, 8)
    state = part.state_dict()
    assert state["optimizer"]["param_steps"] == {"a": 8, "b": 4, "c": 8}
    assert ("param_scalars" in state["optimizer"]) == (case == "NAdam")
    at.save(tmp_path / "ck.safetensors", part)
    r1 = at.Engine(params(), make(), missing="skip")
    r1.load_state_dict(state)
    r2 = at.Engine(params(), make(), missing="skip")
    at.load(tmp_path / "ck.safetensors", r2)
    for r in (r1, r2):
        for t in range(8, 20):
            g = grads_at(t)
            if t in UNUSED:
                del g["b"]
            r.step(g)
        for n in SHAPES:
            assert np.array_equal(r.params[n], whole.params[n]), n
        assert r.state.counts.tolist() == whole.state.counts.tolist()
        for k, v in whole.state.param_scalars.items():
            assert np.array_equal(r.state.param_scalars[k], v)


def test_open_window_absent_names_resume():
    make = CASES["AdamW"][0]
    kw = {"accumulation_steps": 2}
    whole = at.Engine(params(), make(), missing="skip", **kw)
    part = at.Engine(params(), make(), missing="skip", **kw)
    first = grads_at(0)
    del first["b"]
    for e in (whole, part):
        e.step(first)
    state = part.state_dict()
    assert state["accumulation"]["absent"] == ["b"]
    resumed = at.Engine(params(), make(), missing="skip", **kw)
    resumed.load_state_dict(state)
    second = grads_at(1)
    del second["b"]
    for e in (whole, resumed):
        e.step(second)
    assert np.array_equal(resumed.params["b"], whole.params["b"]) and np.array_equal(resumed.params["b"], params()["b"])
    assert resumed.state.counts.tolist() == [1, 0, 1]


def test_bad_param_scalars_are_refused():
    state = engine_run(CASES["NAdam"][0], 8).state_dict()
    engine = at.Engine(params(), CASES["NAdam"][0](), missing="skip")
    for bad in ({"mu_product": {"a": 0.5, "b": 0.4}}, {"mu_product": {"a": 0.5, "b": float("nan"), "c": 0.5}},
                {"mu": {"a": 0.5, "b": 0.4, "c": 0.5}}, {"mu_product": [0.5, 0.4, 0.5]}, [1.0]):
        state["optimizer"]["param_scalars"] = bad
        with pytest.raises(StateDictError, match="param_scalars"):
            engine.load_state_dict(state)
        assert engine.state.step == 0 and not engine.state.param_scalars


def test_bad_param_steps_are_refused():
    make = CASES["AdamW"][0]
    state = engine_run(make, 8).state_dict()
    engine = at.Engine(params(), make(), missing="skip")
    for bad in ({"a": 8, "b": 9, "c": 8}, {"a": 8, "b": 4}, {"a": 8, "b": -1, "c": 8}, [8, 4, 8]):
        state["optimizer"]["param_steps"] = bad
        with pytest.raises(StateDictError, match="param_steps"):
            engine.load_state_dict(state)
        assert engine.state.step == 0 and engine.state.counts is None


@pytest.mark.parametrize("case", ["AdamW", "NAdam"])
@pytest.mark.parametrize("mode", ["replicated", "overlap", "sharded"])
def test_a_group_counts_a_gradient_when_any_rank_has_one(mode, case):
    """Two ranks: at steps 4-7 rank 0 lacks "b" (rank 1 has it: present), at 8-10 both lack it (absent).
    NAdam: every rank keeps every parameter's product, also where its partition holds none of it."""
    make = CASES[case][0]
    kw = {"overlap": mode == "overlap", "shard_state": mode == "sharded", "bucket_bytes": 64}

    def rank_grads(t, rank):
        g = grads_at(t, rank)
        if (4 <= t < 8 and rank == 0) or 8 <= t < 11:
            del g["b"]
        return g

    def run(rank, comm):
        engine = at.Engine(params(), make(), missing="skip", comm=comm, **kw)
        for t in range(14):
            g = rank_grads(t, rank)
            if kw["overlap"]:  # the zero-copy path, marking what is there
                for n, v in g.items():
                    engine.grads[n][...] = v
                engine.mark_ready(list(g))
                engine.step(absent=[n for n in SHAPES if n not in g])
            else:
                engine.step(g)
        names = engine.layout.names  # by name: a sharded engine lays its buckets out interleaved
        return (engine.gather_params().as_dict(), dict(zip(names, engine.state.counts.tolist())),
                {k: dict(zip(names, v.tolist())) for k, v in engine.state.param_scalars.items()})

    results = ThreadGroup(2).run(run)
    # the reference: one process, the ranks' mean gradient, "b" absent where both lacked it
    ref = at.Engine(params(), make(), missing="skip")
    for t in range(14):
        parts = [rank_grads(t, r) for r in range(2)]
        ref.step({n: sum(p.get(n, 0) for p in parts) / 2 for n in SHAPES if any(n in p for p in parts)})
    for got, counts, each in results:
        assert_close_to_scale(got, ref.params.as_dict())
        assert counts == dict(zip(ref.layout.names, [14, 11, 14]))
        assert each.keys() == ref.state.param_scalars.keys() == ({"mu_product"} if case == "NAdam" else set())
        for k, v in each.items():
            assert v == dict(zip(ref.layout.names, ref.state.param_scalars[k].tolist()))


def test_a_pruning_mask_applies_while_parameters_stand_at_different_step_counts():
    """With a parameter a step behind, the update runs per step count on subsets of the pieces; the mask (of
    the whole layout) applies to them (it was refused as another layout)."""
    rng = np.random.default_rng(0)
    shapes = {"w": (40, 30), "b": (30,), "big": (5000,)}
    eng = at.Engine({n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}, at.optim.AdamW(1e-2),
                    missing="skip")
    grads = lambda: {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}  # noqa: E731
    eng.step(grads())
    g = grads()
    del g["b"]
    eng.step(g)
    assert eng.state.counts is not None
    mask = at.prune.magnitude_mask(eng.params, ratio=0.5)
    eng.set_mask(mask)
    assert eng.step(grads()).applied
    assert not eng.params.flat[mask.flat == 0].any()
