"""A group of ranks as threads of one process: the communicator tested without MPI.

Each collective copies every rank's input into a shared slot, waits at a barrier,
and combines the slots in rank order (so every rank computes the same bits), then
waits again before the slots are reused. A rank that raises breaks the barrier:
the others get ``threading.BrokenBarrierError`` instead of waiting forever.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from arraytrain.parallel.communicator import OPS, Communicator


class VirtualClock:
    """Seconds that pass only when told to (``advance``): read by calling it, as ``time.perf_counter``."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ThreadGroup:
    """``rate``: a simulated link, in bytes per second per rank (None: none); each collective then
    takes as long as its ring's bytes take at that rate (changeable mid-run: ``group.rate = ...``):
    it sleeps, or with ``virtual=True`` advances its rank's clock in ``group.clocks`` (no sleep, and
    times that do not depend on how busy the machine is)."""

    def __init__(self, size: int, timeout: float = 60.0, rate: float | None = None, virtual: bool = False):
        self.size = size
        self.rate = rate
        self.clocks = [VirtualClock() for _ in range(size)] if virtual else None
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list = [None] * size
        self.calls = [[] for _ in range(size)]  # (operation, shape, dtype) per rank, in order

    def comms(self) -> list["ThreadExchange"]:
        return [ThreadExchange(self, r) for r in range(self.size)]

    def run(self, fn, *args):
        """``fn(rank, comm, *args)`` on every rank at once; the results in rank order (the first error re-raised)."""
        out, errors = [None] * self.size, [None] * self.size

        def body(rank, comm):
            try:
                out[rank] = fn(rank, comm, *args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                errors[rank] = exc
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r, c)) for r, c in enumerate(self.comms())]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
        if first is None:
            first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return out


class ThreadExchange(Communicator):
    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.size = group, rank, group.size

    def _everyone(self, what, value) -> list:
        g = self.group
        g.calls[self.rank].append(what)
        g.slots[self.rank] = value
        g.barrier.wait()
        values = list(g.slots)
        g.barrier.wait()
        return values

    def _wire(self, nbytes: float) -> None:
        if self.group.rate:
            if self.group.clocks is not None:
                self.group.clocks[self.rank].advance(nbytes / self.group.rate)
            else:
                time.sleep(nbytes / self.group.rate)

    def allreduce(self, x, op: str = "sum") -> None:
        assert op in OPS
        self._wire(2 * (self.size - 1) / self.size * x.nbytes)
        values = self._everyone(("allreduce", x.shape, x.dtype.str, op), x.copy())
        acc = values[0].copy()
        for v in values[1:]:
            if op == "sum":
                acc += v
            else:
                np.maximum(acc, v, out=acc)
        x[...] = acc

    def allgather(self, x) -> list:
        self._wire((self.size - 1) * x.nbytes)
        return [v for v in self._everyone(("allgather", x.shape, x.dtype.str), x.copy())]

    def broadcast(self, x, root: int = 0) -> None:
        values = self._everyone(("broadcast", x.shape, x.dtype.str, root), x.copy())
        x[...] = values[root]

    def gather_objects(self, obj) -> list:
        return self._everyone(("gather_objects",), obj)

    def reduce_scatter(self, x):
        """MPI's in-place placement: block ``rank``'s sum lands in the first block (not the own one)."""
        n = x.shape[0] // self.size
        own = slice(self.rank * n, (self.rank + 1) * n)
        values = self._everyone(("reduce_scatter", x.shape, x.dtype.str), x.copy())
        acc = values[0][own].copy()
        for v in values[1:]:
            acc += v[own]
        x[:n] = acc
        return x[:n]

    def allgather_blocks(self, x) -> None:
        n = x.shape[0] // self.size
        values = self._everyone(("allgather_blocks", x.shape, x.dtype.str), x.copy())
        for r, v in enumerate(values):
            x[r * n : (r + 1) * n] = v[r * n : (r + 1) * n]
