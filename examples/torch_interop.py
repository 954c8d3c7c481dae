"""A PyTorch model trained by arraytrain: parameters and gradients live in the engine's buffers.

``arraytrain.interop.torch.bind`` points each ``torch.nn.Parameter`` at a view
of ``engine.params`` and its ``.grad`` at the matching view of ``engine.grads``. ``loss.backward()`` then
adds the gradients straight into the flat gradient buffer, ``engine.step()``
(no argument) applies AdamW to the flat parameter buffer in one fused kernel
and zeroes the gradient buffer in the same pass, and the model sees the new
weights at once: nothing is copied between torch and the engine.

AdamW here follows ``torch.optim.AdamW`` (Loshchilov & Hutter, 2019; torch's
form, eps after the bias-corrected square root) step for step; the tests run
both side by side for 100 steps and compare every parameter after every step.

Runs in a few seconds: ``python examples/torch_interop.py``.
"""

from __future__ import annotations

import time

import numpy as np
import torch

import arraytrain as at
from arraytrain.interop import torch as at_torch

IN, HIDDEN, CLASSES = 20, 64, 4


def make_model(seed: int = 0, sizes=(IN, HIDDEN, CLASSES)) -> torch.nn.Sequential:
    """A 2-layer MLP with torch's default initialisation drawn from ``seed`` (global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(sizes[0], sizes[1]), torch.nn.ReLU(),
                                   torch.nn.Linear(sizes[1], sizes[2]))


def make_data(n: int = 4096, seed: int = 0, dim: int = IN, classes: int = CLASSES):
    """Gaussian blobs: ``classes`` centres in ``dim`` dimensions, float32 inputs, int64 labels."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((classes, dim)).astype(np.float32)
    y = rng.integers(0, classes, n)
    x = centres[y] + rng.standard_normal((n, dim)).astype(np.float32) * 1.5
    return torch.from_numpy(x), torch.from_numpy(y)


def batches(n: int, batch: int, steps: int, seed: int = 0):
    """``steps`` index arrays of ``batch`` samples, reshuffled every epoch, the same for a given seed."""
    rng = np.random.default_rng(seed)
    order, pos = rng.permutation(n), 0
    for _ in range(steps):
        if pos + batch > n:
            order, pos = rng.permutation(n), 0
        yield torch.from_numpy(order[pos:pos + batch])
        pos += batch


def bind(model: torch.nn.Module, optimizer: at.optim.Optimizer, **engine_kwargs) -> at.Engine:
    """An Engine holding ``model``'s parameters; the model's tensors become views of its buffers.

    :func:`arraytrain.interop.torch.bind` does it: the current values are
    copied once into the flat parameter buffer; after that ``p.data`` is
    ``engine.params[name]`` and ``p.grad`` is ``engine.grads[name]`` (shared
    memory), and every ``engine.step()`` first checks that they still are
    (``model.zero_grad()``, frozen parameters and the rest are handled, see
    docs/guide.md). The engine zeroes its gradient buffer after every step
    (``zero_grad_on_step=True``) because ``backward()`` adds into ``.grad``.
    """
    return at_torch.bind(model, optimizer, **engine_kwargs)


def train_step(model: torch.nn.Module, engine: at.Engine, x: torch.Tensor, y: torch.Tensor):
    """One step: forward, ``loss.backward()`` into the engine's buffer, ``engine.step()``."""
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), engine.step()


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def main(steps: int = 300, batch: int = 64, seed: int = 0) -> float:
    x, y = make_data(5120, seed)
    x_train, y_train, x_test, y_test = x[:4096], y[:4096], x[4096:], y[4096:]
    model = make_model(seed)
    engine = bind(model, at.optim.AdamW(lr=3e-3, weight_decay=1e-2), max_grad_norm=5.0)
    flat = engine.params.flat
    assert all(np.shares_memory(p.detach().numpy(), flat) for p in model.parameters())

    t0 = time.perf_counter()
    losses = []
    for i, idx in enumerate(batches(len(x_train), batch, steps, seed), 1):
        loss, report = train_step(model, engine, x_train[idx], y_train[idx])
        losses.append(loss)
        if i % 50 == 0:
            print(f"step {i}: loss {np.mean(losses[-50:]):.4f}  grad norm {report.grad_norm:.3f}  "
                  f"test accuracy {accuracy(model, x_test, y_test):.3f}")
    acc = accuracy(model, x_test, y_test)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{engine.state.step} AdamW steps on {n_params} parameters (all views of one flat buffer) "
          f"in {time.perf_counter() - t0:.2f} s; final test accuracy {acc:.3f}")
    return acc


if __name__ == "__main__":
    main()
