from __future__ import annotations

from .._checks import check_betas, check_bool, check_number
from ._base import Optimizer, mask_arg, working_args


class LAMB(Optimizer):
    r"""LAMB (You et al., 2020, "Large Batch Optimization for Deep Learning: Training BERT
    in 76 minutes"), optax.lamb semantics.

    Adam's bias-corrected moments, decoupled weight decay added to the update,
    then a trust ratio per parameter :math:`s` (per leaf, as optax), with ``betas``
    :math:`= (\beta_1, \beta_2)` (optax's ``b1``, ``b2``):

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t, \quad
        v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2, \\
        u_t = \frac{m_t / (1-\beta_1^t)}{\sqrt{v_t / (1-\beta_2^t) + \epsilon_{root}} + \epsilon}
              + \lambda p_{t-1}, \\
        r_s = \frac{\lVert p_{t-1,s} \rVert}{\lVert u_{t,s} \rVert}
              \ (1 \text{ if either norm is } 0), \qquad
        p_{t,s} = p_{t-1,s} - \eta\, r_s\, u_{t,s}

    One kernel: the first loop updates the moments and sums :math:`\lVert p\rVert^2`,
    :math:`\lVert u\rVert^2` per piece in float64 (added per parameter in piece
    order, so the ratio does not depend on the thread count); the second loop
    recomputes :math:`u` from the stored moments and applies it. With sharded state
    (``Engine(shard_state=True)``) the per-parameter sums of squares of each rank's
    partition are completed by one all-reduce between the two loops, so a parameter cut
    by a partition boundary gets the ratio of its whole. Slots:
    ``exp_avg`` (optax's ``mu``) and ``exp_avg_sq`` (``nu``). ``trust_ratio`` holds
    the per-parameter ratios of this optimizer's last step (a diagnostic). ``lr`` and ``weight_decay`` may differ
    per parameter through ``overrides`` (see :class:`Optimizer`).
    """

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, *, eps_root: float = 0.0, maximize: bool = False,
                 state_dtype: str | None = None, overrides=None):
        self.lr = self._checked_lr(lr)
        self.betas = check_betas(betas)
        self.eps = check_number("eps", eps, 0.0, lo_open=True)
        self.eps_root = check_number("eps_root", eps_root, 0.0)
        self.weight_decay = check_number("weight_decay", weight_decay, 0.0)
        self.maximize = check_bool("maximize", maximize)
        self._set_state_dtype(state_dtype)
        self._set_overrides(overrides)
        self.trust_ratio = None

    @property
    def slot_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                "eps_root": self.eps_root, "maximize": self.maximize,
                "state_dtype": self.state_dtype, "overrides": self.overrides}

    segment_sums = True  # the trust ratios' norms are per parameter: a partition's sums are completed

    def update(self, kernels, params, grads, state, *, gscale=1.0, lr=None, zero_grad=False, working=None,
               mask=None, reduce_sums=None):
        t = state.step + 1
        b1, b2 = self.betas
        ratio = kernels.lamb_step(params.flat, grads.flat, self._slot(state, "exp_avg"),
                                  self._slot(state, "exp_avg_sq"), self._pieces(params), gscale=self._signed(gscale),
                                  lr=self._lr(state, lr), weight_decay=self.per_param(state, "weight_decay"),
                                  beta1=b1, beta2=b2, eps=self.eps, eps_root=self.eps_root,
                                  inv_bc1=1.0 / (1.0 - b1**t), inv_bc2=1.0 / (1.0 - b2**t),
                                  **working_args(working), zero_grad=zero_grad, mask=mask_arg(mask, params),
                                  reduce_sums=reduce_sums, grad_ptrs=self._grad_ptrs(params, grads))
        self.trust_ratio = ratio  # float64, on the buffers' device
        state.step = t
