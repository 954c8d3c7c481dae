r"""Learning-rate schedules: closed-form functions of the optimizer step, plus reduce-on-plateau.

A schedule is called as ``lr = schedule(step, base_lr)`` once per applied
optimizer step. ``step`` is the number of optimizer steps already applied
(0 for the first update), which is torch's convention: the lr used by the
``(t+1)``-th ``optimizer.step()`` equals the torch scheduler's lr after ``t``
``scheduler.step()`` calls. ``base_lr`` is a float or a 1-D floating NumPy
array (per-parameter base lrs); the result is of the same kind (a float, or a
new float64 array of the same shape). Skipped steps do not advance ``step``;
that is the caller's business, since every schedule here is a pure function
of ``(step, base_lr)`` -- except :class:`ReduceLROnPlateau`, whose state moves
only through :meth:`Schedule.observe`.

Formulas, with :math:`b` the base lr and :math:`t` the step:

Names: a schedule that computes what a ``torch.optim.lr_scheduler`` class computes carries
that class's name and its argument names (without the optimizer: the base lr comes with each
call), so torch code ports by dropping the optimizer argument; the schedules torch has no
class for keep plain names (``Constant``, ``Warmup``, ``Sequential``, whose argument is a
list of ``(schedule, n_steps)`` pairs rather than torch's schedulers and milestones). A state
dict of format 1 (saved before torch's names were adopted: ``MultiStep``, ``Exponential``,
``Linear``, ``Cosine``, ``CosineWarmRestarts``, ``Polynomial``, ``OneCycle``,
``ReduceOnPlateau``; ``total_steps`` of LinearLR, CosineAnnealingLR and PolynomialLR,
``min_lr`` of CosineAnnealingLR, ``anneal`` of OneCycleLR) still loads: the loader reads
those names by the dict's format, and the API has one spelling of each.

- ``Constant()``: :math:`b`.
- ``StepLR(step_size, gamma)``: :math:`b\,\gamma^{\lfloor t / \text{step\_size} \rfloor}` (torch StepLR).
- ``MultiStepLR(milestones, gamma)``: :math:`b\,\gamma^{k}` with :math:`k = \#\{m \in
  \text{milestones} : m \le t\}`; a repeated milestone counts as often as it appears (torch MultiStepLR).
- ``ExponentialLR(gamma)``: :math:`b\,\gamma^{t}` (torch ExponentialLR).
- ``LinearLR(total_iters, start_factor, end_factor)``: :math:`b\,(s + (e - s)\,\min(t, T)/T)`
  (torch LinearLR; holds :math:`b\,e` from :math:`t = T` on).
- ``CosineAnnealingLR(T_max, eta_min)``: :math:`\eta_{min} + (b - \eta_{min})\,(1 + \cos(\pi t/T))/2`
  for :math:`t \le T`, and :math:`\eta_{min}` for :math:`t > T` (torch CosineAnnealingLR up to
  :math:`T`; SGDR, Loshchilov & Hutter 2017, without restarts). Past :math:`T` torch's formula
  climbs back up towards :math:`b` over the next :math:`T` steps; here the lr stays at
  :math:`\eta_{min}` (use :class:`CosineAnnealingWarmRestarts` for restarts).
- ``CosineAnnealingWarmRestarts(T_0, T_mult, eta_min)``: :math:`\eta_{min} + (b - \eta_{min})\,(1 +
  \cos(\pi T_{cur}/T_i))/2` where the cycles have lengths :math:`T_0, T_0 T_{mult}, T_0
  T_{mult}^2, \dots` and :math:`T_{cur}` is the position of :math:`t` inside cycle :math:`i`
  (torch CosineAnnealingWarmRestarts; found with integer arithmetic, so cycle ends are exact).
- ``PolynomialLR(total_iters, power)``: :math:`b\,(1 - \min(t, T)/T)^{p}` (torch PolynomialLR).
- ``OneCycleLR(total_steps, pct_start, anneal_strategy, div_factor, final_div_factor, three_phase)``
  (Smith & Topin 2017, torch OneCycleLR with ``max_lr = b``): with :math:`l_0 = b/\text{div}`,
  :math:`l_{min} = l_0/\text{final\_div}` and :math:`P = \text{pct\_start}\cdot T`, the phases
  end at steps :math:`P - 1` (:math:`l_0 \to b`) and :math:`T - 1` (:math:`b \to l_{min}`); with
  ``three_phase`` at :math:`P - 1` (:math:`l_0 \to b`), :math:`2P - 2` (:math:`b \to l_0`) and
  :math:`T - 1` (:math:`l_0 \to l_{min}`). Inside a phase running from step :math:`s_0` to
  :math:`s_1` from :math:`a` to :math:`z`, with :math:`q = (t - s_0)/(s_1 - s_0)`:
  ``anneal_strategy`` ``"cos"``: :math:`z + (a - z)(1 + \cos(\pi q))/2`; ``"linear"``: :math:`a + (z - a) q`.
  From :math:`t = T - 1` on the lr stays at :math:`l_{min}` (torch raises past :math:`T`).
- ``Warmup(steps, then, start_factor)``: :math:`b\,(s + (1 - s)\,t/W)` for :math:`t < W`, then
  ``then(t - W, b)``: torch ``SequentialLR([LinearLR(start_factor=s, total_iters=W), then],
  milestones=[W])``, where ``then`` starts from its own step 0.
- ``Sequential([(s_0, n_0), (s_1, n_1), ..., (s_k, None)])``: segment :math:`j` covers
  :math:`n_j` steps starting at :math:`N_j = n_0 + \dots + n_{j-1}` and is evaluated at its own
  local step :math:`t - N_j` (torch SequentialLR); the last segment runs for ever.
- ``ReduceLROnPlateau(inner, mode, factor, patience, threshold, threshold_mode, cooldown,
  min_lr, eps)``: torch ReduceLROnPlateau's rules. Each :meth:`~Schedule.observe` of a metric
  :math:`x` (once per epoch or evaluation) counts a bad epoch unless :math:`x` is better than
  the best so far -- ``min``/``rel``: :math:`x < best\,(1 - \theta)`; ``min``/``abs``:
  :math:`x < best - \theta`; ``max``/``rel``: :math:`x > best\,(1 + \theta)`; ``max``/``abs``:
  :math:`x > best + \theta` (a NaN is never better). During cooldown bad epochs are not
  counted; after more than ``patience`` bad epochs a reduction is recorded and cooldown
  starts. The lr at step :math:`t` replays the :math:`n` recorded reductions on the inner lr
  :math:`l = \text{inner}(t, b)`, element by element: :math:`n` times, :math:`l' = \max(l\cdot
  \text{factor}, \text{min\_lr})`, kept only if :math:`l - l' > \epsilon`. With a constant inner
  this is exactly torch's sequence of lrs, per parameter group, eps rule included; in general
  it is :math:`\max(\text{inner}\cdot \text{factor}^n, \text{min\_lr})` until a reduction would
  be smaller than ``eps``. ``min_lr`` only bounds the reductions: an inner lr already below it
  (e.g. during a warm-up) is left as it is.

Per-parameter base lrs (an array ``b``) go through the same formulas element by element.
The ``eta_min`` of ``CosineAnnealingLR`` and ``CosineAnnealingWarmRestarts`` is an absolute lr shared
by all elements, as torch's ``eta_min`` is shared by all parameter groups; ``OneCycleLR``'s lrs are all
proportional to ``b``. ``ReduceLROnPlateau`` reduces every element at the same observations (one
metric, as torch reduces every parameter group) with one absolute ``min_lr`` and the eps rule
applied per element.

Composition and metrics: :meth:`Schedule.observe` exists on every schedule, so a caller can
feed metrics without knowing the schedule. A composite (``Warmup``, ``Sequential``,
``ReduceLROnPlateau`` with a stateful inner) needs ``step``, the number of optimizer steps
applied so far, to route the metric to the segment that sets the next lr; the metrics seen
while another segment is active (e.g. during a warm-up) are not counted.

State: ``state_dict()`` is a JSON-serialisable dict (non-finite floats as the strings
``"inf"``, ``"-inf"``, ``"nan"``), holding the hyperparameters, nested schedules and
reduce-on-plateau's counters; :func:`from_state_dict` rebuilds any schedule from it, and
``load_state_dict`` restores it into a schedule of the same structure, validating all of it
before changing anything.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from itertools import accumulate

import numpy as np

from ._checks import check_bool, check_count, check_number, check_positive, shown
from .errors import ArgumentTypeError, DTypeError, HyperparameterError, StateDictError

__all__ = [
    "Schedule",
    "Constant",
    "StepLR",
    "MultiStepLR",
    "ExponentialLR",
    "LinearLR",
    "CosineAnnealingLR",
    "CosineAnnealingWarmRestarts",
    "PolynomialLR",
    "OneCycleLR",
    "Warmup",
    "Sequential",
    "ReduceLROnPlateau",
    "from_state_dict",
    "SCHEDULE_FORMAT",
]

#: The ``format`` of a schedule's :meth:`~Schedule.state_dict` (checked by :func:`from_state_dict`).
SCHEDULE_FORMAT = 2  # 2: torch's names only (format 1 read by the loader, see _FORMAT_1_TYPES)
# Schedules nest (Warmup(then=...), Sequential segments, ReduceLROnPlateau(inner=...)) at most this
# deep, counting the outermost: far beyond any real composition, and far below Python's
# recursion limit for the recursive lr, state_dict and from_state_dict (a checkpoint holds the
# nesting as JSON, three levels per schedule at most).
MAX_NESTING = 32
ANNEAL = ("cos", "linear")
MODES = ("min", "max")
THRESHOLD_MODES = ("rel", "abs")


# -- argument checks ----------------------------------------------------------------------------------
def _check_step(step, name: str = "step") -> int:
    return check_count(name, step, 0)


def _check_base_lr(base_lr):
    """``(value, is_array)``: a float64 copy (0-d scalar or 1-D array) of a valid base lr."""
    if isinstance(base_lr, np.ndarray):
        if base_lr.dtype.kind != "f":
            raise DTypeError(f"base_lr: expected a floating array, got dtype {base_lr.dtype}")
        if base_lr.ndim != 1:
            raise ArgumentTypeError(f"base_lr: expected a float or a 1-D array, got an array of shape {base_lr.shape}")
        value = np.array(base_lr, dtype=np.float64)  # a copy: the result never aliases the input
        bad = ~(np.isfinite(value) & (value >= 0))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise HyperparameterError(f"base_lr: expected finite values >= 0, got base_lr[{i}] = {value[i]!r}")
        return value, True
    if isinstance(base_lr, bool) or not isinstance(base_lr, numbers.Real):
        raise ArgumentTypeError(f"base_lr: expected a float or a 1-D float array, got {type(base_lr).__name__}")
    return np.float64(check_number("base_lr", base_lr, 0.0)), False


def _check_metric(metric) -> float:
    if isinstance(metric, (bool, str, bytes)):
        raise ArgumentTypeError(f"metric: expected a real number, got {metric!r}")
    try:
        return float(metric)
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"metric: expected a real number, got {type(metric).__name__}") from None


def _check_choice(name: str, value, choices: tuple) -> str:
    if not isinstance(value, str) or value not in choices:
        raise HyperparameterError(f"{name}: expected one of {choices}, got {value!r}")
    return value


def _check_schedule(name: str, value) -> "Schedule":
    """A schedule to nest inside another: it may itself nest at most ``MAX_NESTING - 1`` deep."""
    if not isinstance(value, Schedule):
        raise ArgumentTypeError(f"{name}: expected an arraytrain schedule, got {type(value).__name__}")
    if value._depth() >= MAX_NESTING:
        raise HyperparameterError(f"{name}: schedules nest at most {MAX_NESTING} deep; this one would nest "
                                  f"{value._depth() + 1} deep")
    return value


def _encode_float(x: float):
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))


def _decode_float(name: str, x) -> float:
    if isinstance(x, str) and x in ("inf", "-inf", "nan"):
        return float(x)
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise StateDictError(f"{name}: expected a number or 'inf', '-inf', 'nan', got {shown(x)}")
    return float(x)


# -- the base class -----------------------------------------------------------------------------------
class Schedule(ABC):
    """Base class: ``schedule(step, base_lr) -> lr``.

    Subclasses list their constructor arguments in ``_fields`` (stored under the
    same attribute names; those in ``_schedule_fields`` are nested schedules) and
    implement ``_lr(step, base)`` on validated input: ``step`` an int >= 0 and
    ``base`` a float64 scalar or 1-D array, computed with NumPy operations that
    serve both.
    """

    _fields: tuple[str, ...] = ()
    _schedule_fields: tuple[str, ...] = ()
    _state_fields: tuple[str, ...] = ()

    def __call__(self, step: int, base_lr):
        """The lr for the update after ``step`` applied optimizer steps (see the module docstring)."""
        step = _check_step(step)
        base, is_array = _check_base_lr(base_lr)
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                lr = self._lr(step, base)
        except OverflowError:  # Python float powers, e.g. gamma > 1 over many steps
            lr = math.inf
        if not np.all(np.isfinite(lr)):
            raise HyperparameterError(f"lr: {self!r} gives a non-finite learning rate at step {step}")
        if is_array:
            return np.array(np.broadcast_to(lr, base.shape), dtype=np.float64)
        return float(lr)

    @abstractmethod
    def _lr(self, step: int, base):
        """The lr at ``step`` for a validated float64 ``base`` (scalar or 1-D array)."""

    # -- metrics ------------------------------------------------------------------------------
    @property
    def stateful(self) -> bool:
        """True when :meth:`observe` changes this schedule (a reduce-on-plateau somewhere inside)."""
        return any(c.stateful for c in self._children())

    def observe(self, metric, step: int | None = None) -> None:
        """Feed a metric (once per epoch or evaluation); a no-op for closed-form schedules.

        ``step``, the number of optimizer steps applied so far, is required when a
        composite holds a reduce-on-plateau: the metric goes to the segment active
        at ``step`` (the one that sets the next lr). Everything is checked first.
        """
        metric = _check_metric(metric)
        if step is not None:
            step = _check_step(step)
        elif self._needs_step():
            raise HyperparameterError(
                f"step: {type(self).__name__} needs the number of applied optimizer steps "
                "to route the metric to its active segment, got None"
            )
        self._observe(metric, step)

    def _needs_step(self) -> bool:
        return self.stateful

    def _observe(self, metric: float, step: int | None) -> None:
        pass

    # -- structure and state ------------------------------------------------------------------
    def _children(self) -> list:
        return [getattr(self, f) for f in self._schedule_fields]

    def _depth(self) -> int:
        """Nesting depth, this schedule included (bounded: nested schedules passed _check_schedule)."""
        return 1 + max((c._depth() for c in self._children()), default=0)

    def _config(self) -> dict:
        out = {}
        for f in self._fields:
            v = getattr(self, f)
            out[f] = v.state_dict() if isinstance(v, Schedule) else (list(v) if isinstance(v, tuple) else v)
        return out

    def _state(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        """A JSON-serialisable dict: ``type``, ``format``, hyperparameters, nested schedules, counters."""
        return {"type": type(self).__name__, "format": SCHEDULE_FORMAT, **self._config(), **self._state()}

    @classmethod
    def _keys(cls) -> set:
        return {"type", "format", *cls._fields, *cls._state_fields}

    @classmethod
    def _from_dict(cls, d: Mapping, path: str, depth: int) -> "Schedule":
        kwargs = {f: d[f] for f in cls._fields}
        for f in cls._schedule_fields:
            kwargs[f] = _from_state_dict(d[f], f"{path}.{f}", depth + 1)
        return _construct(cls, kwargs, path)

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict` output into this schedule (same type and nesting).

        Hyperparameters and counters are taken from ``state``. Everything is
        validated before anything changes; nested schedule objects keep their
        identity. A bad dict raises :class:`~arraytrain.errors.StateDictError`.
        """
        self.apply_state(self.check_state(state))

    def check_state(self, state: Mapping) -> "Schedule":
        """Validate a :meth:`state_dict` against this schedule; change nothing.

        Returns what :meth:`apply_state` takes. The engine checks every part of
        a state this way before it writes anything.
        """
        new = from_state_dict(state)
        self._check_structure(new, "schedule")
        return new

    def apply_state(self, checked: "Schedule") -> None:
        """Restore a state validated by :meth:`check_state` (attribute assignments only: cannot fail)."""
        self._assign(checked)

    def _check_structure(self, other: "Schedule", path: str) -> None:
        if type(other) is not type(self):
            raise StateDictError(f"{path}: state is for {type(other).__name__}, this schedule is "
                                 f"{type(self).__name__} (use from_state_dict to rebuild)")
        mine, theirs = self._children(), other._children()
        if len(mine) != len(theirs):
            raise StateDictError(f"{path}: state has {len(theirs)} nested schedules, this schedule has "
                                 f"{len(mine)} (use from_state_dict to rebuild)")
        for i, (a, b) in enumerate(zip(mine, theirs)):
            a._check_structure(b, f"{path}[{i}]")

    def _assign(self, other: "Schedule") -> None:
        for a, b in zip(self._children(), other._children()):
            a._assign(b)
        for k, v in vars(other).items():
            if not _holds_schedules(v):
                setattr(self, k, v)

    def __repr__(self) -> str:
        args = ", ".join(f"{f}={getattr(self, f)!r}" for f in self._fields)
        return f"{type(self).__name__}({args})"


def _holds_schedules(v) -> bool:
    return isinstance(v, Schedule) or (isinstance(v, list) and any(isinstance(x, Schedule) for x in v))


def _construct(cls, kwargs: dict, path: str) -> Schedule:
    try:
        return cls(**kwargs)
    except (HyperparameterError, ArgumentTypeError) as exc:
        raise StateDictError(f"{path}: {exc}") from None


# -- closed-form schedules ----------------------------------------------------------------------------
class Constant(Schedule):
    """The base lr at every step."""

    def _lr(self, step, base):
        return base


class StepLR(Schedule):
    r""":math:`b\,\gamma^{\lfloor t/\text{step\_size}\rfloor}` (torch.optim.lr_scheduler.StepLR)."""

    _fields = ("step_size", "gamma")

    def __init__(self, step_size: int, gamma: float = 0.1):
        self.step_size = check_count("step_size", step_size, 1)
        self.gamma = check_positive("gamma", gamma)

    def _lr(self, step, base):
        return base * self.gamma ** (step // self.step_size)


class MultiStepLR(Schedule):
    r""":math:`b\,\gamma^{k}`, :math:`k` the number of milestones :math:`\le t` (torch MultiStepLR).

    ``milestones`` must be non-decreasing ints >= 0; a repeated milestone
    multiplies by ``gamma`` once per occurrence, as in torch.
    """

    _fields = ("milestones", "gamma")

    def __init__(self, milestones: Sequence[int], gamma: float = 0.1):
        if isinstance(milestones, (str, bytes, Mapping)) or not isinstance(milestones, Sequence):
            raise HyperparameterError(f"milestones: expected a sequence of ints, got {milestones!r}")
        ms = tuple(check_count(f"milestones[{i}]", m, 0) for i, m in enumerate(milestones))
        for i in range(1, len(ms)):
            if ms[i] < ms[i - 1]:
                raise HyperparameterError(f"milestones: expected a non-decreasing sequence, got {list(ms)}")
        self.milestones = ms
        self.gamma = check_positive("gamma", gamma)

    def _lr(self, step, base):
        return base * self.gamma ** bisect_right(self.milestones, step)


class ExponentialLR(Schedule):
    r""":math:`b\,\gamma^{t}` (torch ExponentialLR)."""

    _fields = ("gamma",)

    def __init__(self, gamma: float):
        self.gamma = check_positive("gamma", gamma)

    def _lr(self, step, base):
        return base * self.gamma ** step


class LinearLR(Schedule):
    r""":math:`b\,(s + (e - s)\min(t, T)/T)`, :math:`T` = ``total_iters`` (torch LinearLR;
    ``start_factor`` 0 is allowed here)."""

    _fields = ("total_iters", "start_factor", "end_factor")

    def __init__(self, total_iters: int, start_factor: float = 1.0 / 3, end_factor: float = 1.0):
        self.total_iters = check_count("total_iters", total_iters, 1)
        self.start_factor = check_number("start_factor", start_factor, 0.0, 1.0)
        self.end_factor = check_number("end_factor", end_factor, 0.0, 1.0)

    def _lr(self, step, base):
        s, e = self.start_factor, self.end_factor
        return base * (s + (e - s) * min(step, self.total_iters) / self.total_iters)


class CosineAnnealingLR(Schedule):
    r"""Cosine annealing from :math:`b` to ``eta_min`` over ``T_max`` steps, then ``eta_min``.

    :math:`\eta_{min} + (b - \eta_{min})(1 + \cos(\pi t/T))/2` for :math:`t \le T`
    (torch CosineAnnealingLR; Loshchilov & Hutter 2017). For :math:`t > T` the lr stays
    at ``eta_min``, where torch's formula would rise again.
    """

    _fields = ("T_max", "eta_min")

    def __init__(self, T_max: int, eta_min: float = 0.0):  # noqa: N803 (torch's names)
        self.T_max = check_count("T_max", T_max, 1)
        self.eta_min = check_number("eta_min", eta_min, 0.0)

    def _lr(self, step, base):
        if step >= self.T_max:
            return base * 0.0 + self.eta_min
        c = 1.0 + math.cos(math.pi * step / self.T_max)
        return self.eta_min + (base - self.eta_min) * c / 2


class CosineAnnealingWarmRestarts(Schedule):
    r"""SGDR (Loshchilov & Hutter 2017): cosine cycles of lengths :math:`T_0 T_{mult}^i`.

    :math:`\eta_{min} + (b - \eta_{min})(1 + \cos(\pi T_{cur}/T_i))/2`, torch
    CosineAnnealingWarmRestarts stepped without an epoch argument.
    """

    _fields = ("T_0", "T_mult", "eta_min")

    def __init__(self, T_0: int, T_mult: int = 1, eta_min: float = 0.0):
        self.T_0 = check_count("T_0", T_0, 1)
        self.T_mult = check_count("T_mult", T_mult, 1)
        self.eta_min = check_number("eta_min", eta_min, 0.0)

    def _position(self, step: int) -> tuple[int, int]:
        if self.T_mult == 1:
            return step % self.T_0, self.T_0
        t_cur, t_i = step, self.T_0
        while t_cur >= t_i:  # cycles grow geometrically: O(log step) iterations
            t_cur -= t_i
            t_i *= self.T_mult
        return t_cur, t_i

    def _lr(self, step, base):
        t_cur, t_i = self._position(step)
        return self.eta_min + (base - self.eta_min) * (1 + math.cos(math.pi * t_cur / t_i)) / 2


class PolynomialLR(Schedule):
    r""":math:`b\,(1 - \min(t, T)/T)^{p}`, :math:`T` = ``total_iters`` (torch PolynomialLR)."""

    _fields = ("total_iters", "power")

    def __init__(self, total_iters: int, power: float = 1.0):
        self.total_iters = check_count("total_iters", total_iters, 1)
        self.power = check_positive("power", power)

    def _lr(self, step, base):
        return base * (1.0 - min(step, self.total_iters) / self.total_iters) ** self.power


class OneCycleLR(Schedule):
    r"""The 1cycle policy (Smith & Topin 2017), torch OneCycleLR with ``max_lr = base_lr``.

    Starts at ``base_lr / div_factor``, rises to ``base_lr`` over the first
    ``pct_start * total_steps - 1`` steps, then anneals to
    ``base_lr / div_factor / final_div_factor`` at step ``total_steps - 1``
    (``three_phase``: back to the start lr first, then to the minimum). The lr
    stays at the minimum from ``total_steps - 1`` on. ``anneal_strategy``: ``"cos"`` or
    ``"linear"``. Momentum cycling is not part of a learning-rate schedule and is not done.
    """

    _fields = ("total_steps", "pct_start", "anneal_strategy", "div_factor", "final_div_factor", "three_phase")

    def __init__(self, total_steps: int, pct_start: float = 0.3, anneal_strategy: str = "cos",
                 div_factor: float = 25.0, final_div_factor: float = 1e4, three_phase: bool = False):
        self.total_steps = check_count("total_steps", total_steps, 2)
        self.pct_start = check_number("pct_start", pct_start, 0.0, 1.0, lo_open=True, hi_open=True)
        self.anneal_strategy = _check_choice("anneal_strategy", anneal_strategy, ANNEAL)
        self.div_factor = check_positive("div_factor", div_factor)
        self.final_div_factor = check_positive("final_div_factor", final_div_factor)
        self.three_phase = check_bool("three_phase", three_phase)
        # torch's phase ends, in its float arithmetic
        p = float(self.pct_start * self.total_steps)
        if p - 1 <= 0:
            raise HyperparameterError(f"pct_start: pct_start * total_steps = {p!r} must exceed 1 so that the "
                                      "warm-up phase has a length")
        if self.three_phase:
            ends = (p - 1, float(2 * self.pct_start * self.total_steps) - 2, self.total_steps - 1)
            if ends[1] >= ends[2]:
                raise HyperparameterError(f"pct_start: with three_phase, 2 * pct_start * total_steps - 2 = {ends[1]!r} "
                                          f"must be below total_steps - 1 = {ends[2]}")
            self._phases = ((ends[0], "initial", "max"), (ends[1], "max", "initial"), (ends[2], "initial", "min"))
        else:
            self._phases = ((p - 1, "initial", "max"), (self.total_steps - 1, "max", "min"))

    def _lr(self, step, base):
        initial = base / self.div_factor
        lrs = {"initial": initial, "max": base, "min": initial / self.final_div_factor}
        step = min(step, self.total_steps - 1)
        start = 0.0
        for i, (end, a, z) in enumerate(self._phases):
            if step <= end or i == len(self._phases) - 1:
                pct = (step - start) / (end - start)
                a, z = lrs[a], lrs[z]
                if self.anneal_strategy == "cos":
                    return z + (a - z) / 2.0 * (math.cos(math.pi * pct) + 1)
                return (z - a) * pct + a
            start = end
        raise AssertionError("unreachable: the last phase always matches")


# -- composition --------------------------------------------------------------------------------------
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
        self.then = Constant() if then is None else _check_schedule("then", then)
        self.start_factor = check_number("start_factor", start_factor, 0.0, 1.0)

    def _lr(self, step, base):
        if step < self.steps:
            return base * (self.start_factor + (1.0 - self.start_factor) * step / self.steps)
        return self.then._lr(step - self.steps, base)

    def _observe(self, metric, step):
        if self.then.stateful and step >= self.steps:
            self.then._observe(metric, step - self.steps)


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
            schedules.append(_check_schedule(f"segments[{i}]", sched))
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
            pairs.append((_from_state_dict(seg["schedule"], f"{p}.schedule", depth + 1), seg["steps"]))
        return _construct(cls, {"segments": pairs}, path)

    def __repr__(self):
        return f"Sequential({list(self.segments)!r})"


# -- reduce on plateau --------------------------------------------------------------------------------
class ReduceLROnPlateau(Schedule):
    """torch ReduceLROnPlateau's rules over an inner schedule (see the module docstring).

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
        self.inner = Constant() if inner is None else _check_schedule("inner", inner)
        self.mode = _check_choice("mode", mode, MODES)
        self.factor = check_number("factor", factor, 0.0, 1.0, hi_open=True)
        self.patience = check_count("patience", patience, 0)
        self.threshold = check_number("threshold", threshold, 0.0)
        self.threshold_mode = _check_choice("threshold_mode", threshold_mode, THRESHOLD_MODES)
        self.cooldown = check_count("cooldown", cooldown, 0)
        self.min_lr = check_number("min_lr", min_lr, 0.0)
        self.eps = check_number("eps", eps, 0.0)
        self.best = math.inf if self.mode == "min" else -math.inf
        self.num_bad_epochs = 0
        self.cooldown_counter = 0
        self.num_reductions = 0
        self.last_epoch = 0

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
        return {"best": _encode_float(self.best), "num_bad_epochs": self.num_bad_epochs,
                "cooldown_counter": self.cooldown_counter, "num_reductions": self.num_reductions,
                "last_epoch": self.last_epoch}

    @classmethod
    def _from_dict(cls, d, path, depth):
        new = super()._from_dict(d, path, depth)
        new.best = _decode_float(f"{path}.best", d["best"])
        new.num_bad_epochs = check_count(f"{path}.num_bad_epochs", d["num_bad_epochs"], 0, new.patience,
                                       error=StateDictError)
        new.cooldown_counter = check_count(f"{path}.cooldown_counter", d["cooldown_counter"], 0, new.cooldown,
                                         error=StateDictError)
        new.num_reductions = check_count(f"{path}.num_reductions", d["num_reductions"], 0, error=StateDictError)
        new.last_epoch = check_count(f"{path}.last_epoch", d["last_epoch"], 0, error=StateDictError)
        return new

    def __repr__(self):
        return (f"{super().__repr__()[:-1]}; best={self.best!r}, num_bad_epochs={self.num_bad_epochs}, "
                f"cooldown_counter={self.cooldown_counter}, num_reductions={self.num_reductions})")


# -- rebuilding from a state dict ---------------------------------------------------------------------
_REGISTRY = {cls.__name__: cls for cls in (Constant, StepLR, MultiStepLR, ExponentialLR, LinearLR, CosineAnnealingLR,
                                           CosineAnnealingWarmRestarts, PolynomialLR, OneCycleLR, Warmup, Sequential,
                                           ReduceLROnPlateau)}
# format 1 (state dicts saved before torch's names were adopted): its class names and field names,
# read as today's by the loader
_FORMAT_1_TYPES = {
    "MultiStep": "MultiStepLR",
    "Exponential": "ExponentialLR",
    "Linear": "LinearLR",
    "Cosine": "CosineAnnealingLR",
    "CosineWarmRestarts": "CosineAnnealingWarmRestarts",
    "Polynomial": "PolynomialLR",
    "OneCycle": "OneCycleLR",
    "ReduceOnPlateau": "ReduceLROnPlateau",
}
_FORMAT_1_FIELDS = {
    "LinearLR": {"total_steps": "total_iters"},
    "CosineAnnealingLR": {"total_steps": "T_max", "min_lr": "eta_min"},
    "PolynomialLR": {"total_steps": "total_iters"},
    "OneCycleLR": {"anneal": "anneal_strategy"},
}


def _from_format_1(d: Mapping) -> dict:
    """A format-1 state dict with today's type and field names (its nested schedules stay format 1)."""
    typ = _FORMAT_1_TYPES.get(d["type"], d["type"])
    renames = {old: new for old, new in _FORMAT_1_FIELDS.get(typ, {}).items() if old in d and new not in d}
    return {renames.get(k, k): v for k, v in d.items()} | {"type": typ}


def _from_state_dict(d, path: str, depth: int = 1) -> Schedule:
    if depth > MAX_NESTING:
        raise StateDictError(f"{path}: schedules nest at most {MAX_NESTING} deep")
    if not isinstance(d, Mapping):
        raise StateDictError(f"{path}: expected a dict, got {type(d).__name__}")
    typ = d.get("type")
    if not isinstance(typ, str) or (typ not in _REGISTRY and typ not in _FORMAT_1_TYPES):
        raise StateDictError(f"{path}.type: expected one of {sorted(_REGISTRY)}, got {shown(typ)}")
    fmt = d.get("format")
    if isinstance(fmt, bool) or fmt not in (1, SCHEDULE_FORMAT):
        raise StateDictError(f"{path}.format: expected 1 or {SCHEDULE_FORMAT}, got {shown(fmt)}")
    if fmt == 1:
        d = _from_format_1(d)
        typ = d["type"]
    cls = _REGISTRY.get(typ)
    if cls is None:  # a format-1 name in today's format
        raise StateDictError(f"{path}.type: expected one of {sorted(_REGISTRY)}, got {shown(typ)}")
    keys, expected = set(d), cls._keys()
    if keys != expected:
        missing, unknown = sorted(expected - keys), sorted(map(str, keys - expected))
        raise StateDictError(f"{path}: {typ} state " + "; ".join(
            s for s in (f"lacks {missing}" if missing else "", f"has unknown keys {unknown}" if unknown else "") if s))
    return cls._from_dict(d, path, depth)


def from_state_dict(state: Mapping) -> Schedule:
    """Rebuild any schedule, nested ones included, from its :meth:`Schedule.state_dict`.

    Raises :class:`~arraytrain.errors.StateDictError` naming the offending key
    (e.g. ``schedule.then.inner.patience``) for anything malformed.
    """
    return _from_state_dict(state, "schedule")
