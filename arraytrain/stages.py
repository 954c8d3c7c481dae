"""Pieces of the engine's boundary stages that work on data: the exchanges and the norm's verdict.

A boundary runs, in every mode (see :meth:`arraytrain.Engine.step`)::

    exchange            dense: one in-place all-reduce of the flat gradient and the weight sum;
                        with a compressor: the ranks agree on the weight sum and on finiteness,
                        then each compresses its share of the mean and receives the decoded sum
    norm pass           one read: global and per-parameter norms and the non-finite flag,
                        as a :class:`Verdict` (on CUDA it may stay on the device: a gate)
    skip or clip        NaN/Inf: nothing changes anywhere; else the clip factor
    update              the optimizer's fused kernel (SAM's first window: the ascent instead)
    bookkeeping         counters, loss scaler, report

With one process the exchanges are the identity and cost nothing. With sharded state
(:mod:`arraytrain.shard`) the exchange and the norm pass are one stage,
:func:`reduce_scatter_norm`: one reduce-scatter of the flat gradient, the sums of squares
of this rank's partition, and one small all-reduce that completes them and the weight sum;
the update runs on the partition, and one all-gather publishes the updated weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .ops import NormPass, clip_coef, norm_pass


def exchange_dense(comm, flat, wsum: float) -> float:
    """The flat gradient buffer and the window's weight sum become their sums over ranks.

    The flat buffer is the fusion buffer: one in-place all-reduce. A NaN/Inf on any rank
    reaches every rank through the sum, so the norm pass that follows finds it everywhere.
    """
    if comm.is_local:
        return wsum
    comm.allreduce(flat, "sum")
    return exchange_scalars(comm, wsum, False)[0]


def exchange_scalars(comm, wsum: float, bad: bool) -> tuple[float, bool]:
    """The window's weight sum over ranks, and whether any rank's gradient is not finite."""
    if comm.is_local:
        return wsum, bad
    both = np.array([wsum, float(bad)])
    comm.allreduce(both, "sum")
    return float(both[0]), bool(both[1])


def reduce_scatter_norm(sharding, kernels, wsum: float, reduced=None):
    """Sharded state: ``(gradient partition, weight sum over ranks, NormPass)``.

    One reduce-scatter of the flat gradient; the partition's float64 sums of squares
    (total and per parameter) and the window's weight sum travel in one small all-reduce,
    so every rank finds the same norms, and a NaN/Inf in any partition makes every rank's
    total non-finite. A float64 total that is not finite takes the norm pass's overflow
    path (see :func:`arraytrain.ops.norm_pass`) with two more small all-reduces. ``reduced``:
    the partition already reduced (by the overlapped exchange), instead of the reduce-scatter.
    """
    comm, part = sharding.comm, sharding.part
    g = sharding.reduce_scatter() if reduced is None else reduced
    nseg = len(part.layout)
    total, per_seg = kernels.sumsq(g.flat, part.pieces, nseg=nseg)
    sums = np.concatenate(([total], per_seg, [wsum]))
    comm.allreduce(sums, "sum")
    wsum, total = float(sums[-1]), float(sums[0])
    if math.isfinite(total):
        return g, wsum, NormPass(math.sqrt(total), np.sqrt(sums[1:-1]), False)
    nonfinite = NormPass(math.nan, np.full(nseg, np.nan), True)
    if g.flat.dtype.itemsize < 8:
        return g, wsum, nonfinite
    flags = np.array([0.0 if kernels.all_finite(g.flat) else 1.0, kernels.max_abs(g.flat, part.pieces)])
    comm.allreduce(flags, "max")
    if flags[0]:
        return g, wsum, nonfinite
    peak = float(flags[1])
    total, per_seg = kernels.sumsq_scaled(g.flat, part.pieces, nseg=nseg, inv=1.0 / peak)
    sums = np.concatenate(([total], per_seg))
    comm.allreduce(sums, "sum")
    return g, wsum, NormPass(peak * math.sqrt(sums[0]), peak * np.sqrt(sums[1:]), False)


class Verdict:
    """What the norm pass found, and the gradient's scale for the update.

    The buffer holds the gradient times ``unscale``; ``norm``, ``segment_norms`` and
    ``coef`` (the clip factor) are of the true gradient. Made on the host by
    :meth:`from_host`; on CUDA by :meth:`on_device`, whose finding stays on the device
    until :meth:`settle` reads it (the update kernels read the clip factor and the skip
    decision from the device meanwhile).
    """

    def __init__(self, found: NormPass | None, *, unscale: float, max_norm, eps: float, device=None):
        self.found, self.unscale, self._max_norm, self._eps = found, unscale, max_norm, eps
        self._device = device  # (kernels, sums, gate, flat, layout) while the finding is on the device

    @classmethod
    def from_host(cls, kernels, flat, layout, *, unscale, max_norm, eps) -> Verdict:
        """The norm pass on the host (:func:`arraytrain.ops.norm_pass`): the finding is known at once."""
        return cls(norm_pass(kernels, flat, layout), unscale=unscale, max_norm=max_norm, eps=eps)

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
        return self.found.norm / self.unscale

    @property
    def segment_norms(self) -> np.ndarray:
        """Per-parameter L2 norms of the true gradient."""
        return self.found.segment_norms / self.unscale

    @property
    def coef(self) -> float:
        """The clip factor ``min(1, max_norm / (norm + eps))`` (1 without clipping)."""
        return clip_coef(self.norm, self._max_norm, self._eps)

    def gscale(self):
        """What the update multiplies the gradient by: the clip factor over ``unscale``
        (on the device: a :class:`DeviceScale` of the gate, which also holds every kernel
        back when the total was not finite)."""
        if self.pending:
            kernels, _, gate, _, _ = self._device
            return kernels.DeviceScale(gate)
        return self.coef / self.unscale

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
            self.found = NormPass(math.sqrt(total), np.sqrt(per_seg), False)
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
    step's payload and ``dense_bytes`` that of the uncompressed gradient. ``lr`` is the scheduled learning rate of parameters without
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
    _segment_norms: np.ndarray | None = field(default=None, repr=False)
    _names: tuple = field(default=(), repr=False)
    payload_bytes: int | None = None
    dense_bytes: int | None = None

    @property
    def accumulated(self) -> bool:
        """True when the micro-batch was only accumulated: not applied, skipped or perturbed."""
        return not (self.applied or self.skipped or self.perturbed)

    @property
    def grad_norms(self) -> dict[str, float] | None:
        """Per-parameter L2 norms of the reduced gradient (from the same pass)."""
        if self._segment_norms is None:
            return None
        return {n: float(x) for n, x in zip(self._names, self._segment_norms)}
