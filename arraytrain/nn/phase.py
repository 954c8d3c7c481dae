"""Phase training in the Trainer: FULL steps, PREDICT steps (no forward, no backward) and CORRECT steps.

The rule, the state and the accounting are :mod:`arraytrain.phase`'s
(:class:`~arraytrain.phase.PhaseController`, which a loop of your own can
drive too); :class:`PhaseTrainer` is the :class:`~arraytrain.nn.Trainer`
driving one, and :class:`PhaseCheckpoint` saves its engine and controller in
one file, so that a run resumes mid-phase.
"""

from __future__ import annotations

import time

from ..engine import Engine
from ..errors import ArgumentTypeError, HyperparameterError
from ..phase import Phase, PhaseController, PhaseSchedule, PhaseStats, save
from ..phase.schedule import LOSS_MEAN, LOSS_MIN, LOSS_WINDOW
from ._array import checked_numerics
from .callbacks import Checkpoint
from .trainer import Trainer

__all__ = ["LOSS_MEAN", "LOSS_MIN", "LOSS_WINDOW", "Phase", "PhaseCheckpoint", "PhaseSchedule", "PhaseStats",
           "PhaseTrainer"]


class PhaseTrainer(Trainer):
    """:class:`~arraytrain.nn.Trainer` whose steps cycle through FULL, PREDICT and CORRECT.

    Same ``fit`` / ``evaluate`` / callbacks API and arguments as the Trainer,
    plus the phase lengths (see :class:`~arraytrain.phase.PhaseSchedule`),
    ``history`` and ``correction_beta`` of the
    :class:`~arraytrain.phase.predict.GradientPredictor` and its ``kernels``: those
    of the :class:`~arraytrain.phase.PhaseController` in ``controller``, which
    runs the phases (``schedule``, ``predictor`` and ``stats`` are its). Every
    step, whatever its phase, takes the next batch slot, so an epoch has as
    many optimizer steps as the Trainer's and a FULL step sees the batch the
    Trainer would; a PREDICT step leaves its batch unread. The predictor's step
    index is the controller's step counter.

    On PREDICT steps there is no loss: callbacks get ``{"loss": 0.0, "size": 0,
    "report": ..., "phase": "predict"}`` (``size`` 0 keeps size-weighted
    running means right); an epoch's ``loss`` and training metrics are over
    its FULL/CORRECT batches. ``stats`` (:class:`~arraytrain.phase.PhaseStats`)
    counts steps, backward passes and wall clock per phase (forward, backward,
    prediction, ``engine.step()``, metrics; callbacks run after the step is
    closed); ``timings["predict"]`` is the time in the predictor's kernels.
    ``samples_per_second`` counts every step's batch slot, read or not (epochs
    per second, as for the Trainer).

    The engine must take one micro-batch per optimizer step
    (``accumulation_steps=1``), and have no SAM optimizer, no loss scaler
    (a recorded gradient would not be comparable from step to step) and no
    working copy.

    Resuming mid-phase: :class:`PhaseCheckpoint` (or
    :func:`arraytrain.phase.save` with ``trainer.controller``) writes the engine
    and the controller; load with ``extra = arraytrain.phase.load(path,
    trainer.controller)`` and continue with ``fit(..., initial_epoch=extra["epoch"])``:
    bitwise the uninterrupted run. The plain :class:`~arraytrain.nn.Checkpoint`
    saves the engine alone (a resume from it starts the phases afresh).
    """

    def __init__(self, model, engine, *, full_steps: int = 10, predict_steps: int = 40, correct_every: int = 10,
                 adaptive: bool = False, loss_threshold: float = 0.1, full_bounds=(5, 50),
                 predict_bounds=(10, 100), history: int = 4, correction_beta: float = 0.9,
                 kernels: str = "numba", **trainer_kwargs):
        if isinstance(engine, Engine) and engine.working is not None:
            raise HyperparameterError("working_dtype: gradient prediction records the gradient in engine.grads; "
                                      "an engine with a working copy takes its gradients through step(grads)")
        super().__init__(model, engine, **trainer_kwargs)
        self.controller = PhaseController(engine, full_steps=full_steps, predict_steps=predict_steps,
                                          correct_every=correct_every, adaptive=adaptive,
                                          loss_threshold=loss_threshold, full_bounds=full_bounds,
                                          predict_bounds=predict_bounds, history=history,
                                          correction_beta=correction_beta, kernels=kernels)
        self.timings["predict"] = 0.0

    @property
    def schedule(self) -> PhaseSchedule:
        """The controller's :class:`~arraytrain.phase.PhaseSchedule` (the phase rule and its state)."""
        return self.controller.schedule

    @property
    def predictor(self):
        """The controller's :class:`~arraytrain.phase.predict.GradientPredictor`."""
        return self.controller.predictor

    @property
    def stats(self) -> PhaseStats:
        """A snapshot of the controller's :class:`~arraytrain.phase.PhaseStats`."""
        return self.controller.stats()

    def _train_batch(self, xb, yb, tally) -> tuple[str, dict]:
        engine, ctl = self.engine, self.controller
        phase = ctl.begin_step()
        t1 = time.perf_counter()
        if phase is Phase.PREDICT:
            t2 = t3 = t1  # no forward, no backward
            ctl.get_predicted_gradients()  # into engine.grads
            t4 = time.perf_counter()
            tally.report = engine.step()
            t5 = t6 = time.perf_counter()
            loss, n = None, 0
        else:
            with checked_numerics(xb):
                out = self.model.forward(xb)
                loss, dout = self.loss_fn(out, yb)
                t2 = time.perf_counter()
                self.model.backward(dout)
            t3 = time.perf_counter()
            ctl.record_full_gradients()
            t4 = time.perf_counter()
            tally.report = engine.step()
            t5 = time.perf_counter()
            n = xb.shape[0]
            self._tally(tally, loss, out, yb)
            t6 = time.perf_counter()
        ctl.end_step(loss)
        for cb in self.callbacks:
            cb.on_batch_end(self, self.steps, {"loss": 0.0 if loss is None else loss, "report": tally.report,
                                               "size": n, "phase": phase.value})
        t7 = time.perf_counter()
        # each phase runs kernels of its own (the trend fit, the prediction, the correction)
        kind = "skipped" if tally.report.skipped else phase.value
        return kind, {"forward": t2 - t1, "backward": t3 - t2, "predict": t4 - t3, "optimizer": t5 - t4,
                      "metrics": t6 - t5, "callbacks": t7 - t6}

    def _epoch_logs(self, e: int, tally, t_epoch: float) -> dict:
        logs = super()._epoch_logs(e, tally, t_epoch)
        logs.update(backward_passes=self.controller.stats().backward_passes, full_steps=self.schedule.full_steps,
                    predict_steps=self.schedule.predict_steps)
        return logs


class PhaseCheckpoint(Checkpoint):
    """:class:`~arraytrain.nn.Checkpoint` for a :class:`PhaseTrainer`: the engine and the phase
    controller in one file (:func:`arraytrain.phase.save`), the epoch in ``extra``.

    Resume with ``extra = arraytrain.phase.load(path, trainer.controller)`` and
    ``trainer.fit(..., initial_epoch=extra["epoch"])``.
    """

    def _write(self, trainer, epoch) -> None:
        if not isinstance(trainer, PhaseTrainer):
            raise ArgumentTypeError(f"PhaseCheckpoint: expected a PhaseTrainer, got {type(trainer).__name__} "
                                    "(use Checkpoint)")
        path = self.path.format(epoch=epoch)
        save(path, trainer.controller, extra=self._extra(trainer, epoch))
        self.saved.append(path)
