"""arraytrain.phase: the PhaseController driven by hand, its state, and resuming phase training mid-phase.

A resumed run (saved after a FULL, a PREDICT or a CORRECT step, with the
adaptive lengths moved or not) equals the uninterrupted one bitwise: the
engine's state, the controller's (schedule, counters, lengths, kept losses,
the predictor's ring and correction) and the epochs' figures. The controller
driven by hand equals :class:`~arraytrain.nn.PhaseTrainer`. A refused state or
checkpoint changes neither the controller nor the engine.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import threading
from collections.abc import Mapping

import numpy as np
import pytest

import arraytrain as at
from arraytrain import nn
from arraytrain.errors import (
    ArgumentTypeError,
    CheckpointError,
    HyperparameterError,
    LayoutError,
    StateDictError,
    UnknownParameterError,
)
from arraytrain.parallel.communicator import LocalComm
from arraytrain.phase import Phase, PhaseController, PhaseOrderError, PhaseStats, load, save
from builders import mlp_engine

CFG = dict(full_steps=2, predict_steps=4, correct_every=2, history=3)   # F F P P C P C | F F ...
ADAPTIVE = dict(CFG, adaptive=True, loss_threshold=0.0, full_bounds=(1, 6), predict_bounds=(2, 12))
TIMING = (("phase", "stats", "seconds"), ("phase", "stats", "timed"))  # wall clock: differs run to run


def blobs(n: int, seed: int = 0, d: int = 8, k: int = 3):
    rng = np.random.default_rng(seed)
    centers = 3 * rng.standard_normal((k, d))
    y = rng.integers(0, k, n)
    return (centers[y] + rng.standard_normal((n, d))).astype(np.float32), y


def make_model(seed: int = 0):
    model = nn.MLP([8, 16, 3], activation="relu")
    engine = at.Engine(model.init(seed=seed), at.optim.AdamW(lr=1e-2), zero_grad_on_step=False)
    model.bind(engine)
    return model, engine


def flatten(tree, path=()):
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from flatten(v, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from flatten(v, path + (i,))
    else:
        yield path, tree


def snapshot(engine, controller, timing: bool = True) -> dict:
    """Every leaf of the engine's and the controller's state; arrays as (dtype, shape, bytes)."""
    tree = {"engine": engine.state_dict() if engine is not None else None, "phase": controller.state_dict()}
    out = {}
    for path, v in flatten(tree):
        if not timing and path[:3] in TIMING:
            continue
        if isinstance(v, np.ndarray):
            v = (v.dtype.str, v.shape, v.tobytes())
        elif isinstance(v, float) and math.isnan(v):
            v = "nan"
        out[path] = v
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if a[k] != b[k]]
    assert not differ, f"{len(differ)} leaves differ, first {differ[:3]}"


WALL_CLOCK = ("time", "samples_per_second")  # an epoch's wall-clock figures: never bitwise between two runs


def figures(history) -> list:
    return [{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in logs.items() if k not in WALL_CLOCK}
            for logs in history]


# -- the controller by hand -----------------------------------------------------------------------------


def hand_step(ctl: PhaseController, model, engine, xb, yb) -> Phase:
    """One step of a loop of one's own: the seed's begin / record or predict / end."""
    phase = ctl.begin_step()
    if phase is Phase.PREDICT:
        ctl.get_predicted_gradients()  # into engine.grads
        loss = None
    else:
        out = model.forward(xb)
        loss, dout = nn.softmax_cross_entropy(out, yb)
        model.backward(dout)
        ctl.record_full_gradients()
    engine.step()
    ctl.end_step(loss)
    return phase


@pytest.mark.parametrize("cfg", [CFG, ADAPTIVE], ids=["fixed", "adaptive"])
def test_controller_by_hand_equals_phase_trainer(cfg):
    x, y = blobs(80)
    model, engine = make_model()
    trainer = nn.PhaseTrainer(model, engine, batch_size=16, **cfg)
    trainer.fit(x, y, epochs=12)

    model2, engine2 = make_model()
    ctl = PhaseController(engine2, **cfg)
    batches = nn.Batches(x, y, 16, shuffle=True, seed=0)
    for e in range(12):
        for xb, yb in batches.epoch(e):
            hand_step(ctl, model2, engine2, xb, yb)
    assert_same(snapshot(engine, trainer.controller, timing=False), snapshot(engine2, ctl, timing=False))
    s = ctl.stats()
    assert s.steps == ctl.step == engine2.state.step == 60 and s.cycles == trainer.stats.cycles > 0
    assert s.loss_count["predict"] == 0 and s.loss_count["full"] == s.full_steps
    if cfg is ADAPTIVE:  # the lengths moved: the adaptive state is exercised
        assert (ctl.schedule.full_steps, ctl.schedule.predict_steps) != (2, 4)


def test_layout_controller_with_mappings_equals_the_engine_bound_one(rng):
    """Without an engine: gradients in and predictions out by name (here handed to engine.step(grads))."""
    x, y = blobs(64)
    runs = []
    for bound in (True, False):
        model, engine = make_model()
        ctl = PhaseController(engine if bound else engine.layout, **CFG)
        for i in range(20):
            xb, yb = x[16 * (i % 4):16 * (i % 4 + 1)], y[16 * (i % 4):16 * (i % 4 + 1)]
            phase = ctl.begin_step()
            if phase is Phase.PREDICT:
                pred = ctl.get_predicted_gradients()
                if bound:
                    pred = None  # already in engine.grads
                loss = None
            else:
                loss, dout = nn.softmax_cross_entropy(model.forward(xb), yb)
                model.backward(dout)
                # by name: copies of the gradients, as another framework would hand them over
                ok = ctl.record_full_gradients(None if bound else {k: v.copy() for k, v in engine.grads.items()})
                assert ok
                pred = None
            engine.step(pred)
            ctl.end_step(loss)
        runs.append((engine, ctl))
    (e1, c1), (e2, c2) = runs
    assert_same(snapshot(e1, c1, timing=False), snapshot(e2, c2, timing=False))


def test_seed_api_transitions_and_step_ratio():
    """The phase after two FULL steps, and 4 steps / 1 backward = 4.0 (the phase API's own examples)."""
    layout = at.Layout({"layer1.weight": (64, 128), "layer1.bias": (64,)})
    rng = np.random.default_rng(0)
    grads = {k: (0.1 * rng.standard_normal(layout.shape(k))).astype(np.float32) for k in layout.names}

    ctl = PhaseController(layout, full_steps=2, predict_steps=4, correct_every=2)
    assert ctl.phase is Phase.FULL and ctl.step == 0
    for loss in (1.0, 0.9):
        assert ctl.begin_step() is Phase.FULL and not ctl.phase_changed and ctl.needs_backward
        ctl.record_full_gradients(grads)
        ctl.end_step(loss)
    assert ctl.begin_step() is Phase.PREDICT and ctl.phase_changed and not ctl.needs_backward
    pred = ctl.get_predicted_gradients()
    assert set(pred) == set(layout.names)
    np.testing.assert_allclose(pred["layer1.bias"], grads["layer1.bias"], rtol=1e-6, atol=1e-7)  # constant trend
    ctl.end_step()

    ctl = PhaseController(layout, full_steps=1, predict_steps=3, correct_every=10)
    ctl.begin_step()
    ctl.record_full_gradients(grads)
    ctl.end_step(1.0)
    for _ in range(3):
        assert ctl.begin_step() is Phase.PREDICT
        ctl.get_predicted_gradients()
        ctl.end_step(0.9)  # a loss on a PREDICT step enters the stats, not the adaptive rule
    s = ctl.stats()
    assert s.step_ratio == 4.0 and s.backward_passes == 1 and s.steps == 4
    assert s.mean_losses() == {"full": 1.0, "predict": pytest.approx(0.9), "correct": None}
    assert list(ctl.schedule.losses) == [1.0]
    ctl.reset()
    assert (ctl.step, ctl.phase, ctl.cycle, ctl.predictor.count, ctl.stats().steps) == (0, Phase.FULL, 0, 0, 0)


def test_predict_before_any_record_raises_and_reset_starts_over():
    layout = at.Layout({"w": (3,)})
    ctl = PhaseController(layout, full_steps=1, predict_steps=2, correct_every=5)
    ctl.begin_step()
    assert ctl.record_full_gradients({"w": np.array([1.0, np.nan, 0.0], np.float32)}) is False  # not recorded
    ctl.end_step(1.0)
    assert ctl.begin_step() is Phase.PREDICT and ctl.stats().unrecorded == 1
    with pytest.raises(at.NoGradientsError, match="no gradient has been recorded"):
        ctl.get_predicted_gradients()
    ctl.reset()  # drops the open step
    assert not ctl.in_step and ctl.begin_step() is Phase.FULL


def test_stats_wall_speedup():
    s = PhaseStats(full_steps=2, predict_steps=6, correct_steps=2,
                   seconds={"full": 0.2, "predict": 0.05, "correct": 0.2},
                   timed={"full": 2, "predict": 5, "correct": 2})
    # 10 steps at 0.1 s (a step with backward) over 4 * 0.1 + 6 * 0.01
    assert s.wall_speedup == pytest.approx(1.0 / 0.46)
    assert s.seconds_per_step() == pytest.approx({"full": 0.1, "predict": 0.01, "correct": 0.1})
    assert PhaseStats(full_steps=1, predict_steps=1, timed={"full": 1, "predict": 0, "correct": 0}).wall_speedup is None
    x, y = blobs(64)
    model, engine = make_model()
    tr = nn.PhaseTrainer(model, engine, batch_size=16, **CFG)
    tr.fit(x, y, epochs=4)
    s = tr.stats
    assert all(s.timed[k] == n - 1 for k, n in s.counts().items())  # the first of each phase compiles: untimed
    assert s.wall_speedup is not None and s.wall_speedup > 0
    assert s.step_ratio == s.steps / s.backward_passes


# -- resuming mid-phase ------------------------------------------------------------------------------------

# (samples, epochs before the save, phase of the last step saved): 5 batches an epoch put the
# boundaries after a CORRECT step (5), inside PREDICT (10) and inside FULL (15); 3 batches after
# the first PREDICT step (3) and after the PREDICT step that follows a CORRECT one (6)
RESUMES = [(80, 1, Phase.CORRECT), (80, 2, Phase.PREDICT), (80, 3, Phase.FULL), (48, 1, Phase.PREDICT),
           (48, 2, Phase.PREDICT)]


@pytest.mark.parametrize("cfg", [CFG, ADAPTIVE], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("n,at_epoch,saved_phase", RESUMES)
def test_phase_trainer_resumes_mid_phase_bitwise(tmp_path, cfg, n, at_epoch, saved_phase):
    epochs = 10
    if cfg is ADAPTIVE:  # save after the lengths moved (they do at the start of cycle 6, step 35)
        at_epoch += 8 if n == 80 else 13
        epochs = at_epoch + 4
    x, y = blobs(n)
    model, engine = make_model()
    straight = nn.PhaseTrainer(model, engine, batch_size=16, **cfg)
    straight.fit(x, y, epochs=epochs)

    path = tmp_path / "run-{epoch}.safetensors"
    model1, engine1 = make_model()
    first = nn.PhaseTrainer(model1, engine1, batch_size=16, callbacks=[nn.PhaseCheckpoint(path)], **cfg)
    first.fit(x, y, epochs=at_epoch)
    saved = str(path).format(epoch=at_epoch)
    if cfg is CFG:
        assert first.controller.phase is saved_phase
    else:
        assert (first.schedule.full_steps, first.schedule.predict_steps) != (2, 4)

    model2, engine2 = make_model(seed=7)  # other weights: all of them come from the file
    resumed = nn.PhaseTrainer(model2, engine2, batch_size=16, **cfg)
    extra = load(saved, resumed.controller)
    assert extra == {"epoch": at_epoch}
    assert_same(snapshot(engine1, first.controller), snapshot(engine2, resumed.controller))  # timing too
    resumed.fit(x, y, epochs=epochs, initial_epoch=extra["epoch"])

    assert_same(snapshot(engine, straight.controller, timing=False),
                snapshot(engine2, resumed.controller, timing=False))
    assert figures(resumed.history) == figures(straight.history)[at_epoch:]


def test_controller_resumes_after_any_step_bitwise(tmp_path):
    """A loop of one's own, saved after every one of the first 17 steps and resumed to step 24."""
    x, y = blobs(96)
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 96, 16)]
    total = 24

    def run(model, engine, ctl, start, stop):
        return "".join(hand_step(ctl, model, engine, *batches[i % 6]).value[0].upper() for i in range(start, stop))

    model, engine = make_model()
    straight = PhaseController(engine, **CFG)
    seq = run(model, engine, straight, 0, total)
    assert seq.startswith("FFPPCPCFFPPCPC")
    want = snapshot(engine, straight, timing=False)
    for k in range(17):
        model1, engine1 = make_model()
        ctl1 = PhaseController(engine1, **CFG)
        run(model1, engine1, ctl1, 0, k)
        save(tmp_path / "c.safetensors", ctl1, extra={"step": k})
        model2, engine2 = make_model(seed=3)
        ctl2 = PhaseController(engine2, **CFG)
        assert load(tmp_path / "c.safetensors", ctl2) == {"step": k}
        assert run(model2, engine2, ctl2, k, total) == seq[k:], k
        assert_same(want, snapshot(engine2, ctl2, timing=False))


def test_layout_controller_checkpoint_round_trip(tmp_path):
    """Without an engine the file holds the controller alone."""
    layout = at.Layout({"w": (5, 3), "empty": (0,), "b": (7,)})
    rng = np.random.default_rng(1)
    a = PhaseController(layout, **CFG)
    for _ in range(9):
        if a.begin_step() is Phase.PREDICT:
            a.get_predicted_gradients()
        else:
            a.record_full_gradients({k: rng.standard_normal(layout.shape(k)) for k in layout.names})  # float64: cast
        a.end_step(float(rng.random()))
    save(tmp_path / "p.safetensors", a)
    b = PhaseController(layout, **CFG)
    assert load(tmp_path / "p.safetensors", b) == {}
    assert_same(snapshot(None, a), snapshot(None, b))
    assert b.begin_step() is a.begin_step()
    if b.phase is Phase.PREDICT:
        assert all(np.array_equal(u, v) for u, v in zip(a.get_predicted_gradients().values(),
                                                          b.get_predicted_gradients().values()))


# -- refused states change nothing --------------------------------------------------------------------------


def driven(steps: int, engine_seed: int = 0, cfg=CFG):
    x, y = blobs(48)
    model, engine = make_model(engine_seed)
    ctl = PhaseController(engine, **cfg)
    for i in range(steps):
        hand_step(ctl, model, engine, x[16 * (i % 3):16 * (i % 3 + 1)], y[16 * (i % 3):16 * (i % 3 + 1)])
    return model, engine, ctl


DROP = object()  # delete the key

CORRUPT = [  # (message, path in the state, new value or a function of the old one)
    (r"phase state: lacks \['stats'\]", ("stats",), DROP),
    (r"has unexpected \['extra'\]", ("extra",), 1),
    ("version", ("version",), 2),
    ("step", ("step",), -1),
    ("step", ("step",), lambda s: s + 1),
    ("phase", ("schedule", "phase"), "bogus"),
    ("phase_step", ("schedule", "phase_step"), "3"),
    ("full_steps", ("schedule", "full_steps"), 0),
    ("losses", ("schedule", "losses"), [1.0] * 101),
    ("losses", ("schedule", "losses"), lambda v: v + ["a"]),
    ("stats seconds", ("stats", "seconds", "full"), -1.0),
    ("stats seconds", ("stats", "seconds"), {"full": 0.0}),
    ("stats timed", ("stats", "timed", "full"), 10**6),
    ("unrecorded", ("stats", "unrecorded"), 10**6),
    ("stats loss_sum", ("stats", "loss_sum", "full"), True),
    ("cycle", ("schedule", "cycle"), 10**6),
    ("history_size", ("predictor", "history_size"), 4),
    ("does not match", ("predictor", "correction", "fc1.bias"), np.zeros(3, np.float32)),
    ("recorded at step", ("predictor", "steps"), lambda v: [s + 100 for s in v]),
]


@pytest.mark.parametrize("match,path,value", CORRUPT, ids=[f"{i}-{c[0][:20]}" for i, c in enumerate(CORRUPT)])
def test_refused_state_changes_nothing(match, path, value):
    _, _, source = driven(11)
    _, engine, target = driven(6, engine_seed=2)
    state = copy.deepcopy(source.state_dict())
    parent = functools.reduce(lambda node, key: node[key], path[:-1], state)
    if value is DROP:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value(parent[path[-1]]) if callable(value) else value
    before = snapshot(engine, target)
    with pytest.raises(StateDictError, match=match):
        target.load_state_dict(state)
    assert_same(before, snapshot(engine, target))


def test_adaptive_lengths_outside_the_bounds_are_refused():
    _, _, source = driven(11)
    _, _, target = driven(0, cfg=dict(ADAPTIVE, full_steps=3, full_bounds=(3, 6)))
    with pytest.raises(StateDictError, match="full_steps: 2 is outside its bounds"):
        target.load_state_dict(source.state_dict())


class Tree:
    """Anything with the state protocol (arraytrain.checkpoint.PROTOCOL), for writing hand-made
    checkpoints with arraytrain.save."""

    comm = LocalComm()

    def __init__(self, tree):
        self.tree = tree

    def exclusive(self, what):
        return contextlib.nullcontext()

    def state_dict(self, copy=True):
        return self.tree

    def state_template(self):
        return self.tree

    def check_state(self, state):
        raise AssertionError("not loaded")

    def apply_state(self, checked):
        raise AssertionError("not loaded")


def _bad_engine_part(tree):
    tree["consecutive_skips"] = -1  # a value only the engine's own check refuses, after the controller's passed


def _bad_phase_part(tree):
    tree["phase"]["schedule"]["phase"] = "bogus"


def _bad_ring(tree):
    tree["phase"]["predictor"]["history"]["0"]["fc2.bias"] = np.zeros(4, np.float32)


def _no_phase(tree):
    del tree["phase"]


@pytest.mark.parametrize("match,change", [
    ("consecutive_skips", _bad_engine_part),
    ("phase: expected one of", _bad_phase_part),
    ("fc2.bias", _bad_ring),
    (r"lacks \['phase'\]", _no_phase),
])
def test_refused_checkpoint_changes_neither_engine_nor_controller(tmp_path, match, change):
    _, engine_a, a = driven(11)
    tree = {**engine_a.state_dict(), "phase": a.state_dict()}
    change(tree)
    at.checkpoint.save(tmp_path / "bad.safetensors", Tree(tree))
    _, engine, ctl = driven(5, engine_seed=4)
    before = snapshot(engine, ctl)
    with pytest.raises(CheckpointError, match=match):
        load(tmp_path / "bad.safetensors", ctl)
    assert_same(before, snapshot(engine, ctl))


def test_checkpoints_of_the_other_kind_and_broken_files_are_refused(tmp_path):
    _, engine_a, a = driven(11)
    at.save(tmp_path / "engine.safetensors", engine_a)
    save(tmp_path / "phase.safetensors", a)
    _, engine, ctl = driven(5, engine_seed=4)
    before = snapshot(engine, ctl)
    with pytest.raises(CheckpointError, match=r"lacks \['phase'\]"):
        load(tmp_path / "engine.safetensors", ctl)
    with pytest.raises(CheckpointError, match=r"unexpected \['phase'\]"):
        at.load(tmp_path / "phase.safetensors", engine)
    data = (tmp_path / "phase.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError):
        load(tmp_path / "cut.safetensors", ctl)
    _, _, other = driven(5, cfg=dict(CFG, history=4))  # a ring of another length
    with pytest.raises(CheckpointError, match="history"):
        load(tmp_path / "phase.safetensors", other)
    assert_same(before, snapshot(engine, ctl))
    at.load(tmp_path / "engine.safetensors", engine)  # the weights alone: the controller starts afresh
    assert np.array_equal(engine.params.flat, engine_a.params.flat)


def test_inside_a_step_nothing_is_saved_or_loaded(tmp_path):
    model, engine, ctl = driven(4)
    save(tmp_path / "c.safetensors", ctl)
    kept = (tmp_path / "c.safetensors").read_bytes()
    ctl.begin_step()
    with pytest.raises(PhaseOrderError, match="save: the .* step 4 is open"):
        save(tmp_path / "c.safetensors", ctl)
    with pytest.raises(PhaseOrderError, match="load"):
        load(tmp_path / "c.safetensors", ctl)
    with pytest.raises(PhaseOrderError, match="state_dict"):
        ctl.state_dict()
    assert (tmp_path / "c.safetensors").read_bytes() == kept


def test_save_and_load_hold_the_engine(tmp_path):
    """Another thread's engine call in progress: save and load refuse at once and change nothing."""
    _, engine, ctl = driven(4)
    save(tmp_path / "c.safetensors", ctl)
    kept, before = (tmp_path / "c.safetensors").read_bytes(), snapshot(engine, ctl)
    holding, release = threading.Event(), threading.Event()

    def hold():
        with engine.exclusive("step()"):
            holding.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert holding.wait(30)
        with pytest.raises(at.ConcurrentUseError, match=r"arraytrain.phase.save\(\)"):
            save(tmp_path / "c.safetensors", ctl)
        with pytest.raises(at.ConcurrentUseError, match=r"arraytrain.phase.load\(\)"):
            load(tmp_path / "c.safetensors", ctl)
    finally:
        release.set()
        t.join()
    assert (tmp_path / "c.safetensors").read_bytes() == kept
    assert_same(before, snapshot(engine, ctl))


# -- calls out of order and bad arguments --------------------------------------------------------------------


def _at(steps: int, begun: bool = True):
    """A controller on a layout after ``steps`` steps, the next one begun."""
    layout = at.Layout({"w": (4, 3), "b": (3,)})
    ctl = PhaseController(layout, **CFG)
    g = {"w": np.ones((4, 3), np.float32), "b": np.ones(3, np.float32)}
    for _ in range(steps):
        if ctl.begin_step() is Phase.PREDICT:
            ctl.get_predicted_gradients()
        else:
            ctl.record_full_gradients(g)
        ctl.end_step(1.0)
    if begun:
        ctl.begin_step()
    return ctl, g


def _twice(ctl, g):
    ctl.record_full_gradients(g)
    ctl.record_full_gradients(g)


ORDER = [
    # (error, match, steps before, begun, call)
    (PhaseOrderError, "begin_step: the full step 0 is still open", 0, True, lambda c, g: c.begin_step()),
    (PhaseOrderError, "end_step: no step is open", 0, False, lambda c, g: c.end_step(1.0)),
    (PhaseOrderError, "record_full_gradients: no step is open", 0, False, lambda c, g: c.record_full_gradients(g)),
    (PhaseOrderError, "get_predicted_gradients: the step is FULL", 0, True, lambda c, g: c.get_predicted_gradients()),
    (PhaseOrderError, "record_full_gradients: the step is PREDICT", 2, True, lambda c, g: c.record_full_gradients(g)),
    (PhaseOrderError, "recorded already", 0, True, _twice),
    (PhaseOrderError, "has not called record_full_gradients", 0, True, lambda c, g: c.end_step(1.0)),
    (PhaseOrderError, "has not called get_predicted_gradients", 2, True, lambda c, g: c.end_step()),
    (ArgumentTypeError, "grads: None stands for the engine's", 0, True, lambda c, g: c.record_full_gradients()),
    (LayoutError, r"missing arrays for \['b'\]", 0, True, lambda c, g: c.record_full_gradients({"w": g["w"]})),
    (UnknownParameterError, "'x'", 0, True, lambda c, g: c.record_full_gradients({**g, "x": g["b"]})),
    (ArgumentTypeError, "loss", 2, True, lambda c, g: (c.get_predicted_gradients(), c.end_step("low"))),
    (LayoutError, "out", 2, True, lambda c, g: c.get_predicted_gradients(out=np.zeros(3, np.float32))),
]


@pytest.mark.parametrize("error,match,steps,begun,call", ORDER, ids=[f"{i}-{o[1][:24]}" for i, o in enumerate(ORDER)])
def test_calls_out_of_order_change_nothing(error, match, steps, begun, call):
    ctl, g = _at(steps, begun)
    before = (ctl.step, ctl.phase, ctl.phase_step, ctl.in_step, ctl.predictor.count, ctl.stats().counts(),
              ctl.predictor.state_dict()["steps"])
    with pytest.raises(error, match=match):
        call(ctl, g)
    if call is not _twice:
        assert before == (ctl.step, ctl.phase, ctl.phase_step, ctl.in_step, ctl.predictor.count,
                          ctl.stats().counts(), ctl.predictor.state_dict()["steps"])
    if ctl.in_step:  # and the step can still be completed
        if ctl.phase is Phase.PREDICT:
            ctl.get_predicted_gradients()
        elif ctl.predictor.count == before[4]:
            ctl.record_full_gradients(g)
        ctl.end_step(None if ctl.phase is Phase.PREDICT else 1.0)
        assert ctl.step == steps + 1


@pytest.mark.parametrize("name,call", [
    ("accumulation_steps", lambda: PhaseController(mlp_engine(accumulation_steps=2)[1])),
    ("loss_scaler", lambda: PhaseController(mlp_engine(loss_scaler=at.LossScaler())[1])),
    ("optimizer", lambda: PhaseController(at.Engine({"w": np.zeros(3, np.float32)},
                                                    at.optim.SAM(at.optim.SGD(lr=0.1))))),
    ("correct_every", lambda: PhaseController(at.Layout({"w": (3,)}), correct_every=0)),
    ("history", lambda: PhaseController(at.Layout({"w": (3,)}), history=0)),
    ("layout_or_params", lambda: PhaseController([1, 2])),
])
def test_bad_arguments(name, call):
    with pytest.raises(HyperparameterError if name not in ("layout_or_params",) else ArgumentTypeError, match=name):
        call()


def test_phase_checkpoint_needs_a_phase_trainer(tmp_path):
    x, y = blobs(32)
    model, engine = make_model()
    cb = nn.PhaseCheckpoint(tmp_path / "c.safetensors")
    with pytest.raises(ArgumentTypeError, match="PhaseCheckpoint: expected a PhaseTrainer"):
        nn.Trainer(model, engine, batch_size=16, callbacks=[cb]).fit(x, y, epochs=1)


# -- CUDA -------------------------------------------------------------------------------------------------------


def test_cuda_controller_resumes_bitwise_and_follows_the_cpu(tmp_path):
    from cuda_family import device_cupy, on_device, require_cuda

    require_cuda()
    cupy = device_cupy()

    rng = np.random.default_rng(5)
    p0 = {"w": rng.standard_normal((33, 17)).astype(np.float32), "b": rng.standard_normal(17).astype(np.float32)}
    target = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in p0.items()}

    def run(engine, ctl, start, stop):
        xp = cupy if on_device(engine.params.flat) else np
        goal = {k: xp.asarray(v) for k, v in target.items()}
        for _ in range(start, stop):
            if ctl.begin_step() is Phase.PREDICT:
                ctl.get_predicted_gradients()
                loss = None
            else:
                for k in goal:  # the gradient of 0.5 * |p - target|^2
                    engine.grads[k][...] = engine.params[k] - goal[k]
                ctl.record_full_gradients()
                loss = 1.0
            engine.step()
            ctl.end_step(loss)

    def fresh(device):
        engine = at.Engine(p0, at.optim.AdamW(lr=1e-2), zero_grad_on_step=False, device=device)
        return engine, PhaseController(engine, **CFG)

    cpu, cpu_ctl = fresh("cpu")
    run(cpu, cpu_ctl, 0, 20)
    gpu, gpu_ctl = fresh("cuda")
    run(gpu, gpu_ctl, 0, 20)
    np.testing.assert_allclose(cupy.asnumpy(gpu.params.flat), cpu.params.flat, rtol=1e-5, atol=1e-5)
    part, part_ctl = fresh("cuda")
    run(part, part_ctl, 0, 9)
    save(tmp_path / "g.safetensors", part_ctl)
    again, again_ctl = fresh("cuda")
    load(tmp_path / "g.safetensors", again_ctl)
    run(again, again_ctl, 9, 20)
    assert cupy.array_equal(again.params.flat, gpu.params.flat)
    assert cupy.array_equal(again_ctl.predictor.correction.flat, gpu_ctl.predictor.correction.flat)
