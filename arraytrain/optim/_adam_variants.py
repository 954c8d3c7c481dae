"""Adam's relatives in torch.optim: NAdam, RAdam and Adamax, each one fused kernel per step."""

from __future__ import annotations

import math

import numpy as np

from .._checks import check_betas, check_bool, check_number
from .. import param_steps
from ..buffer import Subset
from ._base import Optimizer, decoupled_decay, mask_arg, working_args


class _AdamVariant(Optimizer):
    """What NAdam, RAdam and Adamax share: torch's ``lr, betas, eps, weight_decay`` (checked
    alike), the two moment slots, and weight decay coupled (L2) or, where the optimizer has
    ``decoupled_weight_decay``, decoupled."""

    _slots: tuple[str, str]
    decoupled_weight_decay = False

    def _set_common(self, lr, betas, eps, weight_decay, maximize, state_dtype, overrides) -> None:
        self._set_basics(lr, eps, weight_decay, maximize, state_dtype, overrides)
        self.betas = check_betas(betas)

    @property
    def slot_names(self) -> tuple[str, ...]:
        return self._slots

    def _decays(self, state, lr) -> dict:
        """The kernels' ``l2`` and ``decay`` per parameter: torch applies one of the two forms."""
        wd = self.per_param(state, "weight_decay")
        if self.decoupled_weight_decay:
            return {"l2": np.zeros_like(wd), "decay": decoupled_decay(lr, wd)}
        return {"l2": wd, "decay": np.ones_like(wd)}

    def _common_args(self, params, gscale, working, zero_grad, mask) -> dict:
        """The kernels' keywords every variant takes alike."""
        b1, b2 = self.betas
        return {"gscale": self._signed(gscale), "beta1": b1, "beta2": b2, "eps": self.eps, **working_args(working),
                "zero_grad": zero_grad, "mask": mask_arg(mask, params)}

    def _arrays(self, state, params, grads) -> tuple:
        """The kernels' positional arrays: params, grads, the two slots, pieces."""
        return (params.flat, grads.flat, *(self._slot(state, k) for k in self._slots), self._pieces(params))


class NAdam(_AdamVariant):
    r"""NAdam (Dozat, 2016, "Incorporating Nesterov Momentum into Adam"), torch.optim.NAdam's form.

    With :math:`d_t = g_t + \lambda p_{t-1}` (L2 decay; with ``decoupled_weight_decay``
    :math:`d_t = g_t` and the parameter first decayed, :math:`p \leftarrow p\,(1 - \eta\lambda)`,
    as in NAdamW), the momentum schedule :math:`\mu_t = \beta_1 (1 - \tfrac12\, 0.96^{t\psi})`
    (``momentum_decay`` :math:`\psi`) and its running product
    :math:`\Pi_t = \prod_{i \le t} \mu_i`:

    .. math::
        m_t = m_{t-1} + (1-\beta_1)(d_t - m_{t-1}), \quad
        v_t = \beta_2 v_{t-1} + (1-\beta_2) d_t^2, \\
        p_t = p_{t-1} - \eta\,\Big(\frac{1-\mu_t}{1-\Pi_t}\, d_t
              + \frac{\mu_{t+1}}{1-\Pi_t\,\mu_{t+1}}\, m_t\Big)
              \Big/ \Big(\sqrt{v_t}/\sqrt{1-\beta_2^t} + \epsilon\Big)

    torch keeps :math:`\Pi_t` as a tensor per parameter, from each parameter's own steps; here it
    is one float64 scalar of the state, ``state.scalars["mu_product"]``, formed on the host, saved
    in checkpoints and restored with them, while every parameter took every step. Once some
    skipped steps for want of a gradient (``missing="skip"``, torch's rule: see
    :mod:`arraytrain.param_steps`) the products differ, and ``state.param_scalars["mu_product"]``
    holds one per parameter (float64), each advanced by the steps its parameter took with the
    :math:`\mu_t` of its own count; a step then launches the kernel once per distinct product among
    the parameters it updates (back to the one scalar when they agree again). Slots ``exp_avg`` and
    ``exp_avg_sq`` (torch's
    names); ``state_dtype="bfloat16"`` keeps them in bfloat16 (math in float32). ``eps``
    must be > 0. ``lr`` and ``weight_decay`` may differ per parameter through
    ``overrides`` (see :class:`Optimizer`).
    """

    _slots = ("exp_avg", "exp_avg_sq")

    def __init__(self, lr: float = 2e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum_decay: float = 4e-3, decoupled_weight_decay: bool = False, *,
                 maximize: bool = False, state_dtype: str | None = None, overrides=None):
        self._set_common(lr, betas, eps, weight_decay, maximize, state_dtype, overrides)
        self.momentum_decay = check_number("momentum_decay", momentum_decay, 0.0)
        self.decoupled_weight_decay = check_bool("decoupled_weight_decay", decoupled_weight_decay)

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                "momentum_decay": self.momentum_decay, "decoupled_weight_decay": self.decoupled_weight_decay,
                "maximize": self.maximize, "state_dtype": self.state_dtype, "overrides": self.overrides}

    def init(self, params):
        state = super().init(params)
        state.scalars["mu_product"] = 1.0
        return state

    def _mu(self, t: int) -> float:
        """The momentum schedule :math:`\\mu_t = \\beta_1 (1 - 0.5 \\cdot 0.96^{t \\psi})` (torch's formula)."""
        return self.betas[0] * (1.0 - 0.5 * (0.96 ** (t * self.momentum_decay)))

    def update(self, kernels, params, grads, state, *, gscale=1.0, lr=None, zero_grad=False, working=None,
               mask=None):
        lr = self._lr(state, lr)
        t = state.step + 1
        mu = self._mu(t)
        each = state.param_scalars.get("mu_product")
        if each is None and state.present is None:  # every parameter at one product: one launch
            mu_product = state.scalars["mu_product"] * mu
            self._launch(kernels, params, grads, state, lr, t, mu_product, gscale, working, zero_grad, mask)
            state.scalars["mu_product"] = mu_product
        else:
            self._launch_apart(kernels, params, grads, state, lr, t, each, gscale, working, zero_grad, mask)
        state.step = t

    def _launch(self, kernels, params, grads, state, lr, t: int, mu_product: float, gscale, working, zero_grad,
                mask) -> None:
        """The kernel over ``params``' pieces, each parameter's product (this step's included) ``mu_product``."""
        mu, mu_next = self._mu(t), self._mu(t + 1)
        kernels.nadam_step(*self._arrays(state, params, grads),
                           grad_step=lr * (1.0 - mu) / (1.0 - mu_product),
                           moment_step=lr * mu_next / (1.0 - mu_product * mu_next),
                           inv_bc2_sqrt=1.0 / math.sqrt(1.0 - self.betas[1] ** t), **self._decays(state, lr),
                           **self._common_args(params, gscale, working, zero_grad, mask),
                           grad_ptrs=self._grad_ptrs(params, grads))

    def _launch_apart(self, kernels, params, grads, state, lr, t: int, each, gscale, working, zero_grad,
                      mask) -> None:
        """Some parameters only (``state.present``), or parameters whose products differ (``each``): one
        launch per distinct product among ``params``' pieces (in increasing product), then every present
        parameter's product advanced, also where none of its pieces lie here (sharded state: every rank
        keeps every product)."""
        mu = self._mu(t)
        nseg = len(params.layout)
        before = np.full(nseg, state.scalars["mu_product"]) if each is None else each
        after = before.copy()
        present = slice(None) if state.present is None else state.present
        after[present] = before[present] * mu
        pieces = params.layout.pieces
        values = before[pieces[:, 2]]
        for value in np.unique(values):
            rows = np.ascontiguousarray(pieces[values == value])
            rows.flags.writeable = False
            self._launch(kernels, Subset(params, rows), Subset(grads, rows), state, lr, t, float(value) * mu, gscale,
                         working, zero_grad, mask)
        param_steps.set_values(state, "mu_product", after)  # (a new array: the device gate's restore keeps the old)


class RAdam(_AdamVariant):
    r"""RAdam (Liu et al., 2020, "On the Variance of the Adaptive Learning Rate and Beyond"),
    torch.optim.RAdam's form.

    With :math:`d_t` as in :class:`NAdam` (L2 decay, or ``decoupled_weight_decay``), the
    moments of Adam, :math:`\rho_\infty = 2/(1-\beta_2) - 1` and
    :math:`\rho_t = \rho_\infty - 2t\beta_2^t/(1-\beta_2^t)`:

    .. math::
        p_t = p_{t-1} - \frac{\eta}{1-\beta_1^t}\, m_t \cdot
        \begin{cases}
          r_t \sqrt{1-\beta_2^t} / (\sqrt{v_t} + \epsilon) & \rho_t > 5 \\
          1 & \text{otherwise}
        \end{cases}, \qquad
        r_t = \sqrt{\frac{(\rho_t-4)(\rho_t-2)\rho_\infty}{(\rho_\infty-4)(\rho_\infty-2)\rho_t}}

    The switch, :math:`r_t` and every bias correction are formed on the host once per
    step; ``eps`` is added to :math:`\sqrt{v_t}` before the bias correction, as in torch
    (Adam adds it after). Slots ``exp_avg``, ``exp_avg_sq``; ``state_dtype``, ``eps > 0``
    and ``overrides`` as :class:`NAdam`.
    """

    _slots = ("exp_avg", "exp_avg_sq")

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled_weight_decay: bool = False, *, maximize: bool = False,
                 state_dtype: str | None = None, overrides=None):
        self._set_common(lr, betas, eps, weight_decay, maximize, state_dtype, overrides)
        self.decoupled_weight_decay = check_bool("decoupled_weight_decay", decoupled_weight_decay)

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                "decoupled_weight_decay": self.decoupled_weight_decay, "maximize": self.maximize,
                "state_dtype": self.state_dtype, "overrides": self.overrides}

    def _rectification(self, t: int) -> float | None:
        """:math:`r_t \\sqrt{1-\\beta_2^t}` at step ``t``, or None where :math:`\\rho_t \\le 5` (no adaptive step)."""
        b2 = self.betas[1]
        bc2 = 1.0 - b2**t
        rho_inf = 2.0 / (1.0 - b2) - 1.0
        rho_t = rho_inf - 2.0 * t * (b2**t) / bc2
        if not rho_t > 5.0:
            return None
        return math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t) * bc2)

    def update(self, kernels, params, grads, state, *, gscale=1.0, lr=None, zero_grad=False, working=None,
               mask=None):
        lr = self._lr(state, lr)
        t = state.step + 1
        rect = self._rectification(t)
        kernels.radam_step(*self._arrays(state, params, grads), step_size=lr / (1.0 - self.betas[0] ** t),
                           rect=0.0 if rect is None else rect, rectified=rect is not None, **self._decays(state, lr),
                           **self._common_args(params, gscale, working, zero_grad, mask),
                           grad_ptrs=self._grad_ptrs(params, grads))
        state.step = t


class Adamax(_AdamVariant):
    r"""Adamax (Kingma & Ba, 2015, section 7.1: Adam with the infinity norm), torch.optim.Adamax's form.

    With :math:`d_t = g_t + \lambda p_{t-1}` (L2 decay):

    .. math::
        m_t = m_{t-1} + (1-\beta_1)(d_t - m_{t-1}), \quad
        u_t = \max(\beta_2 u_{t-1},\ |d_t| + \epsilon), \quad
        p_t = p_{t-1} - \frac{\eta}{1-\beta_1^t}\, \frac{m_t}{u_t}

    ``eps`` inside the max, as in torch (it must be > 0: a zero gradient would give
    0/0). The max propagates NaN, as ``torch.maximum``. Slots ``exp_avg`` and ``exp_inf``
    (torch's names); ``state_dtype`` and ``overrides`` as :class:`NAdam`.
    """

    _slots = ("exp_avg", "exp_inf")

    def __init__(self, lr: float = 2e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, maximize: bool = False, state_dtype: str | None = None,
                 overrides=None):
        self._set_common(lr, betas, eps, weight_decay, maximize, state_dtype, overrides)

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                "maximize": self.maximize, "state_dtype": self.state_dtype, "overrides": self.overrides}

    def update(self, kernels, params, grads, state, *, gscale=1.0, lr=None, zero_grad=False, working=None,
               mask=None):
        lr = self._lr(state, lr)
        t = state.step + 1
        kernels.adamax_step(*self._arrays(state, params, grads), step_size=lr / (1.0 - self.betas[0] ** t),
                            l2=self.per_param(state, "weight_decay"),
                            **self._common_args(params, gscale, working, zero_grad, mask),
                           grad_ptrs=self._grad_ptrs(params, grads))
        state.step = t
