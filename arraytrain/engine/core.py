"""The Engine: accumulate micro-batches, check, clip and apply the optimizer on flat buffers."""

from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import contextmanager

import numpy as np

from .. import _compile_notice, param_steps
from .._checks import check_int
from ..accumulate import REDUCTIONS
from ..amp import LossScaler, working_spec
from ..backend import NUMPY, array_module, backend_of, check_kernel_dtype
from ..buffer import GradsAt, as_flat_buffer, segment_addresses
from ..compress import check_compressor
from ..errors import ArgumentTypeError, ConcurrentUseError, HyperparameterError, MissingGradientError, NonFiniteError
from ..kernels.interface import family
from ..ops import CLIP_EPS
from ..optim import Optimizer, check_optimizer
from ..parallel.communicator import check_parallel
from ..parallel.placement import join, placement, placement_class
from ..parallel.sync import gradient_sync
from ..prune import MaskBuffer
from ..schedules import Schedule
from . import intake, protocol
from .guard import CallGuard, guarded
from .intake import IntakeStage
from .protocol import Counters, Stateful
from .stages import Judge, StepReport, Verdict, check_judging

STATE_FORMAT = protocol.STATE_FORMAT
MISSING = ("error", "zero", "skip")
# calls that touch the gradient buffer only: they do not wait for a deferred publish of the weights
_GRADIENTS_ONLY = ("mark_ready()", "zero_grad()")


class Engine(IntakeStage, Stateful):
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
    missing : "error", "zero" or "skip"
        A micro-batch without a gradient for some parameter (a name left out of
        ``step(grads)``, or named in ``step(absent=...)``): raise
        :class:`~arraytrain.errors.MissingGradientError`; count it as zero (the
        optimizer still moves the parameter: its moments decay, weight decay applies);
        or torch's rule, "skip": a parameter without a gradient in any micro-batch
        of a window is not touched by that boundary (weights, state and its own step
        count, from which its bias corrections come; see :mod:`arraytrain.param_steps`).
        A micro-batch that has a gradient for some of the window's parameters only
        counts the others as zero. "skip" needs an optimizer that can step parameters
        alone (``per_param_steps``: not schedule-free AdamW, Adafactor, Muon or SAM).
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
    clip_eps : float
        The clip factor is ``min(1, max_grad_norm / (norm + clip_eps))``: the
        default 1e-6 is torch's ``clip_grad_norm_``; ``clip_eps=0`` is optax's
        ``clip_by_global_norm`` (scale to exactly ``max_grad_norm``).
    device : None, "cpu" or "cuda"
        Where the buffers live. None: where ``params`` are (NumPy arrays: the
        CPU; CuPy arrays, or a FlatBuffer of them: the current CUDA device).
        "cuda" with NumPy parameters copies them to the current CUDA device
        once, here (the one explicit move; gradients must then arrive on that
        device: a NumPy gradient is refused, never copied behind your back);
        "cpu" with CuPy parameters copies them to the host.
    comm, shard_state, overlap, bucket_bytes, compressor
        Data-parallel training over a group of processes and how its gradient crosses them
        (a :class:`~arraytrain.parallel.Communicator`; each rank's optimizer state a partition
        of the whole; the exchange overlapping the backward pass, in buckets of that size; a
        compressor from :mod:`arraytrain.compress`, or ``"auto"``): documented with the
        strategies they pick, in :mod:`arraytrain.parallel`. Defaults: this process alone,
        replicated state, the blocking exchange, no compressor.
    nonfinite : "skip" or "apply"
        A boundary whose gradient holds NaN/Inf: skip it (nothing changes; see
        ``max_consecutive_skips``), or apply it as torch.optim does without a GradScaler (the
        NaN/Inf reaches the weights). "apply" without ``max_grad_norm`` makes no norm pass at
        all (the report's norms are then NaN): one read of the gradient less. Not with a
        :class:`~arraytrain.LossScaler` (which must see overflows) or a compressor.

    Notes
    -----
    The intake and the calls on the gradient buffer are :class:`~arraytrain.engine.intake.IntakeStage`'s,
    the state protocol :class:`~arraytrain.engine.protocol.Stateful`'s (the Engine's base classes).

    On a CUDA device every stage is a CuPy raw kernel, one launch over the whole buffer,
    and a step synchronises with the host once: the norm pass leaves its verdict (the clip
    factor, or a skip) on the device for the update kernels, and the step reads the norms
    and the non-finite flag back after launching the update (with a compressor or SAM,
    before). Micro-batches between boundaries do not synchronise.

    Threads: an engine is not thread-safe, and it detects misuse rather than corrupting
    itself: while one thread is inside :meth:`step`, :meth:`load_state_dict`,
    :meth:`state_dict`, :meth:`set_mask`, :meth:`zero_grad`, :meth:`update_hessian`,
    :meth:`observe` or :func:`arraytrain.save`, a call to any of them from another thread
    raises :class:`~arraytrain.errors.ConcurrentUseError` and changes nothing. Writes to
    ``engine.params`` / ``engine.grads`` views are not watched.

    Pruning: :meth:`set_mask` keeps a uint8 mask (1 keep, 0 pruned) that every optimizer
    kernel applies to the weights it writes: pruned weights stay exactly zero.

    The zero-copy path: ``engine.params[name]`` and ``engine.grads[name]`` are views into
    the flat buffers. Write (or let a framework accumulate) gradients into ``engine.grads``
    and call ``engine.step()``; ``weight`` then only enters the denominator of the mean.
    """

    def __init__(self, params, optimizer: Optimizer, *, accumulation_steps: int = 1,
                 max_grad_norm: float | None = None, reduction: str = "mean", missing: str = "error",
                 zero_grad_on_step: bool = True, dtype=None, kernels: str = "numba", schedule=None,
                 loss_scaler: LossScaler | None = None, working_dtype: str | None = None,
                 max_consecutive_skips: int | None = 50, compressor=None, device: str | None = None,
                 clip_eps: float = CLIP_EPS, comm=None, shard_state: bool = False, overlap: bool = False,
                 bucket_bytes: int | None = None, nonfinite: str = "skip"):
        optimizer = check_optimizer(optimizer)
        accumulation_steps = check_int("accumulation_steps", accumulation_steps, 1)
        max_grad_norm, clip_eps, nonfinite, max_consecutive_skips = check_judging(max_grad_norm, clip_eps, nonfinite,
                                                                                  max_consecutive_skips)
        if reduction not in REDUCTIONS:
            raise HyperparameterError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
        if missing not in MISSING:
            raise HyperparameterError(f"missing: expected one of {MISSING}, got {missing!r}")
        if missing == "skip":
            param_steps.check_skip_capable(optimizer)
        if nonfinite == "apply" and (compressor is not None or getattr(loss_scaler, "adjusts", False)):
            raise HyperparameterError("nonfinite: 'apply' takes every gradient as it is, which a loss scaler (it "
                                      "must see overflows) and a compressor (its error feedback) cannot; use 'skip'")
        if schedule is not None and not isinstance(schedule, Schedule):
            raise ArgumentTypeError(f"schedule: expected a schedule from arraytrain.schedules, got {type(schedule).__name__}")
        if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
            raise ArgumentTypeError(f"loss_scaler: expected an arraytrain.LossScaler, got {type(loss_scaler).__name__}")
        wspec = None if working_dtype is None else working_spec(working_dtype)
        if compressor is not None:
            compressor = check_compressor(compressor)
        comm, shard_state, overlap, bucket_bytes = check_parallel(comm, shard_state, overlap, bucket_bytes)
        # the placement lays the parameters out (sharded: on the state's blocks, the buckets' owners alternating)
        self.params, members = placement_class(shard_state).lay_out(as_flat_buffer(params, dtype, device), comm,
                                                                     optimizer, bucket_bytes)
        if wspec is not None and self.params.dtype != np.float32:
            raise HyperparameterError(f"working_dtype: working copies need float32 parameters, got {self.params.dtype}")
        check_kernel_dtype(self.params.dtype)
        self._layout = self.params.layout
        self._kernels = family(backend_of(self.params.flat), kernels)
        self._working_dtype = working_dtype
        # numba's kernels: a step that compiles says so (_compile_notice)
        self._compile_clock = _compile_notice.clock(kernels == "numba" and backend_of(self.params.flat) == NUMPY)
        self._guard = CallGuard()
        self._evaluating = False
        two_windows = callable(getattr(optimizer, "perturb", None))  # SAM
        # the ranks agree on everything (else the same error on every rank) and start from rank 0's weights
        join(comm, self.params, optimizer, compressor, shard_state=shard_state, overlap=overlap,
             two_windows=two_windows, accumulation_steps=accumulation_steps, reduction=reduction,
             max_grad_norm=max_grad_norm, clip_eps=clip_eps, missing=missing, nonfinite=nonfinite,
             loss_scaler=None if loss_scaler is None else loss_scaler.state_dict(),
             schedule=None if schedule is None else schedule.state_dict(), working_dtype=working_dtype,
             bucket_bytes=bucket_bytes)
        # the strategies, picked once: which buffers this rank holds, and when the gradient crosses ranks
        gate = backend_of(self.params.flat) != NUMPY and compressor is None and not two_windows and nonfinite == "skip"
        self._placement = placement(comm, self.params, wspec, shard=shard_state, device_gate=gate)
        self._sync = gradient_sync(self._placement, compressor=compressor, overlap=overlap, bucket_bytes=bucket_bytes,
                                   members=members)
        self.params, self.grads, self.working = self._placement.params, self._placement.grads, self._placement.working
        self.state = optimizer.init(self._placement.master)  # validates overrides against the names
        self.comm = comm
        self._starting = 0 if comm.is_local else 2  # boundaries until the group is steady (its deadline's limit)
        self.clip_eps = clip_eps
        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.reduction = reduction
        self.missing = missing
        self.zero_grad_on_step = bool(zero_grad_on_step)
        self.nonfinite = nonfinite
        # gradients read where they lie (arraytrain.buffer.GradsAt) when a window is one micro-batch and
        # nothing needs them in the buffer: one process, the CPU, an optimizer whose kernels take grad_ptrs
        self._in_place_ok = (comm.is_local and accumulation_steps == 1 and compressor is None and not two_windows
                             and backend_of(self.params.flat) == NUMPY and optimizer.reads_in_place
                             and self.zero_grad_on_step)
        self._grads_at = None  # this window's gradient, where it lies (None: in engine.grads)
        self._grad_offsets = GradsAt.offsets_of(self.grads)
        self._grad_addresses = segment_addresses(self.grads) if self._in_place_ok else None
        self._intake = intake.Intake(self.grads, (self.params.flat, self.grads.flat), self._kernels, kernels)
        self.schedule = schedule
        self.loss_scaler = loss_scaler
        self.max_consecutive_skips = max_consecutive_skips
        self.counters = Counters()
        # SAM (an optimizer with ``perturb``) takes two windows per step; between
        # them the weights sit at the ascent point
        self._two_windows = two_windows
        self.compressor = compressor
        self.mask: MaskBuffer | None = None
        self.refresh_working()

    @property
    def layout(self):
        """The :class:`Layout` of the parameter buffer (``engine.params.layout``)."""
        return self._layout

    @property
    def kernels(self):
        """The kernel family this engine runs (:mod:`arraytrain.kernels`; numba, CUDA or the reference)."""
        return self._kernels

    @property
    def placement(self):
        """Which weights, gradients and state this rank holds, and how a boundary moves them: a
        :class:`~arraytrain.parallel.placement.Replicated` or
        :class:`~arraytrain.parallel.placement.Sharded` placement (a binding's hooks ask it which
        pieces of a deferred publish a module's weights need)."""
        return self._placement

    @property
    def overlapped(self) -> bool:
        """The exchange overlaps the backward pass (``overlap=True`` with a group of processes):
        :meth:`mark_ready` starts buckets, so a binding should call it from its backward hooks."""
        return self._sync.overlaps

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

    def refresh_working(self) -> None:
        """Rebuild the working copy from the master weights (after a load or a SAM move); with
        sharded masters a collective (one all-gather). Without a working copy, nothing."""
        self._placement.refresh_working(self._kernels)

    @contextmanager
    def exclusive(self, what: str):
        """Hold the engine's call guard for a block (``what`` names the caller in messages).

        Inside it no other thread's call on this engine runs (each is refused with
        :class:`~arraytrain.errors.ConcurrentUseError`); the holding thread may nest
        calls. :func:`arraytrain.save` and :func:`arraytrain.load` hold it while they
        write or read, so no step changes the buffers meanwhile. Refused inside
        :meth:`evaluation`, where the parameters hold the evaluation weights.
        """
        self._enter(what)
        try:
            yield
        finally:
            self._guard.release()

    def _enter(self, what: str) -> None:
        """Take the call guard for ``what``, refused inside :meth:`evaluation` (see :meth:`exclusive`); then,
        unless ``what`` touches the gradients only, the weights of a deferred publish are completed."""
        self._guard.acquire(what)
        if self._evaluating:
            self._guard.release()
            raise ConcurrentUseError(f"{what}: inside engine.evaluation() the parameters hold the "
                                     "evaluation weights; leave the block first")
        if what not in _GRADIENTS_ONLY:
            try:
                self._placement.settle()
            except BaseException:
                self._guard.release()
                raise

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
            self._placement.settle()
            master = self._placement.master
            y = master.flat.copy()
            self.optimizer.eval_params(master, self.state, out=master)
            self._placement.weights_moved(self._kernels)
            self._evaluating = True
        try:
            yield self.params
        finally:
            master.flat[...] = y
            self._placement.weights_moved(self._kernels)
            self._evaluating = False

    # -- the step ---------------------------------------------------------------------
    @guarded
    def step(self, grads: Mapping | None = None, *, weight: float | None = None, absent=None) -> StepReport:
        """Take one micro-batch; at every ``accumulation_steps``-th call, apply the optimizer.

        ``grads`` maps names to arrays (any framework; cast to the buffer's
        dtype; non-contiguous inputs are copied). ``None`` means the gradients
        are already in ``engine.grads`` (the zero-copy path). The whole input
        is validated before anything is written: a refused call changes nothing.

        ``absent``: with no ``grads``, the names (an iterable) that have no gradient in this
        micro-batch, handled by the ``missing`` policy as a name left out of a mapping is: the
        window's first micro-batch zeroes what ``engine.grads`` holds for them, a later one
        leaves their sums as they are.

        ``weight`` must be a normal number of the buffer's dtype (the kernels
        multiply by it in that dtype: a subnormal would flush the gradient to
        zero, a larger value overflow), and with ``reduction="mean"`` the
        window's weight sum times the loss scale must stay in ``[1/max, 1/tiny]``
        of the dtype, so that the unscale factor ``1 / (sum * scale)`` is normal too.

        The stages: intake (validate, then accumulate into ``engine.grads``); at a
        boundary exchange -> norm pass and non-finite check -> skip or clip ->
        update -> bookkeeping (see :mod:`arraytrain.engine.stages`).

        A step whose kernels numba has to compile first (not in its on-disk cache) for more
        than a second says so on stderr, the first time in a process naming the ``arraytrain
        compile`` command that compiles them ahead (:mod:`arraytrain.precompile`).
        """
        return self.with_compile_notice(self._step, grads, weight, absent)

    def with_compile_notice(self, step, *args):
        """``step(*args)``, and the notice when it compiled kernels for more than a second (:meth:`step`'s;
        for a binding that steps the engine by a kernel of its own)."""
        clock = self._compile_clock
        if clock is None:
            return step(*args)
        before = clock.seconds
        try:
            return step(*args)
        finally:
            _compile_notice.notice(clock.seconds - before, lambda: _compile_notice.command_for(
                self.optimizer, self.params.dtype, self._working_dtype))

    def _step(self, grads, weight, absent) -> StepReport:
        w = self.check_weight(weight)
        if absent is not None and grads is not None:
            raise ArgumentTypeError("absent: names the parameters without a gradient when the gradients are in "
                                    "engine.grads (step() with no grads); a mapping names them by leaving them out")
        absent = self.check_absent(absent)
        boundary = self.counters.micro + 1 >= self.accumulation_steps
        # the schedule, evaluated once and checked before any write
        lr, lrs = self._scheduled(boundary)
        self._intake_stage(grads, w, absent)
        if not boundary:
            return StepReport(applied=False, skipped=False, step=self.state.step, micro_batches=self.counters.micro,
                              lr=lr, loss_scale=self.loss_scale)
        return self._boundary(lr, lrs)

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

    def _intake_stage(self, grads, w: float, absent: tuple) -> None:
        """Intake: validate the whole micro-batch, then accumulate it (the window's first overwrites)."""
        overwrite = self.counters.micro == 0
        if grads is not None:
            self._nothing_in_flight("step(grads)")
            # validated against the last structure seen when names, shapes and dtype repeat
            # (see intake.Intake); nothing is written before this returns
            checked = self._intake.check(grads)
            absent = checked.absent
            self._missing(absent)
            if overwrite:
                for name in absent:
                    self.grads[name][...] = 0
            bases = self._intake.place(checked) if self._in_place_ok and w == 1.0 else None
            if bases is None:
                self._intake.write(checked, w, overwrite)
            else:
                self.read_in_place(bases)
        elif absent:  # (checked by check_absent)
            if overwrite:  # (never in flight: an absent gradient is never marked ready)
                for name in absent:
                    self.grads[name][...] = 0
        if self.missing == "skip":
            self.counters.absent = param_steps.mark(self.counters.absent, self.layout, absent, overwrite)
        self.counters.micro += 1
        self.counters.weight_sum += w

    def _boundary(self, lr: float, lrs) -> StepReport:
        step = self.state.step
        ascent = self._two_windows and not self.counters.perturbed  # SAM's first window
        wsum = self.counters.close_window()
        absent, self.counters.absent = self.counters.absent, None
        # the exchange and the norm pass: the gradient sync, through the placement
        grads_at, self._grads_at = self._grads_at, None
        judge = Judge(self._kernels, self._unscale, self.max_grad_norm, self.clip_eps,
                      check=self.nonfinite == "skip", grads_at=grads_at)
        verdict, payload = (self._sync.ascent if ascent else self._sync.reduce)(wsum, judge)
        if self._starting:  # the second boundary's exchange completed: every peer is past its first step
            self._starting -= 1
            if not self._starting:
                self.comm.steady()
        if self.missing == "skip":  # present where any rank had a gradient: with a group a collective,
            absent = param_steps.agree(self.comm, absent, len(self.layout))  # after every bucket's
        else:
            absent = None
        if verdict is None or verdict.nonfinite:  # None: a compressor's ranks found a non-finite gradient
            return self._skip(step, lr)
        if ascent:
            return self._ascent_stage(verdict, step, lr)
        if not self._update_stage(verdict, lrs, absent, grads_at):
            return self._skip(step, lr)
        return self.finish_applied(verdict, lr, payload)

    @classmethod
    def step_together(cls, engines: list, absent: list | None = None) -> list[StepReport]:
        """One boundary of several engines judged as one gradient: each engine's norm pass over its own
        buffer, one global norm, one NaN/Inf verdict (a skip skips every engine) and one clip factor, then
        each engine's update (SAM's first window: its ascent, by the global norm), so that the engines
        step as one engine over all their parameters would (the torch drop-ins' parameters in several
        engines, by dtype or optimizer). Each engine: one process, windows of one micro-batch whose
        gradient is in its ``grads`` (or read in place), no compressor; they take
        ``max_grad_norm``, ``clip_eps`` and ``nonfinite`` from the first. ``absent``: per engine, as
        :meth:`step`'s. Returns each engine's report."""
        try:
            engines = list(engines)
        except TypeError:
            raise ArgumentTypeError(f"engines: expected a list of engines, got {type(engines).__name__}") from None
        if not engines or not all(isinstance(e, Engine) for e in engines):
            raise ArgumentTypeError("engines: expected a non-empty list of arraytrain.Engine")
        if len({id(e) for e in engines}) != len(engines):
            raise ArgumentTypeError("engines: an engine is listed twice")
        absent = [None] * len(engines) if absent is None else list(absent)
        if len(absent) != len(engines):
            raise ArgumentTypeError(f"absent: expected one entry per engine ({len(engines)}), got {len(absent)}")
        for e in engines:
            if not e.comm.is_local or e.accumulation_steps != 1 or e.compressor is not None:
                raise ArgumentTypeError("engines: step_together takes engines of one process with windows of one "
                                        "micro-batch and no compressor")
        lead = engines[0]
        held = []
        try:
            for e in engines:
                e._enter("step()")
                held.append(e)
            checked = [e.check_absent(a) for e, a in zip(engines, absent)]
            return lead.with_compile_notice(cls._together, engines, checked, lead.max_grad_norm, lead.clip_eps,
                                 lead.nonfinite == "skip")
        finally:
            for e in held:
                e._guard.release()

    @staticmethod
    def _together(engines, absent, max_norm, eps, check) -> list[StepReport]:
        windows, verdicts = [], []
        rates = [e._scheduled(True) for e in engines]  # every schedule checked before any engine changes
        for e, a, (lr, lrs) in zip(engines, absent, rates):  # each boundary up to its norm pass (see _boundary)
            e._intake_stage(None, 1.0, a)
            wsum = e.counters.close_window()
            missing, e.counters.absent = e.counters.absent, None
            grads_at, e._grads_at = e._grads_at, None
            judge = Judge(e._kernels, e._unscale, max_norm, eps, check=check, grads_at=grads_at)
            ascent = e._two_windows and not e.counters.perturbed  # SAM's first window
            verdicts.append((e._sync.ascent if ascent else e._sync.reduce)(wsum, judge)[0])
            windows.append((lr, lrs, missing if e.missing == "skip" else None, grads_at, ascent))
        nonfinite, verdicts = Verdict.joint(verdicts, max_norm, eps)
        reports, refused = [], None
        for e, v, (lr, lrs, missing, grads_at, ascent) in zip(engines, verdicts, windows):
            if ascent and not nonfinite:
                reports.append(e._ascent_stage(v, e.state.step, lr))
            elif nonfinite or not e._update_stage(v, lrs, missing, grads_at):
                try:  # every engine skips (the first past max_consecutive_skips raises after all have)
                    reports.append(e._skip(e.state.step, lr))
                except NonFiniteError as err:
                    refused = refused or err
            else:
                reports.append(e.finish_applied(v, lr, None))
        if refused is not None:
            raise refused
        return reports

    def _unscale(self, wsum: float) -> float:
        # the buffer holds sum(w * g) of the scaled loss: the mean gradient is flat / unscale
        return (wsum if self.reduction == "mean" else 1.0) * self.loss_scale

    def _update_stage(self, verdict: Verdict, lrs, absent, grads_at=None) -> bool:
        """The optimizer's fused update, clip factor folded in; False when a device gate held it back.
        With parameters absent from the window (``missing="skip"``), the present ones only, once per
        step count among them (:mod:`arraytrain.param_steps`)."""
        state, step = self.state, self.state.step
        groups = None if absent is None and state.counts is None else param_steps.groups(absent, state.counts, step)

        def update(gscale):
            # a gradient read where it lies is its owner's: the kernel does not clear it
            zero = self.zero_grad_on_step and grads_at is None
            self._placement.update(self.optimizer, self._kernels, state, gscale, lrs, zero, groups, grads_at)
            state.step = step + 1

        if not verdict.apply(update, state):
            return False
        if groups is not None:
            state.counts = param_steps.advanced(absent, state.counts, step, len(self.layout))
        return True

    def _ascent_stage(self, verdict: Verdict, step: int, lr: float) -> StepReport:
        """SAM's first window: the update stage moves the weights to the ascent point instead."""
        self.counters.consecutive_skips = 0
        self.optimizer.perturb(self._kernels, self.params, self.grads, self.state, gscale=1.0 / verdict.unscale,
                               grad_norm=verdict.norm, zero_grad=self.zero_grad_on_step, mask=self.mask)
        self.counters.perturbed = True
        self.refresh_working()
        return StepReport(applied=False, skipped=False, step=step, micro_batches=0, lr=lr, grad_norm=verdict.norm,
                          clip_coef=verdict.coef, loss_scale=self.loss_scale, perturbed=True,
                          _segment_norms=verdict, _names=self.layout.names)

    def finish_applied(self, verdict: Verdict, lr: float, payload=None) -> StepReport:
        """An applied step's bookkeeping: counters, the loss scaler, the report (the last stage; for a
        binding that applied the update by a kernel of its own, inside :meth:`exclusive`)."""
        self.counters.consecutive_skips = 0
        self.counters.perturbed = False
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf=False)
        return StepReport(applied=True, skipped=False, step=self.state.step, micro_batches=0, lr=lr,
                          grad_norm=verdict.norm, clip_coef=verdict.coef, loss_scale=self.loss_scale,
                          _segment_norms=verdict, _names=self.layout.names,
                          payload_bytes=None if payload is None else payload.nbytes,
                          dense_bytes=None if payload is None else payload.dense_nbytes,
                          compression=None if payload is None else payload.meta.get("phase"))

    def _skip(self, step: int, lr: float) -> StepReport:
        """A NaN/Inf boundary: drop the window; params, state, step and schedule stay."""
        self._placement.drop_window()
        if self.counters.perturbed:  # SAM: back from the ascent point; the pair starts again
            self.optimizer.restore(self._kernels, self.params, self.state)
            self.counters.perturbed = False
            self.refresh_working()
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
        items = intake.check_grads(hessian, self.grads, protect=(self.params.flat, self.grads.flat))
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
            self.mask = None
            self._placement.keep_mask(None)
            return
        new = MaskBuffer.from_user(mask, self.layout)
        if backend_of(self.params.flat) != NUMPY:  # validated on the host; set_mask is the explicit move
            new = MaskBuffer(self.layout, array_module(self.params.flat).asarray(new.flat))
        self.mask = new
        self._placement.apply_mask(new)
        self.refresh_working()

        return (f"Engine({self.params!r}, {self.optimizer!r}, accumulation_steps={self.accumulation_steps}, "
                f"max_grad_norm={self.max_grad_norm}, backend={backend_of(self.params.flat)})")
