"""The loop of the multi-rank check scripts, ``mpi/checks.py`` (under mpiexec) and ``torchrun/checks.py`` (under
torchrun): each imports this module from the folder above its own, which it puts on ``sys.path``.

A check is a module's ``check_*`` function ``fn(comm) -> number of cases`` (None: one). After each check every
rank reports its outcome in one collective (``comm.gather_objects``), so the ranks stay in step and rank 0
prints every rank's failures; the last line is ``all N checks passed on K ranks (C cases)``.
"""

from __future__ import annotations

import sys
import traceback


def checks_of(module: str) -> list:
    """The module's ``check_*`` functions ``fn(comm) -> number of cases``, in the order they are defined."""
    mod = __import__(module)
    return [fn for name, fn in vars(mod).items() if name.startswith("check_") and callable(fn)]


def run(comm, plan, *, echo: bool = False) -> int:
    """Every check of each ``(group, module)`` of ``plan``, in order, named ``group.<name after check_>``:
    the exit status, 0 when every check passed on every rank, else 1. ``echo``: a rank prints its failure to
    stderr at once too (a rank that failed between collectives leaves the others waiting)."""
    failed, checks, cases = [], 0, 0
    for group, module in plan:
        for fn in checks_of(module):
            name = f"{group}.{fn.__name__[6:]}"
            if comm.rank == 0:
                print(name, flush=True)
            try:
                n, err = int(fn(comm) or 1), None
            except Exception:
                n, err = 0, traceback.format_exc()
                if echo:
                    print(f"rank {comm.rank}: {name} failed:\n{err}", file=sys.stderr, flush=True)
            errs = comm.gather_objects(err)
            checks, cases = checks + 1, cases + n
            failed += [(name, r, e) for r, e in enumerate(errs) if e is not None]
    if comm.rank == 0:
        for name, r, e in failed:
            print(f"FAILED {name} on rank {r}:\n{e}", flush=True)
        if not failed:
            print(f"all {checks} checks passed on {comm.size} ranks ({cases} cases)", flush=True)
    return 1 if failed else 0
