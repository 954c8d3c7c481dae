from __future__ import annotations

from .._checks import check_bool, check_number
from ._base import Optimizer, mask_arg, unused_slot, working_args


class RMSprop(Optimizer):
    r"""RMSprop (Hinton, Coursera lecture 6e, 2012), torch.optim.RMSprop semantics.

    With :math:`d_t = g_t + \lambda p_{t-1}` (L2 weight decay):

    .. math::
        v_t = \alpha v_{t-1} + (1-\alpha) d_t^2, \qquad
        u_t = \frac{d_t}{\sqrt{v_t - \bar g_t^2} + \epsilon}

    where, with ``centered=True`` (Graves 2013, "Generating Sequences With
    Recurrent Neural Networks"), :math:`\bar g_t = \bar g_{t-1} + (1-\alpha)(d_t - \bar g_{t-1})`
    estimates the mean gradient, and :math:`\bar g_t = 0` otherwise. With
    ``momentum`` :math:`\mu > 0`: :math:`b_t = \mu b_{t-1} + u_t`,
    :math:`p_t = p_{t-1} - \eta b_t`; else :math:`p_t = p_{t-1} - \eta u_t`.
    ``eps`` is added after the square root, as in torch. Slots use torch's
    names: ``square_avg``, ``grad_avg`` (centered), ``momentum_buffer``
    (momentum > 0). One kernel serves every variant. ``lr`` and
    ``weight_decay`` may differ per parameter through ``overrides``.
    """

    def __init__(self, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0,
                 momentum: float = 0.0, centered: bool = False, *, maximize: bool = False,
                 state_dtype: str | None = None, overrides=None):
        self.lr = self._checked_lr(lr)
        self.alpha = check_number("alpha", alpha, 0.0, 1.0, hi_open=True)
        self.eps = check_number("eps", eps, 0.0, lo_open=True)
        self.weight_decay = check_number("weight_decay", weight_decay, 0.0)
        self.momentum = check_number("momentum", momentum, 0.0)
        self.centered = check_bool("centered", centered)
        self.maximize = check_bool("maximize", maximize)
        self._set_state_dtype(state_dtype)
        self._set_overrides(overrides)

    @property
    def slot_names(self) -> tuple[str, ...]:
        return (("square_avg",) + (("grad_avg",) if self.centered else ())
                + (("momentum_buffer",) if self.momentum > 0 else ()))

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "alpha": self.alpha, "eps": self.eps, "weight_decay": self.weight_decay,
                "momentum": self.momentum, "centered": self.centered, "maximize": self.maximize,
                "state_dtype": self.state_dtype, "overrides": self.overrides}

    def update(self, kernels, params, grads, state, *, gscale=1.0, lr=None, zero_grad=False, working=None,
               mask=None):
        square_avg = self._slot(state, "square_avg")
        empty = unused_slot(square_avg)  # the slots this configuration lacks: never read
        gavg = self._slot(state, "grad_avg") if self.centered else empty
        buf = self._slot(state, "momentum_buffer") if self.momentum > 0 else empty
        rate, l2, _ = self._step_rates(state, lr, 1.0, params.flat.dtype, False)
        kernels.rmsprop_step(params.flat, grads.flat, square_avg, gavg, buf, self._pieces(params),
                             gscale=self._signed(gscale), lr=rate, l2=l2, alpha=self.alpha, eps=self.eps,
                             momentum=self.momentum, centered=self.centered, **working_args(working),
                             zero_grad=zero_grad, mask=mask_arg(mask, params),
                             grad_ptrs=self._grad_ptrs(params, grads))
        state.step += 1
