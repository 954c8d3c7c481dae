from __future__ import annotations

import math

from .._checks import check_betas, check_bool, check_number
from ._base import Optimizer, mask_arg, unused_slot, working_args


class Adam(Optimizer):
    r"""Adam (Kingma & Ba, 2015) with optional AMSGrad (Reddi et al., 2018).

    torch.optim.Adam's form, with :math:`d_t = g_t + \lambda p_{t-1}` (L2 decay):

    .. math::
        m_t = m_{t-1} + (1-\beta_1)(d_t - m_{t-1}), \quad
        v_t = \beta_2 v_{t-1} + (1-\beta_2) d_t^2, \\
        p_t = p_{t-1} - \frac{\eta}{1-\beta_1^t}\,
              \frac{m_t}{\sqrt{\hat v_t}/\sqrt{1-\beta_2^t} + \epsilon}

    where :math:`\hat v_t = v_t`, or :math:`\max(\hat v_{t-1}, v_t)` with AMSGrad.
    ``eps`` is added after the bias-corrected square root, as in torch.

    ``state_dtype="bfloat16"`` keeps the moments in bfloat16 (math stays in the
    parameters' precision, float32): 20 instead of 28 bytes per float32
    parameter per step. Rounding is to nearest even, so an EMA step smaller
    than half a bfloat16 ulp of the moment (about 2**-9 relative) is lost;
    fine for the moments' role as scales, and measured in the tests. float16
    moments are refused: ``v = g**2`` underflows float16 below ``|g| < 2.4e-4``
    and turns the update into ``m / eps``. ``lr`` and ``weight_decay`` may differ
    per parameter through ``overrides`` (see :class:`Optimizer`).
    """

    _decoupled = False

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, maximize: bool = False,
                 state_dtype: str | None = None, overrides=None):
        self.lr = self._checked_lr(lr)
        self.betas = check_betas(betas)
        self.eps = check_number("eps", eps, 0.0, lo_open=True)
        self.weight_decay = check_number("weight_decay", weight_decay, 0.0)
        self.amsgrad = check_bool("amsgrad", amsgrad)
        self._set_state_dtype(state_dtype)
        self.maximize = check_bool("maximize", maximize)
        self._set_overrides(overrides)

    @property
    def slot_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.amsgrad else ())

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                "amsgrad": self.amsgrad, "state_dtype": self.state_dtype, "maximize": self.maximize,
                "overrides": self.overrides}

    def update(self, kernels, params, grads, state, *, gscale=1.0, lr=None, zero_grad=False, working=None,
               mask=None):
        t = state.step + 1
        b1, b2 = self.betas
        step_size, l2, decay = self._step_rates(state, lr, 1.0 - b1**t, params.flat.dtype, self._decoupled)
        m = self._slot(state, "exp_avg")
        vmax = self._slot(state, "max_exp_avg_sq") if self.amsgrad else unused_slot(m)
        kernels.adam_step(params.flat, grads.flat, m, self._slot(state, "exp_avg_sq"), vmax, self._pieces(params),
                          gscale=self._signed(gscale), step_size=step_size, beta1=b1, beta2=b2,
                          eps=self.eps, inv_bc2_sqrt=1.0 / math.sqrt(1.0 - b2**t), l2=l2, decay=decay,
                          amsgrad=self.amsgrad, **working_args(working), zero_grad=zero_grad,
                          mask=mask_arg(mask, params), grad_ptrs=self._grad_ptrs(params, grads))
        state.step = t


class AdamW(Adam):
    r"""AdamW (Loshchilov & Hutter, 2019): Adam with decoupled weight decay.

    As :class:`Adam` with :math:`d_t = g_t` and the parameter first decayed,
    :math:`p \leftarrow p\,(1 - \eta\lambda)`, as torch.optim.AdamW does.
    """

    _decoupled = True

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 state_dtype: str | None = None, overrides=None):
        super().__init__(lr, betas, eps, weight_decay, amsgrad, maximize=maximize, state_dtype=state_dtype,
                         overrides=overrides)
