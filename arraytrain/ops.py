"""Host-side compositions of kernels: the norm pass and the clip factor."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .layout import Layout


@dataclass(frozen=True)
class NormPass:
    """What one read-only pass over a gradient buffer found.

    ``norm`` and ``segment_norms`` are L2 norms of the buffer as stored (before
    any scale the caller folds in later); ``nonfinite`` is True when an element
    is NaN or Inf (the norms are then meaningless).
    """

    norm: float
    segment_norms: np.ndarray
    nonfinite: bool


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
        return NormPass(math.sqrt(total), np.sqrt(per_seg), False)
    nonfinite = NormPass(math.nan, np.full(len(layout), np.nan), True)
    if flat.dtype.itemsize < 8 or (grad_ptrs is None and not kernels.all_finite(flat)):
        return nonfinite
    peak = kernels.max_abs(flat, layout.pieces, grad_ptrs=grad_ptrs)
    if not 0.0 < peak < math.inf:
        return nonfinite
    total, per_seg = kernels.sumsq_scaled(flat, layout.pieces, nseg=len(layout), inv=1.0 / peak, grad_ptrs=grad_ptrs)
    if not math.isfinite(total):  # a NaN that max_abs passed over
        return nonfinite
    return NormPass(peak * math.sqrt(total), peak * np.sqrt(per_seg), False)


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
    if max_norm is None:
        return 1.0
    if eps == 0.0:
        return 1.0 if norm <= max_norm else max_norm / norm
    return min(1.0, max_norm / (norm + eps))
