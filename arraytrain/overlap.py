"""The exchange overlapped with the backward pass: buckets of the flat gradient, started as they fill.

A framework's backward pass writes the gradients of the last layers first. The flat
buffer's parameters are in forward order, so the buffer is cut into buckets from its end:
bucket 0 holds the last parameters, each bucket a contiguous slice of about
``bucket_bytes`` of whole parameters (one larger parameter: a bucket of its own). During
the last micro-batch of a window, :meth:`arraytrain.Engine.mark_ready` says which
gradients are final; a bucket whose parameters are all final starts its exchange at
once — a nonblocking in-place all-reduce (with sharded state: one nonblocking reduce per
partition it touches, to the rank that owns it, which moves the bytes of a
reduce-scatter) — and the boundary waits only for what is still in flight, after
starting the buckets nobody marked (a parameter that got no gradient is exchanged as the
blocking path exchanges it: as the zeros or values the buffer holds).

Buckets start strictly in order: bucket ``k`` waits until buckets ``0..k-1`` have
started. The ranks then enter their collectives in the same order whatever order their
gradients become final in, and a bucket one rank cannot complete (a parameter unused
there) only delays the later ones to the boundary, where every rank starts what is
left, in order: never a hang.

Progress. MPI moves a nonblocking collective forward only inside MPI calls (MPICH has no
progress thread unless ``MPIR_CVAR_ASYNC_PROGRESS=1`` is set). Every
:meth:`~OverlappedExchange.ready` therefore also tests the requests in flight
(``MPI_Test``): the backward pass polls from its hooks, one test per call and request.
NCCL and torch.distributed progress on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ArgumentTypeError, ConcurrentUseError, UnknownParameterError
from .layout import Layout

#: The default bucket size, DDP's.
BUCKET_BYTES = 25 * 2**20


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


class OverlappedExchange:
    """One engine's buckets and the collectives in flight in the current window.

    ``flat``: the gradient buffer's array (padded under sharded state); ``part``: the
    rank's :class:`~arraytrain.shard.Partition` under sharded state, else None.
    """

    def __init__(self, comm, layout: Layout, flat, bucket_bytes: int, part=None):
        self.comm, self.layout, self.flat, self.part = comm, layout, flat, part
        self.buckets = buckets(layout, bucket_bytes, flat.dtype.itemsize)
        self._bucket_of = np.empty(len(layout), np.int64)
        for k, b in enumerate(self.buckets):
            self._bucket_of[list(b.params)] = k
        self._sizes = np.array([len(b.params) for b in self.buckets], np.int64)
        self.reset()

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

    def finish(self):
        """Start what is left, in order, and wait for everything: the buffer (under sharded state,
        this rank's partition of it) then holds the sum over ranks."""
        while self._next < len(self.buckets):
            self._start(self.buckets[self._next])
        for p in self._pending:
            p.wait()
        self._pending = []

    def quiesce(self) -> None:
        """Wait for what is in flight (starting nothing new)."""
        for p in self._pending:
            p.wait()
        self._pending = []

    def _start(self, b: Bucket) -> None:
        self._next += 1
        if b.hi <= b.lo:
            return
        if self.part is None:
            self._pending.append(self.comm.iallreduce(self.flat[b.lo : b.hi]))
            return
        length = self.part.length  # sharded: each partition's piece of the bucket to its owner
        for owner in range(b.lo // length, (b.hi - 1) // length + 1):
            lo, hi = max(b.lo, owner * length), min(b.hi, (owner + 1) * length)
            self._pending.append(self.comm.ireduce(self.flat[lo:hi], owner))
