"""The boundary's stages and what passes between them: the norm's :class:`Verdict` and the :class:`StepReport`.

A boundary runs, in every mode (see :meth:`arraytrain.Engine.step`)::

    exchange + norm     the gradient sync (:mod:`arraytrain.parallel.sync`) moves the window's
                        gradient across ranks through the placement
                        (:mod:`arraytrain.parallel.placement`), whose norm pass gives a
                        :class:`Verdict`: global and per-parameter norms and the non-finite flag
                        (on CUDA it may stay on the device: a gate); a :class:`Judge` carries the
                        unscale and clip settings the verdict needs
    skip or clip        NaN/Inf: nothing changes anywhere; else the clip factor
    update              the optimizer's fused kernel on what the placement owns, then its
                        publish (SAM's first window: the ascent instead)
    bookkeeping         counters, loss scaler, report

With one process the exchange is the identity and costs nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .._checks import check_int, check_number, check_positive
from ..errors import HyperparameterError
from ..ops import NormPass, clip_coef, norm_pass

#: The values of ``nonfinite``: skip a boundary whose gradient holds NaN/Inf, or apply it as torch.optim does.
NONFINITE = ("skip", "apply")


def check_judging(max_grad_norm, clip_eps, nonfinite, max_consecutive_skips) -> tuple:
    """The settings a :class:`Judge` decides by, checked as the engine and the drop-in optimizers take them:
    ``(max_grad_norm, clip_eps, nonfinite, max_consecutive_skips)``, or a HyperparameterError naming one."""
    if max_grad_norm is not None:
        max_grad_norm = check_positive("max_grad_norm", max_grad_norm)
    clip_eps = check_number("clip_eps", clip_eps, 0.0)
    if nonfinite not in NONFINITE:
        raise HyperparameterError(f"nonfinite: expected one of {NONFINITE}, got {nonfinite!r}")
    if max_consecutive_skips is not None:
        max_consecutive_skips = check_int("max_consecutive_skips", max_consecutive_skips, 1)
    return max_grad_norm, clip_eps, nonfinite, max_consecutive_skips


class Judge:
    """How a boundary's norm pass becomes a :class:`Verdict`: the kernels, the unscale factor of
    a window's weight sum and the clip settings, as the engine holds them at that boundary
    (the drop-in optimizers change ``max_grad_norm`` between steps)."""

    __slots__ = ("kernels", "unscale", "max_norm", "eps", "check", "grads_at")

    def __init__(self, kernels, unscale, max_norm, eps: float, *, check: bool = True, grads_at=None):
        self.kernels, self.unscale, self.max_norm, self.eps = kernels, unscale, max_norm, eps
        # check: a NaN/Inf skips the step (nonfinite="skip"); else it is applied, as torch.optim does
        # without a GradScaler. grads_at: the gradient read where it lies (arraytrain.buffer.GradsAt)
        self.check, self.grads_at = check, grads_at

    def found(self, found: NormPass, wsum: float) -> Verdict:
        """A finding made elsewhere (sharded: from the partitions' sums), for the weight sum ``wsum``."""
        return self.verdict(found, self.unscale(wsum))

    def verdict(self, found: NormPass, unscale: float) -> Verdict:
        """A finding made elsewhere, of a buffer that holds the gradient times ``unscale``."""
        return Verdict(self._checked(found), unscale=unscale, max_norm=self.max_norm, eps=self.eps)

    def norm_pass(self, flat, layout, unscale: float, on_device: bool) -> Verdict:
        """The norm pass over ``flat``, on the host or (CUDA) as a gate left on the device; none at all
        when nothing needs it (no non-finite check and no clipping: the report's norms are NaN)."""
        if not self.check and self.max_norm is None:
            n = len(layout)
            return Verdict(NormPass.lazy(math.nan, lambda: np.full(n, math.nan)), unscale=unscale,
                           max_norm=None, eps=self.eps)
        if on_device:
            return Verdict.on_device(self.kernels, flat, layout, unscale=unscale, max_norm=self.max_norm,
                                     eps=self.eps)
        ptrs = None if self.grads_at is None else self.grads_at.ptrs(layout.pieces)
        found = norm_pass(self.kernels, flat, layout, grad_ptrs=ptrs)
        return Verdict(self._checked(found), unscale=unscale, max_norm=self.max_norm, eps=self.eps)

    def _checked(self, found: NormPass) -> NormPass:
        """Without the check a non-finite finding is applied: the clip factor of a NaN norm is 1, and the
        update carries the NaN/Inf into the weights, as torch's step does."""
        if self.check or not found.nonfinite:
            return found
        return found.applied()


class Verdict:
    """What the norm pass found, and the gradient's scale for the update.

    The buffer holds the gradient times ``unscale``; ``norm``, ``segment_norms`` and
    ``coef`` (the clip factor) are of the true gradient. Made on the host by
    :meth:`Judge.norm_pass`; on CUDA by :meth:`on_device`, whose finding stays on the device
    until :meth:`settle` reads it (the update kernels read the clip factor and the skip
    decision from the device meanwhile).
    """

    def __init__(self, found: NormPass | None, *, unscale: float, max_norm, eps: float, device=None):
        self.found, self.unscale, self._max_norm, self._eps = found, unscale, max_norm, eps
        self._device = device  # (kernels, sums, gate, flat, layout) while the finding is on the device
        self._joint = None  # (norm, coef) of the gradient this buffer is part of (see joint)

    @staticmethod
    def joint(verdicts: list, max_norm, eps: float) -> tuple[bool, list]:
        """Several buffers' verdicts judged as one gradient (one model's parameters in several engines):
        ``(non-finite anywhere, the verdicts)``, each with the global norm and one clip factor, and its
        own buffer's scale and per-parameter norms. A finding on the device is read back first."""
        for v in verdicts:
            v.settle()
        nonfinite = any(v.nonfinite for v in verdicts)
        norm = math.sqrt(sum(v.norm ** 2 for v in verdicts))
        coef = clip_coef(norm, max_norm, eps)
        for v in verdicts:
            v._joint = (norm, coef)
        return nonfinite, verdicts

    @classmethod
    def on_device(cls, kernels, flat, layout, *, unscale, max_norm, eps) -> Verdict:
        """CUDA: the norm pass and the gate (clip factor, or skip) stay on the device; no synchronisation."""
        sums, gate = kernels.sumsq_gate(flat, layout.pieces, nseg=len(layout), unscale=unscale,
                                        max_norm=max_norm, eps=eps)
        return cls(None, unscale=unscale, max_norm=max_norm, eps=eps, device=(kernels, sums, gate, flat, layout))

    @property
    def pending(self) -> bool:
        """The finding is still on the device."""
        return self.found is None

    @property
    def nonfinite(self) -> bool:
        """A NaN/Inf was found (False while the finding is on the device)."""
        return self.found is not None and self.found.nonfinite

    @property
    def norm(self) -> float:
        """The global L2 norm of the true gradient (before clipping)."""
        if self._joint is not None:
            return self._joint[0]
        return self.found.norm / self.unscale

    @property
    def segment_norms(self) -> np.ndarray:
        """Per-parameter L2 norms of the true gradient (formed when read: a report holds the verdict)."""
        return self.found.segment_norms / self.unscale

    @property
    def coef(self) -> float:
        """The clip factor ``min(1, max_norm / (norm + eps))`` (1 without clipping)."""
        if self._joint is not None:
            return self._joint[1]
        return clip_coef(self.norm, self._max_norm, self._eps)

    def gscale(self):
        """What the update multiplies the gradient by: the clip factor over ``unscale``
        (on the device: a :class:`DeviceScale` of the gate, which also holds every kernel
        back when the total was not finite)."""
        if self.pending:
            kernels, _, gate, _, _ = self._device
            return kernels.DeviceScale(gate)
        return self.coef / self.unscale

    def apply(self, update, state) -> bool:
        """Run ``update(gscale)``, the optimizer's fused update; False when a device gate held it back.

        On the host it runs once. On the device it runs gated, then :meth:`settle` reads the
        finding back: if the gate held every kernel back, nothing moved, nor may the host's
        counters and scalar state (NAdam's mu_product) that the optimizer advanced, which are
        restored; a finding that is finite after all is applied with the host's norm."""
        if not self.pending:
            update(self.gscale())
            return True
        step, scalars, each = state.step, dict(state.scalars), dict(state.param_scalars)
        update(self.gscale())
        if self.settle():
            return True
        state.step = step
        state.scalars.update(scalars)
        state.param_scalars = each
        if self.nonfinite:
            return False
        update(self.gscale())
        return True

    def settle(self) -> bool:
        """Read a device finding back (the step's one synchronisation); True when the gated
        update it fed ran. When the device total was not finite the kernels held back, and
        the finding is the host's norm pass: non-finite, or a float64 buffer whose finite
        values overflowed the device's sum of squares (the host's norm is overflow-safe)."""
        if not self.pending:
            return True
        kernels, sums, _, flat, layout = self._device
        total, per_seg = kernels.read_sums(sums)
        if math.isfinite(total):
            self.found = NormPass.of_sums(math.sqrt(total), per_seg)
            return True
        self.found = norm_pass(kernels, flat, layout)
        return False


@dataclass(frozen=True, kw_only=True)
class StepReport:
    """What one call of :meth:`Engine.step` did.

    ``applied``: the optimizer ran. ``skipped``: the accumulation boundary was
    reached with a NaN/Inf gradient, so nothing changed and the window was
    dropped. ``perturbed``: (SAM) the boundary moved the weights to the
    ascent point; the next window's gradient, taken there, makes the update.
    None of these: the micro-batch was accumulated. ``grad_norm`` is the
    global L2 norm of the reduced (mean or sum), unscaled gradient before
    clipping, and ``clip_coef`` the factor applied to it; both are None between
    boundaries. With a compressor, ``payload_bytes`` is the measured size of the
    step's payload and ``dense_bytes`` that of the uncompressed gradient, and ``compression`` the
    compressor's phase at that step: ``"dense"`` (its warm-up), ``"ramp"`` (a sparsifier keeping more
    than its target on the way there) or ``"compressed"``. ``lr`` is the scheduled learning rate of parameters without
    an ``lr`` override; ``loss_scale`` the scale to multiply the next loss by.
    """

    applied: bool
    skipped: bool
    step: int
    micro_batches: int
    lr: float
    grad_norm: float | None = None
    clip_coef: float | None = None
    loss_scale: float = 1.0
    perturbed: bool = False
    _segment_norms: np.ndarray | Verdict | None = field(default=None, repr=False)  # (a Verdict: norms when read)
    _names: tuple = field(default=(), repr=False)
    payload_bytes: int | None = None
    dense_bytes: int | None = None
    compression: str | None = None

    @property
    def accumulated(self) -> bool:
        """True when the micro-batch was only accumulated: not applied, skipped or perturbed."""
        return not (self.applied or self.skipped or self.perturbed)

    @property
    def grad_norms(self) -> dict[str, float] | None:
        """Per-parameter L2 norms of the reduced gradient (from the same pass)."""
        norms = self._segment_norms
        if norms is None:
            return None
        if isinstance(norms, Verdict):  # (formed now: most steps' reports are never asked)
            norms = norms.segment_norms
        return {n: float(x) for n, x in zip(self._names, norms)}
