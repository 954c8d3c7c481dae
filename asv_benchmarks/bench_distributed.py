"""MPIComm's all-reduce beside mpi4py's own, in one process (a group of one).

What arraytrain adds to a collective is its validation and dispatch: in one
process MPI's in-place all-reduce does no work on the data, so the time is that
overhead and ``track_fraction_of_mpi4py`` (mpi4py's time over MPIComm's, the
same bytes) shows what a call costs beyond MPI's own. The multi-process figures
(2 and 4 processes) come from ``python -m arraytrain.bench distributed``, which
launches mpiexec. Skipped without mpi4py (``pip install "arraytrain[mpi]"``);
mpi4py is imported in ``setup``, inside the benchmark's own process.
"""

from __future__ import annotations

import numpy as np

from .common import QUICK, best_seconds

SIZES_A = [1, 1_000, 1_000_000] if not QUICK else [1, 1_000]


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError:
        raise NotImplementedError("mpi4py is not installed") from None
    return MPI


class MPICommAllreduce:
    """``MPIComm().allreduce(x)`` (float32, in place) and ``COMM_WORLD.Allreduce(IN_PLACE, x)``."""

    params = [["MPIComm", "mpi4py"], SIZES_A]
    param_names = ["impl", "size"]

    def setup(self, impl, n):
        MPI = _mpi()
        from arraytrain.distributed import MPIComm

        self.x = np.zeros(n, np.float32)
        comm = MPIComm()
        world = comm.comm
        self.fns = {"MPIComm": lambda: comm.allreduce(self.x),
                    "mpi4py": lambda: world.Allreduce(MPI.IN_PLACE, self.x, op=MPI.SUM)}
        self.fn = self.fns[impl]
        for fn in self.fns.values():
            fn()

    def time_allreduce(self, impl, n):
        self.fn()

    def track_fraction_of_mpi4py(self, impl, n):
        reps = 2000 if n < 100_000 else 50

        def run(fn):
            def many():
                for _ in range(reps):
                    fn()
            return best_seconds(many, 5)

        return run(self.fns["mpi4py"]) / run(self.fn)

    track_fraction_of_mpi4py.unit = "fraction"


def _communicator():
    """``(the communicator base class, the completed handle)`` of the arraytrain being measured
    (``arraytrain.exchange`` before the parallel package)."""
    try:
        from arraytrain.parallel.communicator import DONE, Communicator
    except ImportError:
        from arraytrain.exchange import DONE, Exchange as Communicator
    return Communicator, DONE


class _Mirror:
    """A group of 2 in one process whose collectives move nothing: every "peer" holds what this
    rank holds. What remains of a step over it is one rank's own work (the benchmark below)."""

    rank, size, is_local = 0, 2, False

    def allreduce(self, x, op="sum"):
        pass

    def broadcast(self, x, root=0):
        pass

    def gather_objects(self, obj):
        return [obj, obj]

    def allgather(self, x):
        return [x, x]

    def agree(self, what, value, error=None):
        pass

    def reduce_scatter(self, x):
        return x[: x.shape[0] // 2]

    def allgather_blocks(self, x):
        pass

    def iallreduce(self, x, op="sum"):
        return _communicator()[1]


class ShardedStepLocalWork:
    """One rank's own work in a clipped AdamW step of a group of 2, replicated or with sharded state
    (``Engine(shard_state=True)``: the update of half the buffer, plus clearing the gradient
    buffer), float32 or 8-bit state, over a transport that moves nothing. The exchange's own cost
    is ``python -m arraytrain.bench distributed --parts sharding``'s (it launches mpiexec)."""

    params = [["replicated", "sharded"], ["float32", "8bit"], [100_000, 1_000_000] if not QUICK else [100_000]]
    param_names = ["state", "state_dtype", "size"]

    def setup(self, state, state_dtype, n):
        import arraytrain as at
        comm = type("Mirror", (_Mirror, _communicator()[0]), {})()
        opt = at.optim.AdamW(lr=1e-3, state_dtype=None if state_dtype == "float32" else state_dtype)
        self.engine = at.Engine({"w": np.zeros(n, np.float32)}, opt, comm=comm, max_grad_norm=1.0,
                                shard_state=state == "sharded")
        self.g = np.random.default_rng(0).standard_normal(n).astype(np.float32)
        self.time_step(state, state_dtype, n)

    def time_step(self, state, state_dtype, n):
        self.engine.grads["w"][...] = self.g
        self.engine.step()


class OverlapMarkReady:
    """The overlapped exchange's bookkeeping: ``engine.mark_ready`` once per parameter (100 of them,
    last first, as a backward pass marks), each bucket started as it completes, over a transport
    whose nonblocking all-reduce completes at once."""

    def setup(self):
        import arraytrain as at
        comm = type("Mirror", (_Mirror, _communicator()[0]), {})()
        self.engine = at.Engine({f"p{i}": np.zeros(1000, np.float32) for i in range(100)}, at.optim.SGD(lr=1e-3),
                                comm=comm, overlap=True, bucket_bytes=40_000)
        self.names = list(self.engine.layout.names)[::-1]

    def time_mark_100_parameters(self):
        for name in self.names:
            self.engine.mark_ready(name)
        self.engine.zero_grad()  # completes and drops the window's exchange
