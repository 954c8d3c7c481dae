"""SophiaG: a clipped, Hessian-preconditioned sign-momentum method."""

from __future__ import annotations


from .._checks import check_betas, check_bool, check_number
from ._base import Optimizer, decoupled_decay, mask_arg, working_args


class Sophia(Optimizer):
    r"""SophiaG (Liu et al., 2023, "Sophia: A Scalable Stochastic Second-order Optimizer").

    The update of the authors' reference implementation (``SophiaG`` in
    github.com/Liuhong99/Sophia), with :math:`G_t = \pm g_t` (``maximize``):

    .. math::
        m_t = \beta_1 m_{t-1} + (1-\beta_1) G_t, \quad
        \theta \leftarrow \theta\,(1 - \eta\lambda), \\
        \theta_t = \theta - \eta\,\mathrm{sign}(m_t)
            \min\!\Big(\frac{|m_t|}{\max(\rho\, b\, h_t, \epsilon)},\ 1\Big)

    and, every k steps, fed by the caller through :meth:`update_hessian`,
    :math:`h \leftarrow \beta_2 h + (1-\beta_2)\hat h` (no bias correction; ``h``
    starts at 0, so steps before the first estimate are sign-momentum steps of size
    ``lr``).

    The batch-size factor ``bs`` (:math:`b`): the reference code multiplies ``rho``
    by the number of tokens of the batch in the step (``bs=5120`` there, with
    ``rho=0.04``) because its Gauss-Newton-Bartlett estimate is :math:`\hat g \odot
    \hat g` of a *mean* loss gradient; the paper's Algorithm 2 puts the factor ``B``
    into the estimate instead. We keep the reference code's form and defaults, so its
    published ``rho`` carries over; pass ``bs=1`` when the estimate already carries
    the scale (an exact or Hutchinson diagonal). The paper's ``max(rho h, eps)``
    denominator is used; the reference code's ``rho*bs*h + 1e-15`` differs from it
    only where ``rho*bs*h`` is within a few ``eps`` of zero. ``lr`` and
    ``weight_decay`` may differ per parameter through ``overrides``.

    Names: the reference code's (``lr``, ``betas``, ``rho``, ``weight_decay`` positional,
    as ``SophiaG`` takes them; ``eps``, ``bs`` and ``maximize`` keyword-only). ``rho`` is
    the paper's clipping scale :math:`\rho`; SAM's ``rho`` (a neighbourhood radius) is
    another quantity of the same paper-given name, and Adafactor's relative step
    :math:`\rho_t` is not an argument (torch computes it from ``lr``).
    """

    reads_in_place = False  # its kernels read the flat gradient buffer

    fallback_capable = False  # fed by engine.update_hessian
    shard_refusal = ("its Hessian estimates are fed by name through engine.update_hessian, which does not "
                     "take partitions yet; train Sophia replicated (shard_state=False)")

    def __init__(self, lr: float = 1e-4, betas: tuple[float, float] = (0.965, 0.99), rho: float = 0.04,
                 weight_decay: float = 1e-1, *, eps: float = 1e-15, bs: float = 5120, maximize: bool = False,
                 overrides=None):
        self.lr = self._checked_lr(lr)
        self.betas = check_betas(betas)
        self.rho = check_number("rho", rho, 0.0, lo_open=True)
        self.weight_decay = check_number("weight_decay", weight_decay, 0.0)
        self.eps = check_number("eps", eps, 0.0, lo_open=True)
        self.bs = check_number("bs", bs, 0.0, lo_open=True)
        self.maximize = check_bool("maximize", maximize)
        self._set_overrides(overrides)

    @property
    def slot_names(self) -> tuple[str, ...]:
        return ("exp_avg", "hessian")

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "rho": self.rho, "weight_decay": self.weight_decay,
                "eps": self.eps, "bs": self.bs, "maximize": self.maximize, "overrides": self.overrides}

    def update(self, kernels, params, grads, state, *, gscale=1.0, lr=None, zero_grad=False, working=None,
               mask=None):
        lr = self._lr(state, lr)
        wd = self.per_param(state, "weight_decay")
        s = state.slots
        kernels.sophia_step(params.flat, grads.flat, s["exp_avg"].flat, s["hessian"].flat, params.layout.pieces,
                            gscale=self._signed(gscale), lr=lr, decay=decoupled_decay(lr, wd), beta1=self.betas[0],
                            rho_bs=self.rho * self.bs, eps=self.eps, **working_args(working), zero_grad=zero_grad,
                            mask=mask_arg(mask, params))
        state.step += 1

    def update_hessian(self, kernels, state, items, layout) -> None:
        r""":math:`h \leftarrow \beta_2 h + (1-\beta_2)\hat h` for each ``{name: estimate}`` in ``items``.

        ``items`` holds validated 1-D float arrays (as from
        :func:`arraytrain.engine.intake.check_grads`); parameters absent from it keep their
        ``h``. Two passes per parameter with the existing kernels (``scale`` by beta2,
        then ``accumulate`` of ``(1 - beta2) * estimate``), math in the state's dtype;
        estimates come every k steps, so a fused kernel would save little.
        """
        b2 = self.betas[1]
        h = state.slots["hessian"].flat
        for name, est in items.items():
            view = h[layout.slice(name)]
            if view.size:
                kernels.scale(view, factor=b2)
                kernels.accumulate(view, est, w=1.0 - b2, overwrite=False)
