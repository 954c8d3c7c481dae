"""Callbacks of the training loop.

A callback overrides any of the hooks; each receives the :class:`Trainer`
(``trainer.model``, ``trainer.engine``, ``trainer.history``...). ``logs`` of
``on_epoch_end`` is the epoch's dict (``loss``, ``accuracy``..., ``val_loss``,
``val_accuracy``...); a callback may add entries to it. Setting
``trainer.stop_training = True`` ends :meth:`Trainer.fit` after the epoch.
"""

from __future__ import annotations

import math
import os
import sys

from .. import schedules
from .._checks import check_int, check_number
from ..checkpoint import save
from ..errors import ArgumentTypeError, HyperparameterError
from .data import require

class Callback:
    """Base class: every hook does nothing."""

    def on_train_begin(self, trainer) -> None:
        """Called once by :meth:`Trainer.fit <arraytrain.nn.Trainer.fit>` before the first epoch."""
        pass

    def on_epoch_begin(self, trainer, epoch: int) -> None:
        """Called before each epoch; ``epoch`` counts from 1."""
        pass

    def on_batch_end(self, trainer, step: int, logs: dict) -> None:
        """``logs``: ``loss`` (float), ``report`` (the engine's StepReport), ``size`` (rows)."""

    def on_epoch_end(self, trainer, epoch: int, logs: dict) -> None:
        """Called after each epoch and its validation, with the epoch's ``logs`` (a callback may add to them).

        Setting ``trainer.stop_training = True`` ends the fit after this epoch.
        """
        pass

    def on_train_end(self, trainer) -> None:
        """Called once when the fit ends (after the last epoch, or an early stop)."""
        pass


class LambdaCallback(Callback):
    """A callback from plain functions, e.g. ``LambdaCallback(on_epoch_end=print_line)``."""

    def __init__(self, **hooks):
        for name, fn in hooks.items():
            if not hasattr(Callback, name) or not name.startswith("on_"):
                raise HyperparameterError(f"{name}: not a callback hook")
            if not callable(fn):
                raise ArgumentTypeError(f"{name}: expected a callable, got {type(fn).__name__}")
            setattr(self, name, fn)


def _monitored(name: str, logs: dict, monitor: str) -> float:
    if monitor not in logs:
        keys = sorted(k for k, v in logs.items() if isinstance(v, float))
        raise HyperparameterError(f"{name}: monitor {monitor!r} is not in the epoch logs "
                                  f"(no validation data?); available: {keys}")
    return float(logs[monitor])


def _mode(monitor: str, mode: str) -> str:
    if mode == "auto":
        return "min" if "loss" in monitor else "max"
    if mode not in ("min", "max"):
        raise HyperparameterError(f"mode: expected 'auto', 'min' or 'max', got {mode!r}")
    return mode


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by more than ``min_delta`` for ``patience`` epochs.

    ``mode="auto"`` minimises a metric whose name contains "loss" and maximises
    the others. ``restore_best`` copies the parameters of the best epoch back into
    the engine at the end (optimizer state is not rewound). After training:
    ``best``, ``best_epoch``, ``stopped_epoch`` (None if it never stopped).
    """

    def __init__(self, monitor: str = "val_loss", patience: int = 5, min_delta: float = 0.0,
                 mode: str = "auto", restore_best: bool = False):
        self.monitor = monitor
        self.patience = check_int("patience", patience, 0)
        self.min_delta = check_number("min_delta", min_delta, 0.0)
        self.mode = _mode(monitor, mode)
        self.restore_best = bool(restore_best)

    def on_train_begin(self, trainer) -> None:
        self.best = math.inf if self.mode == "min" else -math.inf
        self.best_epoch = self.stopped_epoch = None
        self.wait = 0
        self._best_params = None

    def on_epoch_end(self, trainer, epoch, logs) -> None:
        value = _monitored("EarlyStopping", logs, self.monitor)
        better = value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta
        if better:
            self.best, self.best_epoch, self.wait = value, epoch, 0
            if self.restore_best:
                self._best_params = trainer.engine.params.flat.copy()
        else:
            self.wait += 1
            if self.wait >= self.patience:
                trainer.stop_training = True
                self.stopped_epoch = epoch

    def on_train_end(self, trainer) -> None:
        if self.restore_best and self._best_params is not None and self.best_epoch != trainer.epoch:
            trainer.engine.params.flat[...] = self._best_params


class Checkpoint(Callback):
    """Save the engine with :func:`arraytrain.save` every ``every`` epochs (and after the last).

    ``path`` may hold ``{epoch}`` to keep one file per epoch; otherwise each save
    replaces the previous one. The epoch number is stored in the checkpoint's
    ``extra`` (with anything given in ``extra``), for a resume. ``extra`` is a
    dict, or a function ``extra(trainer) -> dict`` called at each save (e.g. to
    store the history so far).
    """

    def __init__(self, path, every: int = 1, extra=None):
        self.path = os.fspath(path)
        self.every = check_int("every", every, 1)
        if extra is not None and not callable(extra) and not isinstance(extra, dict):
            raise ArgumentTypeError(f"extra: expected a dict, a function trainer -> dict or None, "
                                    f"got {type(extra).__name__}")
        self.extra = extra if callable(extra) else dict(extra or {})
        self.saved: list[str] = []

    def _extra(self, trainer, epoch) -> dict:
        """What goes into the checkpoint's ``extra``: ``self.extra`` (or its value) and the epoch."""
        base = self.extra(trainer) if callable(self.extra) else self.extra
        return {**base, "epoch": epoch}

    def _write(self, trainer, epoch) -> None:
        path = self.path.format(epoch=epoch)
        save(path, trainer.engine, extra=self._extra(trainer, epoch))
        self.saved.append(path)

    def on_epoch_end(self, trainer, epoch, logs) -> None:
        if epoch % self.every == 0:
            self._write(trainer, epoch)

    def on_train_end(self, trainer) -> None:
        if trainer.epoch and trainer.epoch % self.every != 0:
            self._write(trainer, trainer.epoch)


class ReduceLROnPlateauCallback(Callback):
    """Feed ``monitor`` to the engine's :class:`~arraytrain.schedules.ReduceLROnPlateau` schedule
    after every epoch.

    The callback decides nothing: the schedule, given as
    ``Engine(..., schedule=arraytrain.schedules.ReduceLROnPlateau(...))`` (or a schedule holding
    one, e.g. inside a ``Warmup``), holds the mode, factor, patience and threshold and cuts the
    lr (its patience counts epochs, as it is fed once per epoch). The metric goes in with the
    number of optimizer steps applied so far, which routes it to the active segment.
    """

    def __init__(self, monitor: str = "val_loss"):
        self.monitor = monitor

    def on_train_begin(self, trainer) -> None:
        sched = trainer.engine.schedule
        if not isinstance(sched, schedules.Schedule) or not sched.stateful:
            raise ArgumentTypeError(f"{type(self).__name__}: the engine's schedule must be an "
                                    "arraytrain.schedules.ReduceLROnPlateau (Engine(..., schedule=...)) "
                                    f"or hold one, got {type(sched).__name__}")
        self.schedule = sched

    def on_epoch_end(self, trainer, epoch, logs) -> None:
        self.schedule.observe(_monitored(type(self).__name__, logs, self.monitor), trainer.engine.state.step)


def layer_of(name: str) -> str:
    """The layer a parameter belongs to: the name up to its last dot ("fc1.weight" -> "fc1")."""
    return name.rpartition(".")[0] or name


class GradientMonitor(Callback):
    """Per-layer L2 norms of the gradient the optimizer applied, every step.

    Reads the per-parameter norms the engine computes in its one norm pass
    (``StepReport.grad_norms``: the reduced gradient before clipping) and
    combines them per layer, :math:`\\|g_{layer}\\| = \\sqrt{\\sum_p \\|g_p\\|^2}`.
    Per epoch it adds ``grad_norms`` (layer -> mean over the epoch's steps) and
    ``grad_norm_max`` (layer -> max) to the logs; ``history`` keeps them.
    """

    def on_train_begin(self, trainer) -> None:
        self.history: list[dict] = []
        self._sums, self._maxes, self._count = {}, {}, 0

    def on_epoch_begin(self, trainer, epoch) -> None:
        self._sums, self._maxes, self._count = {}, {}, 0

    def on_batch_end(self, trainer, step, logs) -> None:
        norms = logs["report"].grad_norms
        if norms is None:  # accumulated or skipped: nothing was applied
            return
        sq = {}
        for name, v in norms.items():
            layer = layer_of(name)
            sq[layer] = sq.get(layer, 0.0) + v * v
        for layer, s in sq.items():
            n = math.sqrt(s)
            self._sums[layer] = self._sums.get(layer, 0.0) + n
            self._maxes[layer] = max(self._maxes.get(layer, 0.0), n)
        self._count += 1

    def on_epoch_end(self, trainer, epoch, logs) -> None:
        c = max(self._count, 1)
        entry = {"epoch": epoch, "steps": self._count,
                 "mean": {k: v / c for k, v in self._sums.items()}, "max": dict(self._maxes)}
        self.history.append(entry)
        logs["grad_norms"] = entry["mean"]
        logs["grad_norm_max"] = entry["max"]


class Profiler(Callback):
    """The step time split into data, forward (with the loss), backward, optimizer
    (``engine.step``), callbacks, metrics and evaluation, per epoch.

    Adds ``time_split`` (phase -> seconds in this epoch) to the logs and keeps
    the list in ``epochs``; :meth:`summary` gives the whole run's seconds and
    fractions. The trainer times every phase anyway; this callback reports it.
    The warm-up micro-batches (the first of each kind, which compile or load
    kernels) are in none of the phases: ``trainer.warmup_seconds`` holds them.
    """

    def on_train_begin(self, trainer) -> None:
        self.epochs: list[dict] = []
        self._start = dict(trainer.timings)

    def on_epoch_begin(self, trainer, epoch) -> None:
        self._mark = dict(trainer.timings)

    def on_epoch_end(self, trainer, epoch, logs) -> None:
        split = {k: trainer.timings[k] - self._mark.get(k, 0.0) for k in trainer.timings}
        self.epochs.append(split)
        logs["time_split"] = split

    def summary(self, trainer) -> dict:
        """The whole run's seconds per phase and their fractions: ``{"seconds": ..., "fraction": ...}``."""
        seconds = {k: trainer.timings[k] - self._start.get(k, 0.0) for k in trainer.timings}
        total = sum(seconds.values())
        return {"seconds": seconds, "fraction": {k: (v / total if total else 0.0) for k, v in seconds.items()}}


class MagnitudePruning(Callback):
    r"""Prune the weights by magnitude to ``ratio``, at the end of epochs ``start`` to ``end``.

    At the end of the :math:`j`-th of the :math:`k = end - start + 1` pruning epochs
    the target is :math:`s_j = ratio \, (1 - (1 - j/k)^3)`, the cubic schedule of
    Zhu & Gupta 2017 ("To prune, or not to prune"), so ``start == end`` prunes to
    ``ratio`` at once. Each time, :func:`arraytrain.prune.magnitude_mask` (one global
    magnitude cut over the weights, every parameter of ``ndim >= 2``; biases are
    kept) gives the mask, combined with the previous one (a pruned weight stays
    pruned), and :meth:`Engine.set_mask <arraytrain.Engine.set_mask>` installs it:
    the pruned weights are zeroed and every optimizer step keeps them 0. The epochs
    count from the start of training, so a resumed run continues the schedule (the
    mask is in the engine's checkpoint). A CUDA engine's weights are read to the host
    for the cut.

    Adds ``sparsity`` (the fraction of the weights that are pruned) to every epoch's logs.
    """

    def __init__(self, ratio: float, start: int = 1, end: int | None = None):
        self.ratio = check_number("ratio", ratio, 0.0, 1.0, hi_open=True)
        self.start = check_int("start", start, 1)
        self.end = self.start if end is None else check_int("end", end, self.start)

    def target(self, epoch: int) -> float | None:
        """The sparsity to prune to at the end of ``epoch``, or None if it prunes nothing then."""
        if not self.start <= epoch <= self.end:
            return None
        k = self.end - self.start + 1
        return self.ratio * (1.0 - (1.0 - (epoch - self.start + 1) / k) ** 3)

    def on_epoch_end(self, trainer, epoch, logs) -> None:
        from ..buffer import FlatBuffer
        from ..prune import magnitude_mask
        from ._array import to_numpy

        engine = trainer.engine
        target = self.target(epoch)
        if target is not None:
            host = FlatBuffer(engine.layout, to_numpy(engine.gather_params().flat))  # sharded masters: gathered
            mask = magnitude_mask(host, ratio=target)
            if engine.mask is not None:
                mask.flat &= to_numpy(engine.mask.flat)
            engine.set_mask(mask)
        logs["sparsity"] = self.sparsity(engine)

    @staticmethod
    def sparsity(engine) -> float:
        """The fraction of the weights (parameters of ``ndim >= 2``) that the engine's mask prunes."""
        from ..prune import select_names
        from ._array import to_numpy

        if engine.mask is None:
            return 0.0
        names = select_names(engine.layout, None)
        total = sum(engine.mask[n].size for n in names)
        kept = sum(int(to_numpy(engine.mask[n]).sum()) for n in names)
        return (total - kept) / total if total else 0.0


class ProgressBar(Callback):
    """One tqdm bar over the whole fit (needs ``pip install 'arraytrain[train]'``).

    It counts micro-batches across every epoch, with the epoch, the epoch's running
    loss and the last epoch's accuracy (validation accuracy when there is one) as
    its postfix. ``disable=None`` (the default) shows it only when ``file``
    (default stderr) is a terminal, so a pipe or a log file gets no bar residue;
    True hides it, False forces it. :meth:`write` prints a line above the bar.
    """

    def __init__(self, file=None, leave: bool = True, every: int = 10, disable: bool | None = None):
        self._tqdm = require("tqdm", "train", "the progress bar").tqdm
        self.file, self.leave, self.disable = file, bool(leave), disable
        self.every = check_int("every", every, 1)
        self.bar = None

    def on_train_begin(self, trainer) -> None:
        total = (trainer.epochs - trainer.epoch) * len(trainer.batches)
        self.bar = self._tqdm(total=total, unit="batch", leave=self.leave, file=self.file or sys.stderr,
                              dynamic_ncols=True, disable=self.disable)
        self._post = {}

    def on_epoch_begin(self, trainer, epoch) -> None:
        self._post["epoch"] = f"{epoch}/{trainer.epochs}"
        self._loss, self._n, self._i = 0.0, 0, 0

    def on_batch_end(self, trainer, step, logs) -> None:
        self._loss += logs["loss"] * logs["size"]
        self._n += logs["size"]
        self._i += 1
        if self._i % self.every == 0 and self._n:
            self._post["loss"] = f"{self._loss / self._n:.4f}"
            self.bar.set_postfix(self._post, refresh=False)
        self.bar.update(1)

    def on_epoch_end(self, trainer, epoch, logs) -> None:
        self._post["loss"] = f"{logs['loss']:.4f}"
        for key in ("val_accuracy", "accuracy"):
            if key in logs:
                self._post[key.replace("accuracy", "acc")] = f"{logs[key]:.4f}"
                break
        self.bar.set_postfix(self._post)

    def on_train_end(self, trainer) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def write(self, line: str, file=None) -> None:
        """Print ``line`` (to ``file``, default stdout) without breaking the bar."""
        if self.bar is None or self.bar.disable:
            print(line, file=file or sys.stdout, flush=True)
        else:
            self._tqdm.write(line, file=file or sys.stdout)

