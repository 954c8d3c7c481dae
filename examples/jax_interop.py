"""JAX computes the gradients, arraytrain applies AdamW: handed over through DLPack.

The parameters live in the engine's flat buffer. Every step wraps each view
``engine.params[name]`` as a JAX array with ``jax.dlpack.from_dlpack``, runs a
jitted ``jax.value_and_grad`` of the loss, and passes the dict of JAX gradient
arrays to ``engine.step(grads)``, which reads them through ``__dlpack__``
without importing JAX and without a copy, then applies AdamW to the flat
buffer in one fused kernel.

XLA's CPU client aliases an imported buffer only when it starts on a 64-byte
boundary (otherwise ``from_dlpack`` copies). Every FlatBuffer arraytrain
allocates starts on one, and the layout starts every parameter at a multiple
of 16 elements from there, so the parameters go to JAX without a copy too.
:mod:`arraytrain.interop.jax` wraps all of this (``bind``, ``engine.tree()``,
pytree gradients in one call); this example spells the mechanism out.

JAX treats its arrays as immutable, and an array made from a view of the
engine's buffer sees the engine's in-place updates: wrap the views afresh
after every step (as :func:`train_step` does) and keep none across a step.

AdamW follows ``optax.adamw`` (Loshchilov & Hutter, 2019: eps after the
bias-corrected square root, decay ``p <- p - lr * wd * p`` beside the Adam
update); the tests run both for 100 steps and compare after every step.

Runs in a few seconds: ``python examples/jax_interop.py``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import arraytrain as at

IN, HIDDEN, CLASSES = 20, 64, 4


def init_params(seed: int = 0, sizes=(IN, HIDDEN, CLASSES)) -> dict:
    """He-normal weights ``(in, out)`` and zero biases, float32 NumPy arrays."""
    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]), 1):
        params[f"fc{i}.weight"] = (rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32)
        params[f"fc{i}.bias"] = np.zeros(b, np.float32)
    return params


def aligned_params(params: dict) -> at.FlatBuffer:
    """``params`` copied into a flat buffer; every FlatBuffer starts on a 64-byte boundary."""
    return at.FlatBuffer.from_arrays(params)


def make_data(n: int = 4096, seed: int = 0, dim: int = IN, classes: int = CLASSES):
    """Gaussian blobs: ``classes`` centres in ``dim`` dimensions, float32 inputs, int32 labels."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((classes, dim)).astype(np.float32)
    y = rng.integers(0, classes, n).astype(np.int32)
    x = centres[y] + rng.standard_normal((n, dim)).astype(np.float32) * 1.5
    return x, y


def batches(n: int, batch: int, steps: int, seed: int = 0):
    """``steps`` index arrays of ``batch`` samples, reshuffled every epoch, the same for a given seed."""
    rng = np.random.default_rng(seed)
    order, pos = rng.permutation(n), 0
    for _ in range(steps):
        if pos + batch > n:
            order, pos = rng.permutation(n), 0
        yield order[pos:pos + batch]
        pos += batch


def forward(params, x):
    h = x
    n_layers = len(params) // 2
    for i in range(1, n_layers + 1):
        h = h @ params[f"fc{i}.weight"] + params[f"fc{i}.bias"]
        if i < n_layers:
            h = jax.nn.relu(h)
    return h


def loss_fn(params, x, y):
    """Mean softmax cross-entropy of the MLP's logits."""
    logp = jax.nn.log_softmax(forward(params, x))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


value_and_grad = jax.jit(jax.value_and_grad(loss_fn))


def as_jax(engine: at.Engine) -> dict:
    """The engine's parameter views as JAX arrays (DLPack: aliases 64-byte-aligned views on the CPU)."""
    return {name: jax.dlpack.from_dlpack(engine.params[name]) for name in engine.layout.names}


def train_step(engine: at.Engine, x, y):
    """One step: JAX loss and gradients at the engine's parameters, then ``engine.step(grads)``."""
    loss, grads = value_and_grad(as_jax(engine), x, y)
    jax.block_until_ready(grads)  # computed from views of the buffer the step is about to update
    return float(loss), engine.step(grads)


def accuracy(engine: at.Engine, x, y) -> float:
    return float(jnp.mean(jnp.argmax(forward(as_jax(engine), x), axis=1) == y))


def main(steps: int = 300, batch: int = 64, seed: int = 0) -> float:
    x, y = make_data(5120, seed)
    x_train, y_train, x_test, y_test = x[:4096], y[:4096], x[4096:], y[4096:]
    engine = at.Engine(aligned_params(init_params(seed)), at.optim.AdamW(lr=3e-3, weight_decay=1e-2),
                       max_grad_norm=5.0)
    flat = engine.params.flat
    assert all(np.shares_memory(np.from_dlpack(p), flat) for p in as_jax(engine).values())

    t0 = time.perf_counter()
    losses = []
    for i, idx in enumerate(batches(len(x_train), batch, steps, seed), 1):
        loss, report = train_step(engine, x_train[idx], y_train[idx])
        losses.append(loss)
        if i % 50 == 0:
            print(f"step {i}: loss {np.mean(losses[-50:]):.4f}  grad norm {report.grad_norm:.3f}  "
                  f"test accuracy {accuracy(engine, x_test, y_test):.3f}")
    acc = accuracy(engine, x_test, y_test)
    print(f"{engine.state.step} AdamW steps on {engine.layout.num_elements} parameters (JAX gradients read "
          f"through DLPack) in {time.perf_counter() - t0:.2f} s; final test accuracy {acc:.3f}")
    return acc


if __name__ == "__main__":
    main()
