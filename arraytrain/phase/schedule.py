"""Phase training's schedule and counters: :class:`Phase`, :class:`PhaseSchedule` (the cycle and its
adaptive lengths) and :class:`PhaseStats` (see :mod:`arraytrain.phase`)."""



from __future__ import annotations

import numbers
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from .._checks import check_bool, check_count, check_int, check_number, shown
from ..errors import HyperparameterError, StateDictError

LOSS_WINDOW = 100   #: FULL/CORRECT losses kept for the adaptive rule
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


def checked_real(name: str, value, error=StateDictError) -> float:
    """A float from an int or float (NaN/Inf included: a loss may be one), else ``error``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{name}: expected a number, got {shown(value)}")
    return float(value)


class PhaseSchedule:
    """The phase state machine alone: :meth:`begin` gives the phase of the next step,
    :meth:`end` closes it (with its loss on FULL/CORRECT steps, None on PREDICT).

    See the module docstring for the rule. ``full_steps`` and
    ``predict_steps`` are the current lengths (the adaptive rule changes them).
    """

    def __init__(self, full_steps: int = 10, predict_steps: int = 40, correct_every: int = 10, *,
                 adaptive: bool = False, loss_threshold: float = 0.1, full_bounds=(5, 50),
                 predict_bounds=(10, 100)):
        self.correct_every = check_int("correct_every", correct_every, 1)
        self.adaptive = check_bool("adaptive", adaptive)
        self.loss_threshold = check_number("loss_threshold", loss_threshold, 0.0)
        self.full_bounds = _bounds("full_bounds", full_bounds)
        self.predict_bounds = _bounds("predict_bounds", predict_bounds)
        self.full_steps, self.predict_steps = self._lengths(full_steps, predict_steps, HyperparameterError)
        self.phase = Phase.FULL
        self.phase_step = 0
        self.cycle = 0
        self.losses: deque = deque(maxlen=LOSS_WINDOW)

    def _lengths(self, full_steps, predict_steps, error) -> tuple[int, int]:
        full = check_int("full_steps", full_steps, 1, error=error)
        predict = check_int("predict_steps", predict_steps, 1, error=error)
        if self.adaptive:
            for name, v, (lo, hi) in (("full_steps", full, self.full_bounds),
                                      ("predict_steps", predict, self.predict_bounds)):
                if not lo <= v <= hi:
                    raise error(f"{name}: {v} is outside its bounds [{lo}, {hi}] "
                                f"({name.split('_')[0]}_bounds) with adaptive=True")
        return full, predict

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
        """The adaptive rule (see the module docstring) on the kept FULL/CORRECT losses (no-op below 20)."""
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

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The position in the cycle, the current lengths and the kept losses (JSON values).

        ``correct_every``, ``adaptive``, ``loss_threshold`` and the bounds are
        hyperparameters: a load keeps the schedule's own.
        """
        return {"phase": self.phase.value, "phase_step": self.phase_step, "cycle": self.cycle,
                "full_steps": self.full_steps, "predict_steps": self.predict_steps, "losses": list(self.losses)}

    def load_state_dict(self, state: Mapping) -> None:
        """Load :meth:`state_dict` output; everything is validated before anything is written."""
        self.apply_state(self.check_state(state))

    def check_state(self, state: Mapping) -> dict:
        """Validate a :meth:`state_dict` against this schedule; change nothing. Returns what
        :meth:`apply_state` takes. With ``adaptive=True`` the lengths must lie in the bounds."""
        keys = ("phase", "phase_step", "cycle", "full_steps", "predict_steps", "losses")
        try:
            phase, phase_step, cycle, full, predict, losses = (state[k] for k in keys)
        except (KeyError, TypeError) as exc:
            raise StateDictError(f"schedule state lacks {exc}") from None
        try:
            phase = Phase(phase)
        except (ValueError, TypeError):
            raise StateDictError(f"phase: expected one of {[p.value for p in Phase]}, got {shown(phase)}") from None
        full, predict = self._lengths(full, predict, StateDictError)
        if not isinstance(losses, (list, tuple)) or len(losses) > LOSS_WINDOW:
            got = f"a list of {len(losses)}" if isinstance(losses, (list, tuple)) else type(losses).__name__
            raise StateDictError(f"losses: expected a list of at most {LOSS_WINDOW} numbers, got {got}")
        return {"phase": phase, "phase_step": check_count("phase_step", phase_step, error=StateDictError),
                "cycle": check_count("cycle", cycle, error=StateDictError), "full_steps": full,
                "predict_steps": predict, "losses": [checked_real(f"losses[{i}]", v) for i, v in enumerate(losses)]}

    def apply_state(self, checked: dict) -> None:
        """Load a state validated by :meth:`check_state` (assignments only: cannot fail)."""
        self.phase, self.phase_step, self.cycle = checked["phase"], checked["phase_step"], checked["cycle"]
        self.full_steps, self.predict_steps = checked["full_steps"], checked["predict_steps"]
        self.losses = deque(checked["losses"], maxlen=LOSS_WINDOW)


def _per_phase(value):
    return field(default_factory=lambda: {p.value: value for p in Phase})


@dataclass
class PhaseStats:
    """What a :class:`PhaseController` (or :class:`~arraytrain.nn.PhaseTrainer`) did.

    Steps and backward passes per phase, wall clock per phase, losses per phase.
    ``seconds[phase]`` is the wall clock of that phase's steps from
    ``begin_step`` to ``end_step`` (forward, backward, prediction, the
    optimizer step: what the caller does in between), summed over the
    ``timed[phase]`` steps timed: the first step of each phase in a process is
    not, since it compiles (or loads) kernels. ``loss_sum`` / ``loss_count``
    are over the losses given to ``end_step``. ``step_ratio`` is steps /
    backward passes, a count, not a speedup; :attr:`wall_speedup` is the one
    the measured times give.
    """

    full_steps: int = 0
    predict_steps: int = 0
    correct_steps: int = 0
    cycles: int = 0
    unrecorded: int = 0   # FULL/CORRECT gradients with NaN/Inf, not recorded by the predictor
    seconds: dict = _per_phase(0.0)
    timed: dict = _per_phase(0)
    loss_sum: dict = _per_phase(0.0)
    loss_count: dict = _per_phase(0)

    @property
    def steps(self) -> int:
        """Steps of every phase together."""
        return self.full_steps + self.predict_steps + self.correct_steps

    @property
    def backward_passes(self) -> int:
        """Steps that computed a true gradient: FULL and CORRECT."""
        return self.full_steps + self.correct_steps

    @property
    def step_ratio(self) -> float:
        """Steps / backward passes: a count, not a speedup (see :attr:`wall_speedup`)."""
        return self.steps / max(self.backward_passes, 1)

    @property
    def total_seconds(self) -> float:
        """Timed wall clock of every phase together (``seconds`` summed)."""
        return sum(self.seconds.values())

    def counts(self) -> dict:
        """Steps per phase: ``{"full": ..., "predict": ..., "correct": ...}``."""
        return {"full": self.full_steps, "predict": self.predict_steps, "correct": self.correct_steps}

    def seconds_per_step(self) -> dict:
        """Mean seconds of a timed step per phase (0.0 where none was timed)."""
        return {k: (self.seconds[k] / n if n else 0.0) for k, n in self.timed.items()}

    def mean_losses(self) -> dict:
        """Mean of the losses given to ``end_step`` per phase (None where none was given)."""
        return {k: (self.loss_sum[k] / n if n else None) for k, n in self.loss_count.items()}

    @property
    def wall_speedup(self) -> float | None:
        r"""The speedup the measured step times give, or None before every phase seen was timed.

        :math:`\frac{S \, \bar t_b}{\sum_p n_p \bar t_p}`: the time of all
        :math:`S` steps at the mean time :math:`\bar t_b` of a FULL/CORRECT
        step (a step with a backward pass), over their time at each phase's
        mean :math:`\bar t_p`. It covers what runs between ``begin_step`` and
        ``end_step``; data loading and evaluation outside it are not in it.
        """
        counts, per_step = self.counts(), self.seconds_per_step()
        backward_timed = self.timed["full"] + self.timed["correct"]
        if not backward_timed or any(n and not self.timed[k] for k, n in counts.items()):
            return None
        spent = sum(n * per_step[k] for k, n in counts.items())
        backward = (self.seconds["full"] + self.seconds["correct"]) / backward_timed
        return self.steps * backward / spent if spent > 0 else None

