"""Schedule-Free AdamW: no learning-rate decay, the average of the iterates evaluated instead."""

from __future__ import annotations

import functools
import math

import numpy as np

from .._checks import check_betas, check_bool, check_int, check_number
from ..backend import array_module
from ..buffer import FlatBuffer
from ..errors import HyperparameterError
from ..layout import Layout
from ._base import Optimizer, OptState, mask_arg, working_args

# elements per block of the in-place evaluation-weights pass (a small scratch, not a copy)
_EVAL_BLOCK = 1 << 20


class ScheduleFreeAdamW(Optimizer):
    r"""Schedule-Free AdamW (Defazio et al., 2024, "The Road Less Scheduled"), optax's
    ``contrib.schedule_free_adamw``.

    Three sequences: :math:`z` (the base AdamW-without-momentum iterates), :math:`x` (their
    weighted average, the weights to evaluate and to ship) and :math:`y`, the interpolation
    where gradients are taken. ``engine.params`` hold :math:`y`; the slot ``z`` holds
    :math:`z`; :math:`x` is not stored: :math:`x = (y - (1-\beta_1) z)/\beta_1`, computed on
    demand by :meth:`eval_params`, or swapped into ``engine.params`` for a block by
    :meth:`arraytrain.Engine.evaluation`. Per step :math:`t` (1-based), with
    :math:`d = \pm g` (``maximize``):

    .. math::
        v_t = \beta_2 v_{t-1} + (1-\beta_2) d^2, \quad
        z_{t+1} = z_t - \gamma_t \Big(\frac{d}{\sqrt{v_t/(1-\beta_2^t)} + \epsilon} + \lambda y_t\Big), \\
        \bar\gamma_t = \max(\bar\gamma_{t-1}, \gamma'_t), \quad
        c_{t+1} = \frac{\bar\gamma_t^{\,p}}{\sum_{i \le t} \bar\gamma_i^{\,p}}, \\
        x_{t+1} = (1 - c_{t+1})\, x_t + c_{t+1} z_{t+1}, \quad
        y_{t+1} = \beta_1 x_{t+1} + (1-\beta_1) z_{t+1}

    with :math:`p` = ``weight_lr_power`` and the warm-up of optax: :math:`\gamma'_t = \eta
    \min(1, t/W)` for the weights and :math:`\gamma_t = \eta \min(1, (t-1)/W)` for the step
    (optax's base optimizer counts from 0, so the first warm-up step leaves :math:`z` where
    it is); :math:`\eta` is the lr of this step (per parameter: ``overrides`` and the
    engine's schedule apply, and :math:`\bar\gamma` and the weight sum are kept per
    parameter, in float64, in the slots ``max_lr`` and ``weight_sum``). Weight decay is
    taken at :math:`y`. The reference PyTorch code (facebookresearch/schedule_free) differs
    in two details: its :math:`\gamma_t` carries :math:`\sqrt{1-\beta_2^t}` (eps placed
    accordingly) and its warm-up uses :math:`t/W` for both.

    One fused kernel per step (plus a tiny per-parameter pass for the weights): read y, g, z,
    v; write y, z, v. Memory is AdamW's: z replaces the first moment. ``state_dtype="bfloat16"``
    stores :math:`v` in bfloat16; :math:`z` stays in the parameters' dtype (an iterate: steps
    of lr size would round away in bfloat16). With a pruning mask, pruned elements of both
    :math:`y` and :math:`z` are written as 0, so :math:`x` is 0 there too. ``betas[0]`` must
    be > 0 (:math:`x` is recovered through a division by it).
    """

    reads_in_place = False  # its kernels read the flat gradient buffer

    per_param_steps = False
    per_param_steps_refusal = "its averaging weights are shared by every parameter"

    fallback_capable = False
    has_eval_params = True

    def __init__(self, lr: float = 0.0025, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, warmup_steps: int = 0, weight_lr_power: float = 2.0, *,
                 maximize: bool = False, state_dtype: str | None = None, overrides=None):
        self.lr = self._checked_lr(lr)
        self.betas = check_betas(betas)
        if self.betas[0] == 0.0:
            raise HyperparameterError("betas[0]: expected a value in (0.0, 1.0) (x is recovered from y and z "
                                      "through a division by it), got 0.0")
        self.eps = check_number("eps", eps, 0.0, lo_open=True)
        self.weight_decay = check_number("weight_decay", weight_decay, 0.0)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.weight_lr_power = check_number("weight_lr_power", weight_lr_power, 0.0)
        self.maximize = check_bool("maximize", maximize)
        self._set_state_dtype(state_dtype)
        self._set_overrides(overrides)

    @property
    def slot_names(self) -> tuple[str, ...]:
        return ("z", "exp_avg_sq", "max_lr", "weight_sum")

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                "warmup_steps": self.warmup_steps, "weight_lr_power": self.weight_lr_power,
                "maximize": self.maximize, "state_dtype": self.state_dtype, "overrides": self.overrides}

    def init(self, params) -> OptState:
        per_param = scalar_layout(params.layout)
        slots = {"z": params.copy(), "exp_avg_sq": self._new_slot(params, "exp_avg_sq"),
                 "max_lr": FlatBuffer.zeros(per_param, np.float64, array_module(params.flat)),
                 "weight_sum": FlatBuffer.zeros(per_param, np.float64, array_module(params.flat))}
        return OptState(0, slots, self.resolve(params.layout))

    def update(self, kernels, params, grads, state, *, gscale=1.0, lr=None, zero_grad=False, working=None,
               mask=None):
        mask = mask_arg(mask, params)
        t = state.step + 1
        lr = self._lr(state, lr)
        warm = self.warmup_steps
        # optax: the weights see the schedule at its count t, the base step at t - 1
        weight_lr, step_lr = (lr, lr) if not warm else (lr * (min(t, warm) / warm), lr * (min(t - 1, warm) / warm))
        b1, b2 = self.betas
        s = state.slots
        kernels.schedule_free_adamw_step(
            params.flat, grads.flat, s["z"].flat, self._slot(state, "exp_avg_sq"), s["max_lr"].flat,
            s["weight_sum"].flat, self._pieces(params), gscale=self._signed(gscale), lr=step_lr,
            weight_lr=weight_lr, weight_lr_power=self.weight_lr_power,
            weight_decay=self.per_param(state, "weight_decay"), beta1=b1, beta2=b2, eps=self.eps,
            inv_bc2_sqrt=1.0 / math.sqrt(1.0 - b2**t), **working_args(working), zero_grad=zero_grad, mask=mask,
        )
        state.step = t

    def eval_params(self, params, state, out=None) -> FlatBuffer:
        """x, the weights to evaluate at: ``(y - (1 - beta1) z) / beta1`` from ``params`` (y) and the slot z.

        Into ``out`` (a buffer of the parameters' layout, dtype and device; ``params``
        itself works: in place, block by block), else a new buffer. optax's
        ``schedule_free_eval_params``, in the parameters' dtype.
        """
        if out is None:
            out = params.zeros_like()
        elif out.layout != params.layout or out.dtype != params.dtype or type(out.flat) is not type(params.flat):
            raise HyperparameterError(f"out: expected a buffer like the parameters {params!r}, got {out!r}")
        b1 = self.betas[0]
        y, z, x = params.flat, state.slots["z"].flat, out.flat
        xp, t = array_module(y), y.dtype.type
        tmp = xp.empty(min(y.size, _EVAL_BLOCK), y.dtype)
        for a in range(0, y.size, _EVAL_BLOCK):
            b = min(a + _EVAL_BLOCK, y.size)
            tb = tmp[: b - a]
            xp.multiply(z[a:b], t(1.0 - b1), out=tb)
            xp.subtract(y[a:b], tb, out=tb)
            xp.divide(tb, t(b1), out=x[a:b])
        return out


@functools.lru_cache(maxsize=32)
def scalar_layout(layout: Layout) -> Layout:
    """One float per parameter (``max_lr``, ``weight_sum``): the same names, shape (), packed."""
    return Layout({name: () for name in layout.names}, align=1)
