"""The hand-written MLP's operations, forward and backward, and end-to-end training throughput.

Each kind of work a training step is made of, timed apart: matmul (a dense
layer's forward and backward), elementwise activations, losses with their
gradients, reductions; then whole training steps. float32 throughout, as the MLP trains.
``ARRAYTRAIN_BENCH_QUICK=1`` keeps one small size per benchmark.
"""

from __future__ import annotations

import numpy as np

import arraytrain as at
from arraytrain import nn

from .common import QUICK, best_seconds

if QUICK:
    BATCHES = [32]
    LAYERS = ["64x128"]
    ELEMENTS = ["32x128"]
    CLASSES = [10]
    SHAPES = ["64-128-10"]
else:
    BATCHES = [32, 128]
    LAYERS = ["784x1024", "1024x256", "3584x2048"]  # the benchmark MLPs' layers
    ELEMENTS = ["128x1024", "128x4096", "1024x4096"]
    CLASSES = [10, 1000]
    SHAPES = ["784-1024-256-10", "784-3584-2048-10"]  # ~1.07M and ~10.2M parameters


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.replace("-", "x").split("x"))


def _normal(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


class Dense:
    """``y = x W + b`` and its backward: :math:`x^\\top\\delta` and :math:`\\sum\\delta` into
    the bound gradient arrays, :math:`\\delta W^\\top` returned. ``track_gflops``
    counts the matmuls only (2 b n_in n_out each; 3 of them forward + backward)."""

    params = [BATCHES, LAYERS]
    param_names = ["batch", "in x out"]

    def setup(self, batch, layer):
        n_in, n_out = _dims(layer)
        self.layer = nn.Dense(n_in, n_out)
        self.layer.bind(_normal((n_in, n_out)) * np.float32(n_in ** -0.5), np.zeros(n_out, np.float32),
                        np.empty((n_in, n_out), np.float32), np.empty(n_out, np.float32))
        self.x = _normal((batch, n_in), 1)
        self.dy = _normal((batch, n_out), 2)
        self._flops = 2 * batch * n_in * n_out
        self.time_forward_backward(batch, layer)

    def time_forward(self, batch, layer):
        self.layer.forward(self.x, cache=False)

    def time_forward_backward(self, batch, layer):
        self.layer.forward(self.x)
        self.layer.backward(self.dy)

    def track_gflops_forward(self, batch, layer):
        return self._flops / best_seconds(lambda: self.time_forward(batch, layer)) / 1e9

    track_gflops_forward.unit = "GFLOP/s"

    def track_gflops_forward_backward(self, batch, layer):
        return 3 * self._flops / best_seconds(lambda: self.time_forward_backward(batch, layer)) / 1e9

    track_gflops_forward_backward.unit = "GFLOP/s"


class Activation:
    """Elementwise activations: forward into a new array, and forward + backward
    (the backward overwrites the incoming gradient in place, as inside the MLP)."""

    params = [["relu", "gelu", "tanh", "sigmoid"], ELEMENTS]
    param_names = ["activation", "shape"]

    def setup(self, name, shape):
        self.act = nn.activation(name)
        self.x = _normal(_dims(shape))
        self.dy = _normal(_dims(shape), 1)
        self.scratch = np.empty_like(self.dy)
        self.time_forward_backward(name, shape)

    def time_forward(self, name, shape):
        self.act.forward(self.x, cache=False)

    def time_forward_backward(self, name, shape):
        self.act.forward(self.x)
        np.copyto(self.scratch, self.dy)
        self.act.backward(self.scratch, inplace=True)


class Loss:
    """Loss value and its gradient with respect to the logits, in one call."""

    params = [["softmax_cross_entropy", "focal_loss", "mse"], BATCHES, CLASSES]
    param_names = ["loss", "batch", "classes"]

    def setup(self, name, batch, classes):
        self.fn = getattr(nn, name)
        self.logits = _normal((batch, classes))
        rng = np.random.default_rng(1)
        self.target = (_normal((batch, classes), 2) if name == "mse" else rng.integers(0, classes, batch))
        self.time_loss_and_grad(name, batch, classes)

    def time_loss_and_grad(self, name, batch, classes):
        self.fn(self.logits, self.target)


class Reduction:
    """The reductions inside the MLP's step: the bias gradient (sum over the batch,
    into a bound array), the row maximum and the log-softmax's log-sum-exp, the mean."""

    params = [["bias_grad_sum", "row_max", "log_softmax", "mean"], ELEMENTS]
    param_names = ["reduction", "shape"]

    def setup(self, name, shape):
        self.x = _normal(_dims(shape))
        self.out = np.empty(self.x.shape[1], np.float32)
        self._call = {
            "bias_grad_sum": lambda: np.sum(self.x, axis=0, out=self.out),
            "row_max": lambda: self.x.max(axis=1),
            "log_softmax": lambda: nn.log_softmax(self.x),
            "mean": lambda: float(self.x.mean()),
        }[name]
        self._call()

    def time_reduce(self, name, shape):
        self._call()


class MLPTraining:
    """One training step of the MLP on the zero-copy path: forward, softmax
    cross-entropy, ``model.backward`` into ``engine.grads``, ``engine.step()``."""

    params = [SHAPES, BATCHES, ["sgd", "adamw"]]
    param_names = ["shape", "batch", "optimizer"]

    def setup(self, shape, batch, opt):
        sizes = list(_dims(shape))
        self.model = nn.MLP(sizes, activation="relu", dtype=np.float32)
        optimizer = at.optim.SGD(1e-2, momentum=0.9) if opt == "sgd" else at.optim.AdamW(1e-3)
        self.engine = at.Engine(self.model.init(seed=0), optimizer, zero_grad_on_step=False)
        self.model.bind(self.engine)
        self.x = _normal((batch, sizes[0]), 1)
        self.y = np.random.default_rng(2).integers(0, sizes[-1], batch)
        self.batch = batch
        self._step()

    def _step(self):
        _, dlogits = nn.softmax_cross_entropy(self.model.forward(self.x), self.y)
        self.model.backward(dlogits)
        self.engine.step()

    def time_step(self, shape, batch, opt):
        self._step()

    def track_samples_per_second(self, shape, batch, opt):
        return self.batch / best_seconds(self._step, 5)

    track_samples_per_second.unit = "samples/s"
