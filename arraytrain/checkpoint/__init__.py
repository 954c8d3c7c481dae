"""Checkpoints on disk: an engine's whole state in one safetensors file, never pickle.

:func:`save` writes ``engine.state_dict()`` and a caller's ``extra`` dict (an
epoch number, a data-loader position); :func:`load` reads and validates the
file against the engine and only then calls ``engine.load_state_dict``. The
state tree is serialised generically: new kinds of state (schedules, loss
scalers, error-feedback residuals, other optimizers' slots) need no change here.

The file format and the tree's encoding: :mod:`arraytrain.checkpoint.format`.

Writing is atomic: each save makes a private work directory ``.<name>.<hex>.tmp``
beside the target and holds an exclusive ``flock`` on it; the file is written
there (safetensors' own temporary file lands there too), re-opened to check that
its header covers the whole file, ``fsync``-ed, renamed over the target with
``os.replace``, the directory ``fsync``-ed and the work directory removed. On any
exception the work directory is removed and an existing checkpoint is left as it
was. A process killed mid-save leaves the old checkpoint and its one work
directory; the next save to the same target removes every such directory whose
lock no live writer holds (and the ``.<name>.<hex>.tmp`` files of older versions)
before it makes its own, so crashed saves never pile up: a kill at any instant,
during that cleanup too, leaves at most one such entry. A new
file's mode follows the umask. Arrays are written straight from the engine's
buffers (safetensors reads them by pointer), without an in-memory copy of the state.
"""

from __future__ import annotations

import inspect
import math
import os
import secrets
import shutil
import stat
from collections.abc import Mapping

try:
    import fcntl
except ImportError:  # not POSIX: no stale-file cleanup (see _clean_stale)
    fcntl = None

import numpy as np

from ..backend import cupy, is_device_array
from ..engine.protocol import checked_everywhere
from ..errors import ArgumentTypeError, CheckpointError, StateDictError
from ..owned import Owned, OwnedRange
from . import format as _format
from .format import (Encoder, check_header_keys, check_optimizer_type,
                     decode_metadata, dumps, fill, guard, match, sniff, summary, tensor_specs)

def __getattr__(name: str):
    """``safetensors`` and its NumPy API (``_st_numpy``) as module attributes, imported on first use."""
    if name in ("safetensors", "_st_numpy"):
        import safetensors.numpy

        return safetensors if name == "safetensors" else safetensors.numpy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FORMAT", "FORMAT_VERSION", "CheckpointError", "load", "save"]

#: The metadata's ``format``: what marks a safetensors file as an arraytrain checkpoint
#: (:data:`arraytrain.checkpoint.format.FORMAT`).
FORMAT = _format.FORMAT
#: The version of the file format this package writes and reads
#: (:data:`arraytrain.checkpoint.format.FORMAT_VERSION`).
FORMAT_VERSION = _format.FORMAT_VERSION


# -- public API -------------------------------------------------------------------------------------
def save(path, engine, *, extra: Mapping | None = None) -> None:
    """Write ``engine``'s state and ``extra`` to ``path`` (a ``.safetensors`` file), atomically.

    ``extra`` is a mapping of JSON-like values (None, bool, int, float incl.
    inf/NaN, str, lists, tuples, str-keyed mappings) that :func:`load` returns.
    Raises :class:`CheckpointError` if the state holds something that cannot be
    stored, :class:`~arraytrain.errors.ArgumentTypeError` for a bad ``path``,
    ``engine`` or ``extra``, and ``OSError`` from the file system; in every case
    an existing file at ``path`` is left unchanged.
    """
    where = _fspath(path)
    _check_engine(engine)
    comm = _comm_of(engine)
    with engine.exclusive("save()"):  # no step may change the buffers while they are written
        if comm is None:
            _save_tree(where, engine.state_dict(copy=False), extra)
            return
        # a group of processes: every rank calls save; the state is gathered to rank 0 (a
        # collective), which writes the one file, and every rank learns whether that worked
        tree = engine.state_dict(copy=False, **_to_root(engine))
        failure = None
        if comm.rank == 0:
            try:
                _save_tree(where, tree, extra)
            except (StateDictError, ArgumentTypeError, OSError) as exc:
                failure = exc
        with comm.patient():  # the others waited here while rank 0 wrote
            outcome = comm.gather_objects(None if failure is None else f"{type(failure).__name__}: {failure}")[0]
        if failure is not None:
            raise failure
        if outcome is not None:
            raise CheckpointError(f"{where}: rank 0 could not write the checkpoint: {outcome}")


def load(path, engine) -> dict:
    """Load the checkpoint at ``path`` into ``engine``; return the ``extra`` dict saved with it.

    Everything is validated before the engine is touched: the file is a
    complete safetensors file, its metadata names this format and version, the
    tree decodes and every tensor it references is present (and none is
    unreferenced); the tree has the structure of ``engine.state_dict()``
    wherever that holds arrays, with every array of the same shape and dtype
    (no silent casts); then ``engine.load_state_dict`` runs its own checks
    before it writes. Subtrees without arrays (hyperparameters, counters) are
    values for the engine to check; it keeps its own hyperparameters. A
    refused file raises :class:`CheckpointError` (a ``StateDictError`` and ``ValueError``) naming the
    file and the first mismatching path, and leaves the engine unchanged. A
    missing or unreadable file raises the ``OSError`` of the file system.
    """
    where = _fspath(path)
    _check_engine(engine)
    with engine.exclusive("load()"):
        # with a group of processes every rank reads the file (a file system they share) and
        # takes its own share; no rank writes unless every rank's checks passed
        def check():
            tree, extra = _read(where, engine.state_template())
            try:
                return engine.check_state(tree), extra
            except StateDictError as exc:
                raise CheckpointError(f"{where}: {exc}") from exc

        checked, extra = checked_everywhere(engine.comm, check)
        engine.apply_state(checked)
    return extra


# -- writing --------------------------------------------------------------------------------------
def _save_tree(where: str, tree, extra: Mapping | None) -> None:
    """Encode ``tree`` and ``extra`` completely, then write the file atomically."""
    state = Encoder(CheckpointError, tensors=True)
    tree_json = dumps(state.encode(tree, ()))
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ArgumentTypeError(f"extra: expected a mapping of JSON-like values or None, got {type(extra).__name__}")
    extra_json = dumps(Encoder(ArgumentTypeError, tensors=False).encode(extra, ("extra",)))
    from .. import __version__

    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "arraytrain_version": __version__,
        "summary": summary(tree, state.tensors),
        "tree": tree_json,
        "extra": extra_json,
    }
    _write_atomic(where, state.tensors, metadata)


def _write_atomic(where: str, tensors: dict, metadata: dict) -> None:
    import safetensors  # imported by the first save or load, not by ``import arraytrain``
    from safetensors import numpy as _st_numpy

    directory, base = os.path.split(os.path.abspath(where))
    # What older crashed saves left goes first, before this save has a work directory of its
    # own: a kill during the cleanup then leaves at most the one entry being removed, never it
    # beside ours.
    _phase_hook("start")
    _clean_stale(directory, base)
    # A private directory holds everything this save writes: our file and safetensors' own
    # temporary file (it writes ".tmpXXXXXX" beside its target, then renames). A crash leaves
    # that one directory; the next save to the same target removes it.
    work, lock = _make_work_dir(directory, base)
    try:
        tmp = os.path.join(work, "checkpoint.safetensors")
        # Created with 0o666, the file gets the umask's mode, as any new file would;
        # safetensors replaces it with a 0o600 file of its own, so the mode is restored.
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        mode = stat.S_IMODE(os.stat(tmp).st_mode)
        _phase_hook("write")
        _st_numpy.save_file(tensors, tmp, metadata=metadata)
        os.chmod(tmp, mode)
        fd = os.open(tmp, os.O_RDWR)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        # the header must cover the whole file: catches a short write before it replaces anything
        try:
            with safetensors.safe_open(tmp, framework="numpy"):
                pass
        except safetensors.SafetensorError as exc:
            raise CheckpointError(f"{where}: the file just written does not read back: {exc}") from None
        _phase_hook("rename")
        os.replace(tmp, where)
        _phase_hook("renamed")
    except BaseException:
        _remove_entry(work, "own")
        raise
    finally:
        if lock is not None:
            os.close(lock)
    _remove_entry(work, "own")  # empty by now
    _fsync_dir(directory)
    _phase_hook("done")


def _phase_hook(phase: str) -> None:
    """Called as a save reaches each phase; does nothing.

    The phases, in order: ``"start"`` (no work directory of its own yet),
    ``"stale-emptied"`` (inside the cleanup: an older save's directory emptied,
    not yet removed), ``"write"``, ``"rename"``, ``"renamed"``, ``"own-emptied"``
    (the own work directory emptied, not yet removed) and ``"done"``. The crash
    tests replace it in a writer process to stop, or report, a save at a known
    instant; nothing else uses it.
    """


def _make_work_dir(directory: str, base: str) -> tuple:
    """Create and lock this save's work directory; return ``(path, lock descriptor)``.

    Between ``mkdir`` and ``flock`` another writer's cleanup can take the new,
    not yet locked directory for a crashed one and remove it; a fresh name is then
    tried (a few times: the other writer's cleanup has moved on by then).
    """
    for attempt in range(8):
        work = os.path.join(directory, f"{_tmp_prefix(base)}{secrets.token_hex(8)}.tmp")
        os.mkdir(work, 0o700)  # fails if the name exists: it is ours
        try:
            return work, _lock(work)
        except OSError:
            if attempt == 7:
                raise
            _remove_entry(work, "own")


def _tmp_prefix(base: str) -> str:
    return f".{base[:200]}."


def _is_tmp_name(entry: str, prefix: str) -> bool:
    """``entry`` is ``<prefix><16 hex digits>.tmp``: a save's work directory (or an older version's file)."""
    tail = entry[len(prefix):]
    return (entry.startswith(prefix) and len(tail) == 20 and tail.endswith(".tmp")
            and all(c in "0123456789abcdef" for c in tail[:16]))


def _lock(path: str):
    """Hold an exclusive ``flock`` on ``path`` for as long as the returned descriptor is open.

    A writer holds it on its work directory while it saves; the kernel drops it
    when the writer dies, which is how :func:`_clean_stale` tells a crashed
    writer's directory from a live one. None where ``flock`` does not exist.
    """
    if fcntl is None:
        return None
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _clean_stale(directory: str, base: str) -> None:
    """Remove what crashed saves to the same target left behind (best effort, never fails the save).

    Candidates are the entries named like a work directory for ``base``
    (``.<name>.<16 hex>.tmp``; a plain file of that name is what versions
    before the work directories left). An entry another live save holds locked
    is left alone; so are symbolic links. Without ``flock`` nothing is removed.
    """
    if fcntl is None:
        return
    prefix = _tmp_prefix(base)
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    for entry in entries:
        path = os.path.join(directory, entry)
        if not _is_tmp_name(entry, prefix):
            continue
        try:
            info = os.lstat(path)
            if not (stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)):
                continue
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live save holds it
            _remove_entry(path, "stale")
        finally:
            os.close(fd)


def _remove_entry(path: str, whose: str) -> None:
    """Remove a work directory (or an older version's temporary file), ignoring errors.

    A directory's contents go first, then the directory itself in one
    ``rmdir``: a kill in between leaves one empty directory, still one entry
    named like a work directory, which the next save removes.
    """
    try:
        if not os.path.isdir(path) or os.path.islink(path):
            os.unlink(path)
            return
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
        _phase_hook(f"{whose}-emptied")
        os.rmdir(path)
    except OSError:
        pass


def _fsync_dir(directory: str) -> None:
    """Make the rename durable (POSIX; other systems cannot open a directory)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(where: str, template) -> tuple:
    """The validated tree (arrays read) and extra of the checkpoint at ``where``."""
    import safetensors

    st = os.stat(where)  # a missing or unreadable file: the OSError says so
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{where}: not a regular file")
    if st.st_size == 0:
        raise CheckpointError(f"{where}: empty file (0 bytes), not a checkpoint")
    try:
        handle = safetensors.safe_open(where, framework="numpy")
    except safetensors.SafetensorError as exc:
        raise CheckpointError(f"{where}: not a valid safetensors file{sniff(where)}: {exc}") from None
    with handle as f:
        check_header_keys(where, st.st_size)
        tree, refs, extra = decode_metadata(where, f.metadata())
        specs = tensor_specs(where, f, refs)
        check_optimizer_type(where, tree, template)
        checks: list = []
        match(where, (), tree, template, specs, checks)
        arrays = {}
        for key, want in checks:
            if isinstance(want, Owned):  # a sharded buffer: only the range this rank owns is read
                arrays[key] = _read_owned(where, f, key, want)
                continue
            arrays[key] = a = guard(where, f.get_tensor, key)
            if a.shape != want.shape or a.dtype != want.dtype:  # agrees with the header, checked above
                raise CheckpointError(f"{where}: tensor {key!r} reads back as {a.dtype}{a.shape}, "
                                      f"expected {want.dtype}{want.shape}")
    # a CUDA engine: loading is the explicit move to the device, after every check passed
    for key, want in checks:
        if is_device_array(want):
            arrays[key] = cupy().asarray(arrays[key])
        elif isinstance(want, Owned) and want.on_device:
            part = arrays[key]
            arrays[key] = OwnedRange(cupy().asarray(part.data), part.start, part.shape)
    return fill(tree, arrays), extra


def _read_owned(where: str, f, key: str, want: Owned) -> OwnedRange:
    """The flat range ``[want.start, want.stop)`` of tensor ``key``, reading whole rows of its first axis
    (the slices safetensors reads) that cover it, not the tensor."""
    start, stop, shape = want.start, want.stop, want.shape
    if start == stop:
        return OwnedRange(np.empty(0, want.dtype), start, shape)
    if len(shape) == 0:
        block, first = guard(where, f.get_tensor, key).reshape(-1), 0
    else:
        row = math.prod(shape[1:])
        r0, r1 = start // row, -(-stop // row)
        block, first = guard(where, lambda: f.get_slice(key)[r0:r1]).reshape(-1), r0 * row
    if block.dtype != want.dtype:
        raise CheckpointError(f"{where}: tensor {key!r} reads back as {block.dtype}, expected {want.dtype}")
    return OwnedRange(block[start - first : stop - first].copy(), start, shape)


def _fspath(path) -> str:
    try:
        where = os.fspath(path)
    except TypeError:
        raise ArgumentTypeError(f"path: expected a str or os.PathLike, got {type(path).__name__}") from None
    if not isinstance(where, str):
        raise ArgumentTypeError(f"path: expected a str path, got {type(where).__name__}")
    return where


def _to_root(engine) -> dict:
    """``{"root": 0}`` where the engine's ``state_dict`` can assemble the state on rank 0 alone (the
    other ranks then hold no more than their own share); ``{}`` for a protocol engine without it."""
    try:
        takes = "root" in inspect.signature(engine.state_dict).parameters
    except (TypeError, ValueError):
        takes = False
    return {"root": 0} if takes else {}


def _comm_of(engine):
    """The engine's group of processes, or None for a single process."""
    comm = getattr(engine, "comm", None)
    return None if comm is None or comm.is_local else comm


#: What :func:`save` and :func:`load` use of what they are handed (an :class:`~arraytrain.Engine`,
#: a bound engine, or a phase controller's checkpoint): the engine's public state protocol.
PROTOCOL = ("state_dict", "state_template", "check_state", "apply_state", "exclusive")


def _check_engine(engine) -> None:
    if not all(callable(getattr(engine, name, None)) for name in PROTOCOL) or not hasattr(engine, "comm"):
        raise ArgumentTypeError(f"engine: expected an arraytrain.Engine, got {type(engine).__name__}")
