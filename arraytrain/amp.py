"""Mixed precision: dynamic loss scaling and low-precision working copies.

Gradients of a scaled loss arrive in float16, bfloat16 (``ml_dtypes.bfloat16``
arrays) or float32 and are accumulated into the float32 master buffer. The
unscale is not a pass over memory: the engine's norm pass reads the scaled
gradients, divides the norm by the scale on the host, and the optimizer kernel
multiplies the gradient by ``clip / (scale * denominator)`` as it reads it.
"""

from __future__ import annotations

import math

import numpy as np

from ._checks import check_int, check_number, check_positive
from .backend import bfloat16
from .kernels.interface import LP_BF16, LP_F16
from .errors import HyperparameterError, StateDictError

#: ``working_dtype`` name -> (a function of no arguments giving the working copy's dtype, its kind as the
#: optimizer kernels take it); bfloat16's dtype is ml_dtypes', imported when a copy needs it.
WORKING_DTYPES = {"bfloat16": (bfloat16, LP_BF16), "float16": (lambda: np.dtype(np.float16), LP_F16)}


class LossScaler:
    """Dynamic loss scaling with torch.amp.GradScaler's rules.

    Multiply the loss by :attr:`scale` before the backward pass; the engine
    unscales. After a step whose gradients hold NaN/Inf the step is skipped
    and ``scale *= backoff_factor``; after ``growth_interval`` consecutive
    finite steps ``scale *= growth_factor`` — unless that would exceed
    ``max_scale`` or overflow to inf (the finite cap), in which case the scale
    stays. Defaults: init 2**16, growth 2 every 2000 steps, backoff 0.5.
    """

    #: it adapts its scale to overflows, so the engine must find them (nonfinite="skip")
    adjusts = True

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, max_scale: float | None = None):
        self.scale = check_positive("init_scale", init_scale)
        self.growth_factor = check_number("growth_factor", growth_factor, 1.0, lo_open=True)
        self.backoff_factor = check_number("backoff_factor", backoff_factor, 0.0, 1.0, lo_open=True, hi_open=True)
        self.growth_interval = check_int("growth_interval", growth_interval, 1)
        if max_scale is not None:
            max_scale = check_number("max_scale", max_scale, self.scale)
        self.max_scale = max_scale
        self.growth_tracker = 0

    def update(self, found_inf: bool) -> None:
        """Advance the scale after one optimizer boundary."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            grown = self.scale * self.growth_factor
            if math.isfinite(grown) and (self.max_scale is None or grown <= self.max_scale):
                self.scale = grown

    def config(self) -> dict:
        """The configuration (growth, backoff, interval, maximum scale) as a dict."""
        return {"growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "max_scale": self.max_scale}

    def state_dict(self) -> dict:
        """The scale and growth tracker, with the configuration, as a dict (:meth:`load_state_dict` restores it)."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, **self.config()}

    def check_state(self, state) -> tuple[float, int]:
        """Validate a :meth:`state_dict` without changing anything; returns (scale, tracker)."""
        try:
            scale, tracker = state["scale"], state["growth_tracker"]
        except (KeyError, TypeError) as exc:
            raise StateDictError(f"loss scaler state lacks {exc}") from None
        scale = check_positive("loss scaler scale", scale, error=StateDictError)
        tracker = check_int("loss scaler growth_tracker", tracker, 0, self.growth_interval - 1, error=StateDictError)
        return scale, tracker

    def load_state_dict(self, state) -> None:
        """Restore scale and growth tracker (validated first); the configuration stays."""
        self.apply_state(self.check_state(state))

    def apply_state(self, checked: tuple[float, int]) -> None:
        """Restore what :meth:`check_state` returned (two assignments: cannot fail)."""
        self.scale, self.growth_tracker = checked

    def __repr__(self) -> str:
        return f"LossScaler(scale={self.scale}, growth_tracker={self.growth_tracker}, {self.config()})"


def working_spec(dtype) -> tuple[np.dtype, int]:
    """``(numpy dtype, kernel kind)`` of a working-copy dtype name."""
    name = str(dtype) if not isinstance(dtype, str) else dtype
    if name not in WORKING_DTYPES:
        raise HyperparameterError(f"working_dtype: expected None or one of {list(WORKING_DTYPES)}, got {dtype!r}")
    dtype_of, kind = WORKING_DTYPES[name]
    return dtype_of(), kind
