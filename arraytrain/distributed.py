"""Processes: the communicators over MPI (NumPy buffers), NCCL (CuPy buffers) and torch.distributed.

The public face of :mod:`arraytrain.parallel`, where they are defined. :class:`TorchComm`
(:mod:`arraytrain.parallel.torch_dist`) is the communicator over an initialised
torch.distributed process group, for jobs started by ``torchrun``.

:class:`MPIComm` implements :class:`~arraytrain.parallel.communicator.Communicator` with
mpi4py's buffer collectives on NumPy arrays; :class:`NCCLComm` implements it
with NCCL (through ``cupy.cuda.nccl``) on CuPy arrays, one process per GPU
(and MPI for the NumPy arrays it is given).
Both are imported lazily: ``import arraytrain`` never imports mpi4py or CuPy,
and without them the constructors raise
:class:`~arraytrain.errors.BackendUnavailableError` naming the extra to
install (``pip install "arraytrain[mpi]"``: mpi4py and MPICH from PyPI).

Run one process per rank under ``mpiexec``::

    mpiexec -n 4 python train.py          # COMM_WORLD: 4 ranks

The collectives
---------------
``allreduce`` works **in place** (``MPI_IN_PLACE``): the flat gradient buffer
is the fusion buffer and goes on the wire as it lies, one call per step, no
copy on the host. ``allgather`` receives every rank's array into one new
buffer and returns one view of it per rank. Buffers must be C-contiguous
arrays of float32, float64 or a fixed-width integer type (NCCL: no 16-bit
integers, float16 too); buffers written into must be writeable. Bad input is
refused with a typed error naming the argument **before** any collective is
entered, so this process's call changes nothing — but its peers are then
waiting in that collective: run the step path under :func:`abort_on_error` so
that the error ends every rank instead of leaving them blocked.

Every rank must pass arrays of the same shape and dtype, in the same order of
calls; that is not checked on each call (it would cost a collective per
collective). Set-up checks use :meth:`~arraytrain.parallel.communicator.Communicator.agree`,
which raises the same typed error on every rank.

CuPy arrays and MPI
-------------------
:class:`MPIComm` refuses CuPy arrays (:class:`~arraytrain.errors.BackendError`
pointing to :class:`NCCLComm`) rather than staging them through the host. The
MPICH wheel from PyPI is not CUDA-aware, so handing it a device pointer would
crash; a silent device-to-host copy and back would break arraytrain's rule
that nothing moves between host and device behind the caller's back, and
would cost two PCIe transfers a step that NCCL does not pay.

Failure
-------
An exception on one rank inside the step path leaves the others blocked in
the next collective; at exit, ``MPI_Finalize`` then waits for them too, so the
job hangs. :func:`abort_on_error` (a context manager and decorator) prints the
traceback with the rank and calls ``MPI_Abort`` on ``COMM_WORLD``, which ends
every rank, and ``mpiexec`` exits non-zero — what ``python -m mpi4py
script.py`` does for a whole script.

A peer that dies without a word (its machine lost, its link down) leaves no
error to catch: the others would wait in their collective until TCP gives up.
Every wait of :class:`MPIComm` and :class:`TorchComm` is held to a deadline
(:mod:`arraytrain.parallel.deadline`; ``timeout=``, ``ARRAYTRAIN_COMM_TIMEOUT``,
60 s by default once the job is steady): past it the rank writes one line,
``arraytrain: CommTimeoutError: rank R of N: ...``, and ends with status 124.

:func:`launch` starts ``K`` ranks under ``mpiexec`` from Python with a time
limit (the tests and ``python -m arraytrain.bench distributed`` use it): a
distributed bug is a hang until proven otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from ._checks import check_int
from .errors import BackendUnavailableError
from .parallel.communicator import Communicator, LocalComm, Pending, PerRank
from .parallel.mpi import INSTALL_HINT, MPIComm, MPIRequest, NCCLComm, mpi
from .parallel.torch_dist import TorchComm  # torch.distributed as a transport (torch imported on construction only)

__all__ = ["Communicator", "LocalComm", "MPIComm", "MPIRequest", "NCCLComm", "Pending", "PerRank",
           "TorchComm", "abort_on_error", "find_mpiexec", "launch", "mpi"]


@contextlib.contextmanager
def abort_on_error(stream=None):
    """On an exception in the block, end every rank of the job (``MPI_Abort``) instead of hanging.

    The traceback is printed to ``stream`` (stderr) with this rank's number,
    then ``COMM_WORLD.Abort(1)`` ends every process and ``mpiexec`` exits
    non-zero. ``SystemExit(0)`` passes through. Outside a multi-process job —
    mpi4py not imported, MPI finalized, or one process — the exception
    propagates as usual. Also a decorator::

        with abort_on_error():
            for batch in batches:
                engine.step(grads(batch))
    """
    try:
        yield
    except SystemExit as exc:
        if exc.code in (None, 0):
            raise
        _abort_if_distributed(exc, stream)
        raise
    except BaseException as exc:
        _abort_if_distributed(exc, stream)
        raise


_ABORT_GRACE = 0.2  # seconds between a failed rank's last line and its MPI_Abort


def _abort_if_distributed(exc: BaseException, stream) -> None:
    MPI = sys.modules.get("mpi4py.MPI")  # never initialise MPI only to abort it
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        return
    stream = sys.stderr if stream is None else stream
    rank, size = world.Get_rank(), world.Get_size()
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        sys.stdout.flush()
        stream.write(f"arraytrain: rank {rank} of {size} failed; aborting all {size} ranks (MPI_Abort)\n{text}")
        stream.flush()
        # the launcher forwards a rank's output and handles its abort on separate channels: once in a
        # CI run of 2 ranks it ended the job before forwarding the line just written, so give it a moment
        time.sleep(_ABORT_GRACE)
    finally:
        world.Abort(1)
        os._exit(1)  # MPICH's Abort may return once the launcher has been told: never run on


def find_mpiexec() -> str | None:
    """The ``mpiexec`` beside this interpreter (the ``mpich`` wheel's, in a virtualenv), else on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("mpiexec")


def launch(ranks: int, argv, *, timeout: float, env=None) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n ranks argv...`` to completion within ``timeout`` seconds; output captured as text.

    The job gets ``MPIEXEC_TIMEOUT`` (Hydra ends its own job at that limit)
    and, should that fail, ``mpiexec`` is sent SIGTERM, on which it ends every
    rank, and then SIGKILL; :class:`subprocess.TimeoutExpired` is raised either
    way, with the output so far. ``env``: variables added to this process's.
    A job that fails on its own returns its non-zero exit status; one that
    runs to the limit raises, whatever the status Hydra gives it.
    """
    ranks = check_int("ranks", ranks, 1)
    exe = find_mpiexec()
    if exe is None:
        raise BackendUnavailableError(f"no mpiexec beside {sys.executable} or on PATH: {INSTALL_HINT}")
    full = dict(os.environ, MPIEXEC_TIMEOUT=str(max(1, int(timeout))), **(env or {}))
    cmd = [exe, "-n", str(ranks), *map(str, argv)]
    start = time.monotonic()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout + 10)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # Hydra forwards it and cleans up every rank
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    if time.monotonic() - start >= timeout:  # Hydra's own limit ended it (with status 255 or, at times, 0)
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
