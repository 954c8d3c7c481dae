from __future__ import annotations

import numpy as np

from .._checks import check_bool, check_number
from ._base import QUANTIZED_STATE, Optimizer, mask_arg, working_args


class Adagrad(Optimizer):
    r"""Adagrad (Duchi, Hazan & Singer, 2011), torch.optim.Adagrad semantics.

    With :math:`d_t = g_t + \lambda p_{t-1}` (L2 weight decay) and the decayed
    rate :math:`\eta_t = \eta / (1 + (t-1)\,\delta)` (``lr_decay`` :math:`\delta`):

    .. math::
        s_t = s_{t-1} + d_t^2, \qquad
        p_t = p_{t-1} - \eta_t\, \frac{d_t}{\sqrt{s_t} + \epsilon}

    with :math:`s_0` = ``initial_accumulator_value`` (the ``sum`` slot, torch's
    name). ``eps`` is added after the square root, as in torch; it must be > 0
    (torch also accepts 0, which divides 0 by 0 on a zero gradient with a zero
    accumulator). ``lr`` and ``weight_decay`` may differ per parameter through
    ``overrides`` (see :class:`Optimizer`); ``lr_decay`` applies to each.
    """

    def __init__(self, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, *, maximize: bool = False,
                 state_dtype: str | None = None, overrides=None):
        self.lr = self._checked_lr(lr)
        self.lr_decay = check_number("lr_decay", lr_decay, 0.0)
        self.weight_decay = check_number("weight_decay", weight_decay, 0.0)
        self.initial_accumulator_value = check_number("initial_accumulator_value", initial_accumulator_value, 0.0)
        self.eps = check_number("eps", eps, 0.0, lo_open=True)
        self.maximize = check_bool("maximize", maximize)
        self._set_state_dtype(state_dtype)
        self._set_overrides(overrides)

    @property
    def slot_names(self) -> tuple[str, ...]:
        return ("sum",)

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "lr_decay": self.lr_decay, "weight_decay": self.weight_decay,
                "initial_accumulator_value": self.initial_accumulator_value, "eps": self.eps,
                "maximize": self.maximize, "state_dtype": self.state_dtype, "overrides": self.overrides}

    def init(self, params):
        state = super().init(params)
        acc = state.slots["sum"]
        if self.state_dtype in QUANTIZED_STATE:
            if self.initial_accumulator_value:
                acc.load({n: np.full(sh, self.initial_accumulator_value, np.float32)
                          for n, sh in zip(acc.layout.names, acc.layout.shapes)})
            return state
        for lo, hi, _ in acc.layout.pieces.tolist():  # the parameters' elements only: padding stays zero
            acc.flat[lo:hi] = self.initial_accumulator_value
        return state

    def update(self, kernels, params, grads, state, *, gscale=1.0, lr=None, zero_grad=False, working=None,
               mask=None):
        t = state.step + 1
        # torch's decayed rate: lr / (1 + (t - 1) * lr_decay)
        clr, l2, _ = self._step_rates(state, lr, 1.0 + (t - 1) * self.lr_decay, params.flat.dtype, False)
        kernels.adagrad_step(params.flat, grads.flat, self._slot(state, "sum"), self._pieces(params),
                             gscale=self._signed(gscale), lr=clr, l2=l2,
                             eps=self.eps, **working_args(working), zero_grad=zero_grad, mask=mask_arg(mask, params),
                             grad_ptrs=self._grad_ptrs(params, grads))
        state.step = t
