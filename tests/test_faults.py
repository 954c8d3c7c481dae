"""Fault classes: every refused call raises a typed error naming the culprit and changes nothing.

One table per class of fault (issue 11). Each case is run against an engine that
holds every kind of state at once -- Adam with AMSGrad slots, a mid-window
accumulation, a nested schedule with reduce-on-plateau counters, a loss scaler,
top-k compression with error-feedback residuals, a pruning mask -- and after the
refusal :func:`conftest.engine_snapshot` must be bitwise what it was before.
The error must be an :class:`ArrayTrainError` and the matching builtin, and its
message must contain the case's needles (normally the argument's name). Each
table's size is printed.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from typing import Callable, NamedTuple

import numpy as np
import pytest
from safetensors.numpy import save_file

import arraytrain as at
from arraytrain import (
    ArrayTrainError,
    BackendError,
    CheckpointError,
    ConcurrentUseError,
    Engine,
    HyperparameterError,
    Layout,
    LossScaler,
    ShapeMismatchError,
    StateDictError,
    UnknownParameterError,
    checkpoint,
    schedules,
)
from arraytrain._checks import MAX_COUNT
from arraytrain.compress import ErrorFeedback, TopK
from arraytrain.optim import SGD, Adam, Sophia
from conftest import engine_snapshot

pytestmark = pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")

SHAPES = {"W": (4, 3), "z": (0,), "b": (3,)}
MASK = {"W": (np.arange(12).reshape(4, 3) % 3 != 0).astype(np.uint8)}


def _schedule():
    return schedules.ReduceLROnPlateau(schedules.Warmup(3, schedules.CosineAnnealingLR(20)), patience=0, factor=0.5)


def _full(**over) -> Engine:
    """A float32 engine with every kind of state."""
    kw = dict(accumulation_steps=2, max_grad_norm=5.0, schedule=_schedule(),
              loss_scaler=LossScaler(init_scale=2.0**8, growth_interval=3),
              compressor=ErrorFeedback(TopK(ratio=0.5)))
    kw.update(over)
    mask = kw.pop("mask", MASK)
    e = Engine({n: np.zeros(s, np.float32) for n, s in SHAPES.items()}, kw.pop("optimizer", Adam(lr=0.1, amsgrad=True)),
               **kw)
    if mask is not None:
        e.set_mask(mask)
    return e


def _train(e: Engine, calls: int, seed: int) -> Engine:
    rng = np.random.default_rng(seed)
    for i in range(calls):
        e.step({n: rng.standard_normal(s) * e.loss_scale for n, s in SHAPES.items()}, weight=1.0 + i % 3)
        if i % 4 == 3 and e.schedule is not None:
            e.observe(float(i % 2))  # the plateau counters move
    return e


def _live(seed: int = 0, calls: int = 9, **over) -> Engine:
    """Mid-window (an odd number of micro-batches), every state part non-trivial."""
    return _train(_full(**over), calls, seed)


def _grads(scale: float = 1.0):
    return {n: np.full(s, 0.5 * scale) for n, s in SHAPES.items()}


def _needles(match) -> tuple:
    return (match,) if isinstance(match, str) else tuple(match)


def _assert_typed(info, builtin, match) -> None:
    err = info.value
    assert isinstance(err, ArrayTrainError) and isinstance(err, builtin), type(err).__mro__
    for needle in _needles(match):
        assert needle in str(err), f"{needle!r} not in {str(err)!r}"


def _refused(engine: Engine, call, exc, match, builtin=Exception) -> None:
    """``call(engine)`` raises ``exc`` (typed, naming ``match``) and changes nothing; the engine still works."""
    before = engine_snapshot(engine)
    with pytest.raises(exc) as info:
        call(engine)
    _assert_typed(info, builtin, match)
    assert engine_snapshot(engine) == before
    assert not engine.step(_grads(engine.loss_scale)).skipped  # still usable


# == 1. a refused load changes nothing ==============================================================


class LoadCase(NamedTuple):
    id: str
    mutate: Callable | None  # state dict -> None (in place)
    match: str | tuple
    target: Callable | None = None  # builds the engine to load into (default: _full())
    file: bool = True  # also through a checkpoint file (False where the file cannot hold the fault)


def _set(*path_and_value):
    *path, value = path_and_value

    def mutate(sd):
        node = sd
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value(node[path[-1]]) if callable(value) else value
    return mutate


def _drop(*path):
    def mutate(sd):
        node = sd
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]
    return mutate


LOAD_CASES = [
    # the schedule: the issue's case (saved cosine, engine Warmup) and its neighbours
    LoadCase("schedule-other-type", None, "schedule", target=lambda: _full(schedule=schedules.Warmup(5))),
    LoadCase("schedule-inner-other-type", None, "schedule",
             target=lambda: _full(schedule=schedules.ReduceLROnPlateau(schedules.Warmup(3, schedules.LinearLR(20))))),
    LoadCase("schedule-other-nesting", None, "schedule",
             target=lambda: _full(schedule=schedules.ReduceLROnPlateau(schedules.CosineAnnealingLR(20)))),
    LoadCase("schedule-engine-has-none", None, "schedule", target=lambda: _full(schedule=None)),
    LoadCase("schedule-state-has-none", _set("schedule", None), "schedule"),
    LoadCase("schedule-counter-negative", _set("schedule", "num_bad_epochs", -1), "num_bad_epochs"),
    LoadCase("schedule-counter-float", _set("schedule", "num_reductions", 1.5), "num_reductions"),
    LoadCase("schedule-hyperparameter-out-of-range", _set("schedule", "factor", 2.0), "factor"),
    LoadCase("schedule-nested-hyperparameter", _set("schedule", "inner", "steps", -3), ("schedule.inner", "steps")),
    LoadCase("schedule-unknown-key", _set("schedule", "extra_key", 1), "unknown keys"),
    LoadCase("schedule-missing-key", _drop("schedule", "last_epoch"), "last_epoch"),
    LoadCase("schedule-best-not-number", _set("schedule", "best", "low"), "best"),
    LoadCase("schedule-not-a-mapping", _set("schedule", [1, 2]), "schedule"),
    LoadCase("schedule-format", _set("schedule", "format", 3), "format"),
    # the loss scaler
    LoadCase("scaler-scale-zero", _set("loss_scaler", "scale", 0.0), "scale"),
    LoadCase("scaler-scale-inf", _set("loss_scaler", "scale", math.inf), "scale"),
    LoadCase("scaler-scale-nan", _set("loss_scaler", "scale", math.nan), "scale"),
    LoadCase("scaler-scale-str", _set("loss_scaler", "scale", "256"), "scale"),
    LoadCase("scaler-tracker-at-interval", _set("loss_scaler", "growth_tracker", 3), "growth_tracker"),
    LoadCase("scaler-tracker-negative", _set("loss_scaler", "growth_tracker", -1), "growth_tracker"),
    LoadCase("scaler-missing-key", _drop("loss_scaler", "scale"), "scale"),
    LoadCase("scaler-engine-has-none", None, "loss_scaler", target=lambda: _full(loss_scaler=None)),
    LoadCase("scaler-state-has-none", _set("loss_scaler", None), "loss_scaler"),
    # the compressor and its error-feedback residual
    LoadCase("compressor-other-settings", None, "compression", target=lambda: _full(compressor=ErrorFeedback(TopK(ratio=0.25)))),
    LoadCase("compressor-without-feedback", None, "compression", target=lambda: _full(compressor=TopK(ratio=0.5))),
    LoadCase("compressor-engine-has-none", None, "compression", target=lambda: _full(compressor=None)),
    LoadCase("compressor-step-negative", _set("compression", "step", -1), "compression step"),
    LoadCase("compressor-step-huge", _set("compression", "step", 10**400), "compression step"),
    LoadCase("compressor-residual-shape", _set("compression", "residual", "W", np.zeros((3, 4), np.float32)),
             ("residual", "'W'")),
    LoadCase("compressor-residual-missing", _drop("compression", "residual", "b"), ("residual", "'b'")),
    LoadCase("compressor-residual-int", _set("compression", "residual", "b", np.zeros(3, np.int32)), ("residual", "'b'")),
    LoadCase("compressor-residual-unknown", _set("compression", "residual", "nope", np.zeros(3, np.float32)),
             ("residual", "'nope'")),
    LoadCase("compressor-unexpected-arrays", _set("compression", "arrays", {"Q": np.zeros(2, np.float32)}), "Q"),
    # the pruning mask
    LoadCase("mask-value-2", _set("mask", "W", lambda a: np.where(a == 1, 2, 0).astype(np.uint8)), ("mask['W']", "0/1")),
    LoadCase("mask-float", _set("mask", "W", lambda a: a.astype(np.float32)), "mask['W']"),
    LoadCase("mask-shape", _set("mask", "W", np.ones((3, 4), np.uint8)), "mask['W']"),
    LoadCase("mask-missing-name", _drop("mask", "b"), "mask"),
    LoadCase("mask-engine-has-none", None, "mask", target=lambda: _full(mask=None)),
    LoadCase("mask-state-has-none", _set("mask", None), "mask"),
    # buffers: params, grads, slots
    LoadCase("param-shape", _set("params", "W", np.zeros((3, 4), np.float32)), "'W'"),
    LoadCase("param-int", _set("params", "b", np.zeros(3, np.int64)), "'b'"),
    LoadCase("param-unknown", _set("params", "nope", np.zeros(3, np.float32)), "'nope'"),
    LoadCase("param-missing", _drop("params", "b"), "'b'"),
    LoadCase("param-masked-array", _set("params", "b", np.ma.array(np.ones(3, np.float32), mask=[0, 1, 0])),
             ("'b'", "masked"), file=False),
    LoadCase("grad-matrix-wrong-shape", _set("accumulation", "grads", "b", lambda a: np.matrix(a)), "'b'"),
    LoadCase("slot-shape", _set("optimizer", "slots", "exp_avg", "W", np.zeros(12, np.float32)), "'W'"),
    LoadCase("slot-missing", _drop("optimizer", "slots", "max_exp_avg_sq"), "max_exp_avg_sq"),
    LoadCase("slot-complex", _set("optimizer", "slots", "exp_avg_sq", "b", np.zeros(3, np.complex64)), "'b'"),
    # counters and flags
    LoadCase("step-negative", _set("optimizer", "step", -1), "optimizer step"),
    LoadCase("step-bool", _set("optimizer", "step", True), "optimizer step"),
    LoadCase("step-float", _set("optimizer", "step", 4.0), "optimizer step"),
    LoadCase("step-above-2**53", _set("optimizer", "step", MAX_COUNT + 1), "optimizer step"),
    LoadCase("step-10**400", _set("optimizer", "step", 10**400), "optimizer step"),
    LoadCase("micro-out-of-range", _set("accumulation", "micro_batches", 2), "micro_batches"),
    LoadCase("weight-sum-zero-in-open-window", _set("accumulation", "weight_sum", 0.0), "weight_sum"),
    LoadCase("weight-sum-beyond-float32", _set("accumulation", "weight_sum", 1e300), "weight_sum"),
    LoadCase("weight-sum-nan", _set("accumulation", "weight_sum", math.nan), "weight_sum"),
    LoadCase("skips-negative", _set("consecutive_skips", -2), "consecutive_skips"),
    LoadCase("skips-huge", _set("consecutive_skips", 10**30), "consecutive_skips"),
    LoadCase("perturbed-without-sam", _set("perturbed", True), "perturbed"),
    LoadCase("perturbed-int", _set("perturbed", 1), "perturbed"),
    LoadCase("format", _set("format", 2), "format"),
    LoadCase("format-huge-int", _set("format", 10**5000), "format", file=False),  # JSON refuses > 4300 digits
    LoadCase("optimizer-type", _set("optimizer", "type", "SGD"), "SGD"),
    LoadCase("missing-section", _drop("mask"), "mask"),
]


def _source_state() -> dict:
    return _live(seed=1, calls=11).state_dict()


def _target(case: LoadCase) -> Engine:
    return _train(case.target() if case.target else _full(), 9, 2)


def test_load_case_count():
    ids = [c.id for c in LOAD_CASES]
    assert len(set(ids)) == len(ids)
    print(f"\nrefused-load table: {len(LOAD_CASES)} cases, each through load_state_dict and, "
          f"for {sum(c.file for c in LOAD_CASES)}, through a checkpoint file")


@pytest.mark.parametrize("case", LOAD_CASES, ids=[c.id for c in LOAD_CASES])
def test_refused_state_dict_changes_nothing(case):
    sd = _source_state()
    if case.mutate:
        case.mutate(sd)
    _refused(_target(case), lambda e: e.load_state_dict(sd), StateDictError, case.match, ValueError)


@pytest.mark.parametrize("case", [c for c in LOAD_CASES if c.file], ids=[c.id for c in LOAD_CASES if c.file])
def test_refused_checkpoint_changes_nothing(case, tmp_path):
    sd = _source_state()
    if case.mutate:
        case.mutate(sd)
    path = tmp_path / "ck.safetensors"
    checkpoint._save_tree(str(path), sd, {"epoch": 3})  # the writer stores any tree
    _refused(_target(case), lambda e: at.load(path, e), CheckpointError, str(path), ValueError)


def test_every_part_is_checked_before_the_first_write(monkeypatch):
    """Structural: during a load, no write (buffer, part, counter) precedes the last check."""
    events = []
    e = _live(seed=2)
    sd = _live(seed=1, calls=11).state_dict()

    def spy(cls, name, kind):
        real = getattr(cls, name)

        def wrapped(self, *args, **kwargs):
            events.append((kind, f"{cls.__name__}.{name}"))
            return real(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, wrapped)

    from arraytrain.buffer import FlatBuffer
    for cls in (FlatBuffer,):
        spy(cls, "check", "check")
        spy(cls, "assign", "write")
    for cls in (schedules.Schedule, LossScaler, ErrorFeedback):
        spy(cls, "check_state", "check")
        spy(cls, "apply_state", "write")
    from arraytrain.engine import protocol as engine_state

    for name, kind in (("_check_mask_state", "check"), ("_set_counters", "write")):  # the protocol's functions
        real_fn = getattr(engine_state, name)
        monkeypatch.setattr(engine_state, name, lambda *a, _f=real_fn, _n=name, _k=kind: (
            events.append((_k, f"engine_state.{_n}")), _f(*a))[1])
    e.load_state_dict(sd)
    kinds = [k for k, _ in events]
    assert "write" in kinds and "check" in kinds
    first_write = kinds.index("write")
    assert "check" not in kinds[first_write:], events
    assert {n for k, n in events if k == "write"} >= {"FlatBuffer.assign", "Schedule.apply_state",
                                                      "LossScaler.apply_state", "ErrorFeedback.apply_state",
                                                      "engine_state._set_counters"}


def test_accepted_state_loads_bitwise():
    src = _live(seed=1, calls=11)
    dst = _live(seed=2)
    dst.load_state_dict(src.state_dict())
    assert engine_snapshot(dst) == engine_snapshot(src)
    for e in (src, dst):
        _train(e, 5, 7)
    assert engine_snapshot(dst) == engine_snapshot(src)


def test_a_state_that_aliases_the_engines_buffers_loads_as_if_copied():
    """Sources that view other engine buffers are read before any buffer is written."""
    e = _live(seed=3)
    old_params, old_grads = e.params.flat.copy(), e.grads.flat.copy()
    sd = e.state_dict(copy=False)
    sd["params"], sd["accumulation"]["grads"] = e.grads.as_dict(), e.params.as_dict()  # swapped views
    e.load_state_dict(sd)
    np.testing.assert_array_equal(e.params.flat, old_grads)
    np.testing.assert_array_equal(e.grads.flat, old_params)
    before = engine_snapshot(e)
    e.load_state_dict(e.state_dict(copy=False))  # itself: a no-op
    assert engine_snapshot(e) == before


# == 2. ndarray subclasses ===========================================================================


class _Reshaper(np.ndarray):
    """A subclass whose reshape does not flatten (as np.matrix's does not)."""

    def reshape(self, *args, **kwargs):
        return self


def _sub(cls, a):
    return np.asarray(a).view(cls)


SUBCLASS_REFUSED = [
    # (id, call, error, needles): nothing may be written, even for the names before the bad one
    ("matrix-for-1d-param-last", lambda e: e.step({"W": np.ones((4, 3)), "z": np.zeros(0), "b": np.matrix(np.ones(3))}),
     ShapeMismatchError, ("'b'", "(1, 3)")),
    ("matrix-for-0d-size-param", lambda e: e.step({**_grads(), "z": np.matrix(np.zeros((0, 0)))}), ShapeMismatchError,
     "'z'"),
    ("masked-with-mask", lambda e: e.step({**_grads(), "b": np.ma.array(np.ones(3), mask=[0, 1, 0])}), BackendError,
     ("'b'", "masked")),
    ("masked-without-mask", lambda e: e.step({**_grads(), "b": np.ma.array(np.ones(3))}), BackendError, "'b'"),
    ("masked-2d", lambda e: e.step({**_grads(), "W": np.ma.masked_invalid(np.ones((4, 3)))}), BackendError, "'W'"),
    ("masked-in-hessian", lambda e: e.update_hessian({n: np.ma.array(np.ones(s)) for n, s in SHAPES.items()}),
     BackendError, "'W'"),
    ("masked-in-flatbuffer", lambda e: at.FlatBuffer.from_arrays({"a": np.ma.array(np.ones(2))}), BackendError, "'a'"),
    ("masked-in-engine-params", lambda e: Engine({"a": np.ma.array(np.ones(2))}, SGD()), BackendError, "'a'"),
    ("masked-in-set-mask", lambda e: e.set_mask({"b": np.ma.array(np.ones(3, np.uint8), mask=[0, 1, 0])}),
     BackendError, "'b'"),
]


@pytest.mark.parametrize("case", SUBCLASS_REFUSED, ids=[c[0] for c in SUBCLASS_REFUSED])
def test_subclass_refused_before_anything_is_written(case):
    _, call, exc, match = case
    e = _live(optimizer=Sophia(lr=0.01)) if "hessian" in case[0] else _live()
    _refused(e, call, exc, match)


SUBCLASS_ACCEPTED = {
    "matrix-2d": lambda a: np.matrix(a) if a.ndim == 2 else a,
    "reshape-override": lambda a: _sub(_Reshaper, a),
    "memmap-like": lambda a: _sub(np.memmap, a) if a.size else a,
    "recarray-view-of-float": lambda a: a.view(np.recarray),
}


@pytest.mark.parametrize("wrap", list(SUBCLASS_ACCEPTED))
def test_subclass_read_as_a_plain_array(wrap):
    """Accepted subclasses give bitwise the step a plain array gives."""
    plain, sub = _live(), _live()
    rng = np.random.default_rng(5)
    for _ in range(3):
        g = {n: rng.standard_normal(s) for n, s in SHAPES.items()}
        plain.step(g)
        sub.step({n: SUBCLASS_ACCEPTED[wrap](a) for n, a in g.items()})
    assert engine_snapshot(sub) == engine_snapshot(plain)


def test_subclass_count():
    print(f"\nsubclass table: {len(SUBCLASS_REFUSED)} refused, {len(SUBCLASS_ACCEPTED)} accepted")


# == 4. deep nesting and reference cycles ============================================================


def _deep_list(n):
    x: list = []
    for _ in range(n):
        x = [x]
    return x


def _deep_dict(n):
    x: dict = {}
    for _ in range(n):
        x = {"k": x}
    return x


def _deep_tuple(n):
    x: tuple = ()
    for _ in range(n):
        x = (x,)
    return x


def _cycle_list():
    x: list = [1]
    x.append(x)
    return x


def _cycle_dict():
    x: dict = {"a": 1}
    x["self"] = [{"inner": x}]
    return x


def _good_file(tmp_path):
    path = tmp_path / "good.safetensors"
    at.save(path, _live(seed=1, calls=11))
    return path


def _with_metadata(tmp_path, **fields):
    """The good checkpoint with metadata fields replaced by raw JSON text."""
    from safetensors import safe_open
    good = _good_file(tmp_path)
    with safe_open(str(good), framework="numpy") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta.update(fields)
    path = tmp_path / "edited.safetensors"
    save_file(tensors, str(path), metadata=meta)
    return path


def _deep_json(n, open_="[", close="]"):
    return open_ * n + close * n


NEST_SAVE = [
    ("extra-list-500", lambda: {"x": _deep_list(500)}, ("extra", "nested deeper")),
    ("extra-dict-500", lambda: {"x": _deep_dict(500)}, ("extra", "nested deeper")),
    ("extra-tuple-300", lambda: {"x": _deep_tuple(300)}, ("extra", "nested deeper")),
    ("extra-list-5000", lambda: {"x": _deep_list(5000)}, ("extra", "nested deeper")),
    ("extra-just-too-deep", lambda: {"x": _deep_list(checkpoint.format.MAX_DEPTH - 1)}, ("extra", "nested deeper")),
    ("extra-self-list", lambda: {"x": _cycle_list()}, ("extra['x']", "contains itself")),
    ("extra-self-dict", _cycle_dict, ("extra['self'][0]['inner']", "contains itself")),
    ("extra-is-its-own-value", lambda: (lambda d: (d.__setitem__("me", d), d)[1])({}), ("extra['me']", "itself")),
]


@pytest.mark.parametrize("case", NEST_SAVE, ids=[c[0] for c in NEST_SAVE])
def test_deep_or_cyclic_extra_is_refused_before_writing(case, tmp_path):
    _, make, match = case
    path = tmp_path / "ck.safetensors"
    _refused(_live(), lambda e: at.save(path, e, extra=make()), at.ArgumentTypeError, match, TypeError)
    assert os.listdir(tmp_path) == []


def test_nesting_up_to_the_bound_round_trips(tmp_path):
    """The neighbour that must pass: extra as deep as allowed (the root mapping is one level, a tuple two)."""
    path = tmp_path / "ck.safetensors"
    e = _live()
    extra = {"x": _deep_list(checkpoint.format.MAX_DEPTH - 2), "t": _deep_tuple((checkpoint.format.MAX_DEPTH - 3) // 2)}
    at.save(path, e, extra=extra)
    assert at.load(path, _live(seed=4)) == extra


NEST_LOAD = [
    ("tree-list-500", dict(tree='{"params": ' + _deep_json(500) + "}")),
    ("tree-dict-500", dict(tree='{"params": ' + '{"a":' * 500 + "1" + "}" * 500 + "}")),
    ("tree-tuple-tags-200", dict(tree='{"params": ' + '{"$tuple":[' * 200 + "]}" * 200 + "}")),
    ("tree-malformed-deep-tag", dict(tree='{"params": {"$array": ' + _deep_json(900) + "}}")),
    ("tree-list-100000", dict(tree='{"params": ' + _deep_json(100000) + "}")),
    ("extra-list-500", dict(extra='{"x": ' + _deep_json(500) + "}")),
    ("extra-dict-3000", dict(extra='{"x": ' + '{"a":' * 3000 + "1" + "}" * 3000 + "}")),
    ("tree-just-too-deep", dict(tree='{"params": ' + _deep_json(checkpoint.format.MAX_DEPTH) + "}")),
    ("extra-just-too-deep", dict(extra='{"x": ' + _deep_json(checkpoint.format.MAX_DEPTH) + "}")),
]


@pytest.mark.parametrize("case", NEST_LOAD, ids=[c[0] for c in NEST_LOAD])
def test_deep_metadata_is_refused(case, tmp_path):
    path = _with_metadata(tmp_path, **case[1])
    _refused(_live(), lambda e: at.load(path, e), CheckpointError, str(path), ValueError)


def _nested_schedule(depth):
    s = schedules.Constant()
    for _ in range(depth - 1):
        s = schedules.Warmup(1, s)
    return s


def _deep_schedule_state(depth):
    state = schedules.Constant().state_dict()
    for _ in range(depth - 1):
        state = {"type": "Warmup", "format": 2, "steps": 1, "then": state, "start_factor": 0.0}
    return state


NEST_SCHEDULE = [
    ("construct-33", lambda e: _nested_schedule(schedules.MAX_NESTING + 1), HyperparameterError, "nest at most"),
    ("construct-sequential-33", lambda e: schedules.Sequential([(_nested_schedule(schedules.MAX_NESTING), 2),
                                                                 (schedules.Constant(), None)]),
     HyperparameterError, "segments[0]"),
    ("from-state-dict-33", lambda e: schedules.from_state_dict(_deep_schedule_state(schedules.MAX_NESTING + 1)),
     StateDictError, "nest at most"),
    ("from-state-dict-3000", lambda e: schedules.from_state_dict(_deep_schedule_state(3000)), StateDictError,
     "nest at most"),
    ("engine-load-3000", lambda e: e.load_state_dict({**e.state_dict(), "schedule": _deep_schedule_state(3000)}),
     StateDictError, "schedule"),
    ("engine-load-deep-garbage", lambda e: e.load_state_dict({**e.state_dict(), "schedule": _deep_dict(3000)}),
     StateDictError, "schedule"),
]


@pytest.mark.parametrize("case", NEST_SCHEDULE, ids=[c[0] for c in NEST_SCHEDULE])
def test_deep_schedules_are_refused(case):
    _, call, exc, match = case
    _refused(_live(), call, exc, match)


def test_schedules_nested_to_the_bound_save_and_load(tmp_path):
    deepest = schedules.Sequential([(_nested_schedule(schedules.MAX_NESTING - 1), 2), (schedules.Constant(), None)])
    assert deepest._depth() == schedules.MAX_NESTING
    src = _live(schedule=deepest)
    path = tmp_path / "ck.safetensors"
    at.save(path, src)
    dst = _live(seed=5, schedule=schedules.Sequential([(_nested_schedule(schedules.MAX_NESTING - 1), 2),
                                                       (schedules.Constant(), None)]))
    at.load(path, dst)
    assert engine_snapshot(dst) == engine_snapshot(src)


def test_nesting_count():
    print(f"\nnesting table: {len(NEST_SAVE)} save, {len(NEST_LOAD)} load, {len(NEST_SCHEDULE)} schedule cases")


# == 5. counters bounded to what the code computes with ==============================================

COUNTER_CASES = [
    ("step-10**400-then-step", lambda e: e.load_state_dict(_with_step(e, 10**400)), StateDictError, "optimizer step"),
    ("step-2**53+1", lambda e: e.load_state_dict(_with_step(e, MAX_COUNT + 1)), StateDictError, "optimizer step"),
    ("step-10**5000", lambda e: e.load_state_dict(_with_step(e, 10**5000)), StateDictError, ("optimizer step", "bits")),
    ("plateau-last-epoch", lambda e: e.load_state_dict(_with(e, "schedule", "last_epoch", 10**20)), StateDictError,
     "last_epoch"),
    ("plateau-num-reductions", lambda e: e.load_state_dict(_with(e, "schedule", "num_reductions", 2**60)),
     StateDictError, "num_reductions"),
    ("warmup-steps", lambda e: e.load_state_dict(_with(e, "schedule", "inner", "steps", 10**400)), StateDictError,
     "steps"),
    ("compression-step", lambda e: e.load_state_dict(_with(e, "compression", "step", MAX_COUNT + 1)),
     StateDictError, "compression step"),
    ("skips", lambda e: e.load_state_dict(_with(e, "consecutive_skips", 10**400)), StateDictError, "consecutive_skips"),
    ("schedule-call-step", lambda e: e.schedule(10**400, 0.1), HyperparameterError, "step"),
    ("schedule-constructor", lambda e: schedules.CosineAnnealingLR(10**400), HyperparameterError, "T_max"),
    ("multistep-milestone", lambda e: schedules.MultiStepLR([2, 10**400]), HyperparameterError, "milestones[1]"),
    ("weight-int-10**400", lambda e: e.step(_grads(), weight=10**400), HyperparameterError, "weight"),
    ("observe-step", lambda e: e.schedule.observe(1.0, step=10**400), HyperparameterError, "step"),
    ("predictor-steps", lambda e: _predictor_load(10**400), StateDictError, "steps[0]"),
]


def _with(e, *path_and_value):
    sd = e.state_dict()
    _set(*path_and_value)(sd)
    return sd


def _with_step(e, value):
    return _with(e, "optimizer", "step", value)


def _predictor_load(step):
    p = at.GradientPredictor(Layout({"a": (3,)}), history=2)
    sd = p.state_dict()
    sd["steps"] = [step, 0]
    sd["count"], sd["head"] = 1, 1
    p.load_state_dict(sd)


@pytest.mark.parametrize("case", COUNTER_CASES, ids=[c[0] for c in COUNTER_CASES])
def test_counters_are_bounded(case):
    _, call, exc, match = case
    _refused(_live(), call, exc, match)


def test_counters_at_the_bound_are_accepted_and_step():
    """The neighbour: a step count of 2**53 loads and steps (Adam's b**t underflows to 0); past the
    bound the schedule refuses the next call, typed, before anything is written."""
    e = _live()
    sd = e.state_dict()
    sd["optimizer"]["step"] = MAX_COUNT
    sd["compression"]["step"] = MAX_COUNT
    e.load_state_dict(sd)
    report = e.step(_grads(e.loss_scale))  # the window's second micro-batch: applied
    assert report.applied and report.step == MAX_COUNT + 1
    assert np.isfinite(e.params.flat).all()
    before = engine_snapshot(e)
    with pytest.raises(HyperparameterError, match="step"):
        e.step(_grads(e.loss_scale))
    assert engine_snapshot(e) == before


def test_a_file_with_a_huge_step_is_refused(tmp_path):
    sd = _live(seed=1).state_dict()
    sd["optimizer"]["step"] = 10**400
    path = tmp_path / "ck.safetensors"
    checkpoint._save_tree(str(path), sd, None)
    _refused(_live(), lambda e: at.load(path, e), CheckpointError, ("optimizer step", str(path)), ValueError)


def test_counter_count():
    print(f"\ncounter table: {len(COUNTER_CASES)} cases")


# == 6. duplicate keys in the safetensors header ====================================================


def _raw(path) -> tuple[str, bytes]:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return data[8:8 + n].decode(), data[8 + n:]


def _write_raw(path, header: str, body: bytes):
    h = header.encode()
    h += b" " * (-(8 + len(h)) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + body)
    return path


def _first_tensor(header: str) -> tuple[str, dict]:
    obj = json.loads(header)
    key = next(k for k in obj if k != "__metadata__")
    return key, obj[key]


def _dup_metadata_key(header):
    # a first "tree" that would load as another state; safetensors keeps the last one
    return header.replace('"__metadata__":{', '"__metadata__":{"tree":"{}",', 1)


def _dup_tensor_other_dtype(header):
    key, entry = _first_tensor(header)
    liar = dict(entry, dtype="I32" if entry["dtype"] == "F32" else "F32")
    return "{" + json.dumps(key) + ":" + json.dumps(liar) + "," + header[1:]


def _dup_field_in_entry(header):
    key, entry = _first_tensor(header)
    text = json.dumps(key) + ":{"
    i = header.index(text) + len(text)
    return header[:i] + '"dtype":"I32",' + header[i:]


def _dup_metadata_block(header):
    return '{"__metadata__":{"format":"other"},' + header[1:]


def _dup_extra_key(header):
    obj = json.loads(header)
    obj["__metadata__"]["extra"] = '{"epoch": 1, "epoch": 2}'
    return json.dumps(obj)


# (id, edit of the header text, what the message says): safetensors itself refuses a duplicate
# field of its own structures; a duplicate tensor entry or metadata key it takes, last one winning
DUPLICATES = [
    ("metadata-key", _dup_metadata_key, "declares 'tree' twice"),
    ("tensor-entry-other-dtype", _dup_tensor_other_dtype, r"declares \"0:params\['W'\]\" twice"),
    ("field-in-entry", _dup_field_in_entry, "duplicate field `dtype`"),
    ("metadata-block", _dup_metadata_block, "duplicate field `__metadata__`"),
    ("key-inside-extra-json", _dup_extra_key, "'extra' is not valid JSON: duplicate key"),
]


@pytest.mark.parametrize("case", DUPLICATES, ids=[c[0] for c in DUPLICATES])
def test_duplicate_header_keys_are_refused(case, tmp_path):
    _, edit, match = case
    header, body = _raw(_good_file(tmp_path))
    path = _write_raw(tmp_path / "dup.safetensors", edit(header), body)
    _refused(_live(), lambda e: at.load(path, e), CheckpointError, str(path), ValueError)
    with pytest.raises(CheckpointError, match=match):
        at.load(path, _live())


def test_rewritten_header_without_duplicates_still_loads(tmp_path):
    """The neighbour: the same byte surgery without a duplicate is accepted (the test edits are sound)."""
    header, body = _raw(_good_file(tmp_path))
    path = _write_raw(tmp_path / "same.safetensors", json.dumps(json.loads(header)), body)
    src = _live(seed=1, calls=11)
    dst = _live(seed=4)
    at.load(path, dst)
    assert engine_snapshot(dst) == engine_snapshot(src)


def test_duplicate_count():
    print(f"\nduplicate-key table: {len(DUPLICATES)} cases")


# == 7. micro-batch weights ==========================================================================

WEIGHTS = [
    # (id, dtype, weights of the window's calls, needles): the last call is the refused one
    ("subnormal-f32", np.float32, [1e-40], "weight"),
    ("denormal-min-f64", np.float64, [5e-324], "weight"),
    ("tiny-1e-320-f64", np.float64, [1e-320], "weight"),
    ("above-max-f32", np.float32, [1e300], "weight"),
    ("just-above-max-f32", np.float32, [float(np.finfo(np.float32).max) * 1.0000001], "weight"),
    ("inf", np.float64, [math.inf], "weight"),
    ("nan", np.float32, [math.nan], "weight"),
    ("negative", np.float32, [-1.0], "weight"),
    ("zero", np.float64, [0.0], "weight"),
    ("bool", np.float32, [True], "weight"),
    ("str", np.float32, ["2"], "weight"),
    ("huge-int", np.float64, [10**400], "weight"),
    ("window-sum-times-scale-f64", np.float64, [4e302, 4e302], ("weight", "sum", "loss scale")),
    ("window-sum-times-scale-f32", np.float32, [1e33, 1e33], ("weight", "sum", "loss scale")),
    ("huge-after-a-normal-one", np.float32, [1.0, 1e39], "weight"),
]


def _weight_engine(dtype, accumulation=3):
    return Engine({n: np.ones(s, dtype) for n, s in SHAPES.items()}, Adam(lr=0.1), accumulation_steps=accumulation,
                  loss_scaler=LossScaler(init_scale=2.0**16))


@pytest.mark.parametrize("zero_copy", [False, True], ids=["grads", "zero-copy"])
@pytest.mark.parametrize("case", WEIGHTS, ids=[c[0] for c in WEIGHTS])
def test_weights_outside_the_dtype_are_refused(case, zero_copy):
    _, dtype, weights, match = case
    e = _weight_engine(dtype)
    for w in weights[:-1]:
        e.step(None if zero_copy else _grads(), weight=w)
    before = engine_snapshot(e)
    with pytest.raises(HyperparameterError) as info:
        e.step(None if zero_copy else _grads(), weight=weights[-1])
    _assert_typed(info, ValueError, match)
    assert engine_snapshot(e) == before


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_weights_at_the_dtype_edges_are_exact(dtype):
    """The neighbours: the smallest normal weight, and the largest whose window sum keeps the mean's
    factor normal, give bitwise the step weight 1 gives (powers of two: every product is exact)."""
    tiny = float(np.finfo(dtype).tiny)
    ref = Engine({"w": np.ones(3, dtype)}, SGD(lr=0.5), accumulation_steps=2)
    for _ in range(2):
        ref.step({"w": np.full(3, 0.25)})
    for w in (tiny, 1.0 / tiny / 2):
        e = Engine({"w": np.ones(3, dtype)}, SGD(lr=0.5), accumulation_steps=2)
        for _ in range(2):
            e.step({"w": np.full(3, 0.25)}, weight=w)
        assert engine_snapshot(e) == engine_snapshot(ref), w


def test_weight_count():
    print(f"\nweight table: {len(WEIGHTS)} cases x 2 paths")


# == 8. threads =====================================================================================


class _Gate(schedules.Schedule):
    """A schedule that, when armed, holds the calling thread inside step() until released."""

    def __init__(self):
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def _lr(self, step, base):
        if self.armed:
            self.armed = False
            self.entered.set()
            assert self.release.wait(30)
        return base


def _gated():
    e = Engine({n: np.zeros(s, np.float32) for n, s in SHAPES.items()}, Adam(lr=0.1), schedule=_Gate(),
               accumulation_steps=2)
    _train_plain(e, 3)
    return e


def _train_plain(e, calls, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(calls):
        e.step({n: rng.standard_normal(s) for n, s in SHAPES.items()})


def _other_calls(tmp_path):
    path = tmp_path / "busy.safetensors"
    return [
        ("step", lambda e: e.step(_grads())),
        ("step-zero-copy", lambda e: e.step()),
        ("load_state_dict", lambda e: e.load_state_dict(_gated().state_dict())),
        ("state_dict", lambda e: e.state_dict()),
        ("set_mask", lambda e: e.set_mask(MASK)),
        ("zero_grad", lambda e: e.zero_grad()),
        ("observe", lambda e: e.observe(1.0)),
        ("save", lambda e: at.save(path, e)),
        ("load", lambda e: at.load(path, e)),
    ]


def test_a_second_thread_is_refused_and_changes_nothing(tmp_path):
    e, twin = _gated(), _gated()
    at.save(tmp_path / "busy.safetensors", twin)
    saved = (tmp_path / "busy.safetensors").read_bytes()
    grads = _grads()
    e.schedule.armed = True
    worker = threading.Thread(target=e.step, args=(grads,), name="trainer")
    worker.start()
    try:
        assert e.schedule.entered.wait(30)
        for what, call in _other_calls(tmp_path):
            with pytest.raises(ConcurrentUseError) as info:
                call(e)
            _assert_typed(info, RuntimeError, ("busy", "'trainer'", "thread-safe"))
    finally:
        e.schedule.release.set()
        worker.join(30)
    assert (tmp_path / "busy.safetensors").read_bytes() == saved
    twin.step(grads)  # the one call that ran
    assert engine_snapshot(e) == engine_snapshot(twin)
    e.step(_grads())  # free again


def test_two_threads_stepping_never_corrupt_silently():
    """Every call either completes or raises ConcurrentUseError; the result is the serial replay."""
    n = 300_000
    e = Engine({"w": np.zeros(n, np.float32)}, SGD(lr=0.01))
    g = {"w": np.full(n, 0.5, np.float32)}
    done, refused = [0, 0], [0, 0]
    start = threading.Barrier(2)

    def run(k):
        start.wait()
        for _ in range(60):
            try:
                e.step(g)
                done[k] += 1
            except ConcurrentUseError:
                refused[k] += 1

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    serial = Engine({"w": np.zeros(n, np.float32)}, SGD(lr=0.01))
    for _ in range(sum(done)):
        serial.step(g)
    assert e.state.step == sum(done) and sum(done) + sum(refused) == 120
    assert engine_snapshot(e) == engine_snapshot(serial)
    print(f"\nthreads: {sum(done)} steps ran, {sum(refused)} refused with ConcurrentUseError")


def test_same_thread_nesting_is_allowed():
    """save() holds the guard and calls state_dict(): one thread may nest calls."""
    e = _gated()
    with e.exclusive("outer"):
        e.state_dict()
        e.step(_grads())


# == 9. untyped errors that escaped ==================================================================


class _DLPack:
    def __init__(self, device=(1, 0), export=None, device_error=None):
        self._device, self._export, self._device_error = device, export, device_error

    def __dlpack_device__(self):
        if self._device_error:
            raise self._device_error
        return self._device

    def __dlpack__(self, **kwargs):
        raise self._export


class _BrokenProperty:
    @property
    def __dlpack_device__(self):
        raise RuntimeError("driver gone")


class _BrokenCuda:
    @property
    def __cuda_array_interface__(self):
        raise ValueError("stream closed")


class _BrokenArrayInterface:
    @property
    def __array_interface__(self):
        raise KeyError("data")


UNTYPED = [
    ("kernels-cuda", lambda e: Engine({"a": np.ones(2)}, SGD(), kernels="cuda"), HyperparameterError,
     ("kernels", "'cuda'"), ValueError),
    ("kernels-typo", lambda e: Engine({"a": np.ones(2)}, SGD(), kernels="numbaa"), HyperparameterError, "kernels",
     ValueError),
    ("kernels-none", lambda e: Engine({"a": np.ones(2)}, SGD(), kernels=None), HyperparameterError, "kernels",
     ValueError),
    ("dlpack-attribute-error", lambda e: e.step({**_grads(), "b": _DLPack(export=AttributeError("no data"))}),
     BackendError, ("'b'", "no data"), TypeError),
    ("dlpack-key-error", lambda e: e.step({**_grads(), "b": _DLPack(export=KeyError("x"))}), BackendError, "'b'",
     TypeError),
    ("dlpack-device-attribute-error", lambda e: e.step({**_grads(), "b": _DLPack(device_error=AttributeError("x"))}),
     BackendError, "'b'", TypeError),
    ("dlpack-property-raises", lambda e: e.step({**_grads(), "b": _BrokenProperty()}), BackendError,
     ("'b'", "driver gone"), TypeError),
    ("cuda-interface-property-raises", lambda e: e.step({**_grads(), "b": _BrokenCuda()}), BackendError,
     ("'b'", "stream closed"), TypeError),
    ("array-interface-raises", lambda e: e.step({**_grads(), "b": _BrokenArrayInterface()}), BackendError, "'b'",
     TypeError),
    ("dlpack-in-load-state-dict", lambda e: e.load_state_dict(_with(e, "params", "b", _DLPack(export=AttributeError()))),
     StateDictError, "'b'", ValueError),
    ("layout-shape-unknown", lambda e: e.layout.shape("nope"), UnknownParameterError, "'nope'", KeyError),
    ("layout-slice-unknown", lambda e: e.layout.slice("nope"), UnknownParameterError, "'nope'", KeyError),
    ("check-number-huge-int", lambda e: e.step(_grads(), weight=-(10**5000)), HyperparameterError, "weight",
     ValueError),
    ("perturbed-huge-int", lambda e: e.load_state_dict(_with(e, "perturbed", 10**5000)), StateDictError,
     ("perturbed", "bits"), ValueError),
    ("schedule-type-huge-int", lambda e: schedules.from_state_dict({"type": 10**5000}), StateDictError,
     "schedule.type", ValueError),
]


@pytest.mark.parametrize("case", UNTYPED, ids=[c[0] for c in UNTYPED])
def test_errors_are_typed(case):
    _, call, exc, match, builtin = case
    _refused(_live(), call, exc, match, builtin)


def test_untyped_count():
    print(f"\nuntyped-error table: {len(UNTYPED)} cases")


# == 3. temporary files of crashed saves ============================================================

SAVER = """
import sys
import time

import numpy as np

import arraytrain.checkpoint as checkpoint
from arraytrain import Engine, save
from arraytrain.optim import Adam

path, i, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]


def report(phase):  # each phase a save reaches, on stdout; the phase named ``stop`` blocks
    print(phase, flush=True)
    if phase == stop:
        time.sleep(600)


checkpoint._phase_hook = report
e = Engine({"w": np.zeros(1 << 20, np.float32), "b": np.zeros(7, np.float32)}, Adam(lr=0.1))
print("ready", flush=True)
while True:
    i += 1
    for name in e.params:
        e.params[name][...] = i
    save(path, e, extra={"i": i})
"""

def _strays(directory, name):
    return sorted(x for x in os.listdir(directory) if x != name)


def _saver(ck, last: int, stop: str = ""):
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(at.__file__)),
                                                       os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(ck), str(last), stop], stdout=subprocess.PIPE,
                            env=env, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _kill(proc) -> list:
    """SIGKILL the writer; return the phases it reported."""
    import signal

    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    phases = proc.stdout.read().split()
    proc.stdout.close()
    return phases


def _check_after_kill(tmp_path, ck, e, last: int) -> int:
    """At most one leftover, named as a work directory; the checkpoint loads whole; return its ``i``."""
    strays = _strays(tmp_path, ck.name)
    assert len(strays) <= 1, strays  # at most the killed writer's own work directory, or the one it was removing
    assert all(x.startswith(f".{ck.name}.") and x.endswith(".tmp") for x in strays), strays
    if not ck.exists():
        assert last == 0  # killed before the first save finished
        return last
    extra = at.load(ck, e)
    assert extra["i"] >= last  # never goes back
    assert all((v == extra["i"]).all() for v in e.params.as_dict().values())  # never a mix of two saves
    return extra["i"]


def _fresh_engine():
    return Engine({"w": np.zeros(1 << 20, np.float32), "b": np.zeros(7, np.float32)}, Adam(lr=0.1))


@pytest.mark.slow  # the slow tier: kills at random instants (each phase is killed deterministically below)
def test_killed_saves_always_leave_a_loadable_checkpoint_and_no_pile_of_temporaries(tmp_path):
    """A process saving in a loop is SIGKILLed at random moments, 20 times.

    Every other kill is timed from the first save's start, a few milliseconds, so
    that kills land inside the cleanup of what the previous kill left (which only
    the first save of each writer has to do); the others anywhere in the first 0.4 s.
    """
    import time

    ck = tmp_path / "ck.safetensors"
    rng = np.random.default_rng(11)
    e = _fresh_engine()
    last, mid_save, in_cleanup = 0, 0, 0
    deadline = time.monotonic() + 240
    for kill in range(20):
        assert time.monotonic() < deadline, f"only {kill} kills in the time bound"
        had_leftover = bool(_strays(tmp_path, ck.name))
        proc, seen = _saver(ck, last), []
        try:
            if kill % 2 and had_leftover:
                seen.append(proc.stdout.readline().strip())
                assert seen == ["start"]
                time.sleep(rng.uniform(0.0, 0.003))
            else:
                time.sleep(rng.uniform(0.0, 0.4))
        finally:
            phases = seen + _kill(proc)
        last = _check_after_kill(tmp_path, ck, e, last)
        mid_save += bool(_strays(tmp_path, ck.name))
        in_cleanup += had_leftover and "write" not in phases and phases[-1:] in (["start"], ["stale-emptied"])
    at.save(ck, e)  # a clean save after the last crash removes its leftovers
    assert _strays(tmp_path, ck.name) == []
    print(f"\ncrash test: 20 kills, {mid_save} left a work directory, {in_cleanup} inside the cleanup of an "
          f"older one, last checkpoint i={last}")
    assert mid_save >= 1  # the kills did land inside saves


#: The phases a writer is stopped at, in order, with the leftovers expected after its kill:
#: each stop starts a new writer on what the previous kill left.
PHASE_KILLS = [
    ("start", 0),          # the very first save, before its work directory exists: nothing left
    ("write", 1),          # its work directory, with a partial file
    ("start", 1),          # the next save, before it cleans up: the previous one is still there
    ("stale-emptied", 1),  # inside the cleanup: the older directory emptied, not yet removed
    ("write", 1),          # the emptied one gone, the own one made
    ("rename", 1),         # written, fsynced, not yet renamed
    ("renamed", 1),        # renamed over the target: the own (empty) work directory remains
    ("own-emptied", 1),    # the own work directory being removed
    ("done", 0),           # a whole save
]


def test_a_save_killed_at_each_phase_leaves_at_most_one_leftover(tmp_path):
    """Deterministic twin of the random crash test: a hook blocks the writer at a named phase."""
    ck = tmp_path / "ck.safetensors"
    e = _fresh_engine()
    last = 0
    for stop, leftovers in PHASE_KILLS:
        proc = _saver(ck, last, stop)
        try:
            while (line := proc.stdout.readline().strip()) != stop:
                assert line, f"the writer ended before reaching {stop!r}"
        finally:
            _kill(proc)
        saved = last
        last = _check_after_kill(tmp_path, ck, e, last)
        assert len(_strays(tmp_path, ck.name)) == leftovers, (stop, _strays(tmp_path, ck.name))
        # the file is replaced at the rename, no earlier: before it the previous save is what loads
        assert last == saved + (stop in ("renamed", "own-emptied", "done")), stop
    at.save(ck, e)
    assert _strays(tmp_path, ck.name) == []
    print(f"\ncrash phases: {len(PHASE_KILLS)} kills, one at each phase")


def _stale_dir(directory, name, files=("checkpoint.safetensors", ".tmpAbC123")):
    d = directory / f".{name}.{os.urandom(8).hex()}.tmp"
    d.mkdir()
    for f in files:
        (d / f).write_bytes(b"x" * 100)
    return d


STALE = [
    # (id, make the entry, removed by the next save?)
    ("crashed-work-dir", lambda t: _stale_dir(t, "ck.safetensors"), True),
    ("crashed-empty-work-dir", lambda t: _stale_dir(t, "ck.safetensors", ()), True),
    ("older-version-temp-file", lambda t: (t / f".ck.safetensors.{os.urandom(8).hex()}.tmp").write_bytes(b"x"), True),
    ("other-target", lambda t: _stale_dir(t, "other.safetensors"), False),
    ("not-16-hex", lambda t: (t / ".ck.safetensors.abc.tmp").mkdir(), False),
    ("upper-case-hex", lambda t: (t / f".ck.safetensors.{os.urandom(8).hex().upper()}.tmp").mkdir(), False),
    ("other-suffix", lambda t: (t / f".ck.safetensors.{os.urandom(8).hex()}.tmp2").mkdir(), False),
    ("user-file", lambda t: (t / "notes.txt").write_text("keep"), False),
    ("symlink-named-like-one", lambda t: os.symlink(_victim(t), t / f".ck.safetensors.{os.urandom(8).hex()}.tmp"),
     False),
]


def _victim(t):
    v = t / "victim"
    v.mkdir(exist_ok=True)
    (v / "data").write_text("precious")
    return v


@pytest.mark.parametrize("case", STALE, ids=[c[0] for c in STALE])
def test_a_save_removes_only_crashed_saves_of_its_target(case, tmp_path):
    _, make, removed = case
    ck = tmp_path / "ck.safetensors"
    make(tmp_path)
    before = set(os.listdir(tmp_path))
    at.save(ck, _live())
    after = set(os.listdir(tmp_path)) - {ck.name}
    assert after == (before - {x for x in before if x.startswith(".ck.safetensors.") and removed})
    if os.path.isdir(tmp_path / "victim"):
        assert (tmp_path / "victim" / "data").read_text() == "precious"


def test_a_live_save_is_left_alone(tmp_path):
    """A work directory whose lock is held (a save in progress elsewhere) survives; once released it goes."""
    ck = tmp_path / "ck.safetensors"
    live = _stale_dir(tmp_path, "ck.safetensors")
    fd = checkpoint._lock(str(live))
    try:
        at.save(ck, _live())
        assert live.exists()
    finally:
        os.close(fd)
    at.save(ck, _live())
    assert not live.exists() and os.listdir(tmp_path) == [ck.name]


def test_stale_count():
    print(f"\nstale-temporary table: {len(STALE)} cases, and 20 kills")
