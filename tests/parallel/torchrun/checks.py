"""Checks that run on every rank under torchrun:
``torchrun --standalone --nproc-per-node K tests/parallel/torchrun/checks.py GROUP...``.

``tests/parallel/test_torch_dist.py`` launches this with a timeout; run it by hand to
debug a failure. Each rank joins a gloo process group and builds one
:class:`~arraytrain.parallel.torch_dist.TorchComm`; one launch runs many checks (process start-up and
the imports of torch, numba and JAX are the cost). After each check every rank reports its
outcome in one collective, so the ranks stay in step and rank 0 prints every rank's failures;
the last line is ``all N checks passed on K ranks (C cases)`` and the exit status is 0, or the
failures and status 1.

Groups: ``comm`` (TorchComm's collectives, nonblocking handles, subgroups, bad input; see
``torch_comm_checks.py``), ``engine`` (the engine and the compressors over TorchComm: the MPI
checks of ``../mpi/engine_checks.py`` and ``../mpi/compress_checks.py`` with this exchange),
``shard`` (sharded state against the replicated engine: ``../mpi/shard_checks.py``),
``bindings`` (the torch and JAX bindings and their checkpoints; ``binding_checks.py``),
``nccl`` (alone: CuPy buffers over NCCL, one GPU per rank, the group ``cpu:gloo,cuda:nccl``;
``nccl_checks.py``), ``crash`` (the last rank fails before a collective the others wait in:
torchrun must end the job, non-zero, with the error printed).

``ARRAYTRAIN_RANK_TIMEOUT`` (seconds): a rank still running then prints every thread's
stack and exits (``faulthandler``), so a hang ends with where it hung.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# the MPI checks run over TorchComm too; the loop over the checks is the MPI script's (check_runner.py)
sys.path[:0] = [str(HERE), str(HERE.parent / "mpi"), str(HERE.parent)]

from check_runner import run as run_checks  # noqa: E402

GROUPS = {"comm": ("torch_comm_checks",), "engine": ("engine_checks", "compress_checks"),
          "shard": ("shard_checks",), "bindings": ("binding_checks",), "nccl": ("nccl_checks",)}


def run(comm, groups) -> int:
    # each failure printed at once too: a rank that failed between collectives leaves the others waiting
    return run_checks(comm, [(group, module) for group in groups for module in GROUPS[group]], echo=True)


def crash(comm) -> None:
    """The last rank's bad input raises a typed error before the collective; the others wait in it."""
    x = np.ones(8, np.float32)
    if comm.rank == comm.size - 1:
        comm.allreduce(x[::2])
    else:
        comm.allreduce(x)
    print(f"rank {comm.rank}: unreachable: torchrun should have ended this rank", flush=True)


def main(argv) -> int:
    import torch.distributed as dist

    from arraytrain.parallel.torch_dist import TorchComm

    limit = float(os.environ.get("ARRAYTRAIN_RANK_TIMEOUT", "0"))
    if limit > 0:
        faulthandler.dump_traceback_later(limit, exit=True)
    if argv == ["nccl"]:  # one GPU per rank, selected in torch and in CuPy before the group starts
        import cupy
        import torch

        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        cupy.cuda.Device(local).use()
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    comm = TorchComm()
    if argv == ["crash"]:
        crash(comm)
        return 3
    unknown = [g for g in argv if g not in GROUPS]
    if unknown or not argv or ("nccl" in argv and len(argv) > 1):
        print(f"groups: expected some of {sorted(GROUPS)}, or 'nccl' or 'crash' alone, got {argv}", file=sys.stderr)
        return 2
    try:
        return run(comm, argv)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
