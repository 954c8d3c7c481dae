"""The Engine: accumulate micro-batches, check, clip and apply the optimizer on flat buffers."""

from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import contextmanager

import numpy as np

from . import _compile_notice, _intake, engine_state, shard
from ._checks import check_bool, check_int, check_number, check_positive
from ._guard import CallGuard, guarded
from .accumulate import REDUCTIONS
from .amp import LossScaler, working_spec
from .backend import NUMPY, array_module, backend_of, check_kernel_dtype, to_device
from .buffer import FlatBuffer, aligned
from .compress._base import check_compressor
from .engine_state import CheckedState, Counters, StateParts, checked_everywhere
from .exchange import agree_on_setup, check_exchange
from .kernels.interface import family
from .errors import (
    ArgumentTypeError,
    ConcurrentUseError,
    HyperparameterError,
    LayoutError,
    MissingGradientError,
    NonFiniteError,
)
from .ops import CLIP_EPS
from .optim import Optimizer
from .prune import MaskBuffer
from .schedules import Schedule
from .overlap import BUCKET_BYTES, OverlappedExchange
from .shard import Sharding, refuse_unshardable
from .stages import StepReport, Verdict, exchange_dense, exchange_scalars, reduce_scatter_norm

STATE_FORMAT = engine_state.STATE_FORMAT
MISSING = ("error", "zero")


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
        rank 0's parameters are broadcast (the optimizer state starts from them).
    device : None, "cpu" or "cuda"
        Where the buffers live. None: where ``params`` are (NumPy arrays: the
        CPU; CuPy arrays, or a FlatBuffer of them: the current CUDA device).
        "cuda" with NumPy parameters copies them to the current CUDA device
        once, here (the one explicit move; gradients must then arrive on that
        device: a NumPy gradient is refused, never copied behind your back);
        "cpu" with CuPy parameters copies them to the host.
    shard_state : bool
        With ``comm``: each rank keeps and updates one contiguous partition of the
        optimizer state (1/K of it; ZeRO stage 1-2), and under a working copy of the
        float32 master weights too (see :mod:`arraytrain.shard`). A boundary is then one
        reduce-scatter of the gradient, the norm from the partitions' sums of squares and
        one small all-reduce, the update of the own partition, and one all-gather of the
        updated weights (of the working copy, where there is one). Every rank still holds
        the full gradient buffer and the full weights the model reads; under a working copy
        ``engine.params`` is this rank's :class:`~arraytrain.shard.ShardBuffer` of the masters
        (:meth:`gather_params` assembles them). Element-wise optimizers shard (LAMB's
        per-parameter norms are completed over ranks); Muon, Adafactor, Sophia and SAM, and a
        compressor, are refused with a :class:`HyperparameterError` on every rank. With
        ``state_dtype="8bit"`` the engine lays the parameters out with every offset on a
        256-element block (``engine.layout.align`` 256; up to 255 elements of padding per
        parameter), so that no partition boundary cuts a block, and each rank keeps the codes,
        block scales and small parameters' float32 values of its partition. State dicts
        and checkpoints keep the replicated engine's name-keyed form (gathered), so they load
        on any number of ranks. :meth:`memory` reports the bytes per rank.
    overlap : bool
        With ``comm``: exchange the gradient in buckets that start while the backward pass
        still runs (:mod:`arraytrain.overlap`): during the last micro-batch of a window,
        :meth:`mark_ready` (which the torch binding's hooks and the MLP's backward call)
        says which gradients are final, and a bucket whose gradients all are starts its
        nonblocking all-reduce (with ``shard_state``: its reduces to the partitions' owners)
        at once; the boundary starts the rest and waits. The result equals the blocking
        exchange's (bitwise with 2 ranks). Off by default here (a dict of gradients at
        ``step(grads)`` arrives at once); ``bind(..., comm=...)`` turns it on. Not with a
        compressor or SAM, whose exchanges need the whole window.
    bucket_bytes : int
        The overlapped exchange's bucket size (default 25 MiB, DDP's).

    Notes
    -----
    On a CUDA device every stage is a CuPy raw kernel, one launch over the
    whole buffer, and a step synchronises with the host once: the norm pass
    leaves its verdict on the device (the clip factor, or a skip, which the
    update kernels read), and after the update is launched the step reads the
    global and per-parameter norms and the non-finite flag back for the report
    (with a compressor or SAM the verdict is read before the update).
    Micro-batches between boundaries do not synchronise.

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
                 clip_eps: float = CLIP_EPS, comm=None, shard_state: bool = False, overlap: bool = False,
                 bucket_bytes: int = BUCKET_BYTES):
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
        shard_state = check_bool("shard_state", shard_state)
        overlap = check_bool("overlap", overlap)
        bucket_bytes = check_int("bucket_bytes", bucket_bytes, 1)
        if shard_state and comm.is_local:
            raise HyperparameterError("shard_state: sharded state needs a group of processes (comm=MPIComm(), "
                                      "NCCLComm(), ...); with one process there is nothing to shard")
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
        if shard_state:  # 8-bit state: every offset on a block, so that no partition boundary cuts one
            self.params = shard.aligned_to(self.params, optimizer.shard_align)
        if wspec is not None and self.params.dtype != np.float32:
            raise HyperparameterError(f"working_dtype: working copies need float32 parameters, got {self.params.dtype}")
        check_kernel_dtype(self.params.dtype)
        self._layout = self.params.layout
        self._kernels = family(backend_of(self.params.flat), kernels)
        self._working_dtype = working_dtype
        self._compile_clock = None  # numba's kernels: a first step that compiles says so (_compile_notice)
        if kernels == "numba" and backend_of(self.params.flat) == NUMPY:
            from .kernels.cpu._jit import COMPILE_CLOCK

            self._compile_clock = COMPILE_CLOCK
        self._guard = CallGuard()
        self._evaluating = False
        if not comm.is_local:
            agree_on_setup(comm, self.params, optimizer, compressor, accumulation_steps=accumulation_steps,
                           reduction=reduction, max_grad_norm=max_grad_norm, clip_eps=clip_eps,
                           loss_scaler=None if loss_scaler is None else loss_scaler.state_dict(),
                           schedule=None if schedule is None else schedule.state_dict(),
                           working_dtype=working_dtype, shard_state=shard_state, overlap=overlap,
                           bucket_bytes=bucket_bytes)
        if shard_state:  # the same error on every rank: their optimizers and settings agree
            refuse_unshardable(optimizer, compressor)
        two_windows = callable(getattr(optimizer, "perturb", None))  # SAM
        if overlap and not comm.is_local and (compressor is not None or two_windows):
            raise HyperparameterError("overlap: a compressor's exchange and SAM's two windows need the whole "
                                      "window's gradient at once; pass overlap=False")
        if compressor is not None:
            compressor.bind(self.params.layout, self.params.dtype, comm=comm)
        if not comm.is_local:  # every rank starts from rank 0's weights (as bytes: any dtype)
            comm.broadcast(self.params.flat.view(np.uint8), 0)
        self._shard = None
        self._grad_part = None  # sharded: this rank's partition of the reduced gradient, between two stages
        if shard_state:
            self._shard = Sharding(comm, self.params, None if wspec is None else wspec[0])
            self.params = self._shard.params
        # the weights the optimizer updates: all of them, or this rank's partition
        self._opt_params = self.params if self._shard is None else self._shard.master
        self.state = optimizer.init(self._opt_params)  # validates overrides against the names
        self.comm = comm
        self.clip_eps = clip_eps
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.reduction = reduction
        self.missing = missing
        self.zero_grad_on_step = bool(zero_grad_on_step)
        self.grads = self.params.zeros_like() if self._shard is None else self._shard.grads
        self._intake = _intake.Intake(self.grads, (self.params.flat, self.grads.flat), self._kernels, kernels)
        self.schedule = schedule
        self.loss_scaler = loss_scaler
        self.max_consecutive_skips = max_consecutive_skips
        self.counters = Counters()
        # SAM (an optimizer with ``perturb``) takes two windows per step; between
        # them the weights sit at the ascent point
        self._two_windows = two_windows
        self.compressor = compressor
        # CUDA without a compressor or SAM's two windows: the clip factor and the skip decision
        # stay on the device, and the update is launched before the step's one synchronisation
        self._device_gate = (backend_of(self.params.flat) != NUMPY and compressor is None
                             and not self._two_windows and self._shard is None)
        self._overlap = None
        if overlap and not comm.is_local:
            flat = self.grads.flat if self._shard is None else self._shard.padded_grads
            self._overlap = OverlappedExchange(comm, self._layout, flat, bucket_bytes,
                                               None if self._shard is None else self._shard.part)
        self.mask: MaskBuffer | None = None
        self._own_mask = None  # sharded: this rank's part of the mask
        self.working = None
        self._working_kind = 0
        if wspec is not None:
            self.working = self.params.zeros_like(wspec[0]) if self._shard is None else self._shard.working
            self._working_kind = wspec[1]
        self._refresh_working()

    @property
    def layout(self):
        """The :class:`Layout` of the parameter buffer (``engine.params.layout``)."""
        return self._layout

    @property
    def kernels(self):
        """The kernel family this engine runs (:mod:`arraytrain.kernels`; numba, CUDA or the reference)."""
        return self._kernels

    @property
    def intake(self):
        """The dict path's validator: ``engine.intake.fast = False`` validates every micro-batch
        from scratch instead of reusing the last one's structure (benchmarks compare the two)."""
        return self._intake

    @property
    def micro_batches(self) -> int:
        """Micro-batches accumulated in the current window."""
        return self.counters.micro

    @property
    def consecutive_skips(self) -> int:
        """Boundaries in a row whose gradients were not finite (0 after an applied step)."""
        return self.counters.consecutive_skips

    @property
    def loss_scale(self) -> float:
        """The factor to multiply the loss by (1.0 without a loss scaler)."""
        return 1.0 if self.loss_scaler is None else self.loss_scaler.scale

    @property
    def perturbed(self) -> bool:
        """SAM: True between the ascent boundary and the update boundary."""
        return self.counters.perturbed

    @property
    def lr(self) -> float:
        """The learning rate the next applied step uses (parameters without an lr override)."""
        base = self.optimizer.lr
        return base if self.schedule is None else float(self.schedule(self.state.step, base))

    def _working_args(self):
        """The kernels' working copy ``(uint16 bits, kind)`` (sharded: this rank's part), or None."""
        if self.working is None:
            return None
        if self._shard is not None:
            return (self._shard.working_bits(), self._working_kind)
        return (self.working.flat.view(np.uint16), self._working_kind)

    def _refresh_working(self) -> None:
        """Rebuild the working copy from the master weights (after a load or a SAM move).

        Sharded masters: this rank's part, then one all-gather (a collective)."""
        if self.working is not None:
            w, kind = self._working_args()
            self._kernels.cast_working(w, self._opt_params.flat, self._opt_params.layout.pieces, kind=kind)
            if self._shard is not None:
                self._shard.publish()

    def _publish(self) -> None:
        """After the update kernel moved the weights: sharded, every rank's part into every rank's copy."""
        if self._shard is not None:
            self._shard.publish()

    def _weights_moved(self) -> None:
        """The optimizer's weights changed outside the update kernel: the working copy rebuilt,
        or (sharded, without one) the weights published."""
        if self.working is not None:
            self._refresh_working()
        else:
            self._publish()

    @contextmanager
    def exclusive(self, what: str):
        """Hold the engine's call guard for a block (``what`` names the caller in messages).

        Inside it no other thread's call on this engine runs (each is refused with
        :class:`~arraytrain.errors.ConcurrentUseError`); the holding thread may nest
        calls. :func:`arraytrain.save` and :func:`arraytrain.load` hold it while they
        write or read, so no step changes the buffers meanwhile. Refused inside
        :meth:`evaluation`, where the parameters hold the evaluation weights.
        """
        with self._guard(what):
            if self._evaluating:
                raise ConcurrentUseError(f"{what}: inside engine.evaluation() the parameters hold the "
                                         "evaluation weights; leave the block first")
            yield

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
            y = self._opt_params.flat.copy()
            self.optimizer.eval_params(self._opt_params, self.state, out=self._opt_params)
            self._weights_moved()
            self._evaluating = True
        try:
            yield self.params
        finally:
            self._opt_params.flat[...] = y
            self._weights_moved()
            self._evaluating = False

    # -- the step ---------------------------------------------------------------------
    @guarded
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

        The stages: intake (validate, then accumulate into ``engine.grads``); at a
        boundary exchange -> norm pass and non-finite check -> skip or clip ->
        update -> bookkeeping (see :mod:`arraytrain.stages`).

        A step whose kernels numba has to compile first (not in its on-disk cache) for more
        than a second says so once per process on stderr, naming the ``arraytrain compile``
        command that compiles them ahead (:mod:`arraytrain.precompile`).
        """
        clock = self._compile_clock
        if clock is None or not _compile_notice.pending():
            return self._step(grads, weight)
        before = clock.seconds
        try:
            return self._step(grads, weight)
        finally:
            _compile_notice.notice(clock.seconds - before, lambda: _compile_notice.command_for(
                self.optimizer, self.params.dtype, self._working_dtype))

    def _step(self, grads, weight) -> StepReport:
        w = self.check_weight(weight)
        boundary = self.counters.micro + 1 >= self.accumulation_steps
        # the schedule, evaluated once and checked before any write
        lr, lrs = self._scheduled(boundary)
        self._intake_stage(grads, w)
        if not boundary:
            return StepReport(applied=False, skipped=False, step=self.state.step, micro_batches=self.counters.micro,
                              lr=lr, loss_scale=self.loss_scale)
        return self._boundary(lr, lrs)

    def check_weight(self, weight) -> float:
        """``weight`` (None: 1.0) as :meth:`step` takes it, or the error step() would raise.

        For a binding that writes a micro-batch into ``engine.grads`` itself and then
        calls ``step()`` with no gradients: it checks the weight before it writes.
        """
        w = 1.0 if weight is None else check_positive("weight", weight)
        info = np.finfo(self.params.dtype)
        tiny, big = float(info.tiny), float(info.max)
        if not tiny <= w <= big:
            raise HyperparameterError(f"weight: expected a normal {self.params.dtype} number in [{tiny!r}, {big!r}] "
                                      f"(the kernels multiply by it in {self.params.dtype}), got {w!r}")
        if self.reduction == "mean":
            wsum = self.counters.weight_sum + w
            scaled = wsum * self.loss_scale
            if not 1.0 / big <= scaled <= 1.0 / tiny:
                raise HyperparameterError(
                    f"weight: the window's weight sum {wsum!r} times the loss scale "
                    f"{self.loss_scale!r} is {scaled!r}, outside [{1.0 / big!r}, {1.0 / tiny!r}], so its "
                    f"inverse (the mean's factor) is not a normal {self.params.dtype} number"
                )
        return w

    def _scheduled(self, boundary: bool):
        """``(lr, lrs)``: the scheduled lr of parameters without an override, and at a boundary
        the per-parameter rates (None without a schedule), from one evaluation of the schedule."""
        base = self.optimizer.lr
        if self.schedule is None:
            return base, None
        if not boundary:
            return float(self.schedule(self.state.step, base)), None
        rates = self.schedule(self.state.step, np.concatenate(([base], self.optimizer.per_param(self.state, "lr"))))
        return float(rates[0]), rates[1:]

    # -- the stages ---------------------------------------------------------------------------
    def _intake_stage(self, grads, w: float) -> None:
        """Intake: validate the whole micro-batch, then accumulate it (the window's first overwrites)."""
        if grads is not None:
            self._nothing_in_flight("step(grads)")
            # validated against the last structure seen when names, shapes and dtype repeat
            # (see _intake.Intake); nothing is written before this returns
            checked = self._intake.check(grads)
            absent = checked.absent
            if absent and self.missing == "error":
                raise MissingGradientError(
                    f"no gradient for {absent} (policy missing='error'; use missing='zero' to count them as zero)"
                )
            overwrite = self.counters.micro == 0
            if overwrite:
                for name in absent:
                    self.grads[name][...] = 0
            self._intake.write(checked, w, overwrite)
        self.counters.micro += 1
        self.counters.weight_sum += w

    def _boundary(self, lr: float, lrs) -> StepReport:
        step = self.state.step
        ascent = self._two_windows and not self.counters.perturbed  # SAM's first window
        wsum = self.counters.close_window()
        if self._shard is not None:  # one stage: reduce-scatter, the partition's norms, one small all-reduce
            verdict, payload = self._sharded_exchange_stage(wsum), None
        else:
            unscale, payload = self._exchange_stage(wsum, ascent)
            if unscale is None:  # a rank's gradient was not finite: nothing was compressed
                return self._skip(step, lr)
            verdict = self._norm_stage(unscale)
        if verdict.nonfinite:
            return self._skip(step, lr)
        if ascent:
            return self._ascent_stage(verdict, step, lr)
        if not self._update_stage(verdict, lrs):
            return self._skip(step, lr)
        return self._bookkeeping(verdict, lr, payload)

    def _exchange_stage(self, wsum: float, ascent: bool):
        """Exchange: the window's gradient over ranks; returns ``(unscale, payload)``.

        The buffer then holds the gradient times ``unscale``. Dense: one all-reduce of
        the buffer and the weight sum. With a compressor: the ranks agree on the weight
        sum and on finiteness first (``(None, None)``: some rank's is not, skip), then
        each compresses its share of the mean and receives the decoded sum (``payload``:
        what it sent); SAM's ascent window keeps the exact local gradient.
        """
        if self._overlap is not None:  # the buckets nobody marked, then every one in flight
            self._overlap.finish()
            self._overlap.reset()
            return self._unscale(exchange_scalars(self.comm, wsum, False)[0]), None
        if self.compressor is None:
            return self._unscale(exchange_dense(self.comm, self.grads.flat, wsum)), None
        wsum, bad = exchange_scalars(self.comm, wsum, not self._kernels.all_finite(self.grads.flat))
        if bad:
            return None, None
        unscale = self._unscale(wsum)
        if ascent:
            return unscale, None
        if unscale != 1.0:
            self._kernels.scale(self.grads.flat, factor=1.0 / unscale)
        return 1.0, self.compressor.exchange(self.grads.flat)

    def _sharded_exchange_stage(self, wsum: float) -> Verdict:
        """Sharded state: the exchange and the norm pass as one (:func:`arraytrain.stages.reduce_scatter_norm`);
        this rank's partition of the gradient waits for the update stage."""
        reduced = None
        if self._overlap is not None:  # each partition reduced to its owner, bucket by bucket
            self._overlap.finish()
            self._overlap.reset()
            reduced = self._shard.own_grads()
        self._grad_part, wsum, found = reduce_scatter_norm(self._shard, self._kernels, wsum, reduced)
        return Verdict(found, unscale=self._unscale(wsum), max_norm=self.max_grad_norm, eps=self.clip_eps)

    def _unscale(self, wsum: float) -> float:
        # the buffer holds sum(w * g) of the scaled loss: the mean gradient is flat / unscale
        return (wsum if self.reduction == "mean" else 1.0) * self.loss_scale

    def _norm_stage(self, unscale: float) -> Verdict:
        """The norm pass and non-finite check: one read of the buffer. On CUDA (without a
        compressor or SAM) the verdict stays on the device, a gate the update kernels read."""
        how = Verdict.on_device if self._device_gate else Verdict.from_host
        return how(self._kernels, self.grads.flat, self.layout, unscale=unscale, max_norm=self.max_grad_norm,
                   eps=self.clip_eps)

    def _update_stage(self, verdict: Verdict, lrs) -> bool:
        """The optimizer's fused update, clip factor folded in; False when a device gate held it back."""
        if not verdict.pending:
            self._update(verdict.gscale(), lrs)
            return True
        step, scalars = self.state.step, dict(self.state.scalars)
        self._update(verdict.gscale(), lrs)
        if verdict.settle():
            return True
        # the device gate held every kernel back: nothing moved, nor may the host's counters
        # and scalar state (NAdam's mu_product) that the optimizer advanced
        self.state.step = step
        self.state.scalars.update(scalars)
        if verdict.nonfinite:
            return False
        self._update(verdict.gscale(), lrs)  # finite after all (see Verdict.settle): apply with the host's norm
        return True

    def _update(self, gscale, lrs) -> None:
        if self._shard is None:
            self.optimizer.update(self._kernels, self.params, self.grads, self.state, gscale=gscale, lr=lrs,
                                  zero_grad=self.zero_grad_on_step, working=self._working_args(), mask=self.mask)
            return
        # sharded: the own partition, then every rank's into every rank's weights; the gradient
        # buffer (the rank's unreduced gradient and the reduce-scatter's scratch) is cleared whole
        sums = {"reduce_sums": self._shard.reduce_sums} if self.optimizer.segment_sums else {}
        grads, self._grad_part = self._grad_part, None
        self.optimizer.update(self._kernels, self._opt_params, grads, self.state, gscale=gscale, lr=lrs,
                              working=self._working_args(), mask=self._own_mask, **sums)
        self._shard.publish()
        self._shard.clear_grads()

    def _ascent_stage(self, verdict: Verdict, step: int, lr: float) -> StepReport:
        """SAM's first window: the update stage moves the weights to the ascent point instead."""
        self.counters.consecutive_skips = 0
        self.optimizer.perturb(self._kernels, self.params, self.grads, self.state, gscale=1.0 / verdict.unscale,
                               grad_norm=verdict.norm, zero_grad=self.zero_grad_on_step, mask=self.mask)
        self.counters.perturbed = True
        self._refresh_working()
        return StepReport(applied=False, skipped=False, step=step, micro_batches=0, lr=lr, grad_norm=verdict.norm,
                          clip_coef=verdict.coef, loss_scale=self.loss_scale, perturbed=True,
                          _segment_norms=verdict.segment_norms, _names=self.layout.names)

    def _bookkeeping(self, verdict: Verdict, lr: float, payload) -> StepReport:
        """An applied step: counters, the loss scaler, the report."""
        self.counters.consecutive_skips = 0
        self.counters.perturbed = False
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf=False)
        return StepReport(applied=True, skipped=False, step=self.state.step, micro_batches=0, lr=lr,
                          grad_norm=verdict.norm, clip_coef=verdict.coef, loss_scale=self.loss_scale,
                          _segment_norms=verdict.segment_norms, _names=self.layout.names,
                          payload_bytes=None if payload is None else payload.nbytes,
                          dense_bytes=None if payload is None else payload.dense_nbytes)

    def _skip(self, step: int, lr: float) -> StepReport:
        """A NaN/Inf boundary: drop the window; params, state, step and schedule stay."""
        self.grads.flat.fill(0)
        if self._shard is not None:
            self._grad_part = None
            self._shard.clear_grads()
        if self.counters.perturbed:  # SAM: back from the ascent point; the pair starts again
            self.optimizer.restore(self._kernels, self.params, self.state)
            self.counters.perturbed = False
            self._refresh_working()
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf=True)
        self.counters.consecutive_skips += 1
        skips = self.counters.consecutive_skips
        if self.max_consecutive_skips is not None and skips >= self.max_consecutive_skips:
            raise NonFiniteError(
                f"{skips} consecutive steps had NaN/Inf gradients and were skipped "
                f"(max_consecutive_skips={self.max_consecutive_skips}, loss scale {self.loss_scale:g}); "
                "parameters and state are those of the last finite step"
            )
        return StepReport(applied=False, skipped=True, step=step, micro_batches=0, lr=lr, grad_norm=math.nan,
                          loss_scale=self.loss_scale)

    @guarded
    def observe(self, metric: float) -> None:
        """Feed a validation metric to the schedule (reduce-on-plateau); no-op for closed forms."""
        if self.schedule is None:
            raise ArgumentTypeError("observe: the engine has no schedule")
        self.schedule.observe(metric, step=self.state.step)

    @guarded
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

    @guarded
    def set_mask(self, mask) -> None:
        """Prune: keep ``mask`` (1 keep, 0 pruned) inside every optimizer step; None removes it.

        ``mask`` is a uint8 :class:`FlatBuffer` of the parameters' layout (as
        :func:`arraytrain.prune.magnitude_mask` makes) or a mapping name ->
        array of 0/1 (bool or integer; names left out are kept whole). The
        pruned weights are zeroed now (and the working copy rebuilt); every
        later step writes them as exactly 0. Validated before anything changes.
        """
        if mask is None:
            self.mask = self._own_mask = None
            return
        new = MaskBuffer.from_user(mask, self.layout)
        if backend_of(self.params.flat) != NUMPY:  # validated on the host; set_mask is the explicit move
            new = MaskBuffer(self.layout, array_module(self.params.flat).asarray(new.flat))
        self.mask = new
        xp = array_module(self.params.flat)
        if self._shard is None:
            xp.multiply(self.params.flat, new.flat, out=self.params.flat, casting="unsafe")
        else:
            self._own_mask = self._shard.own_mask(new)
            if self._shard.sharded_masters:
                xp.multiply(self._opt_params.flat, self._own_mask, out=self._opt_params.flat, casting="unsafe")
            else:
                xp.multiply(self.params.flat, new.flat, out=self.params.flat, casting="unsafe")
        self._refresh_working()

    @guarded
    def zero_grad(self) -> None:
        """Zero ``engine.grads`` and drop a partly accumulated window.

        With the overlapped exchange, buckets already started in this window are first
        completed with the rest (so that every rank's collectives still match: call it on
        every rank at the same point); before any was started it costs nothing more.
        """
        if self._overlap is not None and self._overlap.started:
            self._overlap.finish()
            self._overlap.reset()
        self.grads.flat.fill(0)
        self.counters.close_window()

    @guarded
    def mark_ready(self, names) -> None:
        """The gradients of ``names`` (a parameter name or an iterable of names) are final for this window.

        The overlapped exchange (``overlap=True`` with a group of processes) then starts every
        bucket whose gradients are all final, in bucket order (see :mod:`arraytrain.overlap`);
        it polls what is in flight too. It acts during the last micro-batch of a window (before
        its :meth:`step`), when the gradients in ``engine.grads`` are the window's sums; at other
        times, and without the overlapped exchange, it only checks the names (an unknown one
        raises :class:`~arraytrain.errors.UnknownParameterError`). Until :meth:`step`, nothing
        may write a marked gradient.
        """
        if self._overlap is None:
            for name in (names,) if isinstance(names, str) else names:
                self._layout.index(name)
            return
        idx = self._overlap.indices(names)
        if self.counters.micro == self.accumulation_steps - 1:
            self._overlap.ready(idx)

    def _nothing_in_flight(self, what: str) -> None:
        """Refuse ``what`` while the overlapped exchange works on the gradient buffer."""
        if self._overlap is not None and self._overlap.started:
            raise ConcurrentUseError(f"{what}: the gradients marked ready are being exchanged; call it before the "
                                     "window's last micro-batch or after its step()")

    # -- state: the protocol of arraytrain.engine_state, on this engine's data ---------------
    def _parts(self) -> StateParts:
        return StateParts(params=self.params, grads=self.grads, optimizer=self.optimizer, opt_state=self.state,
                          counters=self.counters, accumulation_steps=self.accumulation_steps,
                          two_windows=self._two_windows, schedule=self.schedule, loss_scaler=self.loss_scaler,
                          compressor=self.compressor, mask=self.mask, comm=self.comm)

    @guarded
    def gather_params(self) -> FlatBuffer:
        """The full parameters as a new :class:`FlatBuffer`: a copy of ``engine.params``, or with
        sharded master weights (``shard_state`` under a working copy) their all-gather, a
        collective that every rank calls."""
        if self._shard is None or not self._shard.sharded_masters:
            return self.params.copy()
        return shard.gather(self.comm, self.params)

    def memory(self) -> dict[str, int]:
        """Bytes of the buffers this rank holds, by kind.

        ``params``: the full parameter buffer (0 where the float32 master weights are
        sharded); ``grads``: the gradient buffer; ``state``: the optimizer's slots;
        ``master``: this rank's partition of the float32 master weights (sharded state
        under a working copy); ``working``: the low-precision working copy; ``mask``: a
        pruning mask; ``scratch``: work arrays the engine keeps besides these (a sharded
        mask's partition). Sharded buffers include the end padding that makes the
        partitions equal (less than one reduction chunk per rank). Host arrays the
        kernels allocate per call are not counted.
        """
        out = dict.fromkeys(("params", "grads", "state", "master", "working", "mask", "scratch"), 0)
        if self._shard is None:
            out["params"], out["grads"] = self.params.flat.nbytes, self.grads.flat.nbytes
            out["working"] = 0 if self.working is None else self.working.flat.nbytes
        else:
            out.update(self._shard.nbytes())
            out["scratch"] = 0 if self._own_mask is None else self._own_mask.nbytes
        out["state"] = sum(buf.flat.nbytes for buf in self.state.slots.values())
        out["mask"] = 0 if self.mask is None else self.mask.flat.nbytes
        return out

    @guarded
    def state_dict(self, copy: bool = True, *, root: int | None = None) -> dict | None:
        """Name-keyed arrays of everything a bitwise-exact resume needs, plus scalars.

        ``copy=False`` returns views into the live buffers (for a writer that
        serialises them at once, e.g. :func:`arraytrain.save`).

        With a group of processes (``comm``) this is a collective: every rank
        calls it. The parts that differ between ranks — the partly accumulated
        window and the compressor's state with its error-feedback residual —
        are gathered by rank: ``state["accumulation"]`` and
        ``state["compression"]`` are then ``{"ranks": [rank 0's, rank 1's, ...]}``;
        everything else is shared (the same on every rank). With sharded state the
        slots (and sharded masters) are gathered into the full arrays.

        ``root``: with a group of processes, the state is assembled on that rank only and
        the others return None — what a writer on one rank needs (:func:`arraytrain.save`
        passes ``root=0``): the other ranks then never hold more than their own share.
        """
        self._nothing_in_flight("state_dict()")
        if root is not None:
            root = check_int("root", root, 0, self.comm.size - 1, error=ArgumentTypeError)
        return engine_state.state_dict(self._parts(), copy, gather=True, root=root)

    @guarded
    def state_template(self) -> dict:
        """This rank's own state as views, the per-rank parts marked
        (:class:`~arraytrain.exchange.PerRank`): what a reader matches a saved state
        against, whatever number of ranks saved it (not a collective)."""
        return engine_state.state_dict(self._parts(), copy=False, gather=False)

    @guarded
    def check_state(self, state: Mapping) -> CheckedState:
        """Validate a whole state dict against this engine; return it checked.

        Changes nothing; :meth:`apply_state` then loads it. A refused state raises
        :class:`~arraytrain.errors.StateDictError`. Local to this process: with a group,
        :meth:`load_state_dict` makes every rank refuse when one does.
        """
        return CheckedState(engine_state.check_state(self._parts(), state), self)

    @guarded
    def apply_state(self, checked: CheckedState) -> None:
        """Load what this engine's :meth:`check_state` returned (writes that cannot fail), then
        rebuild the working copy. Anything else is refused before any write."""
        if not isinstance(checked, CheckedState) or checked.owner is not self:
            got = "another engine's" if isinstance(checked, CheckedState) else type(checked).__name__
            raise ArgumentTypeError(f"checked: expected what this engine's check_state() returned, got {got}")
        self._nothing_in_flight("apply_state()")
        for write in checked.writes:
            write()
        if self._shard is not None:
            self._own_mask = self._shard.own_mask(self.mask)
        self._refresh_working()

    @guarded
    def load_state_dict(self, state: Mapping) -> None:
        """Load :meth:`state_dict` output. Everything is validated before any buffer is written.

        The optimizer type and slots must match; the optimizer's current
        hyperparameters are kept (so a resumed run may change, e.g., its lr).
        The schedule's, loss scaler's and compressor's states are restored into
        the engine's own, which must be present exactly when the state has them.
        Counters are ints in ``[0, 2**53]`` (see ``arraytrain._checks.MAX_COUNT``).

        :meth:`check_state` then :meth:`apply_state`; with a group of processes every
        rank raises when any rank's check failed. A refused state raises
        :class:`StateDictError` and changes nothing.
        """
        self.apply_state(checked_everywhere(self.comm, lambda: self.check_state(state)))

    def __repr__(self) -> str:
        return (f"Engine({self.params!r}, {self.optimizer!r}, accumulation_steps={self.accumulation_steps}, "
                f"max_grad_norm={self.max_grad_norm}, backend={backend_of(self.params.flat)})")
