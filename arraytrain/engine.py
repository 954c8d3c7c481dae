"""The Engine: accumulate micro-batches, check, clip and apply the optimizer on flat buffers."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from . import _intake
from ._checks import check_count, check_int, check_number, check_positive, shown
from .amp import LossScaler, working_spec
from .backend import NUMPY, array_module, backend_of, kernels_for, to_device
from .buffer import FlatBuffer, aligned
from .compress._base import check_compressor
from .exchange import PerRank, check_exchange
from .errors import (
    ArgumentTypeError,
    BackendError,
    ConcurrentUseError,
    DTypeError,
    HyperparameterError,
    LayoutError,
    MissingGradientError,
    NonFiniteError,
    StateDictError,
)
from .ops import CLIP_EPS, NormPass, clip_coef, norm_pass
from .optim import Optimizer
from .prune import MaskBuffer
from .schedules import Schedule

STATE_FORMAT = 3
REDUCTIONS = ("mean", "sum")
MISSING = ("error", "zero")


class _CallGuard:
    """Refuses a call on an engine while a call from another thread is running on it.

    A non-blocking re-entrant lock: the thread holding it may nest calls (``save``
    holds it while it writes what ``state_dict`` returned); any other thread gets
    :class:`ConcurrentUseError` at once, before its call changes anything.
    """

    def __init__(self):
        self._lock = threading.RLock()
        self._holder: tuple[str, str] | None = None

    @contextmanager
    def __call__(self, what: str):
        if not self._lock.acquire(blocking=False):
            thread, busy = self._holder or ("?", "another call")
            raise ConcurrentUseError(
                f"{what}: the engine is busy with {busy} on thread {thread!r}; an Engine is not "
                "thread-safe: serialise the calls on one engine (e.g. with a lock of your own)"
            )
        outer = self._holder
        self._holder = (threading.current_thread().name, what)
        try:
            yield
        finally:
            self._holder = outer
            self._lock.release()


def _exclusive(method):
    """Run an Engine method under the engine's call guard."""

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        with self._guard(f"{method.__name__}()"):
            if self._evaluating:
                raise ConcurrentUseError(f"{method.__name__}(): inside engine.evaluation() the parameters hold the "
                                         "evaluation weights; leave the block first")
            return method(self, *args, **kwargs)

    return guarded


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


class Engine:
    """Training step on flat buffers: ``engine.step(grads) -> StepReport``.

    Parameters
    ----------
    params : mapping name -> array, or FlatBuffer
        A mapping is copied into a new flat buffer (``dtype`` or the common
        floating dtype); a :class:`FlatBuffer` is used in place.
    optimizer : Optimizer
        An optimizer from :mod:`arraytrain.optim`.
    accumulation_steps : int
        Micro-batches per optimizer step.
    max_grad_norm : float or None
        Global L2 clipping (torch's ``clip_grad_norm_`` factor), folded into
        the optimizer kernel as a scalar: one read-only norm pass, no rescale pass.
    reduction : "mean" or "sum"
        How micro-batches combine: the (weight-)mean or the plain sum.
        ``step(grads, weight=n)`` weights a micro-batch, e.g. by its token
        count; with "mean" the result is ``sum(w*g) / sum(w)``.
    missing : "error" or "zero"
        A micro-batch without a gradient for some parameter: raise, or count
        it as zero (a parameter that did not take part).
    dtype : dtype or None
        The floating dtype of the new buffer a mapping is copied into (None:
        the parameters' common floating dtype); a :class:`FlatBuffer` must
        already hold it.
    zero_grad_on_step : bool
        Zero ``engine.grads`` after every boundary, inside the optimizer
        kernel (no extra pass). Needed when a framework *adds* into the
        buffer (``loss.backward()`` into ``.grad`` views). Set False when the
        caller overwrites the gradients every window: saves 4 bytes/element.
    kernels : "numba" or "reference"
        The fused kernels, or their slow reference twins.
    schedule : a schedule from :mod:`arraytrain.schedules`, or None
        ``lr = schedule(step, base_lr)`` per parameter at every applied step,
        ``step`` counting applied steps only: a skipped step does not advance
        the schedule.
    loss_scaler : LossScaler or None
        Dynamic loss scaling: multiply the loss by ``engine.loss_scale``; the
        engine unscales inside the norm pass and the optimizer kernel, skips
        non-finite steps and adjusts the scale.
    working_dtype : "bfloat16", "float16" or None
        Keep ``engine.working``, a low-precision copy of the float32 weights
        for the forward pass, rewritten by the optimizer kernel itself.
    max_consecutive_skips : int or None
        After this many boundaries in a row with NaN/Inf gradients raise
        :class:`NonFiniteError` instead of skipping forever (None: never).
    compressor : Compressor, ErrorFeedback or None
        A compressor from :mod:`arraytrain.compress`, optionally in
        :class:`~arraytrain.compress.ErrorFeedback`. At every applied
        boundary the reduced, unscaled gradient is compressed
        and replaced by what the receivers decode (with ``comm``: the sum over
        processes of every process's decoded share of the mean); the norm,
        clipping and the optimizer then work on that, as torch's DDP
        communication hooks followed by ``clip_grad_norm_`` do, so every process
        clips identically and the clipped gradient is the one applied.
        Error-feedback residuals therefore hold unclipped gradient. A boundary
        whose gradient is not finite (on any process) compresses nothing:
        residuals and the compressor's call count stay. SAM's ascent window uses
        the exact local gradient (only the update's gradient is compressed, as in
        local-ascent distributed SAM).
    clip_eps : float
        The clip factor is ``min(1, max_grad_norm / (norm + clip_eps))``: the
        default 1e-6 is torch's ``clip_grad_norm_``; ``clip_eps=0`` is optax's
        ``clip_by_global_norm`` (scale to exactly ``max_grad_norm``).
    comm : an :class:`~arraytrain.exchange.Exchange` or None
        Data-parallel training over a group of processes (e.g.
        :class:`arraytrain.distributed.MPIComm`); None: this process alone.
        Every rank feeds its shard of the batch; at each boundary the flat
        gradient buffer is all-reduced in place (one collective: it is the
        fusion buffer) with the window's weight sum, before the norm pass, so
        every rank skips, clips and steps identically. At construction the ranks
        must agree on the layout, dtype, optimizer and settings (else a
        :class:`LayoutError` / :class:`HyperparameterError` on every rank), and
        rank 0's parameters and optimizer state are broadcast.
    device : None, "cpu" or "cuda"
        Where the buffers live. None: where ``params`` are (NumPy arrays: the
        CPU; CuPy arrays, or a FlatBuffer of them: the current CUDA device).
        "cuda" with NumPy parameters copies them to the current CUDA device
        once, here (the one explicit move; gradients must then arrive on that
        device: a NumPy gradient is refused, never copied behind your back);
        "cpu" with CuPy parameters copies them to the host.

    Notes
    -----
    On a CUDA device every stage is a CuPy raw kernel, one launch over the
    whole buffer, and a step synchronises with the host once: after the norm
    pass, to read the global and per-parameter norms and the non-finite flag
    (the skip decision and the report). Micro-batches between boundaries do not
    synchronise.

    Threads: an engine is not thread-safe, and it detects misuse rather than
    corrupting itself. While one thread is inside :meth:`step`,
    :meth:`load_state_dict`, :meth:`state_dict`, :meth:`set_mask`,
    :meth:`zero_grad`, :meth:`update_hessian`, :meth:`observe` or
    :func:`arraytrain.save`, a call to any of them from another thread raises
    :class:`~arraytrain.errors.ConcurrentUseError` and changes nothing. Reads
    and writes of ``engine.params`` / ``engine.grads`` views are not watched:
    do not write them while a step runs. Different engines are independent.

    Pruning: :meth:`set_mask` keeps a uint8 mask (1 keep, 0 pruned) that every
    optimizer kernel applies to the weights it writes, so pruned weights stay
    exactly zero through training.

    The zero-copy path: ``engine.params[name]`` and ``engine.grads[name]``
    are views into the flat buffers. Write (or let a framework accumulate)
    gradients into ``engine.grads`` and call ``engine.step()`` with no
    argument; ``weight`` then only enters the denominator of the mean, so
    weighted gradients must already be multiplied by their weight.
    """

    def __init__(self, params, optimizer: Optimizer, *, accumulation_steps: int = 1,
                 max_grad_norm: float | None = None, reduction: str = "mean", missing: str = "error",
                 zero_grad_on_step: bool = True, dtype=None, kernels: str = "numba", schedule=None,
                 loss_scaler: LossScaler | None = None, working_dtype: str | None = None,
                 max_consecutive_skips: int | None = 50, compressor=None, device: str | None = None,
                 clip_eps: float = CLIP_EPS, comm=None):
        if not isinstance(optimizer, Optimizer):
            raise ArgumentTypeError(f"optimizer: expected an arraytrain.optim.Optimizer, got {type(optimizer).__name__}")
        accumulation_steps = check_int("accumulation_steps", accumulation_steps, 1)
        if max_grad_norm is not None:
            max_grad_norm = check_positive("max_grad_norm", max_grad_norm)
        if reduction not in REDUCTIONS:
            raise HyperparameterError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
        if missing not in MISSING:
            raise HyperparameterError(f"missing: expected one of {MISSING}, got {missing!r}")
        if schedule is not None and not isinstance(schedule, Schedule):
            raise ArgumentTypeError(f"schedule: expected a schedule from arraytrain.schedules, got {type(schedule).__name__}")
        if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
            raise ArgumentTypeError(f"loss_scaler: expected an arraytrain.LossScaler, got {type(loss_scaler).__name__}")
        if max_consecutive_skips is not None:
            max_consecutive_skips = check_int("max_consecutive_skips", max_consecutive_skips, 1)
        wspec = None if working_dtype is None else working_spec(working_dtype)
        if compressor is not None:
            check_compressor(compressor)
        clip_eps = check_number("clip_eps", clip_eps, 0.0)
        comm = check_exchange(comm)
        if isinstance(params, FlatBuffer):
            if dtype is not None and np.dtype(dtype) != params.dtype:
                raise LayoutError(f"dtype: the FlatBuffer holds {params.dtype}, got dtype={np.dtype(dtype)}")
            self.params = params
        elif isinstance(params, Mapping):
            self.params = FlatBuffer.from_arrays(params, dtype=dtype)
        else:
            raise ArgumentTypeError(f"params: expected a mapping name -> array or a FlatBuffer, got {type(params).__name__}")
        moved = to_device(self.params.flat, device)
        if moved is not self.params.flat:
            self.params = FlatBuffer(self.params.layout, aligned(moved))  # a fresh copy: aligned too
        if wspec is not None and self.params.dtype != np.float32:
            raise HyperparameterError(f"working_dtype: working copies need float32 parameters, got {self.params.dtype}")
        self._kernels = kernels_for(self.params.flat, kernels)
        self._guard = _CallGuard()
        self._evaluating = False
        if not comm.is_local:
            _agree(comm, self.params, optimizer, compressor, accumulation_steps=accumulation_steps,
                   reduction=reduction, max_grad_norm=max_grad_norm, clip_eps=clip_eps,
                   loss_scaler=None if loss_scaler is None else loss_scaler.state_dict(),
                   schedule=None if schedule is None else schedule.state_dict(), working_dtype=working_dtype)
        if compressor is not None:
            compressor.bind(self.params.layout, self.params.dtype, comm=comm)
        self.state = optimizer.init(self.params)  # validates overrides against the names
        self.comm = comm
        self.clip_eps = clip_eps
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.reduction = reduction
        self.missing = missing
        self.zero_grad_on_step = bool(zero_grad_on_step)
        self.grads = self.params.zeros_like()
        self._intake = _intake.Intake(self.grads, (self.params.flat, self.grads.flat), self._kernels, kernels)
        self.schedule = schedule
        self.loss_scaler = loss_scaler
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive_skips = 0
        self._micro = 0
        self._weight_sum = 0.0
        # SAM (an optimizer with ``perturb``) takes two windows per step; between
        # them the weights sit at the ascent point
        self._two_windows = callable(getattr(optimizer, "perturb", None))
        self._perturbed = False
        self.compressor = compressor
        # CUDA without a compressor or SAM's two windows: the clip factor and the skip decision
        # stay on the device, and the update is launched before the step's one synchronisation
        self._device_gate = (backend_of(self.params.flat) != NUMPY and compressor is None
                             and not self._two_windows)
        self.mask: MaskBuffer | None = None
        self.working = None
        self._working_kind = 0
        if wspec is not None:
            self.working = self.params.zeros_like(wspec[0])
            self._working_kind = wspec[1]
        if not comm.is_local:  # every rank starts from rank 0's weights and state
            for buf in (self.params, *self.state.slots.values()):
                comm.broadcast(buf.flat.view(np.uint8), 0)  # as bytes: any dtype, bfloat16 state too
        self._refresh_working()

    @property
    def layout(self):
        """The :class:`Layout` of the parameter buffer (``engine.params.layout``)."""
        return self.params.layout

    @property
    def micro_batches(self) -> int:
        """Micro-batches accumulated in the current window."""
        return self._micro

    @property
    def loss_scale(self) -> float:
        """The factor to multiply the loss by (1.0 without a loss scaler)."""
        return 1.0 if self.loss_scaler is None else self.loss_scaler.scale

    @property
    def perturbed(self) -> bool:
        """SAM: True between the ascent boundary and the update boundary."""
        return self._perturbed

    @property
    def lr(self) -> float:
        """The learning rate the next applied step uses (parameters without an lr override)."""
        base = self.optimizer.lr
        return base if self.schedule is None else float(self.schedule(self.state.step, base))

    def _working_args(self):
        if self.working is None:
            return None
        return (self.working.flat.view(np.uint16), self._working_kind)

    def _refresh_working(self) -> None:
        """Rebuild the working copy from the master weights (after a load or a SAM move)."""
        if self.working is not None:
            w, kind = self._working_args()
            self._kernels.cast_working(w, self.params.flat, self.layout.pieces, kind)

    @contextmanager
    def evaluation(self):
        """A block in which ``engine.params`` hold the optimizer's evaluation weights.

        Schedule-free optimizers (:class:`~arraytrain.optim.ScheduleFreeAdamW`) take gradients
        at y, which ``engine.params`` hold while training, and are evaluated at x, the average
        they keep implicitly. Inside ``with engine.evaluation():`` the parameters (and the
        working copy) hold x, computed in place from y and the optimizer state; y waits in a
        temporary copy and is put back bit for bit when the block ends, so evaluating changes
        nothing about training. For every other optimizer the block changes nothing. Calls
        that read or change the training state (``step``, ``state_dict``, ``save``, ...) are
        refused inside it. Yields ``engine.params``.
        """
        if not self.optimizer.has_eval_params:
            yield self.params
            return
        with self._guard("evaluation()"):
            if self._evaluating:
                raise ConcurrentUseError("evaluation(): already inside engine.evaluation()")
            y = self.params.flat.copy()
            self.optimizer.eval_params(self.params, self.state, out=self.params)
            self._refresh_working()
            self._evaluating = True
        try:
            yield self.params
        finally:
            self.params.flat[...] = y
            self._refresh_working()
            self._evaluating = False

    # -- the step ---------------------------------------------------------------------
    @_exclusive
    def step(self, grads: Mapping | None = None, *, weight: float | None = None) -> StepReport:
        """Take one micro-batch; at every ``accumulation_steps``-th call, apply the optimizer.

        ``grads`` maps names to arrays (any framework; cast to the buffer's
        dtype; non-contiguous inputs are copied). ``None`` means the gradients
        are already in ``engine.grads`` (the zero-copy path). The whole input
        is validated before anything is written: a refused call changes nothing.

        ``weight`` must be a normal number of the buffer's dtype (the kernels
        multiply by it in that dtype: a subnormal would flush the gradient to
        zero, a larger value overflow), and with ``reduction="mean"`` the
        window's weight sum times the loss scale must stay in ``[1/max, 1/tiny]``
        of the dtype, so that the unscale factor ``1 / (sum * scale)`` is normal too.
        """
        w = self._check_weight(weight)
        lr = self.lr  # the schedule's lr at this step: computed (and checked) before any write
        if grads is not None:
            # validated against the last structure seen when names, shapes and dtype repeat
            # (see _intake.Intake); nothing is written before this returns
            checked = self._intake.check(grads)
            absent = checked.absent
            if absent and self.missing == "error":
                raise MissingGradientError(
                    f"no gradient for {absent} (policy missing='error'; use missing='zero' to count them as zero)"
                )
            overwrite = self._micro == 0
            if overwrite:
                for name in absent:
                    self.grads[name][...] = 0
            self._intake.write(checked, w, overwrite)
        self._micro += 1
        self._weight_sum += w
        if self._micro < self.accumulation_steps:
            return StepReport(applied=False, skipped=False, step=self.state.step, micro_batches=self._micro, lr=lr,
                              loss_scale=self.loss_scale)
        return self._boundary(lr)

    def _check_weight(self, weight) -> float:
        """A micro-batch weight the kernels represent exactly enough (see :meth:`step`)."""
        if weight is None:
            w = 1.0
        else:
            w = check_positive("weight", weight)
        info = np.finfo(self.params.dtype)
        tiny, big = float(info.tiny), float(info.max)
        if not tiny <= w <= big:
            raise HyperparameterError(f"weight: expected a normal {self.params.dtype} number in [{tiny!r}, {big!r}] "
                                      f"(the kernels multiply by it in {self.params.dtype}), got {w!r}")
        if self.reduction == "mean":
            scaled = (self._weight_sum + w) * self.loss_scale
            if not 1.0 / big <= scaled <= 1.0 / tiny:
                raise HyperparameterError(
                    f"weight: the window's weight sum {self._weight_sum + w!r} times the loss scale "
                    f"{self.loss_scale!r} is {scaled!r}, outside [{1.0 / big!r}, {1.0 / tiny!r}], so its "
                    f"inverse (the mean's factor) is not a normal {self.params.dtype} number"
                )
        return w

    # The stages of a boundary, in order: exchange (dense) -> norm pass and non-finite
    # check -> skip or clip -> [compress + exchange] -> update -> bookkeeping. With one
    # process the exchanges are the identity and cost nothing.
    def _boundary(self, lr: float) -> StepReport:
        step = self.state.step
        # everything that may raise comes before the first write (here: the per-parameter lrs)
        lrs = None if self.schedule is None else self.schedule(step, self.optimizer.per_param(self.state, "lr"))
        ascent = self._two_windows and not self._perturbed
        compressing = self.compressor is not None and not ascent
        if compressing or (ascent and self.compressor is not None):
            # compressed (or SAM's local ascent): no dense exchange; the ranks agree on the
            # weight sum and on skipping before anything is compressed or moved
            wsum, bad = self._exchange_scalars(self._weight_sum, not self._kernels.all_finite(self.grads.flat))
            if bad:
                self._micro, self._weight_sum = 0, 0.0
                return self._skip(step, lr)
        else:
            wsum = self._exchange_dense(self._weight_sum)
        # the gradient buffer holds sum(w * g) of the scaled loss: the mean
        # gradient is flat * gscale with gscale = 1 / (weight sum * loss scale)
        unscale = (wsum if self.reduction == "mean" else 1.0) * self.loss_scale
        self._micro, self._weight_sum = 0, 0.0
        payload = None
        if compressing:
            # compress + exchange: this rank's share of the mean, then the decoded sum over ranks
            if unscale != 1.0:
                self._kernels.scale(self.grads.flat, 1.0 / unscale)
            payload, unscale = self.compressor.exchange(self.grads.flat), 1.0
        applied = False
        if self._device_gate:
            found, applied = self._gated_update(unscale, step, lrs)
        else:
            found = norm_pass(self._kernels, self.grads.flat, self.layout)
        if found.nonfinite:
            return self._skip(step, lr)
        self.consecutive_skips = 0
        norm = found.norm / unscale
        coef = clip_coef(norm, self.max_grad_norm, self.clip_eps)
        norms = found.segment_norms / unscale
        if ascent:
            self.optimizer.perturb(self._kernels, self.params, self.grads, self.state, gscale=1.0 / unscale,
                                   grad_norm=norm, zero_grad=self.zero_grad_on_step, mask=self.mask)
            self._perturbed = True
            self._refresh_working()
            return StepReport(applied=False, skipped=False, step=step, micro_batches=0, lr=lr, grad_norm=norm,
                              clip_coef=coef, loss_scale=self.loss_scale, perturbed=True, _segment_norms=norms,
                              _names=self.layout.names)
        if not applied:
            self._update(coef / unscale, lrs)
        self._perturbed = False
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf=False)
        return StepReport(applied=True, skipped=False, step=self.state.step, micro_batches=0, lr=lr, grad_norm=norm,
                          clip_coef=coef, loss_scale=self.loss_scale, _segment_norms=norms, _names=self.layout.names,
                          payload_bytes=None if payload is None else payload.nbytes,
                          dense_bytes=None if payload is None else payload.dense_nbytes)

    def _exchange_dense(self, wsum: float) -> float:
        """The dense exchange: the gradient buffer and the weight sum become their sums over ranks.

        The flat buffer is the fusion buffer: one in-place all-reduce. A NaN/Inf on any rank
        reaches every rank through the sum, so the norm pass that follows finds it everywhere.
        """
        if self.comm.is_local:
            return wsum
        self.comm.allreduce(self.grads.flat, "sum")
        return self._exchange_scalars(wsum, False)[0]

    def _exchange_scalars(self, wsum: float, bad: bool) -> tuple[float, bool]:
        """The window's weight sum over ranks, and whether any rank's gradient is not finite."""
        if self.comm.is_local:
            return wsum, bad
        both = np.array([wsum, float(bad)])
        self.comm.allreduce(both, "sum")
        return float(both[0]), bool(both[1])

    def _update(self, gscale, lrs) -> None:
        """The optimizer's fused update (``lrs``: the scheduled per-parameter rates, or None)."""
        self.optimizer.update(self._kernels, self.params, self.grads, self.state, gscale=gscale, lr=lrs,
                              zero_grad=self.zero_grad_on_step, working=self._working_args(), mask=self.mask)

    def _gated_update(self, unscale: float, step: int, lrs):
        """CUDA: norm pass, clip factor and skip decision on the device, update launched, then one read.

        The update kernels take the clip factor from the device and return untouched when
        the norm pass found a non-finite total, so the device never waits for the host
        between the norm pass and the update. Returns ``(NormPass, applied)``. When the
        total was not finite nothing was updated (the step count is put back); a float64
        buffer whose finite values overflowed the sum of squares then gets the host's
        overflow-safe norm and the update runs after all (the caller's path).
        """
        k = self._kernels
        sums, gate = k.sumsq_gate(self.grads.flat, self.layout.pieces, len(self.layout), unscale,
                                  self.max_grad_norm, self.clip_eps)
        scalars = dict(self.state.scalars)
        self._update(k.DeviceScale(gate), lrs)
        total, per_seg = k.read_sums(sums)
        if math.isfinite(total):
            return NormPass(math.sqrt(total), np.sqrt(per_seg), False), True
        self.state.step = step  # the gate held every kernel back: nothing moved
        self.state.scalars.update(scalars)  # nor does the host's scalar state (NAdam's mu_product)
        return norm_pass(k, self.grads.flat, self.layout), False

    def _skip(self, step: int, lr: float) -> StepReport:
        """A NaN/Inf boundary: drop the window; params, state, step and schedule stay."""
        self.grads.flat.fill(0)
        if self._perturbed:  # SAM: back from the ascent point; the pair starts again
            self.optimizer.restore(self._kernels, self.params, self.state)
            self._perturbed = False
            self._refresh_working()
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf=True)
        self.consecutive_skips += 1
        if self.max_consecutive_skips is not None and self.consecutive_skips >= self.max_consecutive_skips:
            raise NonFiniteError(
                f"{self.consecutive_skips} consecutive steps had NaN/Inf gradients and were skipped "
                f"(max_consecutive_skips={self.max_consecutive_skips}, loss scale {self.loss_scale:g}); "
                "parameters and state are those of the last finite step"
            )
        return StepReport(applied=False, skipped=True, step=step, micro_batches=0, lr=lr, grad_norm=math.nan,
                          loss_scale=self.loss_scale)

    @_exclusive
    def observe(self, metric: float) -> None:
        """Feed a validation metric to the schedule (reduce-on-plateau); no-op for closed forms."""
        if self.schedule is None:
            raise ArgumentTypeError("observe: the engine has no schedule")
        self.schedule.observe(metric, step=self.state.step)

    @_exclusive
    def update_hessian(self, hessian: Mapping) -> None:
        """Feed a diagonal Hessian estimate by name (Sophia); validated before anything changes."""
        feed = getattr(self.optimizer, "update_hessian", None)
        if feed is None:
            raise ArgumentTypeError(f"update_hessian: {type(self.optimizer).__name__} takes no Hessian estimates")
        items = _intake.check_grads(hessian, self.grads, protect=(self.params.flat, self.grads.flat))
        absent = [n for n in self.layout.names if n not in items and self.layout.shape(n) != (0,)]
        if absent:
            raise MissingGradientError(f"update_hessian: no estimate for {absent}")
        feed(self._kernels, self.state, items, self.layout)

    @_exclusive
    def set_mask(self, mask) -> None:
        """Prune: keep ``mask`` (1 keep, 0 pruned) inside every optimizer step; None removes it.

        ``mask`` is a uint8 :class:`FlatBuffer` of the parameters' layout (as
        :func:`arraytrain.prune.magnitude_mask` makes) or a mapping name ->
        array of 0/1 (bool or integer; names left out are kept whole). The
        pruned weights are zeroed now (and the working copy rebuilt); every
        later step writes them as exactly 0. Validated before anything changes.
        """
        if mask is None:
            self.mask = None
            return
        if isinstance(mask, FlatBuffer):
            if mask.layout != self.layout:
                raise LayoutError(f"mask: its layout {mask.layout!r} differs from the parameters' {self.layout!r}")
            if mask.dtype != np.uint8:
                raise DTypeError(f"mask: expected a uint8 buffer (1 keep, 0 pruned), got {mask.dtype}")
            host = mask.flat.get() if backend_of(mask.flat) != NUMPY else mask.flat.copy()
            new = MaskBuffer(self.layout, host)
        elif isinstance(mask, Mapping):
            for name, m in mask.items():
                if isinstance(m, np.ma.MaskedArray):  # np.asarray would drop its mask
                    raise BackendError(f"mask[{name!r}]: a masked array; pass 0/1 values (e.g. m.filled(0))")
                if name not in self.layout:
                    raise LayoutError(f"mask: {name!r} is not a parameter; names: {list(self.layout.names)}")
                a = _host_array(m)
                if a.shape != self.layout.shape(name):
                    raise LayoutError(f"mask[{name!r}]: expected shape {self.layout.shape(name)}, got {a.shape}")
                if not (a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer)) or not np.isin(a, (0, 1)).all():
                    raise DTypeError(f"mask[{name!r}]: expected 0/1 values (bool or integer), got {a.dtype}")
            new = MaskBuffer.ones(self.layout)
            for name, m in mask.items():
                new[name][...] = _host_array(m)
        else:
            raise ArgumentTypeError(f"mask: expected a uint8 FlatBuffer, a mapping name -> 0/1 array, or None; "
                                    f"got {type(mask).__name__}")
        if backend_of(self.params.flat) != NUMPY:  # validated on the host; set_mask is the explicit move
            new = MaskBuffer(self.layout, array_module(self.params.flat).asarray(new.flat))
        self.mask = new
        xp = array_module(self.params.flat)
        xp.multiply(self.params.flat, new.flat, out=self.params.flat, casting="unsafe")
        self._refresh_working()

    @_exclusive
    def zero_grad(self) -> None:
        """Zero ``engine.grads`` and drop a partly accumulated window."""
        self.grads.flat.fill(0)
        self._micro, self._weight_sum = 0, 0.0

    # -- state ----------------------------------------------------------------------------
    @_exclusive
    def state_dict(self, copy: bool = True) -> dict:
        """Name-keyed arrays of everything a bitwise-exact resume needs, plus scalars.

        ``copy=False`` returns views into the live buffers (for a writer that
        serialises them at once, e.g. :func:`arraytrain.save`).

        With a group of processes (``comm``) this is a collective: every rank
        calls it. The parts that differ between ranks — the partly accumulated
        window and the compressor's state with its error-feedback residual —
        are gathered by rank: ``state["accumulation"]`` and
        ``state["compression"]`` are then ``{"ranks": [rank 0's, rank 1's, ...]}``;
        everything else is shared (the same on every rank).
        """
        return self._state(copy, gather=True)

    def _state(self, copy: bool, gather: bool) -> dict:
        acc = {
            "micro_batches": self._micro,
            "weight_sum": self._weight_sum,
            "grads": self.grads.as_dict(copy=copy),
        }
        comp = None if self.compressor is None else self.compressor.state_dict()
        if not gather:  # a template for checkpoint.load: one share, or any number shaped like this one
            acc = PerRank(acc)
            comp = None if comp is None else PerRank(comp)
        elif not self.comm.is_local:
            acc = {"ranks": _gather_by_rank(self.comm, acc)}
            comp = None if comp is None else {"ranks": _gather_by_rank(self.comm, comp)}
        return {
            "format": STATE_FORMAT,
            "params": self.params.as_dict(copy=copy),
            "optimizer": {
                "type": type(self.optimizer).__name__,
                "hyperparameters": self.optimizer.hyperparameters(),
                "step": self.state.step,
                "slots": {k: buf.as_dict(copy=copy) for k, buf in self.state.slots.items()},
                # only where the optimizer keeps any (NAdam): the other states read as before
                **({"scalars": dict(self.state.scalars)} if self.state.scalars else {}),
            },
            "accumulation": acc,
            "schedule": None if self.schedule is None else self.schedule.state_dict(),
            "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
            "consecutive_skips": self.consecutive_skips,
            "perturbed": self._perturbed,
            "compression": comp,
            "mask": None if self.mask is None else self.mask.as_dict(copy=copy),
        }

    @_exclusive
    def load_state_dict(self, state: Mapping) -> None:
        """Load :meth:`state_dict` output. Everything is validated before any buffer is written.

        The optimizer type and slots must match; the optimizer's current
        hyperparameters are kept (so a resumed run may change, e.g., its lr).
        The schedule's, loss scaler's and compressor's states are restored into
        the engine's own, which must be present exactly when the state has them.
        Counters are ints in ``[0, 2**53]`` (see ``arraytrain._checks.MAX_COUNT``).

        Two phases: :meth:`_check_state` validates every part of ``state``
        against the engine and returns what to write; only then are the writes
        made, and they cannot fail (same-dtype copies and assignments). A refused
        state raises :class:`StateDictError` and changes nothing.
        """
        self._apply_writes(self._checked_everywhere(lambda: self._check_state(state)))

    def _apply_writes(self, writes: list) -> None:
        for write in writes:
            write()
        self._refresh_working()

    def _checked_everywhere(self, check):
        """``check()``, with every rank of the group raising when any rank's check failed.

        With a group of processes, a state refused on one rank (a file it cannot read,
        a share that does not fit) must not leave the others loading alone: the ranks
        compare outcomes (one small collective) and all raise before any rank writes.
        """
        if self.comm.is_local:
            return check()
        try:
            result, failure = check(), None
        except (StateDictError, OSError) as exc:
            result, failure = None, exc
        outcomes = self.comm.gather_objects(None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        bad = [(r, msg) for r, msg in enumerate(outcomes) if msg is not None]
        if bad:
            rank, msg = bad[0]
            raise StateDictError(f"rank {rank} refused the state ({len(bad)} of {self.comm.size} ranks did), "
                                 f"so no rank loads it: {msg}")
        return result

    def _check_state(self, state: Mapping) -> list:
        """Validate a whole state dict; return the writes that load it (callables that cannot fail)."""
        try:
            fmt = state["format"]
            opt = state["optimizer"]
            acc = state["accumulation"]
            params = state["params"]
            slots = opt["slots"]
            scalars = opt.get("scalars", {})  # absent where the optimizer keeps none
            step = opt["step"]
            skips, perturbed = state["consecutive_skips"], state["perturbed"]
            parts = {key: state[key] for key, _, _ in self._PARTS}
            mask = state["mask"]
        except (KeyError, TypeError) as exc:
            raise StateDictError(f"state dict lacks {exc}") from None
        if fmt != STATE_FORMAT:
            raise StateDictError(f"format: expected {STATE_FORMAT}, got {shown(fmt)}")
        acc, parts["compression"] = self._own_share(acc, parts["compression"])
        try:
            micro, wsum, grads = acc["micro_batches"], acc["weight_sum"], acc["grads"]
        except (KeyError, TypeError) as exc:
            raise StateDictError(f"accumulation lacks {exc}") from None
        if not isinstance(opt, Mapping) or opt.get("type") != type(self.optimizer).__name__:
            got = opt.get("type") if isinstance(opt, Mapping) else type(opt).__name__
            raise StateDictError(f"optimizer: state is for {got!r}, engine has {type(self.optimizer).__name__!r}")
        if not isinstance(slots, Mapping) or set(slots) != set(self.state.slots):
            got = sorted(slots) if isinstance(slots, Mapping) else type(slots).__name__
            raise StateDictError(f"optimizer slots: expected {sorted(self.state.slots)}, got {got}")
        scalars = self._check_scalars(scalars)
        step = check_count("optimizer step", step, 0, error=StateDictError)
        micro = check_int("micro_batches", micro, 0, self.accumulation_steps - 1, error=StateDictError)
        wsum = self._check_weight_sum(micro, wsum)
        skips = check_count("consecutive_skips", skips, 0, error=StateDictError)
        if not isinstance(perturbed, bool) or (perturbed and not self._two_windows):
            raise StateDictError(f"perturbed: expected a bool (True only for SAM), got {shown(perturbed)}")
        # the optional parts: each present in the state exactly when the engine has one, each
        # checked by its own check_state (which changes nothing) and loaded by its apply_state
        writes = []
        for key, attr, what in self._PARTS:
            sub, mine = parts[key], getattr(self, attr)
            if (sub is None) != (mine is None):
                raise StateDictError(f"{key}: the state has {'none' if sub is None else what}, "
                                     f"the engine has {'none' if mine is None else 'one'}")
            if sub is not None:
                try:
                    checked = mine.check_state(sub)
                except (ValueError, TypeError, KeyError) as exc:  # a custom part's own errors
                    if isinstance(exc, StateDictError):
                        raise
                    raise StateDictError(f"{key}: {exc}") from exc
                writes.append(functools.partial(mine.apply_state, checked))
        if (mask is None) != (self.mask is None):
            raise StateDictError(f"mask: the state has {'none' if mask is None else 'a pruning mask'}, the engine has "
                                 f"{'none' if self.mask is None else 'one'} (set_mask(...) before loading a pruned run)")
        if mask is not None:
            writes.append(functools.partial(self.mask.assign, self._check_mask_state(mask)))
        targets = [self.params, self.grads, *self.state.slots.values()]
        protect = tuple(b.flat for b in targets)
        try:
            buffers = [(self.params, params), (self.grads, grads)]
            buffers += [(self.state.slots[k], v) for k, v in slots.items()]
            for buf, arrays in buffers:
                checked = _intake.ready_to_assign(buf, buf.check(arrays), protect)
                writes.append(functools.partial(buf.assign, checked))
        except (LayoutError, KeyError, ValueError, TypeError) as exc:
            raise StateDictError(f"state dict does not match the engine: {exc}") from exc
        writes.append(functools.partial(self._set_counters, step, micro, wsum, skips, perturbed))
        writes.append(functools.partial(self.state.scalars.update, scalars))
        return writes

    def _check_scalars(self, scalars) -> dict:
        """The optimizer's saved scalar state: the same names as the engine's, finite numbers."""
        if not isinstance(scalars, Mapping) or set(scalars) != set(self.state.scalars):
            got = sorted(scalars) if isinstance(scalars, Mapping) else type(scalars).__name__
            raise StateDictError(f"optimizer scalars: expected {sorted(self.state.scalars)}, got {got}")
        return {k: check_number(f"optimizer scalars[{k!r}]", v, error=StateDictError) for k, v in scalars.items()}

    def _own_share(self, acc, comp):
        """This rank's accumulation and compression state out of a state saved by some number of ranks.

        A state saved by K ranks holds K shares; on K ranks each takes its own. On another
        number of ranks (one process included) it is refused when a share is rank-specific:
        a window accumulated part-way, or error-feedback residuals (what each rank failed to
        send); otherwise the shares are equal and rank 0's is taken. A single process's
        state is one share.
        """
        shares = {}
        for key, part in (("accumulation", acc), ("compression", comp)):
            many = isinstance(part, Mapping) and set(part) == {"ranks"}
            if many and (not isinstance(part["ranks"], (list, tuple)) or not part["ranks"]):
                raise StateDictError(f"{key}: 'ranks' must be a non-empty list of per-rank states")
            shares[key] = list(part["ranks"]) if many else [part]
        saved = len(shares["accumulation"])
        if comp is None:
            shares["compression"] = [None] * saved
        if len(shares["compression"]) != saved:
            raise StateDictError(f"compression: {len(shares['compression'])} per-rank states, accumulation {saved}")
        if saved == self.comm.size:
            return shares["accumulation"][self.comm.rank], shares["compression"][self.comm.rank]
        where = f"the state was saved by {saved} process{'es' if saved > 1 else ''}, this group has {self.comm.size}"
        if any(not isinstance(a, Mapping) or a.get("micro_batches") != 0 for a in shares["accumulation"]):
            raise StateDictError(f"accumulation: {where}, and a window was accumulated part-way (each rank's partial "
                                 "gradient sum is its own): resume on the same number of ranks, or save at a boundary")
        if any(isinstance(c, Mapping) and "residual" in c for c in shares["compression"]):
            raise StateDictError(f"compression: {where}, and error-feedback residuals are per rank (what each rank "
                                 "has not sent yet): resume on the same number of ranks")
        return shares["accumulation"][0], shares["compression"][0]

    # (state key, engine attribute, what the message calls it): parts with check_state/apply_state
    _PARTS = (("schedule", "schedule", "one"), ("loss_scaler", "loss_scaler", "one"),
              ("compression", "compressor", "a compressor"))

    def _set_counters(self, step: int, micro: int, wsum: float, skips: int, perturbed: bool) -> None:
        self.state.step = step
        self._micro, self._weight_sum = micro, wsum
        self.consecutive_skips, self._perturbed = skips, perturbed

    def _check_weight_sum(self, micro: int, wsum) -> float:
        """The saved window's weight sum: 0 for an empty window, else a sum step() could have made."""
        wsum = check_number("weight_sum", wsum, 0.0, error=StateDictError)
        big = float(np.finfo(self.params.dtype).max)
        if (micro == 0) != (wsum == 0.0) or wsum > big:
            raise StateDictError(f"weight_sum: expected 0 with micro_batches=0, else a value in "
                                 f"[{float(np.finfo(self.params.dtype).tiny)!r}, {big!r}]; got {wsum!r} "
                                 f"with micro_batches={micro}")
        return wsum

    def _check_mask_state(self, arrays) -> dict:
        """A saved mask: uint8 arrays of 0/1 of every parameter's shape."""
        if not isinstance(arrays, Mapping) or set(arrays) != set(self.layout.names):
            got = sorted(arrays) if isinstance(arrays, Mapping) else type(arrays).__name__
            raise StateDictError(f"mask: expected arrays for {list(self.layout.names)}, got {got}")
        out = {}
        for name in self.layout.names:
            a = arrays[name]
            if (type(a) is not type(self.params.flat) or a.dtype != np.uint8
                    or a.shape != self.layout.shape(name)):
                raise StateDictError(f"mask[{name!r}]: expected uint8 of shape {self.layout.shape(name)}, "
                                     f"got {getattr(a, 'dtype', type(a).__name__)}{getattr(a, 'shape', '')}")
            if a.size and a.max() > 1:
                raise StateDictError(f"mask[{name!r}]: expected 0/1 values (1 keep, 0 pruned), got max {int(a.max())}")
            out[name] = a.copy()  # the load may write the mask buffer this array views
        return out

    def __repr__(self) -> str:
        return (f"Engine({self.params!r}, {self.optimizer!r}, accumulation_steps={self.accumulation_steps}, "
                f"max_grad_norm={self.max_grad_norm}, backend={backend_of(self.params.flat)})")


def _agree(comm, params: FlatBuffer, optimizer, compressor, **settings) -> None:
    """Every rank has the same layout, dtype, backend, optimizer and settings (else LayoutError on every rank)."""
    comm.agree("the parameter layout", (params.layout.names, params.layout.shapes, str(params.dtype),
                                        backend_of(params.flat)))
    comm.agree("the engine's settings", repr((type(optimizer).__name__, optimizer.hyperparameters(),
                                              None if compressor is None else compressor.describe(),
                                              sorted(settings.items()))),
               error=HyperparameterError)


def _gather_by_rank(comm, tree) -> list:
    """Every rank's ``tree`` (same structure everywhere), in rank order: arrays all-gathered, values gathered."""
    arrays: list = []

    def strip(node):
        if isinstance(node, Mapping):
            return {k: strip(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(strip(v) for v in node)
        if hasattr(node, "shape") and hasattr(node, "dtype"):
            arrays.append(node)
            return _Slot(len(arrays) - 1)
        return node

    skeleton = strip(tree)
    skeletons = comm.gather_objects(skeleton)
    received = [comm.allgather(a) for a in arrays]

    def fill(node, rank):
        if isinstance(node, _Slot):
            return received[node.index][rank]
        if isinstance(node, Mapping):
            return {k: fill(v, rank) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(fill(v, rank) for v in node)
        return node

    return [fill(sk, r) for r, sk in enumerate(skeletons)]


@dataclass(frozen=True)
class _Slot:
    index: int


def _host_array(a) -> np.ndarray:
    """A mask given by the caller, on the host for validation (a CuPy array is read back)."""
    if type(a).__module__.partition(".")[0] == "cupy":
        return a.get()
    return np.asarray(a)
