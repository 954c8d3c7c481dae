"""The gradient sync: how the window's gradient crosses the ranks, and when.

An engine holds one, picked in ``__init__`` (:func:`gradient_sync`):

- :class:`BucketedSync` (``overlap=True``): the buffer cut into buckets that start their
  nonblocking reduces while the backward pass still runs; the boundary starts the rest and
  waits. The blocking exchange is its degenerate case (:meth:`BucketedSync.blocking`, the
  default): no bucket, and at the boundary the placement's one collective over the whole
  buffer (an all-reduce; sharded, a reduce-scatter). With one process, the identity.
- :class:`CompressedSync` (a compressor): the ranks agree on the weight sum and on
  finiteness, then each compresses its share of the mean and receives the decoded sum.

Each answers :meth:`~BucketedSync.reduce` (the boundary's exchange and norm pass, through the
placement: a :class:`~arraytrain.engine.stages.Verdict`, or None to skip), :meth:`~BucketedSync.ascent`
(SAM's first window: the same, but a compressor's sync keeps the exact local gradient),
:meth:`~BucketedSync.mark_ready`, ``started`` (something is in flight: what ``step(grads)``,
``state_dict()`` and ``apply_state()`` refuse) and :meth:`~BucketedSync.drain` (``zero_grad()``:
complete what was started).

Buckets
-------

A framework's backward pass writes the gradients of the last layers first. The flat
buffer's parameters are in forward order, so the buffer is cut into buckets from its end:
bucket 0 holds the last parameters, each bucket a contiguous slice of about
``bucket_bytes`` of whole parameters (one larger parameter: a bucket of its own); by
default an eighth of the gradient, between 1 and 25 MiB (:func:`default_bucket_bytes`). During
the last micro-batch of a window, :meth:`arraytrain.Engine.mark_ready` says which
gradients are final; a bucket whose parameters are all final starts its exchange at
once — a nonblocking in-place all-reduce (with sharded state: one nonblocking reduce per
partition it touches, to the rank that owns it, which moves the bytes of a
reduce-scatter) — and the boundary waits only for what is still in flight, after
starting the buckets nobody marked (a parameter that got no gradient is exchanged as the
blocking path exchanges it: as the zeros or values the buffer holds).

With sharded state the engine lays the buckets out interleaved (:func:`arraytrain.parallel.shard.interleaved`:
dealt to the ranks in turn, so that consecutive buckets have different owners and their reduces
cross the links both ways at once); the buckets keep their members and start order, each still a
contiguous slice (:func:`buckets_in`).

Buckets start strictly in order: bucket ``k`` waits until buckets ``0..k-1`` have
started. The ranks then enter their collectives in the same order whatever order their
gradients become final in, and a bucket one rank cannot complete (a parameter unused
there) only delays the later ones to the boundary, where every rank starts what is
left, in order: never a hang.

Progress. MPI moves a nonblocking collective forward only inside MPI calls (MPICH has no
progress thread unless ``MPIR_CVAR_ASYNC_PROGRESS=1`` is set, which spins a core).
:class:`~arraytrain.parallel.mpi.MPIComm` therefore keeps a thread that tests the requests
in flight every 0.5 ms while the backward pass computes
(:mod:`arraytrain.parallel.progress`), and every :meth:`~BucketedSync.ready` also tests
them (``MPI_Test``) from the backward pass's hooks. NCCL and torch.distributed progress on
their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ArgumentTypeError, ConcurrentUseError, UnknownParameterError
from ..layout import Layout
from .communicator import window_sums

#: The largest default bucket, DDP's bucket size.
BUCKET_BYTES = 25 * 2**20
#: The smallest default bucket.
MIN_BUCKET_BYTES = 2**20
#: The default cuts the gradient into about this many buckets (:func:`default_bucket_bytes`).
BUCKET_SHARE = 8


def default_bucket_bytes(nbytes: int) -> int:
    """The bucket size for a gradient of ``nbytes``: an eighth of it, at least 1 MiB and at most 25 MiB.

    The exchange that cannot hide is the last bucket's, started when the backward pass ends; DDP's
    fixed 25 MB made one bucket of a 16.8 MB gradient (nothing overlapped) and two of a 67 MB one (the
    second waiting for the first layer's gradient). Measured on two nodes at 2 Gbit/s (docs/cluster.md):
    the 4.2M-parameter MLP's overlapped step took 116-118 ms with 1-4 MiB buckets against 147 ms with
    25 MiB, the blocking step's. Below 1 MiB a bucket's fixed cost (a collective's start, its latency)
    grows against its bytes."""
    return int(min(BUCKET_BYTES, max(MIN_BUCKET_BYTES, nbytes // BUCKET_SHARE)))


@dataclass(frozen=True)
class Bucket:
    """A contiguous slice ``[lo, hi)`` of the flat buffer and the parameters (indices) in it."""

    lo: int
    hi: int
    params: tuple[int, ...]


def buckets(layout: Layout, bucket_bytes: int, itemsize: int) -> tuple[Bucket, ...]:
    """``layout`` cut into buckets from its end (bucket 0: the last parameters), each of whole
    parameters and about ``bucket_bytes``; together they cover ``[0, layout.size)``."""
    per = max(1, bucket_bytes // itemsize)
    out = []
    hi = layout.size
    members: list[int] = []
    for i in range(len(layout) - 1, -1, -1):
        members.append(i)
        lo = layout.offsets[i]
        if hi - lo >= per or i == 0:
            out.append(Bucket(0 if i == 0 else lo, hi, tuple(members)))
            hi, members = lo, []
    return tuple(out)


def buckets_in(layout: Layout, members) -> tuple[Bucket, ...]:
    """Buckets of given parameters (``members``: a list of name lists, in the order the buckets start),
    each contiguous in ``layout``; together they cover ``[0, layout.size)``, a bucket reaching to the
    next one's first offset (see :func:`arraytrain.parallel.shard.interleaved`)."""
    firsts = sorted((layout.offsets[layout.index(names[0])], k) for k, names in enumerate(members))
    bounds = {k: (0 if j == 0 else lo, firsts[j + 1][0] if j + 1 < len(firsts) else layout.size)
              for j, (lo, k) in enumerate(firsts)}
    return tuple(Bucket(*bounds[k], tuple(layout.index(n) for n in names)) for k, names in enumerate(members))


class BucketedSync:
    """The buckets of one engine's gradient and the collectives in flight in the current window
    (see the module docstring); the placement says what a bucket's collective is. Without buckets
    (:meth:`blocking`) the boundary runs the placement's one collective over the whole buffer."""

    def __init__(self, placement, bucket_bytes: int | None = None, members=None, *, blocking: bool = False):
        self.placement = placement
        self.layout = layout = placement.layout
        flat = placement.bucket_flat
        if bucket_bytes is None:
            bucket_bytes = default_bucket_bytes(layout.size * flat.dtype.itemsize)
        self.bucket_bytes = bucket_bytes
        # members: the buckets' parameter names where the layout was interleaved (shard.interleaved)
        if blocking:
            self.buckets = ()
        else:
            self.buckets = (buckets(layout, bucket_bytes, flat.dtype.itemsize) if members is None
                            else buckets_in(layout, members))
        self._bucket_of = np.empty(len(layout), np.int64)
        for k, b in enumerate(self.buckets):
            self._bucket_of[list(b.params)] = k
        self._sizes = np.array([len(b.params) for b in self.buckets], np.int64)
        self.reset()

    @classmethod
    def blocking(cls, placement) -> "BucketedSync":
        """The degenerate case: no bucket, the whole window's gradient reduced at the boundary."""
        return cls(placement, blocking=True)

    @property
    def overlaps(self) -> bool:
        """:meth:`mark_ready` starts buckets while the backward pass runs."""
        return bool(self.buckets)

    def reset(self) -> None:
        """A new window: nothing marked, nothing in flight."""
        self._final = np.zeros(len(self.layout), bool)
        self._missing = self._sizes.copy()
        self._next = 0  # the next bucket to start, in order
        self._pending: list = []

    @property
    def started(self) -> bool:
        """Some bucket of this window has started its exchange."""
        return self._next > 0

    def indices(self, names) -> list[int]:
        """The layout indices of ``names`` (a name or an iterable of names), checked."""
        if isinstance(names, str):
            names = (names,)
        try:
            return [self.layout.index(n) for n in names]
        except UnknownParameterError:
            raise
        except TypeError:
            raise ArgumentTypeError(f"names: expected a parameter name or an iterable of names, "
                                    f"got {type(names).__name__}") from None

    def mark_ready(self, names, last: bool) -> None:
        """``names`` are final: during the window's last micro-batch (``last``), :meth:`ready`; without
        buckets this only checks the names (an unknown one raises)."""
        idx = self.indices(names)
        if last and self.buckets:
            self.ready(idx)

    def ready(self, indices) -> None:
        """Parameters ``indices`` are final: start every bucket that is complete, in order; poll.

        Marking again a parameter whose bucket has started means its gradient was written
        again while being exchanged (a second backward pass before ``step()``): refused
        with :class:`~arraytrain.errors.ConcurrentUseError` rather than sending a mix.
        """
        for i in indices:
            if self._final[i] and self._bucket_of[i] < self._next:
                raise ConcurrentUseError(
                    f"{self.layout.names[i]!r}: its gradient was marked ready again while its bucket is being "
                    "exchanged (a second backward pass before step()?); accumulate micro-batches with "
                    "accumulation_steps, one step() after each backward pass")
            if not self._final[i]:
                self._final[i] = True
                self._missing[self._bucket_of[i]] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._start(self.buckets[self._next])
        self._pending = [p for p in self._pending if not p.test()]

    def finish(self) -> None:
        """Start what is left, in order, and wait for everything (without buckets: the placement's
        blocking exchange): the buffer (under sharded state, this rank's partition of it) then holds
        the sum over ranks."""
        if not self.buckets:
            self.placement.exchange()
            return
        while self._next < len(self.buckets):
            self._start(self.buckets[self._next])
        for p in self._pending:
            p.wait()
        self._pending = []
        self.placement.buckets_reduced()

    def reduce(self, wsum: float, judge):
        """The buckets nobody marked, then every one in flight (or the blocking exchange); the placement's
        norm pass: ``(Verdict, None)``."""
        self.finish()
        if self.buckets:
            self.reset()
        return self.placement.verdict(wsum, judge), None

    def ascent(self, wsum: float, judge):
        """SAM's first window: as :meth:`reduce`."""
        return self.reduce(wsum, judge)

    def drain(self) -> None:
        """Complete the buckets started in this window (every rank's collectives still match), then
        forget the window."""
        if self.started:
            self.finish()
            self.reset()

    def _start(self, b: Bucket) -> None:
        self._next += 1
        if b.hi > b.lo:
            self._pending.extend(self.placement.start_reduce(b.lo, b.hi))


class CompressedSync(BucketedSync):
    """A compressor's exchange (replicated placement): the ranks agree on the weight sum and on
    finiteness (a non-finite gradient anywhere: nothing is compressed, the step skips), then each
    compresses its share of the mean and receives the decoded sum (``payload``: what it sent).
    SAM's ascent window keeps the exact local gradient. No buckets: the compressor needs the
    whole window's gradient."""

    def __init__(self, placement, compressor):
        super().__init__(placement, blocking=True)
        self.compressor = compressor

    def reduce(self, wsum: float, judge):
        return self._compressed(wsum, judge, exact=False)

    def ascent(self, wsum: float, judge):
        return self._compressed(wsum, judge, exact=True)

    def _compressed(self, wsum: float, judge, exact: bool):
        place = self.placement
        kernels, flat = judge.kernels, place.grads.flat
        wsum, bad = window_sums(place.comm, wsum, not kernels.all_finite(flat))
        if bad:
            return None, None
        unscale = judge.unscale(wsum)
        if exact:
            return place.norm_pass(unscale, judge), None
        if unscale != 1.0:
            kernels.scale(flat, factor=1.0 / unscale)
        payload = self.compressor.exchange(flat)
        return place.norm_pass(1.0, judge), payload


class AutoSync(CompressedSync):
    """An :class:`~arraytrain.compress.Auto`'s exchange: while it is dense (``dense_next``), the
    placement's own dense reduce — the exchange without a compressor — counted and timed by
    ``Auto.dense_call``; otherwise the chosen compressor's, as :class:`CompressedSync`."""

    def reduce(self, wsum: float, judge):
        if not self.compressor.dense_next:
            return super().reduce(wsum, judge)
        with self.compressor.dense_call(self.placement.grads.flat) as call:
            self.placement.exchange()
            verdict = self.placement.verdict(wsum, judge)
        return verdict, call.payload


def gradient_sync(placement, *, compressor=None, overlap: bool = False, bucket_bytes: int | None = None,
                  members=None):
    """The engine's gradient sync: compressed with a compressor, bucketed with ``overlap`` and a group of
    processes (``members``: the buckets' names where the layout was interleaved), else blocking (the
    engine refused the combinations that cannot be)."""
    if compressor is not None:
        return (AutoSync if hasattr(compressor, "dense_call") else CompressedSync)(placement, compressor)
    if overlap and not placement.comm.is_local:
        return BucketedSync(placement, bucket_bytes, members)
    return BucketedSync.blocking(placement)
