from __future__ import annotations

import math

from ..errors import HyperparameterError
from .._checks import check_number
from ._base import Optimizer


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
    """

    _decoupled = False

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False):
        self.lr = check_number("lr", lr, 0.0)
        try:
            b1, b2 = betas
        except (TypeError, ValueError):
            raise HyperparameterError(f"betas: expected a pair (beta1, beta2), got {betas!r}") from None
        self.betas = (check_number("betas[0]", b1, 0.0, 1.0, hi_open=True),
                      check_number("betas[1]", b2, 0.0, 1.0, hi_open=True))
        self.eps = check_number("eps", eps, 0.0, lo_open=True)
        self.weight_decay = check_number("weight_decay", weight_decay, 0.0)
        if not isinstance(amsgrad, bool):
            raise HyperparameterError(f"amsgrad: expected a bool, got {amsgrad!r}")
        self.amsgrad = amsgrad

    @property
    def slot_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.amsgrad else ())

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps,
                "weight_decay": self.weight_decay, "amsgrad": self.amsgrad}

    def update(self, kernels, params, grads, state, *, gscale=1.0, lr=None, zero_grad=False):
        lr = self.lr if lr is None else lr
        t = state.step + 1
        b1, b2 = self.betas
        if self._decoupled:
            l2, decay = 0.0, 1.0 - lr * self.weight_decay
        else:
            l2, decay = self.weight_decay, 1.0
        s = state.slots
        vmax = s["max_exp_avg_sq"].flat if self.amsgrad else params.flat[:0]
        kernels.adam_step(params.flat, grads.flat, s["exp_avg"].flat, s["exp_avg_sq"].flat, vmax,
                          gscale, lr / (1.0 - b1**t), b1, b2, self.eps, math.sqrt(1.0 - b2**t),
                          l2, decay, self.amsgrad, zero_grad)
        state.step = t


class AdamW(Adam):
    r"""AdamW (Loshchilov & Hutter, 2019): Adam with decoupled weight decay.

    As :class:`Adam` with :math:`d_t = g_t` and the parameter first decayed,
    :math:`p \leftarrow p\,(1 - \eta\lambda)`, as torch.optim.AdamW does.
    """

    _decoupled = True

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False):
        super().__init__(lr, betas, eps, weight_decay, amsgrad)
