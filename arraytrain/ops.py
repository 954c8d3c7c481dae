"""Host-side compositions of kernels: the norm pass and the clip factor."""

from __future__ import annotations

import math
import numpy as np

from .layout import Layout


class NormPass:
    """What one read-only pass over a gradient buffer found.

    ``norm`` and ``segment_norms`` are L2 norms of the buffer as stored (before
    any scale the caller folds in later); ``nonfinite`` is True when an element
    is NaN or Inf (the norms are then meaningless). Made :meth:`of_sums` or
    :meth:`lazy`, the per-segment norms are formed when first read: every step
    reports them, few callers read them, and two NumPy calls a step cost
    microseconds each inside a training loop.
    """

    __slots__ = ("norm", "nonfinite", "_norms", "_make")

    def __init__(self, norm: float, segment_norms: np.ndarray | None, nonfinite: bool):
        self.norm, self.nonfinite, self._norms, self._make = norm, nonfinite, segment_norms, None

    @classmethod
    def lazy(cls, norm: float, make, nonfinite: bool = False) -> NormPass:
        """A finding whose per-segment norms are ``make()``, called when they are first read."""
        found = cls(norm, None, nonfinite)
        found._make = make
        return found

    @classmethod
    def of_sums(cls, norm: float, sums: np.ndarray, peak: float = 1.0) -> NormPass:
        """A finite finding whose per-segment norms are ``peak * sqrt(sums)``."""
        return cls.lazy(norm, lambda: np.sqrt(sums) if peak == 1.0 else peak * np.sqrt(sums))

    @property
    def segment_norms(self) -> np.ndarray:
        if self._norms is None:
            self._norms = self._make()
        return self._norms

    def applied(self) -> NormPass:
        """The same finding taken as finite (a non-finite gradient applied, not skipped)."""
        return NormPass.lazy(self.norm, lambda: self.segment_norms)

    def __repr__(self) -> str:
        return f"NormPass(norm={self.norm!r}, nonfinite={self.nonfinite!r})"


def norm_pass(kernels, flat, layout: Layout, grad_ptrs=None) -> NormPass:
    """Global and per-parameter L2 norms and the non-finite flag, in one pass.

    The finite check is folded into the float64 sum of squares: a NaN/Inf
    element makes it non-finite, and squares being >= 0 nothing can cancel it.
    Only a float64 buffer can also overflow from finite values (|x| > 1e154);
    that rare case takes two more passes (a finite check, then the sum of
    ``(x / max|x|)^2``) so that huge finite gradients still get a finite norm.
    ``grad_ptrs``: the gradient is read where it lies (see :mod:`arraytrain.kernels.interface`);
    the overflow case then finds a non-finite element through the scaled sum.
    """
    total, per_seg = kernels.sumsq(flat, layout.pieces, nseg=len(layout), grad_ptrs=grad_ptrs)
    if math.isfinite(total):
        return NormPass.of_sums(math.sqrt(total), per_seg)
    nonfinite = NormPass(math.nan, np.full(len(layout), np.nan), True)
    if flat.dtype.itemsize < 8 or (grad_ptrs is None and not kernels.all_finite(flat)):
        return nonfinite
    peak = kernels.max_abs(flat, layout.pieces, grad_ptrs=grad_ptrs)
    if not 0.0 < peak < math.inf:
        return nonfinite
    total, per_seg = kernels.sumsq_scaled(flat, layout.pieces, nseg=len(layout), inv=1.0 / peak, grad_ptrs=grad_ptrs)
    if not math.isfinite(total):  # a NaN that max_abs passed over
        return nonfinite
    return NormPass.of_sums(peak * math.sqrt(total), per_seg, peak)


# The global-norm clipping rules, named by their ``clip_eps`` (the Engine's and
# AccumulationConfig's argument): 1e-6, torch.nn.utils.clip_grad_norm_'s ``max_norm / (norm + 1e-6)``,
# the default everywhere; 0.0, optax.clip_by_global_norm's ``max_norm / norm`` (exactly max_norm after).
CLIP_EPS = 1e-6


def clip_coef(norm: float, max_norm: float | None, eps: float = CLIP_EPS) -> float:
    """Global-norm clip factor ``min(1, max_norm / (norm + eps))``.

    ``eps=1e-6`` (:data:`CLIP_EPS`) is torch.nn.utils.clip_grad_norm_'s rule; ``eps=0``
    scales to exactly ``max_norm`` (optax.clip_by_global_norm's rule: a clipped gradient's norm is
    ``max_norm`` itself, not slightly below it).
    """
    return 1.0 if max_norm is None else clip_factor(norm, max_norm, eps)


def clip_factor(norm: float, max_norm: float, eps: float) -> float:
    """:func:`clip_coef` for a ``max_norm`` given: the one clip rule, which the torch drop-ins' one-call
    step (:func:`arraytrain.kernels.cpu.optimizers.adam_checked`) compiles too. A NaN norm gives NaN
    with ``eps=0`` and 1.0 otherwise, as Python's ``min(1.0, nan)`` does."""
    if eps == 0.0:
        return 1.0 if norm <= max_norm else max_norm / norm
    coef = max_norm / (norm + eps)
    return coef if coef < 1.0 else 1.0
