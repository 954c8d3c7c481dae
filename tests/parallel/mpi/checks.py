"""Checks that run on every rank under mpiexec: ``mpiexec -n K python tests/parallel/mpi/checks.py GROUP...``.

``tests/parallel/test_mpi.py`` launches this with a timeout; run it by hand to
debug a failure. One launch runs many checks (process start-up and numba's
import are the cost). After each check every rank reports its outcome in one
collective, so the ranks stay in step and rank 0 prints every rank's failures;
the last line is ``all N checks passed on K ranks (C cases)`` and the exit
status is 0, or the failures and status 1.

Groups: ``comm`` (the collectives, set-up agreement, bad input),
``compress`` (every compressor's multi-rank exchange and error feedback),
``engine`` (the engine over MPIComm: data parallel, compressed, a resumed checkpoint, a set-up
that differs on one rank),
``shard`` (sharded optimizer state against the replicated engine, checkpoints across
numbers of ranks, bad set-ups; see ``shard_checks.py``),
``overlap`` (the nonblocking collectives and the exchange overlapped with the backward pass),
``crash`` (the last rank fails inside :func:`abort_on_error` while the others
wait in a collective: the job must end, non-zero, with the error printed),
``stall`` (the last rank stops answering once the job is steady: the others end at their
deadline, :mod:`arraytrain.parallel.deadline`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the checks' modules, and check_runner.py (torchrun's too)

from check_runner import run as run_checks  # noqa: E402

from arraytrain.distributed import MPIComm, abort_on_error  # noqa: E402

GROUPS = {"comm": "comm_checks", "compress": "compress_checks", "engine": "engine_checks", "shard": "shard_checks",
          "overlap": "overlap_checks"}


def run(comm: MPIComm, groups) -> int:
    return run_checks(comm, [(group, GROUPS[group]) for group in groups])


def crash(comm: MPIComm) -> None:
    """The last rank's bad input raises a typed error before the collective; the others wait in it."""
    x = np.ones(8, np.float32)
    with abort_on_error():
        if comm.rank == comm.size - 1:
            comm.allreduce(x[::2])
        else:
            comm.allreduce(x)
    print(f"rank {comm.rank}: unreachable: the job should have been aborted", flush=True)


def crash_in_flight(comm: MPIComm) -> None:
    """The last rank fails while its first buckets' all-reduces are in flight; the others wait at the boundary."""
    import arraytrain as at

    with abort_on_error():
        eng = at.Engine({f"p{i}": np.ones(1000) for i in range(8)}, at.optim.SGD(lr=0.1), comm=comm, overlap=True,
                        bucket_bytes=8000)
        eng.mark_ready([f"p{i}" for i in range(4, 8)])  # buckets 0-3 start
        if comm.rank == comm.size - 1:
            raise RuntimeError("this rank fails with buckets in flight")
        eng.step()
    print(f"rank {comm.rank}: unreachable: the job should have been aborted", flush=True)


def stall(comm: MPIComm) -> None:
    """A peer slow in its first step (as one compiling kernels) is waited for; a peer that stops answering
    once the job is steady (as one behind a downed link) ends the others at the deadline: one line each."""
    import time

    import arraytrain as at

    # overlapped: the boundary waits on the buckets' handles (MPIRequest.wait), the path the blocking
    # collectives' deadline does not cover by itself (the cluster's link-down test covers the blocking one)
    eng = at.Engine({"w": np.ones(1000, np.float32)}, at.optim.SGD(lr=0.1), comm=comm, overlap=True)
    last = comm.rank == comm.size - 1
    for step in range(3):
        if last and step == 0:
            time.sleep(4)  # over the 2 s limit of a steady job, within the start's 20
        eng.step({"w": np.ones(1000, np.float32)})
    print(f"rank {comm.rank}: steady after {eng.state.step} steps", flush=True)
    if last:
        time.sleep(300)
    eng.step({"w": np.ones(1000, np.float32)})
    print(f"rank {comm.rank}: unreachable: the deadline should have ended this rank", flush=True)


def main(argv) -> int:
    if argv == ["stall"]:
        stall(MPIComm(timeout=2))
        return 3
    comm = MPIComm()
    if argv == ["crash"]:
        crash(comm)
        return 3
    if argv == ["crash-in-flight"]:
        crash_in_flight(comm)
        return 3
    unknown = [g for g in argv if g not in GROUPS]
    if unknown or not argv:
        print(f"groups: expected some of {sorted(GROUPS)} or 'crash' alone, got {argv}", file=sys.stderr)
        return 2
    return run(comm, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
