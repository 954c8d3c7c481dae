from __future__ import annotations

from .._checks import check_number
from ._base import Optimizer, mask_arg, working_args


class Adadelta(Optimizer):
    r"""Adadelta (Zeiler, 2012, "ADADELTA: An Adaptive Learning Rate Method"), torch.optim.Adadelta's form.

    With :math:`d_t = g_t + \lambda p_{t-1}` (L2 weight decay):

    .. math::
        s_t = \rho s_{t-1} + (1-\rho) d_t^2, \quad
        \Delta_t = \frac{\sqrt{a_{t-1} + \epsilon}}{\sqrt{s_t + \epsilon}}\, d_t, \quad
        a_t = \rho a_{t-1} + (1-\rho) \Delta_t^2, \quad
        p_t = p_{t-1} - \eta \Delta_t

    ``eps`` inside both square roots, as in torch; it must be > 0 (with 0 the first
    step is 0 and a zero gradient gives 0/0). ``rho`` may be 1 (the averages then stay
    at 0: a plain step of :math:`\eta\, d_t`), as torch allows. Slots ``square_avg``
    (:math:`s`) and ``acc_delta`` (:math:`a`), torch's names; ``state_dtype="bfloat16"``
    keeps them in bfloat16 (math in float32). ``lr`` and ``weight_decay`` may differ per
    parameter through ``overrides`` (see :class:`Optimizer`).
    """

    def __init__(self, lr: float = 1.0, rho: float = 0.9, eps: float = 1e-6, weight_decay: float = 0.0, *,
                 maximize: bool = False, state_dtype: str | None = None, overrides=None):
        self._set_basics(lr, eps, weight_decay, maximize, state_dtype, overrides)
        self.rho = check_number("rho", rho, 0.0, 1.0)

    @property
    def slot_names(self) -> tuple[str, ...]:
        return ("square_avg", "acc_delta")

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "rho": self.rho, "eps": self.eps, "weight_decay": self.weight_decay,
                "maximize": self.maximize, "state_dtype": self.state_dtype, "overrides": self.overrides}

    def update(self, kernels, params, grads, state, *, gscale=1.0, lr=None, zero_grad=False, working=None,
               mask=None):
        rate, l2, _ = self._step_rates(state, lr, 1.0, params.flat.dtype, False)
        kernels.adadelta_step(params.flat, grads.flat, self._slot(state, "square_avg"), self._slot(state, "acc_delta"),
                              self._pieces(params), gscale=self._signed(gscale), lr=rate, l2=l2, rho=self.rho,
                              eps=self.eps,
                              **working_args(working), zero_grad=zero_grad, mask=mask_arg(mask, params),
                              grad_ptrs=self._grad_ptrs(params, grads))
        state.step += 1
