from __future__ import annotations

from ..errors import HyperparameterError
from .._checks import check_bool, check_number
from ._base import Optimizer, mask_arg, working_args


class SGD(Optimizer):
    r"""Stochastic gradient descent with momentum (torch.optim.SGD semantics).

    With :math:`d_t = g_t + \lambda p_{t-1}` (L2 weight decay):

    .. math::
        b_1 = d_1, \quad b_t = \mu b_{t-1} + (1 - \tau) d_t, \qquad
        p_t = p_{t-1} - \eta \,(d_t + \mu b_t \text{ if Nesterov else } b_t)

    Sutskever et al. 2013 for the Nesterov form. With ``momentum=0`` there is
    no state and the update is ``p -= lr * d``. ``lr`` and ``weight_decay`` may
    differ per parameter through ``overrides`` (see :class:`Optimizer`).
    """

    def __init__(self, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 state_dtype: str | None = None, overrides=None):
        self.lr = self._checked_lr(lr)
        self.momentum = check_number("momentum", momentum, 0.0)
        self.dampening = check_number("dampening", dampening, 0.0, 1.0)
        self.weight_decay = check_number("weight_decay", weight_decay, 0.0)
        check_bool("nesterov", nesterov)
        if nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise HyperparameterError("nesterov: requires momentum > 0 and dampening == 0")
        self.nesterov = nesterov
        self.maximize = check_bool("maximize", maximize)
        self._set_state_dtype(state_dtype)
        self._set_overrides(overrides)

    @property
    def slot_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum != 0 else ()

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "momentum": self.momentum, "dampening": self.dampening,
                "weight_decay": self.weight_decay, "nesterov": self.nesterov, "maximize": self.maximize,
                "state_dtype": self.state_dtype, "overrides": self.overrides}

    def update(self, kernels, params, grads, state, *, gscale=1.0, lr=None, zero_grad=False, working=None,
               mask=None):
        buf = self._slot(state, "momentum_buffer") if self.momentum != 0 else params.flat[:0]
        rate, l2, _ = self._step_rates(state, lr, 1.0, params.flat.dtype, False)
        kernels.sgd_step(params.flat, grads.flat, buf, self._pieces(params), gscale=self._signed(gscale),
                         lr=rate, l2=l2, momentum=self.momentum,
                         dampening=self.dampening, nesterov=self.nesterov, first=state.step == 0,
                         **working_args(working), zero_grad=zero_grad, mask=mask_arg(mask, params),
                         grad_ptrs=self._grad_ptrs(params, grads))
        state.step += 1
