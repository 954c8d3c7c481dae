"""The Engine: accumulate micro-batches, check, clip and apply the optimizer on flat buffers."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from . import _intake
from ._checks import check_int, check_number, check_positive
from .backend import backend_of, kernels_for
from .buffer import FlatBuffer
from .errors import (
    ArgumentTypeError,
    HyperparameterError,
    LayoutError,
    MissingGradientError,
    StateDictError,
)
from .ops import clip_coef, norm_pass
from .optim import Optimizer

STATE_FORMAT = 1
REDUCTIONS = ("mean", "sum")
MISSING = ("error", "zero")


@dataclass(frozen=True)
class StepReport:
    """What one call of :meth:`Engine.step` did.

    ``applied``: the optimizer ran. ``skipped``: the accumulation boundary was
    reached with a NaN/Inf gradient, so nothing changed and the window was
    dropped. Neither: the micro-batch was accumulated. ``grad_norm`` is the
    global L2 norm of the reduced (mean or sum) gradient before clipping, and
    ``clip_coef`` the factor applied to it; both are None between boundaries.
    """

    applied: bool
    skipped: bool
    step: int
    micro_batches: int
    lr: float
    grad_norm: float | None = None
    clip_coef: float | None = None
    _segment_norms: np.ndarray | None = field(default=None, repr=False)
    _names: tuple = field(default=(), repr=False)

    @property
    def accumulated(self) -> bool:
        return not (self.applied or self.skipped)

    @property
    def grad_norms(self) -> dict[str, float] | None:
        """Per-parameter L2 norms of the reduced gradient (from the same pass)."""
        if self._segment_norms is None:
            return None
        return {n: float(x) for n, x in zip(self._names, self._segment_norms)}


class Engine:
    """Training step on flat buffers: ``engine.step(grads) -> StepReport``.

    Parameters
    ----------
    params : mapping name -> array, or FlatBuffer
        A mapping is copied into a new flat buffer (``dtype`` or the common
        floating dtype); a :class:`FlatBuffer` is used in place.
    optimizer : Optimizer
    accumulation_steps : int
        Micro-batches per optimizer step.
    max_grad_norm : float or None
        Global L2 clipping (torch's ``clip_grad_norm_`` factor), folded into
        the optimizer kernel as a scalar: one read-only norm pass, no rescale pass.
    reduction : "mean" or "sum"
        How micro-batches combine: the (weight-)mean or the plain sum.
        ``step(grads, weight=n)`` weights a micro-batch, e.g. by its token
        count; with "mean" the result is ``sum(w*g) / sum(w)``.
    missing : "error" or "zero"
        A micro-batch without a gradient for some parameter: raise, or count
        it as zero (a parameter that did not take part).
    zero_grad_on_step : bool
        Zero ``engine.grads`` after every boundary, inside the optimizer
        kernel (no extra pass). Needed when a framework *adds* into the
        buffer (``loss.backward()`` into ``.grad`` views). Set False when the
        caller overwrites the gradients every window: saves 4 bytes/element.
    kernels : "numba" or "reference"
        The fused kernels, or their slow reference twins.

    The zero-copy path: ``engine.params[name]`` and ``engine.grads[name]``
    are views into the flat buffers. Write (or let a framework accumulate)
    gradients into ``engine.grads`` and call ``engine.step()`` with no
    argument; ``weight`` then only enters the denominator of the mean, so
    weighted gradients must already be multiplied by their weight.
    """

    def __init__(self, params, optimizer: Optimizer, *, accumulation_steps: int = 1,
                 max_grad_norm: float | None = None, reduction: str = "mean", missing: str = "error",
                 zero_grad_on_step: bool = True, dtype=None, kernels: str = "numba"):
        if not isinstance(optimizer, Optimizer):
            raise ArgumentTypeError(f"optimizer: expected an arraytrain.optim.Optimizer, got {type(optimizer).__name__}")
        accumulation_steps = check_int("accumulation_steps", accumulation_steps, 1)
        if max_grad_norm is not None:
            max_grad_norm = check_positive("max_grad_norm", max_grad_norm)
        if reduction not in REDUCTIONS:
            raise HyperparameterError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
        if missing not in MISSING:
            raise HyperparameterError(f"missing: expected one of {MISSING}, got {missing!r}")
        if isinstance(params, FlatBuffer):
            if dtype is not None and np.dtype(dtype) != params.dtype:
                raise LayoutError(f"dtype: the FlatBuffer holds {params.dtype}, got dtype={np.dtype(dtype)}")
            self.params = params
        elif isinstance(params, Mapping):
            self.params = FlatBuffer.from_arrays(params, dtype=dtype)
        else:
            raise ArgumentTypeError(f"params: expected a mapping name -> array or a FlatBuffer, got {type(params).__name__}")
        self._kernels = kernels_for(self.params.flat, kernels)
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.reduction = reduction
        self.missing = missing
        self.zero_grad_on_step = bool(zero_grad_on_step)
        self.grads = self.params.zeros_like()
        self.state = optimizer.init(self.params)
        self._micro = 0
        self._weight_sum = 0.0

    @property
    def layout(self):
        return self.params.layout

    @property
    def micro_batches(self) -> int:
        """Micro-batches accumulated in the current window."""
        return self._micro

    # -- the step ---------------------------------------------------------------------
    def step(self, grads: Mapping | None = None, *, weight: float | None = None) -> StepReport:
        """Take one micro-batch; at every ``accumulation_steps``-th call, apply the optimizer.

        ``grads`` maps names to arrays (any framework; cast to the buffer's
        dtype; non-contiguous inputs are copied). ``None`` means the gradients
        are already in ``engine.grads`` (the zero-copy path). The whole input
        is validated before anything is written: a refused call changes nothing.
        """
        w = 1.0 if weight is None else check_positive("weight", weight)
        if grads is not None:
            items = _intake.check_grads(grads, self.grads, protect=(self.params.flat, self.grads.flat))
            absent = [n for n in self.layout.names if n not in items]
            if absent and self.missing == "error":
                raise MissingGradientError(
                    f"no gradient for {absent} (policy missing='error'; use missing='zero' to count them as zero)"
                )
            overwrite = self._micro == 0
            if overwrite:
                for name in absent:
                    self.grads[name][...] = 0
            _intake.write_grads(self._kernels, self.grads, items, w, overwrite)
        self._micro += 1
        self._weight_sum += w
        lr = self.optimizer.lr
        if self._micro < self.accumulation_steps:
            return StepReport(False, False, self.state.step, self._micro, lr)
        return self._boundary(lr)

    def _boundary(self, lr: float) -> StepReport:
        denom = self._weight_sum if self.reduction == "mean" else 1.0
        found = norm_pass(self._kernels, self.grads.flat, self.layout)
        self._micro, self._weight_sum = 0, 0.0
        if found.nonfinite:
            self.grads.flat.fill(0)
            return StepReport(False, True, self.state.step, 0, lr, math.nan, None)
        norm = found.norm / denom
        coef = clip_coef(norm, self.max_grad_norm)
        self.optimizer.update(self._kernels, self.params, self.grads, self.state,
                              gscale=coef / denom, lr=lr, zero_grad=self.zero_grad_on_step)
        return StepReport(True, False, self.state.step, 0, lr, norm, coef,
                          found.segment_norms / denom, self.layout.names)

    def zero_grad(self) -> None:
        """Zero ``engine.grads`` and drop a partly accumulated window."""
        self.grads.flat.fill(0)
        self._micro, self._weight_sum = 0, 0.0

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Name-keyed copies of everything a bitwise-exact resume needs, plus scalars."""
        return {
            "format": STATE_FORMAT,
            "params": self.params.as_dict(copy=True),
            "optimizer": {
                "type": type(self.optimizer).__name__,
                "hyperparameters": self.optimizer.hyperparameters(),
                "step": self.state.step,
                "slots": {k: buf.as_dict(copy=True) for k, buf in self.state.slots.items()},
            },
            "accumulation": {
                "micro_batches": self._micro,
                "weight_sum": self._weight_sum,
                "grads": self.grads.as_dict(copy=True),
            },
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Load :meth:`state_dict` output. Everything is validated before any buffer is written.

        The optimizer type and slots must match; the optimizer's current
        hyperparameters are kept (so a resumed run may change, e.g., its lr).
        """
        try:
            fmt = state["format"]
            opt = state["optimizer"]
            acc = state["accumulation"]
            params = state["params"]
            slots = opt["slots"]
            step, micro, wsum = opt["step"], acc["micro_batches"], acc["weight_sum"]
            grads = acc["grads"]
        except (KeyError, TypeError) as exc:
            raise StateDictError(f"state dict lacks {exc}") from None
        if fmt != STATE_FORMAT:
            raise StateDictError(f"format: expected {STATE_FORMAT}, got {fmt!r}")
        if opt.get("type") != type(self.optimizer).__name__:
            raise StateDictError(f"optimizer: state is for {opt.get('type')!r}, engine has {type(self.optimizer).__name__!r}")
        if set(slots) != set(self.state.slots):
            raise StateDictError(f"optimizer slots: expected {sorted(self.state.slots)}, got {sorted(slots)}")
        check_int("optimizer step", step, 0, error=StateDictError)
        check_int("micro_batches", micro, 0, self.accumulation_steps - 1, error=StateDictError)
        check_number("weight_sum", wsum, 0.0, error=StateDictError)
        try:
            checked = [(self.params, self.params.check(params))]
            checked += [(self.state.slots[k], self.state.slots[k].check(v)) for k, v in slots.items()]
            checked.append((self.grads, self.grads.check(grads)))
        except (LayoutError, KeyError, ValueError, TypeError) as exc:
            raise StateDictError(f"state dict does not match the engine: {exc}") from exc
        for buf, arrays in checked:
            buf.assign(arrays)
        self.state.step = int(step)
        self._micro, self._weight_sum = int(micro), float(wsum)

    def __repr__(self) -> str:
        return (f"Engine({self.params!r}, {self.optimizer!r}, accumulation_steps={self.accumulation_steps}, "
                f"max_grad_norm={self.max_grad_norm}, backend={backend_of(self.params.flat)})")
