"""Validation of scalar arguments: one place for the rules and the messages."""

from __future__ import annotations

import math
import numbers

from .errors import HyperparameterError


def check_number(name: str, value, lo: float = -math.inf, hi: float = math.inf, *,
                 lo_open: bool = False, hi_open: bool = False, error=HyperparameterError) -> float:
    """``value`` as a float if it is a finite real number in the interval, else ``error``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise error(f"{name}: expected a finite real number, got {value!r}")
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
        raise error(f"{name}: expected an int {bounds}, got {value!r}")
    return int(value)


def check_bool(name: str, value, error=HyperparameterError) -> bool:
    """``value`` if it is a bool (not merely truthy), else ``error``."""
    if not isinstance(value, bool):
        raise error(f"{name}: expected a bool, got {value!r}")
    return value


def check_betas(betas, name: str = "betas") -> tuple[float, float]:
    """A pair of decay rates, each in [0, 1)."""
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise HyperparameterError(f"{name}: expected a pair (beta1, beta2), got {betas!r}") from None
    return (check_number(f"{name}[0]", b1, 0.0, 1.0, hi_open=True),
            check_number(f"{name}[1]", b2, 0.0, 1.0, hi_open=True))
