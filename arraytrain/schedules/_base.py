"""The schedule protocol: :class:`Schedule`, its argument checks and its state dicts (:func:`from_state_dict`)."""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Mapping

import numpy as np

from .._checks import check_count, check_number, shown
from ..errors import ArgumentTypeError, DTypeError, HyperparameterError, StateDictError
from ._format1 import FORMAT_1_TYPES, from_format_1

# a state dict's "format" (2: torch's names only; format 1 is read by the loader, see _format1.py)
SCHEDULE_FORMAT = 2
# Schedules nest (Warmup(then=...), Sequential segments, ReduceLROnPlateau(inner=...)) at most this
# deep, counting the outermost: far beyond any real composition, and far below Python's
# recursion limit for the recursive lr, state_dict and from_state_dict (a checkpoint holds the
# nesting as JSON, three levels per schedule at most).
MAX_NESTING = 32


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


def check_schedule(name: str, value) -> "Schedule":
    """A schedule to nest inside another: it may itself nest at most ``MAX_NESTING - 1`` deep."""
    if not isinstance(value, Schedule):
        raise ArgumentTypeError(f"{name}: expected an arraytrain schedule, got {type(value).__name__}")
    if value._depth() >= MAX_NESTING:
        raise HyperparameterError(f"{name}: schedules nest at most {MAX_NESTING} deep; this one would nest "
                                  f"{value._depth() + 1} deep")
    return value


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
        """The lr for the update after ``step`` applied optimizer steps (see the package docstring)."""
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
        """Nesting depth, this schedule included (bounded: nested schedules passed check_schedule)."""
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
            kwargs[f] = rebuild(d[f], f"{path}.{f}", depth + 1)
        return construct(cls, kwargs, path)

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


def construct(cls, kwargs: dict, path: str) -> Schedule:
    try:
        return cls(**kwargs)
    except (HyperparameterError, ArgumentTypeError) as exc:
        raise StateDictError(f"{path}: {exc}") from None


# -- rebuilding from a state dict ---------------------------------------------------------------------
_REGISTRY: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: :func:`from_state_dict` rebuilds ``cls`` from a state dict whose ``type`` is its name."""
    _REGISTRY[cls.__name__] = cls
    return cls


def rebuild(d, path: str, depth: int = 1) -> Schedule:
    """:func:`from_state_dict` of a schedule at ``path``, nested ``depth`` deep (the outermost: 1)."""
    if depth > MAX_NESTING:
        raise StateDictError(f"{path}: schedules nest at most {MAX_NESTING} deep")
    if not isinstance(d, Mapping):
        raise StateDictError(f"{path}: expected a dict, got {type(d).__name__}")
    typ = d.get("type")
    if not isinstance(typ, str) or (typ not in _REGISTRY and typ not in FORMAT_1_TYPES):
        raise StateDictError(f"{path}.type: expected one of {sorted(_REGISTRY)}, got {shown(typ)}")
    fmt = d.get("format")
    if isinstance(fmt, bool) or fmt not in (1, SCHEDULE_FORMAT):
        raise StateDictError(f"{path}.format: expected 1 or {SCHEDULE_FORMAT}, got {shown(fmt)}")
    if fmt == 1:
        d = from_format_1(d)
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
    return rebuild(state, "schedule")
