"""The training loop: batches through an MLP, gradients into the engine, metrics per epoch.

One optimizer-facing call per batch: ``engine.step()``. Gradient accumulation,
clipping, the schedule and the optimizer are the engine's (its
``accumulation_steps``, ``max_grad_norm``, ``schedule``); the model's backward
writes the gradients straight into ``engine.grads``. Every batch is one
micro-batch; an accumulation window left open at the end of an epoch carries
over into the next.

Data parallelism: with an engine over a group of processes (``Engine(comm=...)``)
every rank draws the same global batches and trains on its own contiguous shard of
each (rank ``r`` of ``K`` takes rows ``[n*r//K, n*(r+1)//K)``), weighted by its
share ``n_r / n``, so the engine's exchange sums to the global batch's mean
gradient: the same trajectory as one process up to float rounding. The epoch's
loss and metrics are computed over every rank's shard.

Mixed precision: with an engine that keeps a low-precision working copy
(``Engine(working_dtype="bfloat16" | "float16")``) the model reads its weights
from that copy (upcast exactly to float32, once per micro-batch) and the batch
is rounded to the working dtype too; the matmuls, activations and the loss are
computed in float32 (NumPy has no bfloat16 matmul, and its float16 one no BLAS).
Each micro-batch's parameter gradient is rounded to the working dtype and handed
to ``engine.step`` as such (the engine accumulates it into its float32 master
gradient): in float16 a gradient above 65504 becomes inf and a tiny one 0, which
is what dynamic loss scaling (``Engine(loss_scaler=...)``) is for. The loss is
multiplied by ``engine.loss_scale`` before the backward pass whenever the engine
has a loss scaler; the engine unscales.

Non-finite values: the forward and backward passes of a training step run with
NumPy's overflow and invalid-value warnings off, because their result is
checked instead: a NaN/Inf gradient makes the engine skip the step (and after
``max_consecutive_skips`` in a row raise :class:`~arraytrain.errors.NonFiniteError`);
an epoch's logs count its skipped steps (``skipped_steps``) and its batches
whose loss was not finite (``nonfinite_losses``). Evaluation likewise reports
a non-finite loss as NaN rather than warning.

Warm-up: the first micro-batch of each kind (accumulated, applied, skipped; for
the :class:`~arraytrain.nn.PhaseTrainer` each phase) compiles or loads the
kernels it needs; its time is kept apart in :attr:`Trainer.warmup_seconds`
and is in neither ``timings`` nor :attr:`Trainer.samples_per_second`.

Determinism: the initial weights come from the model's seed, the batch order of
epoch ``e`` from ``default_rng([seed, e])``, and the engine's kernels reduce in a
fixed order, so two runs with the same seeds are bitwise equal on one machine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .._checks import check_int
from ..engine import Engine
from ..errors import ArgumentTypeError, HyperparameterError
from ._array import array_namespace, checked_numerics, to_numpy
from .callbacks import Callback
from .data import Batches
from .layers import MLP
from .losses import CLASSIFICATION_LOSSES, LOSSES
from .metrics import classification_report

PHASES = ("data", "forward", "backward", "optimizer", "callbacks", "metrics", "evaluation")


def _at_evaluation_weights(evaluate):
    """``Trainer.evaluate`` inside :meth:`arraytrain.Engine.evaluation`: at a schedule-free
    optimizer's x rather than y (the parameters themselves for every other optimizer)."""
    from functools import wraps

    @wraps(evaluate)
    def at_evaluation_weights(self, *args, **kwargs):
        with self.engine.evaluation():
            return evaluate(self, *args, **kwargs)

    return at_evaluation_weights


class Trainer:
    """Fit an :class:`MLP` bound to an :class:`~arraytrain.Engine`.

    Parameters
    ----------
    model, engine
        The model is bound to the engine here if it is not already.
    loss : str or callable
        A name in :data:`arraytrain.nn.losses.LOSSES` (``"cross_entropy"``,
        ``"focal"``, ``"poly1"``, ``"dice"``, ``"mse"``, ``"binary_cross_entropy"``)
        or ``f(outputs, targets) -> (loss, doutputs)``.
    batch_size, shuffle, seed, drop_last
        Batching (see :class:`~arraytrain.nn.data.Batches`).
    callbacks : sequence of :class:`~arraytrain.nn.callbacks.Callback`
    num_classes : int or None
        Turns on classification metrics (accuracy, macro precision / recall /
        F1, confusion matrix); the default is the model's output width for the
        classification losses and off for the others.
    eval_batch_size : int
        Batch size of :meth:`evaluate` (and of ``fit``'s validation), forward
        passes only.

    Notes
    -----
    After :meth:`fit`: ``history`` (one dict per epoch), ``timings`` (seconds per
    phase: data, forward (with the loss), backward, optimizer (``engine.step``),
    callbacks, metrics, evaluation; the warm-up micro-batches left out),
    ``warmup_seconds`` and ``warmup_batches`` (the first micro-batch of each
    kind: kernel compile or cache load), :attr:`samples_per_second`; ``steps``
    counts micro-batches, ``engine.state.step`` optimizer steps. Each epoch's
    logs hold ``samples_per_second`` over that epoch's timed micro-batches
    (NaN when all of them were warm-up): the median over epochs is a steadier
    figure than the run's mean, as a benchmark's median of timed rounds is.
    """

    def __init__(self, model: MLP, engine: Engine, *, loss: str | Callable = "cross_entropy",
                 batch_size: int = 32, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 callbacks: Sequence[Callback] = (), num_classes: int | None = None,
                 eval_batch_size: int = 1024):
        if not isinstance(model, MLP):
            raise ArgumentTypeError(f"model: expected an arraytrain.nn.MLP, got {type(model).__name__}")
        if not isinstance(engine, Engine):
            raise ArgumentTypeError(f"engine: expected an arraytrain.Engine, got {type(engine).__name__}")
        if callable(loss):
            self.loss_fn, self.loss_name = loss, getattr(loss, "__name__", "loss")
        elif loss in LOSSES:
            self.loss_fn, self.loss_name = LOSSES[loss], loss
        else:
            raise HyperparameterError(f"loss: expected one of {tuple(LOSSES)} or a callable, got {loss!r}")
        callbacks = list(callbacks)
        for i, cb in enumerate(callbacks):
            if not isinstance(cb, Callback):
                raise ArgumentTypeError(f"callbacks[{i}]: expected an arraytrain.nn.Callback, got {type(cb).__name__}")
        if num_classes is None and loss in CLASSIFICATION_LOSSES:
            num_classes = model.sizes[-1]
        self.num_classes = None if num_classes is None else check_int("num_classes", num_classes, 2)
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.eval_batch_size = check_int("eval_batch_size", eval_batch_size, 1)
        self.seed = check_int("seed", seed, 0)
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        self.model, self.engine, self.callbacks = model, engine, callbacks
        self._working = None
        if engine.working is not None:
            self._working = _WorkingCopy(engine, model)
        elif model.engine is not engine:
            model.bind(engine)
        self.history: list[dict] = []
        self.timings = dict.fromkeys(PHASES, 0.0)
        self.stop_training = False
        self.epoch = 0           # epochs completed
        self.epochs = 0          # target of the current fit()
        self.batches: Batches | None = None
        self.steps = 0           # micro-batches seen
        self.warmup_seconds = 0.0
        self.warmup_batches = 0
        self._kinds_seen: set[str] = set()
        self._timed_samples = 0
        self._timed_seconds = 0.0

    # -- throughput ------------------------------------------------------------------------
    @property
    def samples_per_second(self) -> float:
        """Training samples per second over the micro-batches after the warm-up.

        A micro-batch is fetching the batch, forward and loss, backward,
        ``engine.step()`` and the per-batch callbacks; evaluation between epochs
        is not in it, nor is the first micro-batch of each kind (accumulated,
        applied, skipped...), which compiles or loads kernels (``warmup_seconds``).
        """
        return self._timed_samples / self._timed_seconds if self._timed_seconds > 0 else 0.0

    def time_split(self) -> dict:
        """Fraction of the measured time per phase."""
        total = sum(self.timings.values())
        return {k: (v / total if total else 0.0) for k, v in self.timings.items()}

    # -- callbacks ---------------------------------------------------------------------
    def _call(self, hook: str, *args) -> None:
        t = time.perf_counter()
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)
        self.timings["callbacks"] += time.perf_counter() - t

    # -- the loop ------------------------------------------------------------------------
    def fit(self, x, y, *, epochs: int, validation: tuple | None = None, initial_epoch: int = 0) -> list[dict]:
        """Train until epoch ``epochs`` (1-based, counting ``initial_epoch`` completed ones).

        ``validation=(x_val, y_val)`` adds ``val_*`` entries to each epoch's logs.
        Returns :attr:`history`.
        """
        epochs = check_int("epochs", epochs, 0)
        initial_epoch = check_int("initial_epoch", initial_epoch, 0, epochs)
        array_namespace(x, y)
        self.batches = Batches(x, y, self.batch_size, shuffle=self.shuffle, seed=self.seed,
                               drop_last=self.drop_last)
        if len(self.batches) == 0:
            raise HyperparameterError(f"batch_size: {self.batch_size} with drop_last leaves no batch "
                                      f"of {self.batches.n} samples")
        ranks = self.engine.comm.size
        smallest = self.batch_size if self.drop_last or self.batches.n % self.batch_size == 0 else \
            self.batches.n % self.batch_size
        if smallest < ranks:
            raise HyperparameterError(f"batch_size: a batch of {smallest} samples cannot be shared by {ranks} "
                                      "processes (each needs at least one): use a larger batch_size or drop_last")
        self.epochs, self.epoch, self.stop_training = epochs, initial_epoch, False
        self._call("on_train_begin")
        for e in range(initial_epoch, epochs):
            logs = self._train_epoch(e)
            if validation is not None:
                t = time.perf_counter()
                for k, v in self.evaluate(*validation).items():
                    logs[f"val_{k}"] = v
                self.timings["evaluation"] += time.perf_counter() - t
            self.epoch = e + 1
            self._call("on_epoch_end", e + 1, logs)
            self.history.append(logs)
            if self.stop_training:
                break
        self._call("on_train_end")
        return self.history

    def _train_epoch(self, e: int) -> dict:
        self._call("on_epoch_begin", e + 1)
        t_epoch = time.perf_counter()
        tally = _Tally()
        timed_samples, timed_seconds = 0, 0.0
        it = self.batches.epoch(e)
        while True:
            t0 = time.perf_counter()
            try:
                xb, yb = next(it)
            except StopIteration:
                break
            t_data = time.perf_counter() - t0
            kind, split = self._train_batch(xb, yb, tally)
            seconds = time.perf_counter() - t0
            tally.skipped += tally.report.skipped
            if kind in self._kinds_seen:
                self.timings["data"] += t_data
                for k, v in split.items():
                    self.timings[k] += v
                timed_samples += xb.shape[0]  # the global batch (every rank's shard)
                timed_seconds += seconds
            else:  # the first of its kind compiles (or loads from the cache) what it runs
                self._kinds_seen.add(kind)
                self.warmup_seconds += seconds
                self.warmup_batches += 1
            self.steps += 1
        self._timed_samples += timed_samples
        self._timed_seconds += timed_seconds
        logs = self._epoch_logs(e, tally, t_epoch)
        logs["samples_per_second"] = timed_samples / timed_seconds if timed_seconds > 0 else float("nan")
        return logs

    def _train_batch(self, xb, yb, tally: "_Tally") -> tuple[str, dict]:
        """One batch: forward and loss, backward, ``engine.step()``, metrics, callbacks.

        Returns the step's kind (see :func:`_step_kind`) and its seconds per phase.
        """
        engine, work = self.engine, self._working
        t1 = time.perf_counter()
        weight = None
        comm = engine.comm
        if not comm.is_local:  # this rank's shard, weighted by its share of the batch
            n = xb.shape[0]
            lo, hi = n * comm.rank // comm.size, n * (comm.rank + 1) // comm.size
            xb, yb, weight = xb[lo:hi], yb[lo:hi], (hi - lo) / n
        with checked_numerics(xb):
            if work is not None:
                work.refresh()
                xb = work.round_input(xb)
            out = self.model.forward(xb)
            loss, dout = self.loss_fn(out, yb)
            if weight is not None and work is None:
                dout = dout * weight  # the zero-copy path: weighted gradients are multiplied by their weight
            if engine.loss_scaler is not None:
                dout = dout * engine.loss_scale
            t2 = time.perf_counter()
            if work is None:
                self.model.backward(dout)
            else:
                self.model.backward(dout, accumulate=False)
            t3 = time.perf_counter()
        if work is None:
            tally.report = engine.step(weight=weight)
        else:
            tally.report = engine.step(work.gradients(), weight=weight)
        t4 = time.perf_counter()
        self._tally(tally, loss, out, yb)
        t5 = time.perf_counter()
        for cb in self.callbacks:
            cb.on_batch_end(self, self.steps, {"loss": loss, "report": tally.report, "size": xb.shape[0]})
        t6 = time.perf_counter()
        return _step_kind(tally.report), {"forward": t2 - t1, "backward": t3 - t2, "optimizer": t4 - t3,
                                          "metrics": t5 - t4, "callbacks": t6 - t5}

    def _tally(self, tally: "_Tally", loss: float, out, yb) -> None:
        """Add a batch's loss (weighted by its size) and, for classifiers, its predictions."""
        n = out.shape[0]
        if not math.isfinite(loss):
            tally.nonfinite += 1
        tally.loss_sum += loss * n
        tally.seen += n
        if self.num_classes is not None:
            tally.preds.append(to_numpy(array_namespace(out).argmax(out, axis=1)))
            tally.labels.append(to_numpy(yb))

    def _epoch_logs(self, e: int, tally: "_Tally", t_epoch: float) -> dict:
        engine = self.engine
        if not engine.comm.is_local:  # the epoch's figures over every rank's shard
            parts = engine.comm.gather_objects((tally.loss_sum, tally.seen, tally.preds, tally.labels,
                                                tally.nonfinite))
            tally.loss_sum = sum(p[0] for p in parts)
            tally.seen = sum(p[1] for p in parts)
            tally.preds = [a for p in parts for a in p[2]]
            tally.labels = [a for p in parts for a in p[3]]
            tally.nonfinite = sum(p[4] for p in parts)
        logs = {"epoch": e + 1, "loss": tally.loss_sum / tally.seen if tally.seen else float("nan"),
                "lr": float(tally.report.lr if tally.report is not None else engine.lr),
                "steps": engine.state.step, "optimizer_steps": engine.state.step,
                "skipped_steps": tally.skipped,
                "nonfinite_losses": tally.nonfinite}
        if engine.loss_scaler is not None:
            logs["loss_scale"] = engine.loss_scale
        if self.num_classes is not None and tally.preds:
            t = time.perf_counter()
            logs.update(classification_report(np.concatenate(tally.labels), np.concatenate(tally.preds),
                                              self.num_classes))
            self.timings["metrics"] += time.perf_counter() - t
        logs["time"] = time.perf_counter() - t_epoch
        return logs

    def evaluate(self, x, y, *, model: MLP | None = None) -> dict:
        """Loss (mean over samples) and, for classification, the metrics, without training.

        ``model``: another model with the same inputs and outputs (a quantized copy,
        say) to evaluate instead of the trainer's, as it is bound.
        """
        if model is not None and not isinstance(model, MLP):
            raise ArgumentTypeError(f"model: expected an arraytrain.nn.MLP or None, got {type(model).__name__}")
        work = self._working if model is None else None
        model = self.model if model is None else model
        batches = Batches(x, y, self.eval_batch_size, shuffle=False)
        loss_sum, seen, preds = 0.0, 0, []
        if work is not None:
            work.refresh()
        for xb, yb in batches.epoch(0):
            with checked_numerics(xb):  # a diverged model's loss is reported as NaN
                if work is not None:
                    xb = work.round_input(xb)
                out = model.predict(xb)
                loss, _ = self.loss_fn(out, yb)
            loss_sum += loss * xb.shape[0]
            seen += xb.shape[0]
            if self.num_classes is not None:
                preds.append(to_numpy(array_namespace(out).argmax(out, axis=1)))
        logs = {"loss": loss_sum / max(seen, 1)}
        if self.num_classes is not None:
            pred = np.concatenate(preds) if preds else np.zeros(0, np.int64)
            logs.update(classification_report(to_numpy(y), pred, self.num_classes))
        return logs

    evaluate = _at_evaluation_weights(evaluate)


@dataclass
class _Tally:
    """An epoch's running totals: size-weighted loss, predictions and labels, the last report."""

    loss_sum: float = 0.0
    seen: int = 0
    preds: list = field(default_factory=list)
    labels: list = field(default_factory=list)
    report: object = None
    skipped: int = 0       # optimizer boundaries skipped for a NaN/Inf gradient
    nonfinite: int = 0     # batches whose loss was NaN/Inf


def _step_kind(report) -> str:
    """What a micro-batch made the engine do: each kind runs kernels of its own."""
    if report.skipped:
        return "skipped"
    if report.applied:
        return "applied"
    return "ascent" if report.perturbed else "accumulated"


class _WorkingCopy:
    """An engine's low-precision working copy driving the model (see the module docstring).

    The model is bound to ``weights`` (float32, the working copy's exact values) and
    ``grads`` (float32, one micro-batch's gradient, overwritten each time); ``low``
    holds that gradient rounded to the working dtype, which goes to ``engine.step``.
    """

    def __init__(self, engine: Engine, model: MLP):
        if model.dtype != np.float32:
            raise HyperparameterError(f"model: a working copy drives a float32 model, got {model.dtype}")
        self.engine, self.dtype = engine, engine.working.dtype
        # full buffers of the layout (with sharded state engine.params holds one partition of the masters)
        self.weights = engine.grads.zeros_like(np.float32)
        self.grads = engine.grads.zeros_like(np.float32)
        self.low = engine.grads.zeros_like(self.dtype)
        self._low_views = self.low.as_dict()
        self.refresh()
        model.bind(self.weights.as_dict(), grads=self.grads.as_dict())

    def refresh(self) -> None:
        """Copy the working copy's values (exactly: every bfloat16/float16 is a float32)."""
        self.weights.flat[...] = self.engine.working.flat

    def round_input(self, x):
        return x.astype(self.dtype).astype(np.float32)

    def gradients(self) -> dict:
        """This micro-batch's gradient rounded to the working dtype, as ``{name: view}``."""
        with np.errstate(over="ignore"):  # float16 overflow gives inf: the engine skips the step
            self.low.flat[...] = self.grads.flat
        return self._low_views
