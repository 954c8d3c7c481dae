r"""Phase training: FULL steps, PREDICT steps (no forward, no backward) and CORRECT steps.

A cycle, in vsa-optim-rs's ``PhaseTrainer`` rule (``get_next_phase`` /
``transition_phase`` / ``adjust_phase_lengths``), which :class:`PhaseSchedule`
transcribes:

* FULL for ``full_steps`` steps: forward, backward, the true gradient is
  recorded into a :class:`~arraytrain.predict.GradientPredictor`, ``engine.step()``.
* then PREDICT: no forward and no backward; the predicted gradient (a linear
  trend over the recorded ones plus a correction) is written into
  ``engine.grads`` and ``engine.step()`` applies it, so clipping, the schedule,
  the optimizer and NaN/Inf skipping work as on any step.
* ``phase_step`` counts the steps since the cycle's PREDICT phase began
  (CORRECT steps included); when a PREDICT step finds ``phase_step > 0`` and
  ``phase_step % correct_every == 0`` the step is CORRECT instead: forward and
  backward, the correction is updated with the trend's residual and the true
  gradient recorded and applied. When ``phase_step >= predict_steps`` (checked
  after the correction test) or a CORRECT step leaves no PREDICT steps, the
  next cycle starts with FULL.

Example, ``full_steps=2, predict_steps=4, correct_every=2``: F F P P C P C | F F ...

Adaptive lengths (``adaptive=True``, vsa-optim-rs's rule): the losses of the last
100 FULL/CORRECT steps are kept (PREDICT steps have no forward pass, hence no
loss). When a cycle starts and at least 20 are held, ``early`` and ``late`` are
the means of the oldest and newest 10: if ``late > early * (1 + loss_threshold)``
the loss is rising and ``full_steps += 5``, ``predict_steps -= 10``; if
``late < 0.95 * early`` it is falling well and ``full_steps -= 2``,
``predict_steps += 5``; each then clamped to its bounds (vsa-optim-rs's: full in
[5, 50], predict in [10, 100]).

Accounting (:class:`PhaseStats`): the step ratio is steps / backward passes,
vsa-optim-rs's "speedup"; it is *not* a speedup. The trainer also measures wall
clock per phase (each step from fetching its batch to the end of its
callbacks), which is what a speedup has to be read from.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum


from .._checks import check_bool, check_int, check_number
from ..errors import HyperparameterError
from ..predict import GradientPredictor
from .trainer import Trainer

LOSS_WINDOW = 100   # FULL/CORRECT losses kept for the adaptive rule (vsa-optim-rs's deque capacity)
LOSS_MEAN = 10      # early / late means over this many losses
LOSS_MIN = 20       # losses needed before the lengths adapt


class Phase(str, Enum):
    """A step's kind: FULL and CORRECT run forward and backward, PREDICT neither."""

    FULL = "full"
    PREDICT = "predict"
    CORRECT = "correct"


def _bounds(name: str, value) -> tuple[int, int]:
    try:
        lo, hi = value
    except (TypeError, ValueError):
        raise HyperparameterError(f"{name}: expected a pair (low, high), got {value!r}") from None
    lo = check_int(f"{name}[0]", lo, 1)
    hi = check_int(f"{name}[1]", hi, lo)
    return lo, hi


class PhaseSchedule:
    """The phase state machine alone: :meth:`begin` gives the phase of the next step,
    :meth:`end` closes it (with its loss on FULL/CORRECT steps, None on PREDICT).

    See the module docstring for the rule. ``full_steps`` and
    ``predict_steps`` are the current lengths (the adaptive rule changes them).
    """

    def __init__(self, full_steps: int = 10, predict_steps: int = 40, correct_every: int = 10, *,
                 adaptive: bool = False, loss_threshold: float = 0.1, full_bounds=(5, 50),
                 predict_bounds=(10, 100)):
        self.full_steps = check_int("full_steps", full_steps, 1)
        self.predict_steps = check_int("predict_steps", predict_steps, 1)
        self.correct_every = check_int("correct_every", correct_every, 1)
        self.adaptive = check_bool("adaptive", adaptive)
        self.loss_threshold = check_number("loss_threshold", loss_threshold, 0.0)
        self.full_bounds = _bounds("full_bounds", full_bounds)
        self.predict_bounds = _bounds("predict_bounds", predict_bounds)
        if self.adaptive:
            for name, v, (lo, hi) in (("full_steps", self.full_steps, self.full_bounds),
                                      ("predict_steps", self.predict_steps, self.predict_bounds)):
                if not lo <= v <= hi:
                    raise HyperparameterError(f"{name}: {v} is outside its bounds [{lo}, {hi}] "
                                              f"({name.split('_')[0]}_bounds) with adaptive=True")
        self.phase = Phase.FULL
        self.phase_step = 0
        self.cycle = 0
        self.losses: deque = deque(maxlen=LOSS_WINDOW)

    def _next(self) -> Phase:
        if self.phase is Phase.FULL:
            return Phase.PREDICT if self.phase_step >= self.full_steps else Phase.FULL
        if self.phase is Phase.PREDICT:
            if self.phase_step > 0 and self.phase_step % self.correct_every == 0:
                return Phase.CORRECT
            return Phase.FULL if self.phase_step >= self.predict_steps else Phase.PREDICT
        return Phase.PREDICT if self.predict_steps > self.phase_step else Phase.FULL

    def begin(self) -> Phase:
        """Move to the phase of the next step and return it."""
        new = self._next()
        if new is not self.phase:
            old, self.phase = self.phase, new
            if new is Phase.FULL:
                self.phase_step = 0
                self.cycle += 1
                if self.adaptive:
                    self.adjust()
            elif new is Phase.PREDICT and old is Phase.FULL:
                self.phase_step = 0
        return self.phase

    def adjust(self) -> None:
        """vsa-optim-rs's adaptive rule on the kept FULL/CORRECT losses (no-op below 20)."""
        if len(self.losses) < LOSS_MIN:
            return
        losses = list(self.losses)
        early = sum(losses[:LOSS_MEAN]) / LOSS_MEAN
        late = sum(losses[-LOSS_MEAN:]) / LOSS_MEAN
        (flo, fhi), (plo, phi) = self.full_bounds, self.predict_bounds
        if late > early * (1.0 + self.loss_threshold):      # rising: more FULL, less PREDICT
            self.full_steps = min(max(self.full_steps + 5, flo), fhi)
            self.predict_steps = min(max(self.predict_steps - 10, plo), phi)
        elif late < early * 0.95:                            # falling well: more PREDICT
            self.full_steps = min(max(self.full_steps - 2, flo), fhi)
            self.predict_steps = min(max(self.predict_steps + 5, plo), phi)

    def end(self, loss: float | None = None) -> None:
        """Close the step; ``loss`` of a FULL/CORRECT step feeds the adaptive rule."""
        if loss is not None:
            self.losses.append(float(loss))
        self.phase_step += 1

    def state_dict(self) -> dict:
        return {"phase": self.phase.value, "phase_step": self.phase_step, "cycle": self.cycle,
                "full_steps": self.full_steps, "predict_steps": self.predict_steps, "losses": list(self.losses)}


@dataclass
class PhaseStats:
    """What a :class:`PhaseTrainer` did: steps per phase, backward passes, wall clock per phase.

    ``seconds[phase]`` is measured wall clock of that phase's steps (forward,
    backward, prediction, ``engine.step()``, callbacks);
    ``step_ratio`` is steps / backward passes, a count, not a speedup.
    """

    full_steps: int = 0
    predict_steps: int = 0
    correct_steps: int = 0
    cycles: int = 0
    unrecorded: int = 0   # FULL/CORRECT gradients with NaN/Inf, not recorded by the predictor
    seconds: dict = field(default_factory=lambda: {p.value: 0.0 for p in Phase})

    @property
    def steps(self) -> int:
        return self.full_steps + self.predict_steps + self.correct_steps

    @property
    def backward_passes(self) -> int:
        return self.full_steps + self.correct_steps

    @property
    def step_ratio(self) -> float:
        return self.steps / max(self.backward_passes, 1)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def seconds_per_step(self) -> dict:
        counts = {"full": self.full_steps, "predict": self.predict_steps, "correct": self.correct_steps}
        return {k: (self.seconds[k] / counts[k] if counts[k] else 0.0) for k in counts}


class PhaseTrainer(Trainer):
    """:class:`~arraytrain.nn.Trainer` whose steps cycle through FULL, PREDICT and CORRECT.

    Same ``fit`` / ``evaluate`` / callbacks API and arguments as the Trainer,
    plus the phase lengths (see :class:`PhaseSchedule`), ``history`` and
    ``correction_beta`` of the :class:`~arraytrain.predict.GradientPredictor`
    and its ``kernels``. Every step, whatever its phase, takes the next batch
    slot, so an epoch has as many optimizer steps as the Trainer's and a FULL
    step sees the batch the Trainer would; a PREDICT step leaves its batch
    unread. The predictor's step index is the trainer's step counter.

    On PREDICT steps there is no loss: callbacks get ``{"loss": 0.0, "size": 0,
    "report": ..., "phase": "predict"}`` (``size`` 0 keeps size-weighted
    running means right); an epoch's ``loss`` and training metrics are over
    its FULL/CORRECT batches. ``stats`` (:class:`PhaseStats`) counts steps,
    backward passes and wall clock per phase; ``timings["predict"]`` is the
    time in the predictor's kernels. ``samples_per_second`` counts every
    step's batch slot, read or not (epochs per second, as for the Trainer).

    The engine must take one micro-batch per optimizer step
    (``accumulation_steps=1``), and have no SAM optimizer and no loss scaler
    (a recorded gradient would not be comparable from step to step).
    """

    def __init__(self, model, engine, *, full_steps: int = 10, predict_steps: int = 40, correct_every: int = 10,
                 adaptive: bool = False, loss_threshold: float = 0.1, full_bounds=(5, 50),
                 predict_bounds=(10, 100), history: int = 4, correction_beta: float = 0.9,
                 kernels: str = "numba", **trainer_kwargs):
        super().__init__(model, engine, **trainer_kwargs)
        if engine.accumulation_steps != 1:
            raise HyperparameterError(f"accumulation_steps: PhaseTrainer needs an engine with accumulation_steps=1, "
                                      f"got {engine.accumulation_steps}")
        if callable(getattr(engine.optimizer, "perturb", None)):
            raise HyperparameterError("optimizer: PhaseTrainer cannot drive a two-window optimizer (SAM)")
        if engine.loss_scaler is not None:
            raise HyperparameterError("loss_scaler: PhaseTrainer needs an engine without a loss scaler")
        self.schedule = PhaseSchedule(full_steps, predict_steps, correct_every, adaptive=adaptive,
                                      loss_threshold=loss_threshold, full_bounds=full_bounds,
                                      predict_bounds=predict_bounds)
        self.predictor = GradientPredictor(engine.grads, history, correction_beta, kernels=kernels)
        self.stats = PhaseStats()
        self.timings["predict"] = 0.0

    def _train_batch(self, xb, yb, tally) -> None:
        engine, timings, sched, stats = self.engine, self.timings, self.schedule, self.stats
        grads = engine.grads.flat
        phase = sched.begin()
        t1 = time.perf_counter()
        if phase is Phase.PREDICT:
            t2 = t3 = t1  # no forward, no backward
            self.predictor.predict(self.steps, out=grads)
            t4 = time.perf_counter()
            tally.report = engine.step()
            t5 = t6 = time.perf_counter()
            loss, n = None, 0
        else:
            out = self.model.forward(xb)
            loss, dout = self.loss_fn(out, yb)
            t2 = time.perf_counter()
            self.model.backward(dout)
            t3 = time.perf_counter()
            record = self.predictor.record if phase is Phase.FULL else self.predictor.correct
            stats.unrecorded += not record(grads, self.steps)
            t4 = time.perf_counter()
            tally.report = engine.step()
            t5 = time.perf_counter()
            n = xb.shape[0]
            self._tally(tally, loss, out, yb)
            t6 = time.perf_counter()
        sched.end(loss)
        for cb in self.callbacks:
            cb.on_batch_end(self, self.steps, {"loss": 0.0 if loss is None else loss, "report": tally.report,
                                               "size": n, "phase": phase.value})
        t7 = time.perf_counter()
        timings["forward"] += t2 - t1
        timings["backward"] += t3 - t2
        timings["predict"] += t4 - t3
        timings["optimizer"] += t5 - t4
        timings["metrics"] += t6 - t5
        timings["callbacks"] += t7 - t6
        if phase is Phase.FULL:
            stats.full_steps += 1
        elif phase is Phase.PREDICT:
            stats.predict_steps += 1
        else:
            stats.correct_steps += 1
        stats.seconds[phase.value] += t7 - t1

    def _epoch_logs(self, e: int, tally, t_epoch: float) -> dict:
        self.stats.cycles = self.schedule.cycle
        logs = super()._epoch_logs(e, tally, t_epoch)
        logs.update(backward_passes=self.stats.backward_passes, full_steps=self.schedule.full_steps,
                    predict_steps=self.schedule.predict_steps)
        return logs
