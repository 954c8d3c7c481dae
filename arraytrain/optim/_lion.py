from __future__ import annotations

from .._checks import check_betas, check_bool, check_number
from ._base import Optimizer, mask_arg, working_args


class Lion(Optimizer):
    r"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"), optax.lion semantics.

    With ``betas`` :math:`= (\beta_1, \beta_2)` (optax's ``b1``, ``b2``):

    .. math::
        c_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \qquad
        p_t = p_{t-1} - \eta\,(\operatorname{sign}(c_t) + \lambda p_{t-1}), \qquad
        m_t = \beta_2 m_{t-1} + (1-\beta_2) g_t

    Weight decay is decoupled and multiplied by the learning rate (optax's and
    the paper's code; torch has no Lion). Only the momentum ``exp_avg`` is
    kept. ``sign(0) = 0``; a NaN gradient gives a NaN step (never a silent zero).
    The update has unit size per element, so the lr is typically 3-10x smaller
    than AdamW's and the weight decay 3-10x larger. ``lr`` and ``weight_decay``
    may differ per parameter through ``overrides`` (see :class:`Optimizer`).
    """

    def __init__(self, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 1e-3, *,
                 maximize: bool = False, state_dtype: str | None = None, overrides=None):
        self.lr = self._checked_lr(lr)
        self.betas = check_betas(betas)
        self.weight_decay = check_number("weight_decay", weight_decay, 0.0)
        self.maximize = check_bool("maximize", maximize)
        self._set_state_dtype(state_dtype)
        self._set_overrides(overrides)

    @property
    def slot_names(self) -> tuple[str, ...]:
        return ("exp_avg",)

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "weight_decay": self.weight_decay,
                "maximize": self.maximize, "state_dtype": self.state_dtype, "overrides": self.overrides}

    def update(self, kernels, params, grads, state, *, gscale=1.0, lr=None, zero_grad=False, working=None,
               mask=None):
        rate, _, decay = self._step_rates(state, lr, 1.0, params.flat.dtype, True)
        b1, b2 = self.betas
        kernels.lion_step(params.flat, grads.flat, self._slot(state, "exp_avg"), self._pieces(params),
                          gscale=self._signed(gscale), lr=rate, decay=decay,
                          beta1=b1, beta2=b2, **working_args(working), zero_grad=zero_grad,
                          mask=mask_arg(mask, params), grad_ptrs=self._grad_ptrs(params, grads))
        state.step += 1
