"""SAM / ASAM: sharpness-aware minimisation as a wrapper over any base optimizer."""

from __future__ import annotations

import math

from .._checks import check_bool, check_number
from ..errors import ArgumentTypeError, HyperparameterError
from ._base import Optimizer, OptState, mask_arg

# davda54/sam's guard against a zero gradient norm: e = rho * g / (||g|| + 1e-12)
NORM_EPS = 1e-12


class SAM(Optimizer):
    r"""Sharpness-Aware Minimization (Foret et al., 2021); ``adaptive=True``: ASAM (Kwon et al., 2021).

    Two gradient evaluations per step. With :math:`g = \nabla L(w)`:

    .. math::
        e(w) = \rho\,\frac{g}{\lVert g\rVert + 10^{-12}} \quad\text{or, adaptive,}\quad
        e(w) = \rho\,\frac{w^2 \odot g}{\lVert w \odot g\rVert + 10^{-12}}, \\
        w_{t+1} = \mathrm{base\_step}\big(w_t,\ \nabla L(w_t + e(w_t))\big)

    (the :math:`p=2` solution of the paper's inner maximisation; the adaptive form and the
    ``1e-12`` follow the SAM reference implementation, github.com/davda54/sam).

    The caller drives two windows per step: :meth:`perturb` (first gradient) saves the
    weights in the slot ``sam_backup`` and moves them to :math:`w + e(w)`, in one pass
    (plus one float64 reduction pass for the adaptive norm :math:`\lVert w\odot g\rVert`);
    the second gradient is taken there; :meth:`update` copies the weights back from the
    backup (one extra pass: read the backup, write the weights) and runs the base
    optimizer's fused step with that gradient. :meth:`restore` undoes a perturbation
    without a step (a skipped, non-finite second window).

    ``rho`` is the neighbourhood radius :math:`\rho` (the paper's and davda54/sam's name;
    :class:`Sophia`'s ``rho`` is another quantity). State: the base optimizer's slots plus
    ``sam_backup``. ``lr``, ``weight_decay``, ``overrides`` and per-parameter values
    delegate to the base optimizer, which carries ``maximize``.
    """

    reads_in_place = False  # its kernels read the flat gradient buffer

    per_param_steps = False
    per_param_steps_refusal = "its two gradient windows per step"

    fallback_capable = False  # two gradient windows per step
    shard_refusal = ("its ascent moves every weight along the whole gradient, of which a rank with sharded "
                     "state receives its partition only; train SAM replicated (shard_state=False)")

    def __init__(self, base: Optimizer, rho: float = 0.05, adaptive: bool = False):
        if not isinstance(base, Optimizer) or isinstance(base, SAM):
            raise HyperparameterError(f"base: expected an Optimizer (not SAM), got {base!r}")
        self.base = base
        self.rho = check_number("rho", rho, 0.0, lo_open=True)
        self.adaptive = check_bool("adaptive", adaptive)

    # -- delegation to the base optimizer -------------------------------------------------
    @property
    def PER_PARAM(self):  # noqa: N802 (the base class's constant)
        """The base optimizer's per-parameter hyperparameters."""
        return self.base.PER_PARAM

    @property
    def lr(self):
        """The base optimizer's learning rate (setting it sets the base optimizer's)."""
        return self.base.lr

    @lr.setter
    def lr(self, value):
        self.base.lr = value

    @property
    def weight_decay(self):
        """The base optimizer's weight decay."""
        return self.base.weight_decay

    @property
    def overrides(self):
        """The base optimizer's per-parameter overrides."""
        return self.base.overrides

    def resolve(self, layout):
        return self.base.resolve(layout)

    def per_param(self, state, key):
        return self.base.per_param(state, key)

    @property
    def has_eval_params(self):
        """Whether the base optimizer evaluates the model at other weights than its parameters."""
        return self.base.has_eval_params

    def eval_params(self, params, state, out=None):
        return self.base.eval_params(params, state, out)

    @property
    def slot_names(self) -> tuple[str, ...]:
        return tuple(self.base.slot_names) + ("sam_backup",)

    def hyperparameters(self) -> dict:
        return {"base": type(self.base).__name__, "base_hyperparameters": self.base.hyperparameters(),
                "rho": self.rho, "adaptive": self.adaptive}

    def __repr__(self) -> str:
        return f"SAM({self.base!r}, rho={self.rho!r}, adaptive={self.adaptive!r})"

    def init(self, params) -> OptState:
        state = self.base.init(params)
        state.slots["sam_backup"] = params.zeros_like()
        return state

    # -- the two windows ------------------------------------------------------------------
    def perturb(self, kernels, params, grads, state, *, gscale=1.0, grad_norm=None, zero_grad=False,
                mask=None) -> None:
        """Save the weights and move them to ``w + e(w)`` (first window).

        The gradient is ``gscale * grads``; ``grad_norm`` is its global L2 norm (the
        engine's norm pass), or None to compute it here. The adaptive norm
        ``||w * gscale * grads||`` is always computed here (one float64 reduction pass).
        ``zero_grad`` zeroes the gradient buffer in the same pass. ``mask`` (see
        :meth:`Optimizer.update`): pruned weights stay 0 at the ascent point; ``e`` is
        the unmasked one (its norm includes the pruned elements' gradients), then projected.
        """
        mask = mask_arg(mask, params)
        pieces, nseg = params.layout.pieces, len(params.layout)
        if self.adaptive:
            norm = abs(gscale) * math.sqrt(kernels.sumsq_product(params.flat, grads.flat, pieces, nseg=nseg)[0])
        elif grad_norm is None:
            norm = abs(gscale) * math.sqrt(kernels.sumsq(grads.flat, pieces, nseg=nseg)[0])
        else:
            norm = float(grad_norm)
        kernels.sam_perturb(params.flat, grads.flat, state.slots["sam_backup"].flat, pieces,
                            scale=self.rho * gscale / (norm + NORM_EPS), adaptive=self.adaptive, zero_grad=zero_grad,
                            mask=mask)

    def restore(self, kernels, params, state) -> None:
        """Copy the weights saved by :meth:`perturb` back (one pass; padding is zero in both)."""
        kernels.accumulate(params.flat, state.slots["sam_backup"].flat, w=1.0, overwrite=True)

    def update(self, kernels, params, grads, state, *, gscale=1.0, lr=None, zero_grad=False, working=None,
               mask=None):
        """Second window: restore the weights, then the base optimizer's step with this gradient.

        Assumes :meth:`perturb` ran on this state in the first window (the engine tracks
        it, ``Engine.perturbed``); otherwise the backup holds stale weights.
        """
        if "sam_backup" not in state.slots:
            raise ArgumentTypeError("SAM.update: the state has no 'sam_backup' slot; build it with SAM.init")
        mask_arg(mask, params)  # refused before the weights are restored
        self.restore(kernels, params, state)
        inner = OptState(state.step, {k: v for k, v in state.slots.items() if k != "sam_backup"}, state.hp,
                         state.scalars)
        self.base.update(kernels, params, grads, inner, gscale=gscale, lr=lr, zero_grad=zero_grad, working=working,
                         mask=mask)
        state.step = inner.step
