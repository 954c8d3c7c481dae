"""Validation of scalar arguments: one place for the rules and the messages."""

from __future__ import annotations

import math
import numbers

from .errors import HyperparameterError

# Counters (steps, call counts, skips, epochs) are bounded by 2**53: every such int converts to
# a float64 exactly, and the code computes with them as floats (Adam's bias correction b**t, the
# schedules' step / total_steps, torch's formulas). Larger values, which no run reaches (2**53
# steps at one per microsecond take 285 years), can only come from a corrupt or hand-made state
# dict, and would fail later with an untyped OverflowError (int too large to convert to float).
MAX_COUNT = 2**53


def shown(value) -> str:
    """``repr(value)`` for a message, except an int too long to print (Python refuses > 4300 digits)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(int(value)) >= 2**64:
        return f"an int of {int(value).bit_length()} bits"
    return repr(value)


def check_number(name: str, value, lo: float = -math.inf, hi: float = math.inf, *,
                 lo_open: bool = False, hi_open: bool = False, error=HyperparameterError) -> float:
    """``value`` as a float if it is a finite real number in the interval, else ``error``."""
    try:
        ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    except OverflowError:  # an int beyond the float range
        ok = False
    if not ok:
        raise error(f"{name}: expected a finite real number, got {shown(value)}")
    value = float(value)
    below = value <= lo if lo_open else value < lo
    above = value >= hi if hi_open else value > hi
    if below or above:
        lb, rb = "(" if lo_open else "[", ")" if hi_open else "]"
        raise error(f"{name}: expected a value in {lb}{lo}, {hi}{rb}, got {value!r}")
    return value


def check_positive(name: str, value, error=HyperparameterError) -> float:
    """A finite number > 0."""
    return check_number(name, value, 0.0, lo_open=True, error=error)


def check_int(name: str, value, lo: int = 0, hi: float = math.inf, error=HyperparameterError) -> int:
    """``value`` as an int (not a bool) in ``[lo, hi]``, else ``error``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not lo <= value <= hi:
        bounds = f">= {lo}" if hi == math.inf else f"in [{lo}, {hi}]"
        raise error(f"{name}: expected an int {bounds}, got {shown(value)}")
    return int(value)


def check_count(name: str, value, lo: int = 0, hi: int = MAX_COUNT, error=HyperparameterError) -> int:
    """A counter or step count: an int in ``[lo, hi]``, ``hi`` at most :data:`MAX_COUNT`."""
    return check_int(name, value, lo, min(hi, MAX_COUNT), error=error)


def check_bool(name: str, value, error=HyperparameterError) -> bool:
    """``value`` if it is a bool (not merely truthy), else ``error``."""
    if not isinstance(value, bool):
        raise error(f"{name}: expected a bool, got {shown(value)}")
    return value


def check_betas(betas, name: str = "betas") -> tuple[float, float]:
    """A pair of decay rates, each in [0, 1)."""
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise HyperparameterError(f"{name}: expected a pair (beta1, beta2), got {betas!r}") from None
    return (check_number(f"{name}[0]", b1, 0.0, 1.0, hi_open=True),
            check_number(f"{name}[1]", b2, 0.0, 1.0, hi_open=True))


def check_choice(name: str, value, allowed: tuple) -> str:
    """``value`` if it is one of the strings ``allowed``, else :class:`HyperparameterError` naming ``name``."""
    if not isinstance(value, str) or value not in allowed:
        raise HyperparameterError(f"{name}: expected one of {list(allowed)}, got {value!r}")
    return value
