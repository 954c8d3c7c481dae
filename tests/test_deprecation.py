"""Old spellings of the public API: each still works for one release, warns, and means the new one.

Every case names the old spelling, builds with it under ``pytest.warns`` (the warning must
name the new spelling and point at the caller's line), and compares the result with the
same thing built the new way. The project's own code and tests never warn: conftest.py
turns arraytrain's deprecation warnings into errors in every test, and
:func:`test_the_project_uses_no_old_spelling` scans the code no test runs (benchmarks,
examples).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import warnings
from pathlib import Path

import numpy as np
import pytest

import arraytrain as at
from arraytrain import AccumulationConfig, Engine, HyperparameterError, optim, schedules
from arraytrain.optim import LAMB, SGD, Adafactor, Adagrad, Adam, AdamW, Lion, RMSprop, Sophia

ROOT = Path(__file__).resolve().parents[1]


def _same(a, b):
    """Two optimizers, schedules or configs built alike."""
    if hasattr(a, "hyperparameters"):
        return type(a) is type(b) and a.hyperparameters() == b.hyperparameters()
    if hasattr(a, "state_dict"):
        return type(a) is type(b) and a.state_dict() == b.state_dict()
    return a == b


# (id, old spelling, new spelling, a fragment of the warning: the new name)
CONSTRUCTORS = [
    ("lion-b1-b2", lambda: Lion(b1=0.5, b2=0.9), lambda: Lion(betas=(0.5, 0.9)), "betas="),
    ("lion-b1", lambda: Lion(lr=1e-3, b1=0.5), lambda: Lion(lr=1e-3, betas=(0.5, 0.99)), "betas="),
    ("lion-positional", lambda: Lion(1e-3, 0.5, 0.9, 0.1, True), lambda: Lion(1e-3, (0.5, 0.9), 0.1, maximize=True),
     "betas="),
    ("lamb-b1-b2", lambda: LAMB(b1=0.8, b2=0.9), lambda: LAMB(betas=(0.8, 0.9)), "betas="),
    ("lamb-positional", lambda: LAMB(1e-3, 0.8, 0.9, 1e-5, 1e-8, 0.01),
     lambda: LAMB(1e-3, (0.8, 0.9), 1e-5, 0.01, eps_root=1e-8), "keyword arguments"),
    ("adam-positional-state-dtype", lambda: Adam(1e-3, (0.9, 0.99), 1e-8, 0.0, False, "bfloat16", True),
     lambda: Adam(1e-3, (0.9, 0.99), state_dtype="bfloat16", maximize=True), "keyword arguments"),
    ("adamw-positional-state-dtype", lambda: AdamW(1e-3, (0.9, 0.99), 1e-8, 0.1, False, "bfloat16"),
     lambda: AdamW(1e-3, (0.9, 0.99), weight_decay=0.1, state_dtype="bfloat16"), "keyword arguments"),
    ("sgd-positional-maximize", lambda: SGD(0.1, 0.9, 0.0, 0.0, False, True),
     lambda: SGD(0.1, 0.9, maximize=True), "keyword arguments"),
    ("adagrad-positional-maximize", lambda: Adagrad(0.1, 0.0, 0.0, 0.0, 1e-10, True),
     lambda: Adagrad(0.1, maximize=True), "keyword arguments"),
    ("rmsprop-positional-maximize", lambda: RMSprop(0.1, 0.9, 1e-8, 0.0, 0.0, False, True),
     lambda: RMSprop(0.1, 0.9, maximize=True), "keyword arguments"),
    ("adafactor-positional-maximize", lambda: Adafactor(0.1, -0.8, (None, 1e-3), 1.0, 0.0, True),
     lambda: Adafactor(0.1, maximize=True), "keyword arguments"),
    ("sophia-positional-eps-bs", lambda: Sophia(1e-4, (0.9, 0.99), 0.04, 0.1, 1e-12, 100),
     lambda: Sophia(1e-4, (0.9, 0.99), 0.04, 0.1, eps=1e-12, bs=100), "keyword arguments"),
    ("cosine-min-lr", lambda: schedules.CosineAnnealingLR(10, min_lr=0.1),
     lambda: schedules.CosineAnnealingLR(10, eta_min=0.1), "eta_min="),
    ("cosine-total-steps", lambda: schedules.CosineAnnealingLR(total_steps=10),
     lambda: schedules.CosineAnnealingLR(T_max=10), "T_max="),
    ("linear-total-steps", lambda: schedules.LinearLR(total_steps=5, start_factor=0.5),
     lambda: schedules.LinearLR(total_iters=5, start_factor=0.5), "total_iters="),
    ("polynomial-total-steps", lambda: schedules.PolynomialLR(total_steps=5, power=2.0),
     lambda: schedules.PolynomialLR(5, power=2.0), "total_iters="),
    ("onecycle-anneal", lambda: schedules.OneCycleLR(10, anneal="linear"),
     lambda: schedules.OneCycleLR(10, anneal_strategy="linear"), "anneal_strategy="),
    ("config-normalize-false", lambda: AccumulationConfig(normalize=False),
     lambda: AccumulationConfig(reduction="sum"), "reduction="),
    ("config-normalize-true", lambda: AccumulationConfig(2, normalize=True, max_grad_norm=1.0),
     lambda: AccumulationConfig(2, "mean", 1.0), "reduction="),
    ("config-positional-normalize", lambda: AccumulationConfig(4, False, 1.0),
     lambda: AccumulationConfig(4, "sum", 1.0), "reduction="),
]


@pytest.mark.parametrize("name, old, new, fragment", CONSTRUCTORS, ids=[c[0] for c in CONSTRUCTORS])
def test_an_old_argument_warns_and_means_the_new_one(name, old, new, fragment):
    with pytest.warns(DeprecationWarning, match="deprecated") as record:
        got = old()
    assert any(fragment in str(w.message) for w in record), [str(w.message) for w in record]
    assert all(w.filename == __file__ for w in record), "the warning points at the caller's line"
    assert _same(got, new())


# the class names that shipped before torch's were adopted
OLD_SCHEDULES = {"MultiStep": "MultiStepLR", "Exponential": "ExponentialLR", "Linear": "LinearLR",
                 "Cosine": "CosineAnnealingLR", "CosineWarmRestarts": "CosineAnnealingWarmRestarts",
                 "Polynomial": "PolynomialLR", "OneCycle": "OneCycleLR", "ReduceOnPlateau": "ReduceLROnPlateau"}


@pytest.mark.parametrize("old, new", OLD_SCHEDULES.items())
def test_an_old_schedule_name_warns_and_is_the_new_class(old, new):
    with pytest.warns(DeprecationWarning, match=f"schedules.{old} is deprecated.*schedules.{new}") as record:
        cls = getattr(schedules, old)
    assert record[0].filename == __file__
    assert cls is getattr(schedules, new)
    assert old not in schedules.__all__ and old not in dir(schedules)
    scope: dict = {}
    with pytest.warns(DeprecationWarning):
        exec(f"from arraytrain.schedules import {old} as imported", scope)
    assert scope["imported"] is cls
    assert schedules.RENAMED == OLD_SCHEDULES


# the callback names that shipped before (their old name is a schedule's)
OLD_CALLBACKS = {"ReduceLROnPlateau": "ReduceLROnPlateauCallback"}


@pytest.mark.parametrize("module", ["arraytrain.nn", "arraytrain.nn.callbacks"])
@pytest.mark.parametrize("old, new", OLD_CALLBACKS.items())
def test_an_old_callback_name_warns_and_is_the_new_class(module, old, new):
    import importlib

    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=f"{module}.{old} is deprecated.*{module}.{new}") as record:
        cls = getattr(mod, old)
    assert record[0].filename == __file__
    assert cls is getattr(mod, new) and cls is at.nn.ReduceLROnPlateauCallback
    assert cls is not schedules.ReduceLROnPlateau
    assert old not in getattr(mod, "__all__", ()) and old not in dir(mod)
    scope: dict = {}
    with pytest.warns(DeprecationWarning):
        exec(f"from {module} import {old} as imported", scope)
    assert scope["imported"] is cls
    with pytest.raises(AttributeError, match="NoSuchCallback"):
        mod.NoSuchCallback  # noqa: B018
    from arraytrain.nn import callbacks

    assert callbacks.RENAMED == OLD_CALLBACKS


# the modules that moved into arraytrain.parallel: (old module, old name, new module, new name)
MOVED = [("arraytrain.exchange", "Exchange", "arraytrain.parallel.communicator", "Communicator"),
         ("arraytrain.exchange", "LocalExchange", "arraytrain.parallel.communicator", "LocalComm"),
         ("arraytrain.exchange", "PerRank", "arraytrain.parallel.communicator", "PerRank"),
         ("arraytrain.overlap", "buckets", "arraytrain.parallel.sync", "buckets"),
         ("arraytrain.shard", "partition", "arraytrain.parallel.shard", "partition"),
         ("arraytrain.torch_comm", "TorchComm", "arraytrain.parallel.torch_dist", "TorchComm")]


@pytest.mark.parametrize("old_module, old, module, new", MOVED)
def test_a_moved_module_name_warns_and_is_the_new_object(old_module, old, module, new):
    import importlib

    mod = importlib.import_module(old_module)
    with pytest.warns(DeprecationWarning, match=f"{old_module}.{old} is deprecated.*{module}.{new}") as record:
        obj = getattr(mod, old)
    assert record[0].filename == __file__
    assert obj is getattr(importlib.import_module(module), new)
    assert mod.__all__ == [] and old not in dir(mod)
    with pytest.raises(AttributeError, match="nothing_here"):
        mod.nothing_here  # noqa: B018


def test_the_old_callback_name_feeds_the_schedule_as_before():
    from arraytrain import nn

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 4)).astype(np.float32), rng.integers(0, 2, 64)
    with pytest.warns(DeprecationWarning, match="ReduceLROnPlateauCallback"):
        old = nn.ReduceLROnPlateau("loss")
    lrs = []
    for callback in (old, nn.ReduceLROnPlateauCallback("loss")):
        model = nn.MLP([4, 8, 2])
        sched = schedules.ReduceLROnPlateau(mode="max", factor=0.5, patience=0)  # every falling loss is a plateau
        engine = Engine(model.init(seed=0), optim.SGD(lr=0.1), schedule=sched, zero_grad_on_step=False)
        history = nn.Trainer(model, engine, batch_size=16, seed=0, callbacks=[callback]).fit(x, y, epochs=3)
        lrs.append([h["lr"] for h in history])
    assert lrs[0] == lrs[1] and lrs[0][-1] < lrs[0][0]


def test_the_old_cosine_spelling_builds_what_it_built():
    with pytest.warns(DeprecationWarning) as record:
        old = schedules.Cosine(20, min_lr=0.01)
    assert len(record) == 2  # the class name, then the argument
    new = schedules.CosineAnnealingLR(20, eta_min=0.01)
    assert [old(t, 1.0) for t in range(25)] == [new(t, 1.0) for t in range(25)]
    assert old.state_dict()["type"] == "CosineAnnealingLR"


def test_an_unknown_schedule_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="Cosinus"):
        schedules.Cosinus  # noqa: B018


# (object, old attribute, the new value it returns, a fragment of the warning)
ATTRIBUTES = [
    (lambda: Lion(betas=(0.5, 0.9)), "b1", 0.5, ".betas[0]"),
    (lambda: Lion(betas=(0.5, 0.9)), "b2", 0.9, ".betas[1]"),
    (lambda: LAMB(betas=(0.8, 0.95)), "b1", 0.8, ".betas[0]"),
    (lambda: LAMB(betas=(0.8, 0.95)), "b2", 0.95, ".betas[1]"),
    (lambda: AccumulationConfig(reduction="sum"), "normalize", False, "reduction"),
    (lambda: AccumulationConfig(), "normalize", True, "reduction"),
    (lambda: schedules.CosineAnnealingLR(10, 0.1), "min_lr", 0.1, ".eta_min"),
    (lambda: schedules.CosineAnnealingLR(10, 0.1), "total_steps", 10, ".T_max"),
    (lambda: schedules.LinearLR(7), "total_steps", 7, ".total_iters"),
    (lambda: schedules.PolynomialLR(8), "total_steps", 8, ".total_iters"),
    (lambda: schedules.OneCycleLR(10, anneal_strategy="linear"), "anneal", "linear", ".anneal_strategy"),
]


@pytest.mark.parametrize("make, attribute, value, fragment", ATTRIBUTES,
                         ids=[f"{i}-{a[1]}" for i, a in enumerate(ATTRIBUTES)])
def test_an_old_attribute_warns_and_reads_the_new_one(make, attribute, value, fragment):
    obj = make()
    with pytest.warns(DeprecationWarning, match="deprecated") as record:
        got = getattr(obj, attribute)
    assert got == value and fragment in str(record[0].message) and record[0].filename == __file__


@pytest.mark.parametrize("call, fragment", [
    (lambda: Lion(b1=0.5, betas=(0.5, 0.9)), "betas"),
    (lambda: LAMB(b2=0.9, betas=(0.5, 0.9)), "betas"),
    (lambda: schedules.CosineAnnealingLR(10, eta_min=0.1, min_lr=0.1), "eta_min"),
    (lambda: schedules.CosineAnnealingLR(T_max=10, total_steps=10), "T_max"),
    (lambda: AccumulationConfig(normalize=True, reduction="mean"), "reduction"),
], ids=["lion", "lamb", "cosine-eta-min", "cosine-t-max", "config"])
def test_an_old_and_a_new_spelling_together_are_refused(call, fragment):
    with pytest.raises(HyperparameterError, match=fragment):
        call()


def test_positional_arguments_beyond_the_old_signature_are_refused():
    with pytest.raises(TypeError, match="positional"):
        Lion(1e-3, 0.9, 0.99, 0.0, False, None, None, "extra")
    with pytest.raises(TypeError, match="multiple values"):
        Adam(1e-3, (0.9, 0.99), 1e-8, 0.0, False, "bfloat16", state_dtype="bfloat16")


def test_normalize_is_checked_as_before():
    with pytest.raises(HyperparameterError, match="normalize"):
        AccumulationConfig(normalize=1)


def test_the_config_stays_a_frozen_dataclass():
    cfg = AccumulationConfig(2, "sum", 1.0, 0.0)
    assert dataclasses.replace(cfg, reduction="mean") == AccumulationConfig(2, "mean", 1.0, 0.0)
    assert [f.name for f in dataclasses.fields(cfg)] == ["accumulation_steps", "reduction", "max_grad_norm",
                                                         "clip_eps"]
    assert hash(cfg) == hash(AccumulationConfig(2, "sum", 1.0, 0.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.reduction = "mean"  # type: ignore[misc]


# -- checkpoints of the previous release ----------------------------------------------------------------


def _engine(opt, schedule=None):
    params = {"w": np.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": np.zeros(3)}
    return Engine(params, opt, schedule=schedule)


def _grads(t):
    return {"w": np.full((2, 3), 0.1 * t), "b": np.arange(3.0) - t}


OLD_COSINE = {"type": "Cosine", "format": 1, "total_steps": 10, "min_lr": 1e-4}  # as the previous release saved it


@pytest.mark.parametrize("make, old_hp", [
    (lambda: Lion(lr=1e-2, betas=(0.5, 0.9), weight_decay=0.1),
     {"lr": 1e-2, "b1": 0.5, "b2": 0.9, "weight_decay": 0.1, "maximize": False, "state_dtype": None,
      "overrides": {}}),
    (lambda: LAMB(lr=1e-2, betas=(0.8, 0.9)),
     {"lr": 1e-2, "b1": 0.8, "b2": 0.9, "eps": 1e-6, "eps_root": 0.0, "weight_decay": 0.0, "maximize": False,
      "state_dtype": None, "overrides": {}}),
], ids=["lion", "lamb"])
def test_a_checkpoint_of_the_previous_release_resumes(make, old_hp, tmp_path, monkeypatch):
    """A checkpoint holding ``b1``/``b2`` and a ``Cosine`` schedule loads and continues bitwise."""
    from safetensors import safe_open

    def cosine():
        return schedules.CosineAnnealingLR(10, eta_min=1e-4)

    ref = _engine(make(), cosine())
    for t in range(3):
        ref.step(_grads(t))
    path = str(tmp_path / "old.safetensors")
    with monkeypatch.context() as m:  # the previous release wrote these names
        m.setattr(ref.optimizer, "hyperparameters", lambda: old_hp)
        m.setattr(ref.schedule, "state_dict", lambda: dict(OLD_COSINE))
        at.save(path, ref)
    with safe_open(path, "np") as f:
        meta = " ".join(f.metadata().values())
    assert all(f'"{key}"' in meta for key in ("b1", "b2", "Cosine", "min_lr"))
    resumed = _engine(make(), cosine())
    at.load(path, resumed)
    # an optimizer rebuilt from the old hyperparameters is the same optimizer
    with pytest.warns(DeprecationWarning, match="betas"):
        rebuilt = type(ref.optimizer)(**old_hp)
    assert rebuilt.hyperparameters() == ref.optimizer.hyperparameters()
    for t in range(3, 6):
        for e in (ref, resumed):
            e.step(_grads(t))
    np.testing.assert_array_equal(resumed.params.flat, ref.params.flat)
    assert resumed.schedule.state_dict() == ref.schedule.state_dict()
    assert resumed.lr == ref.lr


# -- the project itself uses no old spelling ----------------------------------------------------------------

OLD_KEYWORDS = {  # callee name -> keywords it no longer takes (deprecated)
    "Lion": {"b1", "b2"}, "LAMB": {"b1", "b2"}, "AccumulationConfig": {"normalize"},
    "CosineAnnealingLR": {"min_lr", "total_steps"}, "LinearLR": {"total_steps"}, "PolynomialLR": {"total_steps"},
    "OneCycleLR": {"anneal"},
}
# callee name -> how many arguments it takes positionally (more: the shipped positional form)
POSITIONAL = {name: sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in inspect.signature(cls).parameters.values())
              for name, cls in [(n, getattr(optim, n)) for n in optim.__all__ if n not in ("Optimizer", "OptState")]
              + [("AccumulationConfig", AccumulationConfig)]}
OWN_CODE = ["arraytrain", "examples", "asv_benchmarks", "tests"]
DEFINING = {"tests/test_deprecation.py"}  # the old spellings on purpose


def _old_spellings(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in OLD_SCHEDULES and isinstance(node.value, ast.Name) \
                and node.value.id == "schedules":
            found.append(f"schedules.{node.attr}")
        if isinstance(node, ast.Attribute) and node.attr in OLD_CALLBACKS and isinstance(node.value, ast.Name) \
                and node.value.id in ("nn", "callbacks"):
            found.append(f"{node.value.id}.{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith("schedules"):
            found += [f"import {a.name}" for a in node.names if a.name in OLD_SCHEDULES]
        if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith(("nn", "nn.callbacks")):
            found += [f"import {a.name}" for a in node.names if a.name in OLD_CALLBACKS]
        if isinstance(node, ast.Call):
            f = node.func
            callee = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            found += [f"{callee}({k.arg}=...)" for k in node.keywords if k.arg in OLD_KEYWORDS.get(callee, ())]
            ours = not ast.unparse(f).startswith(("torch.", "optax."))  # torch.optim.SGD is not ours
            if ours and len(node.args) > POSITIONAL.get(callee, len(node.args)) and not any(
                    isinstance(a, ast.Starred) for a in node.args):
                found.append(f"{callee}() with {len(node.args)} positional arguments")
    return found


def test_the_project_uses_no_old_spelling():
    """Benchmarks and examples, which no test runs in-process, checked statically (the tests by conftest)."""
    files = [p for d in OWN_CODE for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 50
    offenders = {}
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel in DEFINING:
            continue
        found = _old_spellings(ast.parse(path.read_text(), rel))
        if found:
            offenders[rel] = found
    assert offenders == {}


def test_the_scan_finds_old_spellings():
    code = ("from arraytrain.schedules import Cosine\nx = schedules.OneCycle(5)\nopt = optim.Lion(b1=0.5)\n"
            "cfg = AccumulationConfig(normalize=False)\nsgd = SGD(0.1, 0.9, 0.0, 0.0, False, True)\n"
            "ok = Adam(1e-3, (0.9, 0.99), 1e-8, 0.0, False, maximize=True)\n"
            "cb = nn.ReduceLROnPlateau('val_loss')\nfrom arraytrain.nn.callbacks import ReduceLROnPlateau\n"
            "fine = schedules.ReduceLROnPlateau(patience=2)\n")
    assert sorted(_old_spellings(ast.parse(code))) == ["AccumulationConfig(normalize=...)", "Lion(b1=...)",
                                                      "SGD() with 6 positional arguments", "import Cosine",
                                                      "import ReduceLROnPlateau", "nn.ReduceLROnPlateau",
                                                      "schedules.OneCycle"]


def test_the_cli_and_every_optimizer_default_build_without_warnings():
    from arraytrain import cli
    from arraytrain.bench.common import OPTIMIZERS, arraytrain_optimizer

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name, cls in cli.optimizers().items():
            opt = cls(lr=1e-3)
            assert type(opt)(**opt.hyperparameters()).hyperparameters() == opt.hyperparameters(), name
        for opt in OPTIMIZERS:
            arraytrain_optimizer(opt)
            if opt != "adafactor":
                arraytrain_optimizer(opt, state_dtype="bfloat16")
