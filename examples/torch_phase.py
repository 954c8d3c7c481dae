"""Gradient prediction driven from a PyTorch training loop: ``arraytrain.phase.PhaseController``.

The controller says what each step is (``begin_step()`` returns its phase): FULL and
CORRECT steps run forward and ``loss.backward()`` and hand the gradient over
(``record_full_gradients``); PREDICT steps run neither, and the optimizer
applies the gradient the predictor extrapolates from the recorded ones
(``get_predicted_gradients``). ``end_step(loss)`` closes the step;
``stats()`` counts the backward passes saved and measures the wall clock.

Two ways to wire it:

* :func:`train` — the model bound to an arraytrain engine
  (:func:`arraytrain.interop.torch.bind`): ``.grad`` tensors are views of
  ``engine.grads``, so ``record_full_gradients()`` reads what ``backward()``
  wrote and ``get_predicted_gradients()`` writes the prediction where
  ``engine.step()`` reads it. Nothing is copied. :func:`arraytrain.phase.save`
  / :func:`~arraytrain.phase.load` checkpoint the engine and the controller in
  one file, and a run resumed from it continues bitwise (``main`` shows it).
* :func:`train_with_torch_optimizer` — ``torch.optim.AdamW`` applies the
  gradients; the controller is built on the parameters' layout and takes and
  returns gradients by name.

Runs in a few seconds: ``python examples/torch_phase.py``.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import arraytrain as at
from arraytrain.interop import torch as at_torch
from arraytrain.phase import Phase, PhaseController

# `arraytrain train --predict`'s default cycle (arraytrain.cli.PREDICT_DEFAULTS, measured on the digits MLP):
# F F P P P C P P C | ..., 4 gradients in the line fit
PHASES = dict(full_steps=2, predict_steps=6, correct_every=3, history=4, correction_beta=1.0)
LR = 3e-3


def blobs(n: int, seed: int, dim: int = 20, classes: int = 4):
    """Gaussian blobs as torch tensors: float32 inputs, int64 labels."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((classes, dim)).astype(np.float32)
    labels = rng.integers(0, classes, n)
    points = centres[labels] + 1.5 * rng.standard_normal((n, dim)).astype(np.float32)
    return torch.from_numpy(points), torch.from_numpy(labels)


def mlp(seed: int, dim: int = 20, hidden: int = 64, classes: int = 4) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes))


def minibatch(step: int, n: int, size: int, seed: int) -> torch.Tensor:
    """The indices of ``step``'s batch, from the step alone: a run can resume at any step."""
    return torch.from_numpy(np.random.default_rng([seed, step]).choice(n, size, replace=False))


def forward_loss(model, x, y) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y)


def train(model, engine, ctl: PhaseController, x, y, start: int, stop: int, batch: int = 64, seed: int = 0,
          log=print) -> None:
    """Steps ``start`` to ``stop`` of a bound model: the controller's phases, ``engine.step()`` each."""
    for step in range(start, stop):
        if ctl.begin_step() is Phase.PREDICT:
            ctl.get_predicted_gradients()  # into engine.grads, i.e. every p.grad: no forward, no backward
            loss = None
        else:
            idx = minibatch(step, len(x), batch, seed)
            loss = forward_loss(model, x[idx], y[idx])
            loss.backward()                # into engine.grads
            ctl.record_full_gradients()    # read from engine.grads, before step() zeroes it
            loss = loss.item()
        engine.step()
        ctl.end_step(loss)
        if (step + 1) % 50 == 0:
            log(f"step {step + 1}: {ctl.phase.value:7s} cycle {ctl.cycle}, "
                f"{ctl.stats().backward_passes} backward passes so far")


def train_with_torch_optimizer(x, y, steps: int, batch: int = 64, seed: int = 0):
    """torch.optim.AdamW applies the gradients; the controller takes and returns them by name."""
    model = mlp(seed)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ctl = PhaseController(at.Layout({name: tuple(p.shape) for name, p in params.items()}), **PHASES)
    for step in range(steps):
        opt.zero_grad()
        if ctl.begin_step() is Phase.PREDICT:
            for name, g in ctl.get_predicted_gradients().items():  # views of the controller's buffer
                params[name].grad = torch.from_numpy(g.copy())
            loss = None
        else:
            idx = minibatch(step, len(x), batch, seed)
            loss = forward_loss(model, x[idx], y[idx])
            loss.backward()
            ctl.record_full_gradients({name: p.grad for name, p in params.items()})
            loss = loss.item()
        opt.step()
        ctl.end_step(loss)
    return model, ctl


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def bound(seed: int = 0):
    """A model bound to an engine, and a controller on the engine."""
    model = mlp(seed)
    engine = at_torch.bind(model, at.optim.AdamW(lr=LR))
    return model, engine, PhaseController(engine, **PHASES)


def main(steps: int = 300, seed: int = 0) -> float:
    x, y = blobs(5120, seed)
    x_train, y_train, x_test, y_test = x[:4096], y[:4096], x[4096:], y[4096:]

    t0 = time.perf_counter()
    model, engine, ctl = bound(seed)
    train(model, engine, ctl, x_train, y_train, 0, steps, seed=seed)
    seconds = time.perf_counter() - t0
    s = ctl.stats()
    speedup = s.wall_speedup
    print(f"{s.steps} steps, {s.backward_passes} backward passes ({s.full_steps} FULL, {s.correct_steps} CORRECT, "
          f"{s.predict_steps} PREDICT): step ratio {s.step_ratio:.2f}, measured wall-clock speedup "
          + (f"{speedup:.2f}x" if speedup is not None else "unknown") + f", {seconds:.2f} s")

    # the same run, saved mid-phase and resumed by new objects from the file
    half = steps // 2 + 1
    with tempfile.TemporaryDirectory() as tmp:
        first, first_engine, first_ctl = bound(seed)
        train(first, first_engine, first_ctl, x_train, y_train, 0, half, seed=seed, log=lambda _: None)
        path = Path(tmp) / "phase.safetensors"
        at.phase.save(path, first_ctl, extra={"step": half})
        again, again_engine, again_ctl = bound(seed + 1)  # other weights: the file brings them
        start = at.phase.load(path, again_ctl)["step"]
        train(again, again_engine, again_ctl, x_train, y_train, start, steps, seed=seed, log=lambda _: None)
    same = np.array_equal(again_engine.params.flat, engine.params.flat)
    print(f"saved after step {half} ({first_ctl.phase.value}), resumed: bitwise the uninterrupted run: {same}")

    theirs, their_ctl = train_with_torch_optimizer(x_train, y_train, steps, seed=seed)
    print(f"torch.optim.AdamW fed the same way: {their_ctl.stats().backward_passes} backward passes, "
          f"test accuracy {accuracy(theirs, x_test, y_test):.3f}")
    acc = accuracy(model, x_test, y_test)
    print(f"final test accuracy {acc:.3f}")
    return acc


if __name__ == "__main__":
    main()
