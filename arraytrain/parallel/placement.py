"""The placement: which weights, gradients and optimizer state a rank holds, and how a boundary
reduces, judges, updates and publishes them.

An engine holds one, picked in ``__init__`` (:func:`placement`):

- :class:`Replicated`: every rank holds everything. A window's gradient is all-reduced
  (by the gradient sync: whole at the boundary, or in buckets), its norm pass reads the
  whole buffer, and the optimizer updates every weight. With one process this is plain
  training: every collective is the identity.
- :class:`Sharded` (``shard_state=True``, ZeRO stage 1-2): each rank owns one contiguous
  partition (:class:`~arraytrain.parallel.shard.Partition`) of the optimizer state, and
  under a working copy of the float32 master weights too. A window's gradient is
  reduce-scattered (or reduced to each partition's owner, bucket by bucket); the norm
  comes from the partitions' sums of squares, completed with the weight sum in one small
  all-reduce; the rank updates its partition, then one all-gather publishes the updated
  weights (or working copy) into every rank's full copy. With ``defer_publish`` (set by
  ``bind(..., gather_in_forward=True)``) that all-gather starts in chunks after the update
  and completes while the next forward pass runs: each module waits (:meth:`Sharded.settle`)
  for the chunks its own parameters lie in, and every other reader of the weights for all.

Both implement :class:`Placement`, the contract the engine, the gradient syncs and the bindings
call (where a method does not apply to one of them, it is a no-op there): the placement lays out
its own parameters (:meth:`Placement.lay_out`), and gives ``params`` (what the model reads),
``master`` (what the optimizer updates), ``grads`` (what the model writes into), ``working``; for
the gradient sync ``bucket_flat`` and :meth:`~Placement.start_reduce`; for the boundary
:meth:`~Placement.exchange` or :meth:`~Placement.buckets_reduced`, then :meth:`~Placement.verdict` (the norm
pass, a :class:`~arraytrain.engine.stages.Verdict`),
:meth:`~Placement.norm_pass`, :meth:`~Placement.update`, :meth:`~Placement.drop_window`; the
publish (:meth:`~Placement.publish`, :meth:`~Placement.settle`, :meth:`~Placement.chunk_needed`);
and :meth:`~Placement.refresh_working`, :meth:`~Placement.weights_moved`, the mask
(:meth:`~Placement.keep_mask`, :meth:`~Placement.apply_mask`), :meth:`~Placement.gather_params`
and :meth:`~Placement.memory`. A third placement (parameters sharded too) implements the same.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np

from ..backend import array_module
from ..buffer import FlatBuffer, Subset, aligned_zeros
from ..errors import HyperparameterError
from ..layout import REDUCE_CHUNK
from ..ops import NormPass
from ..param_steps import pieces_of
from .communicator import agree_on_setup, window_sums
from .shard import ShardBuffer, aligned_to, gather, interleaved, padded_buffer, partition

#: A deferred publish all-gathers each partition in about this many chunks (each at least
#: :data:`~arraytrain.layout.REDUCE_CHUNK` elements): the first modules wait for the first chunk only.
PUBLISH_CHUNKS = 8


class Placement(ABC):
    """The contract of a placement (see the module docstring); the working copy's rebuild is shared."""

    comm = None
    params = master = grads = None
    working = None
    working_kind = 0
    kernel_mask = None  # the mask the update kernels apply (sharded: this rank's partition)
    defer_publish = False  # the publish after an update left in flight (bind(..., gather_in_forward=True))

    @classmethod
    def lay_out(cls, params: FlatBuffer, comm, optimizer, bucket_bytes: int | None) -> tuple[FlatBuffer, list | None]:
        """``(params as this placement lays them out, the buckets' names where it chose them)``: the
        parameters as given, and the gradient sync cuts its own buckets."""
        return params, None

    @abstractmethod
    def working_bits(self):
        """The working copy as the kernels write it (uint16 bits; sharded: this rank's partition), or None."""

    @property
    @abstractmethod
    def bucket_flat(self):
        """The array the gradient sync cuts into buckets."""

    @abstractmethod
    def start_reduce(self, lo: int, hi: int) -> list:
        """A bucket's collectives over ``[lo, hi)`` of :attr:`bucket_flat`, started (nonblocking)."""

    @abstractmethod
    def exchange(self) -> None:
        """The window's gradient across the ranks in one blocking collective (the blocking gradient sync)."""

    def buckets_reduced(self) -> None:
        """Every bucket's collectives (:meth:`start_reduce`) completed: the gradient is exchanged."""

    @abstractmethod
    def verdict(self, wsum: float, judge):
        """The norm pass over the exchanged gradient, the window's weight sum ``wsum`` summed over the
        ranks with it: a :class:`~arraytrain.engine.stages.Verdict`."""

    @abstractmethod
    def norm_pass(self, unscale: float, judge):
        """The norm pass over a gradient already exchanged (a compressor's): a Verdict."""

    @abstractmethod
    def update(self, optimizer, kernels, state, gscale, lrs, zero_grad: bool, groups=None, grads_at=None) -> None:
        """The optimizer's fused update of what this rank owns, then the publish."""

    @abstractmethod
    def drop_window(self) -> None:
        """A skipped boundary: the window's gradient is dropped."""

    @abstractmethod
    def publish(self) -> None:
        """The updated weights into every rank's copy (nothing where every rank updated every weight)."""

    def settle(self, need: int | None = None) -> None:
        """Complete a deferred publish's chunks ``0..need`` (None: all); nothing where none is in flight."""

    @property
    def in_flight(self) -> int:
        """How many chunks of a deferred publish are not yet complete."""
        return 0

    def chunk_needed(self, spans) -> int:
        """The last chunk of a deferred publish to wait for before reading the flat elements ``spans``
        (``[(start, stop), ...]``); -1: none."""
        return -1

    @abstractmethod
    def keep_mask(self, mask) -> None:
        """The pruning mask (a :class:`~arraytrain.prune.MaskBuffer` or None) the kernels apply."""

    @abstractmethod
    def apply_mask(self, mask) -> None:
        """:meth:`keep_mask`, and zero the pruned weights now."""

    @abstractmethod
    def gather_params(self) -> FlatBuffer:
        """The full parameters as a new buffer (sharded masters: a collective)."""

    @abstractmethod
    def memory(self) -> dict:
        """Bytes of the buffers held here, by kind (see :meth:`arraytrain.Engine.memory`)."""

    @property
    def layout(self):
        """The full layout of the parameters."""
        return self.grads.layout

    def working_args(self):
        """The kernels' working copy ``(uint16 bits, kind)`` (sharded: this rank's partition), or None."""
        bits = self.working_bits()
        return None if bits is None else (bits, self.working_kind)

    def refresh_working(self, kernels) -> None:
        """Rebuild the working copy from the master weights (after a load or a SAM move); sharded,
        then one all-gather (a collective)."""
        if self.working is not None:
            bits = self.working_bits()
            kernels.cast_working(bits, self.master.flat, self.master.layout.pieces, kind=self.working_kind)
            self.publish()

    def weights_moved(self, kernels) -> None:
        """The master weights changed outside the update kernel: the working copy rebuilt, or the
        weights published."""
        if self.working is not None:
            self.refresh_working(kernels)
        else:
            self.publish()


class Replicated(Placement):
    """Every rank holds all the weights, the whole gradient and all the state (see the module docstring).

    ``device_gate``: the norm pass leaves its verdict on the CUDA device, a gate the update
    kernels read (not with a compressor or SAM, whose stages read the verdict first).
    """

    def __init__(self, comm, params: FlatBuffer, working_spec=None, *, device_gate: bool = False):
        self.comm, self.params, self.master = comm, params, params
        self.grads = params.zeros_like()
        if working_spec is not None:
            self.working, self.working_kind = params.zeros_like(working_spec[0]), working_spec[1]
        self.device_gate = device_gate

    def working_bits(self):
        """The working copy as the kernels write it (uint16 bits), or None."""
        return None if self.working is None else self.working.flat.view(np.uint16)

    @property
    def bucket_flat(self):
        """The array the gradient sync cuts into buckets."""
        return self.grads.flat

    def start_reduce(self, lo: int, hi: int) -> list:
        """A bucket's collective: the nonblocking in-place all-reduce of ``[lo, hi)``."""
        return [self.comm.iallreduce(self.grads.flat[lo:hi])]

    def exchange(self) -> None:
        """The window's gradient summed over ranks, in place: one all-reduce (the buffer is the fusion
        buffer; a NaN/Inf on any rank reaches every rank through the sum)."""
        if not self.comm.is_local:
            self.comm.allreduce(self.grads.flat, "sum")

    def verdict(self, wsum: float, judge):
        """The weight sum over ranks, then the norm pass."""
        wsum = window_sums(self.comm, wsum, False)[0]
        return self.norm_pass(judge.unscale(wsum), judge)

    def norm_pass(self, unscale: float, judge):
        """The norm pass and non-finite check over the whole buffer: one read."""
        return judge.norm_pass(self.grads.flat, self.layout, unscale, self.device_gate)

    def update(self, optimizer, kernels, state, gscale, lrs, zero_grad: bool, groups=None, grads_at=None) -> None:
        """The optimizer's fused update of every weight (the gradient zeroed in it with ``zero_grad``);
        with ``groups`` (:func:`arraytrain.param_steps.groups`) of the present parameters only; with
        ``grads_at`` (:class:`~arraytrain.buffer.GradsAt`) reading the gradients where they lie."""
        run_groups(groups, state, self.params, self.grads if grads_at is None else grads_at,
                   lambda p, g: optimizer.update(kernels, p, g, state, gscale=gscale, lr=lrs, zero_grad=zero_grad,
                                                 working=self.working_args(), mask=self.kernel_mask))

    def drop_window(self) -> None:
        """A skipped boundary: the window's gradient is dropped."""
        self.grads.flat.fill(0)

    def publish(self) -> None:
        """Nothing to publish: every rank updated every weight."""

    def keep_mask(self, mask) -> None:
        """The pruning mask (a :class:`~arraytrain.prune.MaskBuffer` or None) the kernels apply."""
        self.kernel_mask = mask

    def apply_mask(self, mask) -> None:
        """:meth:`keep_mask`, and zero the pruned weights now."""
        self.keep_mask(mask)
        xp = array_module(self.params.flat)
        xp.multiply(self.params.flat, mask.flat, out=self.params.flat, casting="unsafe")

    def gather_params(self) -> FlatBuffer:
        """The full parameters: a copy."""
        return self.params.copy()

    def memory(self) -> dict:
        """Bytes of the parameter, gradient and working buffers (see :meth:`arraytrain.Engine.memory`)."""
        return {"params": self.params.flat.nbytes, "grads": self.grads.flat.nbytes,
                "working": 0 if self.working is None else self.working.flat.nbytes}


class Sharded(Placement):
    """Each rank keeps and updates one partition (see the module docstring).

    Every rank keeps the full gradient buffer (what the model writes into) and the full
    weights the model reads: the parameters, or under a working copy the working copy,
    with the float32 master weights sharded. Each array the collectives move is padded
    to ``ranks * length`` elements; the engine's :class:`~arraytrain.FlatBuffer` views
    are its head.
    """

    @classmethod
    def lay_out(cls, params: FlatBuffer, comm, optimizer, bucket_bytes: int | None) -> tuple[FlatBuffer, list]:
        """Every offset on the optimizer's :attr:`~arraytrain.optim.Optimizer.shard_align` (8-bit state: a
        block, so that no partition boundary cuts one), and the buckets dealt to the ranks in turn
        (:func:`~arraytrain.parallel.shard.interleaved`, blocking or overlapped alike: the same layout
        either way, so the overlapped exchange equals the blocking one bitwise)."""
        return interleaved(aligned_to(params, optimizer.shard_align), comm.size, bucket_bytes)

    def __init__(self, comm, params: FlatBuffer, working_spec=None):
        layout = params.layout
        part = partition(layout, comm.size, comm.rank)
        xp = array_module(params.flat)
        self.comm, self.partition = comm, part
        self.grads, self._grads = padded_buffer(layout, params.dtype, xp, part)
        own = slice(part.lo, part.hi)
        if working_spec is None:
            self.params, self._weights = padded_buffer(layout, params.dtype, xp, part)
            self.params.flat[...] = params.flat
            self.master = ShardBuffer(part, self._weights[own])  # a view: the rank's partition of the weights
        else:
            masters = aligned_zeros(part.length, params.dtype, xp)
            n = max(0, min(part.hi, layout.size) - part.lo)
            masters[:n] = params.flat[part.lo : part.lo + n]
            self.master = self.params = ShardBuffer(part, masters)
            self.working, self._weights = padded_buffer(layout, working_spec[0], xp, part)
            self.working_kind = working_spec[1]
        self._own_weights = self._weights[own]
        self._grad_part = None  # this rank's partition of the reduced gradient, from the exchange to update()
        # a deferred publish: chunks of chunk_length elements of every partition, gathered in order
        self.chunk_length = max(1, -(-part.length // (PUBLISH_CHUNKS * REDUCE_CHUNK))) * REDUCE_CHUNK
        self._gathers: list = []
        self._settled = 0

    @property
    def sharded_masters(self) -> bool:
        """The float32 master weights are sharded (a working copy holds the full weights)."""
        return self.working is not None

    def working_bits(self):
        """This rank's partition of the working copy, as the kernels write it (uint16 bits), or None."""
        return None if self.working is None else self._own_weights.view(np.uint16)

    @property
    def bucket_flat(self):
        """The whole padded gradient array (the engine's ``grads.flat`` is its head)."""
        return self._grads

    def start_reduce(self, lo: int, hi: int) -> list:
        """A bucket's collectives: each partition's slice of ``[lo, hi)`` reduced to its owner."""
        length = self.partition.length
        return [self.comm.ireduce(self._grads[max(lo, r * length) : min(hi, (r + 1) * length)], r)
                for r in range(lo // length, (hi - 1) // length + 1)]

    def exchange(self) -> None:
        """One reduce-scatter of the gradient: this rank's partition of the sum, kept for :meth:`update`."""
        self._grad_part = ShardBuffer(self.partition, self.comm.reduce_scatter(self._grads))

    def buckets_reduced(self) -> None:
        """The buckets reduced each partition to its owner: this rank's lies in place."""
        self._grad_part = ShardBuffer(self.partition, self._grads[self.partition.lo : self.partition.hi])

    def verdict(self, wsum: float, judge):
        """The norm pass as the partitions' float64 sums of squares (total and per parameter) with the
        weight sum in one small all-reduce, so every rank finds the same norms and a NaN/Inf in any
        partition makes every rank's total non-finite. A float64 total that is not finite takes the
        norm pass's overflow path (:func:`arraytrain.ops.norm_pass`) with two more small all-reduces.
        The partition waits for :meth:`update`."""
        found, wsum = self._partition_norm(judge.kernels, wsum)
        return judge.found(found, wsum)

    def norm_pass(self, unscale: float, judge):
        """The norm pass over this rank's partition of a gradient already reduced to it, completed over
        the ranks (one small all-reduce of the partitions' sums)."""
        found, _ = self._partition_norm(judge.kernels, None)
        return judge.verdict(found, unscale)

    def _partition_norm(self, kernels, wsum: float | None) -> tuple[NormPass, float | None]:
        """The partition's float64 sums of squares (total and per parameter), with ``wsum`` (when given)
        in the same small all-reduce: ``(the global finding, the global weight sum)``."""
        comm, part, g = self.comm, self.partition, self._grad_part
        nseg = len(part.layout)
        total, per_seg = kernels.sumsq(g.flat, part.pieces, nseg=nseg)
        sums = np.concatenate(([total], per_seg, [] if wsum is None else [wsum]))
        comm.allreduce(sums, "sum")
        if wsum is not None:
            wsum, sums = float(sums[-1]), sums[:-1]
        total = float(sums[0])
        if math.isfinite(total):
            return NormPass.of_sums(math.sqrt(total), sums[1:]), wsum
        nonfinite = NormPass(math.nan, np.full(nseg, np.nan), True)
        if g.flat.dtype.itemsize < 8:
            return nonfinite, wsum
        flags = np.array([0.0 if kernels.all_finite(g.flat) else 1.0, kernels.max_abs(g.flat, part.pieces)])
        comm.allreduce(flags, "max")
        if flags[0]:
            return nonfinite, wsum
        peak = float(flags[1])
        total, per_seg = kernels.sumsq_scaled(g.flat, part.pieces, nseg=nseg, inv=1.0 / peak)
        sums = np.concatenate(([total], per_seg))
        comm.allreduce(sums, "sum")
        return NormPass.of_sums(peak * math.sqrt(sums[0]), sums[1:], peak), wsum

    def update(self, optimizer, kernels, state, gscale, lrs, zero_grad: bool, groups=None, grads_at=None) -> None:
        """The own partition's update, then every rank's into every rank's weights; the gradient
        buffer (the rank's unreduced gradient and the reduce-scatter's scratch) is cleared whole."""
        sums = {"reduce_sums": self._reduce_sums} if optimizer.segment_sums else {}
        grads, self._grad_part = self._grad_part, None
        run_groups(groups, state, self.master, grads,
                   lambda p, g: optimizer.update(kernels, p, g, state, gscale=gscale, lr=lrs,
                                                 working=self.working_args(), mask=self.kernel_mask, **sums))
        self.publish(deferred=self.defer_publish)
        self._grads.fill(0)

    def _reduce_sums(self, sums) -> None:
        """Complete per-parameter partial sums over ranks, in place (LAMB's norms)."""
        self.comm.allreduce(sums, "sum")

    def drop_window(self) -> None:
        """A skipped boundary: the window's gradient and the reduce-scatter's scratch are dropped."""
        self._grad_part = None
        self._grads.fill(0)

    def publish(self, deferred: bool = False) -> None:
        """Every rank's updated partition of the weights (or working copy) into every rank's full copy: one
        all-gather, or with ``deferred`` its chunks started in order and left in flight (:meth:`settle`)."""
        self.settle()
        flat = self._weights.view(np.uint8)
        if not deferred:
            self.comm.allgather_blocks(flat)
            return
        step, n = self.chunk_length * self._weights.itemsize, self.partition.length * self._weights.itemsize
        self._gathers = [self.comm.iallgather_blocks(flat, lo, min(lo + step, n)) for lo in range(0, n, step)]

    def settle(self, need: int | None = None) -> None:
        """Complete the deferred publish's chunks ``0..need`` (None: all of them), in order."""
        gathers = self._gathers
        if not gathers:
            return
        stop = len(gathers) if need is None else min(need + 1, len(gathers))
        while self._settled < stop:
            gathers[self._settled].wait()
            self._settled += 1
        if self._settled == len(gathers):
            self._gathers, self._settled = [], 0

    @property
    def in_flight(self) -> int:
        """How many chunks of a deferred publish are not yet complete."""
        return len(self._gathers) - self._settled

    def chunk_needed(self, spans) -> int:
        """The last chunk of a deferred publish to wait for before reading the flat elements ``spans``
        (``[(start, stop), ...]``): the chunk of each one's last element in every other rank's
        partition; -1 when they all lie in this rank's."""
        length, own, need = self.partition.length, self.partition.rank, -1
        for a, b in spans:
            for r in range(a // length, (b - 1) // length + 1) if b > a else ():
                if r != own:
                    need = max(need, (min(b, (r + 1) * length) - 1 - r * length) // self.chunk_length)
        return need

    def keep_mask(self, mask) -> None:
        """This rank's partition of a pruning mask, padded to the partition's length, for the kernels."""
        if mask is None:
            self.kernel_mask = None
            return
        part = self.partition
        out = array_module(mask.flat).zeros(part.length, np.uint8)
        n = max(0, min(part.hi, part.layout.size) - part.lo)
        out[:n] = mask.flat[part.lo : part.lo + n]
        self.kernel_mask = out

    def apply_mask(self, mask) -> None:
        """:meth:`keep_mask`, and zero the pruned weights now (the sharded masters' partition, or every
        rank's full weights)."""
        self.keep_mask(mask)
        xp = array_module(self.params.flat)
        if self.sharded_masters:
            xp.multiply(self.master.flat, self.kernel_mask, out=self.master.flat, casting="unsafe")
        else:
            xp.multiply(self.params.flat, mask.flat, out=self.params.flat, casting="unsafe")

    def gather_params(self) -> FlatBuffer:
        """The full parameters: a copy, or the sharded masters' all-gather (a collective)."""
        if not self.sharded_masters:
            return self.params.copy()
        return gather(self.comm, self.params)

    def memory(self) -> dict:
        """Bytes of the buffers held here, by kind (see :meth:`arraytrain.Engine.memory`)."""
        out = {"grads": self._grads.nbytes,
               "scratch": 0 if self.kernel_mask is None else self.kernel_mask.nbytes}
        if self.working is None:
            out["params"] = self._weights.nbytes
        else:
            out["master"] = self.master.flat.nbytes
            out["working"] = self._weights.nbytes
        return out


def refuse_unshardable(optimizer, compressor) -> None:
    """A typed error (the same on every rank, before anything is allocated) for what cannot shard."""
    why = optimizer.shard_refusal
    if why is not None:
        raise HyperparameterError(f"shard_state: {type(optimizer).__name__} cannot shard its state: {why}")
    if compressor is not None:
        raise HyperparameterError("shard_state: a compressor's exchange replaces the reduce-scatter; "
                                  "compression and sharded state do not compose yet (drop one of them)")


def join(comm, params: FlatBuffer, optimizer, compressor, *, shard_state: bool, overlap: bool, two_windows: bool,
         **settings) -> None:
    """An engine joins its group: every rank has the same layout, optimizer and settings (else the same
    typed error on every rank: :func:`~arraytrain.parallel.communicator.agree_on_setup`), what cannot
    shard or overlap is refused, the compressor is bound to the group, and every rank starts from rank
    0's weights (broadcast as bytes: any dtype)."""
    if not comm.is_local:
        agree_on_setup(comm, params, optimizer, compressor, shard_state=shard_state, overlap=overlap, **settings)
    if shard_state:  # the same error on every rank: their optimizers and settings agree
        refuse_unshardable(optimizer, compressor)
    if overlap and not comm.is_local and (compressor is not None or two_windows):
        raise HyperparameterError("overlap: a compressor's exchange and SAM's two windows need the whole "
                                  "window's gradient at once; pass overlap=False")
    if compressor is not None:
        compressor.bind(params.layout, params.dtype, comm=comm)
    if not comm.is_local:
        comm.broadcast(params.flat.view(np.uint8), 0)


def placement_class(shard: bool) -> type[Placement]:
    """The engine's placement: :class:`Sharded` with ``shard``, else :class:`Replicated`."""
    return Sharded if shard else Replicated


def placement(comm, params: FlatBuffer, working_spec=None, *, shard: bool = False, device_gate: bool = False):
    """The engine's placement over ``params`` as :meth:`Placement.lay_out` laid them out."""
    if shard:
        return Sharded(comm, params, working_spec)
    return Replicated(comm, params, working_spec, device_gate=device_gate)


def run_groups(groups, state, params, grads, update) -> None:
    """``update(params, grads)`` over every weight, or once per group of present parameters that
    stand at one step count (``state.step`` set to it, ``state.present`` to the group's parameters, the
    buffers cut to its pieces: see :mod:`arraytrain.param_steps`); the caller sets the engine's step
    count afterwards. Every rank calls ``update`` for every group, with the same ``state.present``, also
    where none of the group's pieces lie in its partition (sharded state)."""
    if groups is None:
        update(params, grads)
        return
    for count, keep in groups:
        state.step = count
        if keep is None:
            update(params, grads)
            continue
        pieces = pieces_of(params.layout.pieces, keep)
        state.present = keep
        try:
            update(Subset(params, pieces), Subset(grads, pieces))
        finally:
            state.present = None
