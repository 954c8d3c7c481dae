r"""Phase training from any loop: FULL, PREDICT and CORRECT steps, their state and their checkpoints.

A cycle, as :class:`PhaseSchedule` runs it:

* FULL for ``full_steps`` steps: forward, backward, the true gradient is
  recorded into a :class:`~arraytrain.phase.predict.GradientPredictor`, the optimizer steps.
* then PREDICT: no forward and no backward; the predicted gradient (a linear
  trend over the recorded ones plus a correction) takes the true one's place
  (with an engine: written into ``engine.grads``, so that ``engine.step()``'s
  clipping, schedule, optimizer and NaN/Inf skipping work as on any step).
* ``phase_step`` counts the steps since the cycle's PREDICT phase began
  (CORRECT steps included); when a PREDICT step finds ``phase_step > 0`` and
  ``phase_step % correct_every == 0`` the step is CORRECT instead: forward and
  backward, the correction is updated with the trend's residual and the true
  gradient recorded and applied. When ``phase_step >= predict_steps`` (checked
  after the correction test) or a CORRECT step leaves no PREDICT steps, the
  next cycle starts with FULL.

Example, ``full_steps=2, predict_steps=4, correct_every=2``: F F P P C P C | F F ...

Adaptive lengths (``adaptive=True``): the losses of the last
100 FULL/CORRECT steps are kept (PREDICT steps have no forward pass, hence no
loss). When a cycle starts and at least 20 are held, ``early`` and ``late`` are
the means of the oldest and newest 10: if ``late > early * (1 + loss_threshold)``
the loss is rising and ``full_steps += 5``, ``predict_steps -= 10``; if
``late < 0.95 * early`` it is falling well and ``full_steps -= 2``,
``predict_steps += 5``; each then clamped to its bounds (by default: full in
[5, 50], predict in [10, 100]).

Driving it from a loop of your own (``begin_step`` / ``record_full_gradients`` /
``get_predicted_gradients`` / ``end_step``), here with a torch model bound to an engine (:mod:`arraytrain.interop.torch`)::

    ctl = PhaseController(engine, full_steps=2, predict_steps=6, correct_every=3)
    for x, y in batches:
        if ctl.begin_step() is Phase.PREDICT:
            ctl.get_predicted_gradients()     # into engine.grads: no forward, no backward
            loss = None
        else:
            loss = loss_fn(model(x), y)
            loss.backward()                   # into engine.grads
            ctl.record_full_gradients()       # the engine's gradient buffer
            loss = loss.item()
        engine.step()
        ctl.end_step(loss)
    print(ctl.stats().step_ratio, ctl.stats().wall_speedup)

Without an engine (a torch or optax optimizer applies the gradients) the
controller is built on a :class:`~arraytrain.Layout` (or a mapping name ->
array), takes ``record_full_gradients({name: grad})`` and returns the
prediction as ``{name: array}``.

Accounting (:class:`PhaseStats`): the step ratio is steps / backward passes,
a count, *not* a speedup. The controller also
measures wall clock per phase, from ``begin_step`` to ``end_step``, and
:attr:`PhaseStats.wall_speedup` is the speedup those measurements give.

Checkpoints: :func:`save` writes the engine's state and the controller's
(phase, counters, current lengths, kept losses, stats, the predictor's ring
and correction) into one safetensors file of :mod:`arraytrain.checkpoint`'s
format, the controller's under the key ``"phase"`` beside the engine's; :func:`load`
validates all of it, engine and controller, before it writes either. A run
saved between two steps and resumed continues bitwise as the uninterrupted one.
"""

from __future__ import annotations

from ..errors import PhaseOrderError
from .controller import PhaseController, load, save
from . import schedule
from .schedule import Phase, PhaseSchedule, PhaseStats

LOSS_WINDOW = schedule.LOSS_WINDOW  #: FULL/CORRECT losses kept for the adaptive rule

__all__ = ["LOSS_WINDOW", "Phase", "PhaseController", "PhaseOrderError", "PhaseSchedule", "PhaseStats", "load",
           "save"]
