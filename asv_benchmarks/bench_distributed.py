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
