"""Schedules over other schedules: a warm-up, a sequence, and reduce-on-plateau (the one with state)."""

from __future__ import annotations

import math
import numbers
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from itertools import accumulate

import numpy as np

from .._checks import MAX_COUNT, check_choice, check_count, check_number, shown
from ..errors import HyperparameterError, StateDictError
from ._base import Schedule, check_schedule, construct, rebuild, register
from ._closed import Constant

MODES = ("min", "max")
THRESHOLD_MODES = ("rel", "abs")


def _encode_float(x: float):
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))


def _decode_float(name: str, x) -> float:
    if isinstance(x, str) and x in ("inf", "-inf", "nan"):
        return float(x)
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise StateDictError(f"{name}: expected a number or 'inf', '-inf', 'nan', got {shown(x)}")
    return float(x)


@register
class Warmup(Schedule):
    r"""Linear warm-up for ``steps`` steps, then ``then`` from its own step 0.

    :math:`b\,(s + (1 - s)\,t/W)` for :math:`t < W`, else ``then(t - W, b)``: torch
    ``SequentialLR([LinearLR(start_factor=s, end_factor=1, total_iters=W), then],
    milestones=[W])``. ``start_factor`` defaults to 0 (the first update has lr 0,
    the common warm-up convention); torch's LinearLR requires it > 0.
    ``steps=0`` is ``then`` alone.
    """

    _fields = ("steps", "then", "start_factor")
    _schedule_fields = ("then",)

    def __init__(self, steps: int, then: Schedule | None = None, start_factor: float = 0.0):
        self.steps = check_count("steps", steps, 0)
        self.then = Constant() if then is None else check_schedule("then", then)
        self.start_factor = check_number("start_factor", start_factor, 0.0, 1.0)

    def _lr(self, step, base):
        if step < self.steps:
            return base * (self.start_factor + (1.0 - self.start_factor) * step / self.steps)
        return self.then._lr(step - self.steps, base)

    def _observe(self, metric, step):
        if self.then.stateful and step >= self.steps:
            self.then._observe(metric, step - self.steps)


@register
class Sequential(Schedule):
    """A chain ``[(schedule, n_steps), ..., (schedule, None)]`` (torch SequentialLR).

    Each segment runs for its ``n_steps`` (an int >= 1) at its own local step
    0, 1, ...; the last one, with ``None``, runs for ever.
    """

    _fields = ("segments",)

    def __init__(self, segments: Sequence):
        if isinstance(segments, (str, bytes, Mapping)) or not isinstance(segments, Sequence) or not segments:
            raise HyperparameterError(f"segments: expected a non-empty list of (schedule, n_steps) pairs, "
                                      f"got {segments!r}")
        schedules, lengths = [], []
        last = len(segments) - 1
        for i, seg in enumerate(segments):
            if isinstance(seg, (str, bytes)) or not isinstance(seg, Sequence) or len(seg) != 2:
                raise HyperparameterError(f"segments[{i}]: expected a (schedule, n_steps) pair, got {seg!r}")
            sched, n = seg
            schedules.append(check_schedule(f"segments[{i}]", sched))
            if i == last:
                if n is not None:
                    raise HyperparameterError(f"segments[{i}]: the last segment runs for ever and takes "
                                              f"n_steps=None, got {n!r}")
            else:
                lengths.append(check_count(f"segments[{i}] n_steps", n, 1))
        self._schedules = schedules
        self._lengths = tuple(lengths)
        self._starts = (0, *accumulate(lengths))

    @property
    def segments(self) -> tuple:
        """The ``(schedule, n_steps)`` pairs (``None`` for the last)."""
        return tuple(zip(self._schedules, (*self._lengths, None)))

    def _children(self):
        return list(self._schedules)

    def _segment(self, step: int) -> tuple[Schedule, int]:
        i = bisect_right(self._starts, step) - 1
        return self._schedules[i], step - self._starts[i]

    def _lr(self, step, base):
        sched, local = self._segment(step)
        return sched._lr(local, base)

    def _observe(self, metric, step):
        if not self.stateful:
            return
        sched, local = self._segment(step)
        if sched.stateful:
            sched._observe(metric, local)

    def _config(self):
        return {"segments": [{"schedule": s.state_dict(), "steps": n} for s, n in self.segments]}

    @classmethod
    def _from_dict(cls, d, path, depth):
        segs = d["segments"]
        if not isinstance(segs, list):
            raise StateDictError(f"{path}.segments: expected a list, got {type(segs).__name__}")
        pairs = []
        for i, seg in enumerate(segs):
            p = f"{path}.segments[{i}]"
            if not isinstance(seg, Mapping) or set(seg) != {"schedule", "steps"}:
                raise StateDictError(f"{p}: expected a dict with keys 'schedule' and 'steps', got {seg!r}")
            pairs.append((rebuild(seg["schedule"], f"{p}.schedule", depth + 1), seg["steps"]))
        return construct(cls, {"segments": pairs}, path)

    def __repr__(self):
        return f"Sequential({list(self.segments)!r})"


# -- reduce on plateau --------------------------------------------------------------------------------
@register
class ReduceLROnPlateau(Schedule):
    """torch ReduceLROnPlateau's rules over an inner schedule (see the package docstring).

    ``observe(metric)`` once per epoch/evaluation moves the state: ``best``,
    ``num_bad_epochs``, ``cooldown_counter``, ``num_reductions`` and
    ``last_epoch`` (the number of metrics observed, torch's name). The lr at a
    step replays the ``num_reductions`` reductions on ``inner(step, base_lr)``
    element by element: ``max(lr * factor, min_lr)``, kept only where it lowers
    the lr by more than ``eps``. With per-parameter base lrs every element is
    reduced at the same observations, each against its own lr, as torch does
    for its parameter groups; ``min_lr`` is one absolute floor for all.
    """

    _fields = ("inner", "mode", "factor", "patience", "threshold", "threshold_mode", "cooldown", "min_lr", "eps")
    _schedule_fields = ("inner",)
    _state_fields = ("best", "num_bad_epochs", "cooldown_counter", "num_reductions", "last_epoch")

    def __init__(self, inner: Schedule | None = None, mode: str = "min", factor: float = 0.1, patience: int = 10,
                 threshold: float = 1e-4, threshold_mode: str = "rel", cooldown: int = 0, min_lr: float = 0.0,
                 eps: float = 1e-8):
        self.inner = Constant() if inner is None else check_schedule("inner", inner)
        self.mode = check_choice("mode", mode, MODES)
        self.factor = check_number("factor", factor, 0.0, 1.0, hi_open=True)
        self.patience = check_count("patience", patience, 0)
        self.threshold = check_number("threshold", threshold, 0.0)
        self.threshold_mode = check_choice("threshold_mode", threshold_mode, THRESHOLD_MODES)
        self.cooldown = check_count("cooldown", cooldown, 0)
        self.min_lr = check_number("min_lr", min_lr, 0.0)
        self.eps = check_number("eps", eps, 0.0)
        self.best = math.inf if self.mode == "min" else -math.inf
        self.num_bad_epochs = self.cooldown_counter = self.num_reductions = self.last_epoch = 0

    @property
    def stateful(self) -> bool:
        return True

    def _needs_step(self) -> bool:
        return self.inner._needs_step()

    def _is_better(self, a: float) -> bool:
        best, th = self.best, self.threshold
        if self.mode == "min":
            return a < (best * (1.0 - th) if self.threshold_mode == "rel" else best - th)
        return a > (best * (th + 1.0) if self.threshold_mode == "rel" else best + th)

    def _observe(self, metric, step):
        self.last_epoch += 1
        if self._is_better(metric):
            self.best = metric
            self.num_bad_epochs = 0
        else:
            self.num_bad_epochs += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0  # bad epochs during cooldown are ignored
        if self.num_bad_epochs > self.patience:
            self.num_reductions += 1
            self.cooldown_counter = self.cooldown
            self.num_bad_epochs = 0
        if self.inner.stateful:
            self.inner._observe(metric, step)

    def _lr(self, step, base):
        lr = np.asarray(self.inner._lr(step, base), dtype=np.float64)
        for _ in range(self.num_reductions):
            new = np.maximum(lr * self.factor, self.min_lr)
            keep = lr - new > self.eps  # torch's eps rule, per element
            if not keep.any():
                break  # every element is at min_lr or below the eps rule: later reductions change nothing
            lr = np.where(keep, new, lr)
        return lr

    def _state(self):
        return {"best": _encode_float(self.best), **{f: getattr(self, f) for f in self._state_fields[1:]}}

    @classmethod
    def _from_dict(cls, d, path, depth):
        new = super()._from_dict(d, path, depth)
        new.best = _decode_float(f"{path}.best", d["best"])
        highest = {"num_bad_epochs": new.patience, "cooldown_counter": new.cooldown}  # the counters' bounds
        for f in cls._state_fields[1:]:
            setattr(new, f, check_count(f"{path}.{f}", d[f], 0, highest.get(f, MAX_COUNT), error=StateDictError))
        return new

    def __repr__(self):
        return (f"{super().__repr__()[:-1]}; best={self.best!r}, num_bad_epochs={self.num_bad_epochs}, "
                f"cooldown_counter={self.cooldown_counter}, num_reductions={self.num_reductions})")

