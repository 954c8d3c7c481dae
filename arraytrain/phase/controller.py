"""Phase training's controller and checkpoints: :class:`PhaseController` (the step protocol on an engine
or a loop of one's own), :func:`save` and :func:`load` (see :mod:`arraytrain.phase`)."""



from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from contextlib import nullcontext

from .. import checkpoint
from .._checks import check_count, check_number, shown
from ..backend import module_of_backend
from ..buffer import FlatBuffer
from ..engine import Engine
from ..parallel.communicator import LocalComm
from ..errors import ArgumentTypeError, CheckpointError, HyperparameterError, PhaseOrderError, StateDictError
from .predict import GradientPredictor

from .schedule import Phase, PhaseSchedule, PhaseStats, checked_real

_COUNTED = {Phase.FULL: "full_steps", Phase.PREDICT: "predict_steps", Phase.CORRECT: "correct_steps"}
STATE_VERSION = 1   # of PhaseController.state_dict()
PHASE_KEY = "phase"  # the controller's state in a checkpoint's tree, beside the engine's keys


def _loss(loss) -> float | None:
    if loss is None:
        return None
    if not isinstance(loss, bool):
        try:
            return float(loss)  # a Python or NumPy number, a 0-d array or one-element tensor
        except (TypeError, ValueError):
            pass
    raise ArgumentTypeError(f"loss: expected a number or None, got {type(loss).__name__}")


class PhaseController:
    """Gradient prediction driven step by step from any training loop.

    Parameters
    ----------
    target : Engine, Layout, FlatBuffer or mapping name -> array
        An :class:`~arraytrain.Engine`: ``record_full_gradients()`` reads
        ``engine.grads`` and ``get_predicted_gradients()`` writes it, so the
        next ``engine.step()`` applies the prediction. The engine must take one
        micro-batch per optimizer step (``accumulation_steps=1``), and have no
        SAM optimizer and no loss scaler (a recorded gradient would not be
        comparable from step to step). Otherwise what the gradients look like
        (a :class:`~arraytrain.Layout`, with ``dtype`` and ``device`` as for the
        :class:`~arraytrain.phase.predict.GradientPredictor`): gradients come in and
        predictions go out as ``{name: array}``.
    full_steps, predict_steps, correct_every, adaptive, loss_threshold, full_bounds, predict_bounds
        The phase rule (:class:`PhaseSchedule`).
    history, correction_beta, kernels, dtype, device
        The :class:`~arraytrain.phase.predict.GradientPredictor`.

    Notes
    -----
    A step: :meth:`begin_step` returns its :class:`Phase`; on FULL and CORRECT
    steps compute the true gradient and call :meth:`record_full_gradients`
    once; on PREDICT steps call :meth:`get_predicted_gradients`; then apply
    the gradient (``engine.step()``, or your optimizer) and :meth:`end_step`
    with the loss. The predictor's step index is :attr:`step`, the steps ended
    so far. Calls out of this order raise :class:`PhaseOrderError` and change
    nothing. Between steps :meth:`state_dict` and :func:`save` capture
    everything a bitwise resume needs.
    """

    def __init__(self, target, *, full_steps: int = 10, predict_steps: int = 40, correct_every: int = 10,
                 adaptive: bool = False, loss_threshold: float = 0.1, full_bounds=(5, 50),
                 predict_bounds=(10, 100), history: int = 4, correction_beta: float = 0.9,
                 kernels: str = "numba", dtype=None, device: str | None = None):
        if isinstance(target, Engine):
            _check_engine(target)
            self.engine, grads = target, target.grads
        else:
            self.engine, grads = None, target
        self.schedule = PhaseSchedule(full_steps, predict_steps, correct_every, adaptive=adaptive,
                                      loss_threshold=loss_threshold, full_bounds=full_bounds,
                                      predict_bounds=predict_bounds)
        self.predictor = GradientPredictor(grads, history, correction_beta, kernels=kernels, dtype=dtype,
                                           device=device)
        self.layout = self.predictor.layout
        self._initial = (self.schedule.full_steps, self.schedule.predict_steps)
        self._scratch: FlatBuffer | None = None  # gradients given by name, predictions without an engine
        self._warm: set = set()                  # phases whose first, untimed step (it compiles) ran here
        self._clear()

    def _clear(self) -> None:
        self.step = 0          # steps ended: the predictor's step index of the next step
        self.phase_changed = False
        self._stats = PhaseStats()
        self._open: Phase | None = None  # the phase of the step begun and not yet ended
        self._done = False               # its gradient recorded (FULL/CORRECT) or predicted (PREDICT)
        self._t0 = 0.0

    # -- where it stands ----------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        """The phase of the current (or last) step."""
        return self.schedule.phase

    @property
    def phase_step(self) -> int:
        """The schedule's ``phase_step``: steps since the FULL or PREDICT phase began (CORRECT counts with PREDICT)."""
        return self.schedule.phase_step

    @property
    def cycle(self) -> int:
        """The schedule's ``cycle``: how many times a FULL phase began again (0 in the first cycle)."""
        return self.schedule.cycle

    @property
    def in_step(self) -> bool:
        """True between :meth:`begin_step` and :meth:`end_step`."""
        return self._open is not None

    @property
    def needs_backward(self) -> bool:
        """Whether the current step computes the true gradient (FULL and CORRECT)."""
        return self.schedule.phase is not Phase.PREDICT

    # -- the step -----------------------------------------------------------------------
    def begin_step(self) -> Phase:
        """Start a step: move to its phase (``phase_changed`` says whether it changed) and return it."""
        if self._open is not None:
            raise PhaseOrderError(f"begin_step: the {self._open.value} step {self.step} is still open; "
                                  "call end_step(loss) first")
        before = self.schedule.phase
        phase = self.schedule.begin()
        self.phase_changed = phase is not before
        self._open, self._done = phase, False
        self._t0 = time.perf_counter()
        return phase

    def _require(self, what: str, phases: tuple) -> Phase:
        if self._open is None:
            raise PhaseOrderError(f"{what}: no step is open; call begin_step() first")
        if self._open not in phases:
            raise PhaseOrderError(f"{what}: the step is {self._open.value.upper()}, this call belongs to "
                                  + " and ".join(p.value.upper() for p in phases) + " steps")
        return self._open

    def record_full_gradients(self, grads=None) -> bool:
        """Record the true gradient of a FULL or CORRECT step (once per step).

        ``grads``: None for the engine's gradient buffer (before ``engine.step()``,
        which may zero it); a mapping name -> array of every parameter (any
        framework; cast to the predictor's dtype); a :class:`FlatBuffer` or
        flat array of the layout. On a CORRECT step the correction is updated
        with the trend's residual first. Returns False when the gradient has a
        NaN or Inf: it is not recorded (``stats().unrecorded`` counts it).
        """
        phase = self._require("record_full_gradients", (Phase.FULL, Phase.CORRECT))
        if self._done:
            raise PhaseOrderError(f"record_full_gradients: step {self.step}'s gradient was recorded already")
        flat = self._incoming(grads)
        record = self.predictor.record if phase is Phase.FULL else self.predictor.correct
        ok = record(flat, self.step)
        self._done = True
        self._stats.unrecorded += not ok
        return ok

    def get_predicted_gradients(self, out=None) -> dict:
        """The predicted gradient of a PREDICT step, as ``{name: array}`` views of where it was written.

        ``out``: a FlatBuffer or flat array of the layout to write into; by
        default ``engine.grads`` with an engine (the next ``engine.step()``
        applies it), else a buffer of the controller's, rewritten by its next
        call (copy what you keep). Raises :class:`~arraytrain.NoGradientsError` before
        any gradient was recorded (every FULL one had a NaN/Inf), the step still open.
        """
        self._require("get_predicted_gradients", (Phase.PREDICT,))
        if out is None:
            buf = self.engine.grads if self.engine is not None else self._scratch_buffer()
            self.predictor.predict(self.step, out=buf.flat)
        elif isinstance(out, FlatBuffer):
            buf = out
            self.predictor.predict(self.step, out=buf)  # the predictor checks its layout
        else:
            buf = FlatBuffer(self.layout, self.predictor.predict(self.step, out=out))
        self._done = True
        return buf.as_dict()

    def end_step(self, loss=None) -> None:
        """Close the step with its loss (None on PREDICT steps, which have no forward pass).

        The losses of FULL/CORRECT steps feed the adaptive rule; a loss given
        on a PREDICT step only enters ``stats().loss_sum``.
        """
        phase = self._open
        if phase is None:
            raise PhaseOrderError("end_step: no step is open; call begin_step() first")
        if not self._done:
            missing = "get_predicted_gradients()" if phase is Phase.PREDICT else "record_full_gradients()"
            raise PhaseOrderError(f"end_step: the {phase.value} step {self.step} has not called {missing}")
        loss = _loss(loss)
        seconds = time.perf_counter() - self._t0
        stats = self._stats
        setattr(stats, _COUNTED[phase], getattr(stats, _COUNTED[phase]) + 1)
        if phase in self._warm:
            stats.seconds[phase.value] += seconds
            stats.timed[phase.value] += 1
        self._warm.add(phase)
        if loss is not None:
            stats.loss_sum[phase.value] += loss
            stats.loss_count[phase.value] += 1
        self.schedule.end(None if phase is Phase.PREDICT else loss)
        self.step += 1
        self._open = None

    def stats(self) -> PhaseStats:
        """A snapshot of the counts, times and losses (``cycles`` included)."""
        s = self._stats
        return dataclasses.replace(s, cycles=self.schedule.cycle, seconds=dict(s.seconds), timed=dict(s.timed),
                                   loss_sum=dict(s.loss_sum), loss_count=dict(s.loss_count))

    def reset(self) -> None:
        """Back to the start: the first FULL step, the constructor's lengths, no records, no stats.

        An open step is dropped (e.g. a PREDICT step whose prediction raised
        :class:`~arraytrain.NoGradientsError` because every recorded gradient had a NaN/Inf).
        """
        sched = self.schedule
        sched.apply_state({"phase": Phase.FULL, "phase_step": 0, "cycle": 0, "full_steps": self._initial[0],
                           "predict_steps": self._initial[1], "losses": []})
        self.predictor.reset()
        self._clear()

    # -- gradients in and out -----------------------------------------------------------
    def _scratch_buffer(self) -> FlatBuffer:
        if self._scratch is None:
            self._scratch = FlatBuffer.zeros(self.layout, self.predictor.dtype,
                                             module_of_backend(self.predictor.backend))
        return self._scratch

    def _incoming(self, grads):
        """The flat gradient to record (validated by the predictor; a mapping is packed first)."""
        if grads is None:
            if self.engine is None:
                raise ArgumentTypeError("grads: None stands for the engine's gradient buffer, and this controller "
                                        "has no engine; pass a mapping name -> array")
            return self.engine.grads.flat
        if isinstance(grads, Mapping):
            scratch = self._scratch_buffer()
            scratch.assign(scratch.check(grads))  # every name, each shape; floats of another precision cast
            return scratch.flat
        return grads

    # -- state ---------------------------------------------------------------------------
    def _between_steps(self, what: str) -> None:
        if self._open is not None:
            raise PhaseOrderError(f"{what}: the {self._open.value} step {self.step} is open (after begin_step, "
                                  "before end_step); its state is only whole between steps")

    def state_dict(self, copy: bool = True) -> dict:
        """Everything a bitwise resume needs, between steps: the schedule, the step, the stats and the
        predictor's arrays (``copy=False``: views of its buffers, for a writer that reads them at once)."""
        self._between_steps("state_dict")
        s = self._stats
        return {
            "version": STATE_VERSION,
            "step": self.step,
            "schedule": self.schedule.state_dict(),
            "stats": {"full_steps": s.full_steps, "predict_steps": s.predict_steps,
                      "correct_steps": s.correct_steps, "unrecorded": s.unrecorded, "seconds": dict(s.seconds),
                      "timed": dict(s.timed), "loss_sum": dict(s.loss_sum), "loss_count": dict(s.loss_count)},
            "predictor": self.predictor.state_dict(copy=copy),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Load :meth:`state_dict` output; a refused state raises :class:`StateDictError` and changes nothing."""
        self.apply_state(self.check_state(state))

    def check_state(self, state: Mapping) -> tuple:
        """Validate a :meth:`state_dict` (every part, and their agreement); change nothing.

        Returns what :meth:`apply_state` takes. The schedule's hyperparameters
        (``correct_every``, ``adaptive``, ...) and the predictor's
        ``correction_beta`` stay the controller's own.
        """
        self._between_steps("load_state_dict")
        _check_keys("phase state", state, ("version", "step", "schedule", "stats", "predictor"))
        if state["version"] != STATE_VERSION:
            raise StateDictError(f"phase state: version {shown(state['version'])} is not {STATE_VERSION}")
        step = check_count("step", state["step"], error=StateDictError)
        sched = self.schedule.check_state(state["schedule"])
        stats = _check_stats(state["stats"])
        predictor = self.predictor.check_state(state["predictor"])
        counts = stats.counts()
        if stats.steps != step:
            raise StateDictError(f"step: {step}, but the stats count {counts} steps ({stats.steps})")
        for what, per_phase in (("timed", stats.timed), ("loss_count", stats.loss_count)):
            if any(per_phase[k] > n for k, n in counts.items()):
                raise StateDictError(f"stats {what}: {per_phase} exceeds the steps per phase {counts}")
        if stats.unrecorded > stats.backward_passes:
            raise StateDictError(f"stats unrecorded: {stats.unrecorded} > the {stats.backward_passes} "
                                 "FULL/CORRECT steps")
        if sched["cycle"] > step or (step == 0 and (sched["phase"], sched["phase_step"]) != (Phase.FULL, 0)):
            raise StateDictError(f"schedule: {sched['phase'].value} step {sched['phase_step']} of cycle "
                                 f"{sched['cycle']} after {step} steps")
        _, steps, count, head = predictor
        if count and steps[(head - 1) % len(steps)] >= step:
            raise StateDictError(f"predictor: a gradient recorded at step {steps[(head - 1) % len(steps)]}, "
                                 f"but only {step} steps were taken")
        return step, sched, stats, predictor

    def apply_state(self, checked: tuple) -> None:
        """Load a state validated by :meth:`check_state` (copies and assignments: cannot fail)."""
        step, sched, stats, predictor = checked
        self.schedule.apply_state(sched)
        self.predictor.apply_state(predictor)
        self.step, self._stats, self.phase_changed = step, stats, False

    def __repr__(self) -> str:
        s = self.schedule
        return (f"PhaseController({'engine' if self.engine is not None else 'layout'}, full_steps={s.full_steps}, "
                f"predict_steps={s.predict_steps}, correct_every={s.correct_every}, step={self.step}, "
                f"phase={s.phase.value}, {self.predictor!r})")


def _check_engine(engine: Engine) -> None:
    if engine.accumulation_steps != 1:
        raise HyperparameterError(f"accumulation_steps: gradient prediction needs an engine with "
                                  f"accumulation_steps=1, got {engine.accumulation_steps}")
    if callable(getattr(engine.optimizer, "perturb", None)):
        raise HyperparameterError("optimizer: gradient prediction cannot drive a two-window optimizer (SAM)")
    if engine.loss_scaler is not None:
        raise HyperparameterError("loss_scaler: gradient prediction needs an engine without a loss scaler")


def _check_keys(what: str, state, keys: tuple) -> None:
    if not isinstance(state, Mapping):
        raise StateDictError(f"{what}: expected a mapping, got {type(state).__name__}")
    missing = [k for k in keys if k not in state]
    unexpected = [k for k in state if k not in keys]
    if missing or unexpected:
        raise StateDictError(f"{what}: " + "; ".join(([f"lacks {missing}"] if missing else [])
                                                     + ([f"has unexpected {unexpected}"] if unexpected else [])))


def _check_stats(state) -> PhaseStats:
    counters = ("full_steps", "predict_steps", "correct_steps", "unrecorded")
    tables = ("seconds", "timed", "loss_sum", "loss_count")
    _check_keys("stats", state, counters + tables)
    phases = [p.value for p in Phase]
    for name in tables:
        if not isinstance(state[name], Mapping) or sorted(state[name]) != sorted(phases):
            got = list(state[name]) if isinstance(state[name], Mapping) else type(state[name]).__name__
            raise StateDictError(f"stats {name}: expected a value per phase {phases}, got {got}")

    def table(name, check):
        return {p: check(f"stats {name}[{p!r}]", state[name][p]) for p in phases}

    def seconds(name, v):
        return check_number(name, v, 0.0, error=StateDictError)

    def count(name, v):
        return check_count(name, v, error=StateDictError)

    return PhaseStats(**{k: count(f"stats {k}", state[k]) for k in counters},
                      seconds=table("seconds", seconds), timed=table("timed", count),
                      loss_sum=table("loss_sum", checked_real), loss_count=table("loss_count", count))


# -- checkpoints --------------------------------------------------------------------------------
class _Checkpointed:
    """What :func:`arraytrain.save` / :func:`arraytrain.load` are handed: the engine's state tree with
    the controller's added under ``"phase"`` (only the controller's without an engine).

    Loading checks the controller's part, then lets the engine check and load its own
    (a refusal there changes nothing), then loads the controller's: all or nothing.
    """

    def __init__(self, controller: "PhaseController", what: str):
        if not isinstance(controller, PhaseController):
            raise ArgumentTypeError(f"controller: expected an arraytrain.phase.PhaseController, "
                                    f"got {type(controller).__name__}")
        controller._between_steps(what)
        engine = controller.engine
        if engine is not None and not engine.comm.is_local:
            raise CheckpointError(f"{what}: a PhaseController's checkpoint is written and read by one process; "
                                  "this engine runs over a group of processes")
        self.controller, self.engine = controller, engine

        self.comm = LocalComm()

    def exclusive(self, what: str):
        """The engine's call guard, held while the file is written or read: another thread's
        ``engine.step()`` would change the buffers (:func:`arraytrain.save` holds it the same way)."""
        return nullcontext() if self.engine is None else self.engine.exclusive(what)

    def state_dict(self, copy: bool = True) -> dict:
        return self._with_phase({} if self.engine is None else self.engine.state_dict(copy=copy), copy)

    def state_template(self) -> dict:
        return self._with_phase({} if self.engine is None else self.engine.state_template(), False)

    def _with_phase(self, tree: Mapping, copy: bool) -> dict:
        tree = dict(tree)
        if PHASE_KEY in tree:
            raise CheckpointError(f"the engine's state has a key {PHASE_KEY!r} of its own")
        tree[PHASE_KEY] = self.controller.state_dict(copy=copy)
        return tree

    def check_state(self, tree: Mapping) -> tuple:
        mine = self.controller.check_state(tree[PHASE_KEY])
        if self.engine is None:
            return mine, None
        return mine, self.engine.check_state({k: v for k, v in tree.items() if k != PHASE_KEY})

    def apply_state(self, checked: tuple) -> None:
        mine, engine = checked
        if self.engine is not None:
            self.engine.apply_state(engine)
        self.controller.apply_state(mine)


def save(path, controller: PhaseController, *, extra: Mapping | None = None) -> None:
    """Write ``controller``'s engine (if any) and the controller's own state to ``path``, atomically.

    One safetensors file of :func:`arraytrain.save`'s format (arrays as
    tensors, the predictor's ring and correction included), ``extra`` as
    there. Between steps only (:class:`PhaseOrderError` inside one).
    """
    state = _Checkpointed(controller, "save")
    with state.exclusive("arraytrain.phase.save()"):
        checkpoint.save(path, state, extra=extra)


def load(path, controller: PhaseController) -> dict:
    """Load a checkpoint written by :func:`save` into ``controller`` and its engine; return ``extra``.

    The file, the engine's part and the controller's part are all validated
    before anything is written; a refused file raises
    :class:`~arraytrain.CheckpointError` and changes neither. A file written
    by :func:`arraytrain.save` has no phase state and is refused (load it with
    :func:`arraytrain.load` to start prediction afresh from its weights).
    """
    state = _Checkpointed(controller, "load")
    with state.exclusive("arraytrain.phase.load()"):
        return checkpoint.load(path, state)
