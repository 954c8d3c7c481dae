"""Resume through a checkpoint file, for every optimizer, with a schedule and a loss scaler
running: save at step k, load into a fresh engine, continue -> bitwise equal to the
uninterrupted run (params, every state slot, step, loss scale, schedule)."""

from __future__ import annotations

import numpy as np
import pytest

import arraytrain as at
from arraytrain import optim
from conftest import _frozen

SHAPES = {"w": (6, 5), "empty": (0,), "b": (5,), "t": (2, 3, 4)}

# every optimizer the package exports, in a configuration that exercises its state
OPTIMIZERS = {
    "sgd": lambda: optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda: optim.Adam(lr=1e-2, amsgrad=True),
    "adamw": lambda: optim.AdamW(lr=1e-2, overrides={"b": {"weight_decay": 0.0}}),
    "adamw-bf16": lambda: optim.AdamW(lr=1e-2, state_dtype="bfloat16"),
    "adagrad": lambda: optim.Adagrad(lr=0.05, lr_decay=0.01),
    "rmsprop": lambda: optim.RMSprop(lr=1e-2, momentum=0.9, centered=True),
    "lion": lambda: optim.Lion(lr=1e-3),
    "lamb": lambda: optim.LAMB(lr=1e-2),
    "adafactor": lambda: optim.Adafactor(lr=1e-2),
    "sophia": lambda: optim.Sophia(lr=1e-3, bs=1),
    "sam-adamw": lambda: optim.SAM(optim.AdamW(lr=1e-2), rho=0.05),
    "nadam": lambda: optim.NAdam(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),  # + mu_product
    "radam": lambda: optim.RAdam(lr=1e-3, betas=(0.9, 0.9)),  # rectified from step 6: after the cut
    "adamax-bf16": lambda: optim.Adamax(lr=1e-2, weight_decay=0.01, state_dtype="bfloat16"),
    "adadelta": lambda: optim.Adadelta(lr=1.0, weight_decay=0.01),
    "sam-nadam": lambda: optim.SAM(optim.NAdam(lr=1e-2), rho=0.05),
    "muon": lambda: optim.Muon(lr=0.02, fallback=optim.AdamW(lr=1e-2), fallback_for=("t",), state_dtype="bfloat16"),
    "schedule-free-adamw": lambda: optim.ScheduleFreeAdamW(lr=1e-2, warmup_steps=3),
}


def test_every_exported_optimizer_is_in_the_table():
    exported = {n for n in optim.__all__ if n not in ("by_name", "Optimizer", "OptState")}
    used = {type(make()).__name__ for make in OPTIMIZERS.values()}
    assert exported == used


def _scheduled_engine(make):
    """An engine of ``make()`` accumulating 2 micro-batches, clipped, warmed up then cosine-annealed, loss-scaled."""
    init = {k: np.random.default_rng(0).standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    return at.Engine(init, make(), accumulation_steps=2, max_grad_norm=2.0,
                     schedule=at.schedules.Warmup(2, then=at.schedules.CosineAnnealingLR(30)),
                     loss_scaler=at.LossScaler(init_scale=2.0**6, growth_interval=3))


def _micro_batches(n):
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        g = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
        if i == 9:  # one non-finite window: skipped, the scale backs off
            g["w"][0, 0] = np.nan
        out.append(g)
    return out


def _feed(engine, grads, start=0):
    for i, g in enumerate(grads, start):
        engine.step({k: v * engine.loss_scale for k, v in g.items()})
        if isinstance(engine.optimizer, optim.Sophia) and i % 4 == 3:
            engine.update_hessian({k: np.abs(v) + 0.1 for k, v in g.items()})


def _bits(engine):
    return (engine.params.flat.tobytes(), {k: b.flat.tobytes() for k, b in engine.state.slots.items()},
            engine.state.step, engine.loss_scale, engine.lr, engine.perturbed, _frozen(engine.state.scalars))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("cut", [7, 12])  # mid accumulation window / after the skipped window
def test_resume_from_a_file_is_bitwise_equal(name, cut, tmp_path):
    grads = _micro_batches(24)
    straight = _scheduled_engine(OPTIMIZERS[name])
    _feed(straight, grads)
    first = _scheduled_engine(OPTIMIZERS[name])
    _feed(first, grads[:cut])
    path = tmp_path / "ckpt.safetensors"
    at.save(path, first, extra={"cut": cut})
    resumed = _scheduled_engine(OPTIMIZERS[name])
    assert at.load(path, resumed) == {"cut": cut}
    _feed(resumed, grads[cut:], cut)
    assert straight.state.step > 0
    assert _bits(resumed) == _bits(straight)
