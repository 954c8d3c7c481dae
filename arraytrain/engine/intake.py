"""Validation and copy-in of ``{name: grad}`` mappings, shared by Engine and GradientAccumulator.

Everything is checked before anything is written, so a refused call changes
nothing. Gradients of another floating precision are accepted and cast:
float32/float64 inside the kernel, float16 (which numba cannot read) by a
copy made during validation. Non-contiguous gradients are accepted and read
through a contiguous copy. NumPy subclasses are read as plain arrays and
masked arrays refused (see :func:`arraytrain.backend.as_array`).

:func:`ready_to_assign` prepares arrays that a state load will copy into
buffers, so that the copy itself cannot fail or depend on its order.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import numpy as np

from ..backend import KERNEL_DTYPES, NUMPY, array_module, as_array, backend_of
from ..buffer import FlatBuffer, GradsAt, segment_addresses
from .._checks import check_positive
from ..errors import (AliasingError, ArgumentTypeError, ConcurrentUseError, HyperparameterError, MissingGradientError,
                     ShapeMismatchError, UnknownParameterError)
from .guard import guarded

# Gradients of fewer elements than this go through the staging array and the one scatter call
# of the fast path; larger ones are written directly, one accumulate call each: a call costs
# about a microsecond, the extra staging copy of 4096 float32 elements (32 KiB read and written
# in cache) about as much, so above this size the direct call is the cheaper one.
STAGE_BELOW = 4096
# The small gradients are staged in groups of about this many elements (128 KiB of float32): the
# staging array is written and read back while it, the group's gradients and the part of the buffer
# it is added into are all in the L2 cache. Measured on a core with 1 MiB of L2 (a micro-batch of 1e6
# float32 elements in 500 / 2000 gradients, best of 7 rounds, 4 alternations): 470 / 910 us a call
# in groups of 32K elements, 625 / 1050 in groups of 64K (the three arrays, 768 KiB, no longer fit),
# 510-570 / 970-1050 in groups of 16K (twice the kernel calls).
STAGE_GROUP = 1 << 15
_FLOAT_DTYPES = tuple(np.dtype(t) for t in (np.float16, np.float32, np.float64))


def _alias_error(name) -> AliasingError:
    return AliasingError(
        f"{name!r}: the gradient shares memory with an engine buffer; to hand gradients "
        "over in place write them into engine.grads and call step() with no argument"
    )


def check_grads(grads: Mapping, buf: FlatBuffer, protect: tuple = ()) -> dict:
    """Return ``{name: 1-D array}`` for a validated gradient mapping.

    ``protect`` lists flat arrays the gradients must not share memory with
    (the parameter buffer, the gradient buffer itself).
    """
    if not isinstance(grads, Mapping):
        raise ArgumentTypeError(f"grads must be a mapping name -> array, got {type(grads).__name__}")
    backend = backend_of(buf.flat)
    xp = array_module(buf.flat)
    out = {}
    for name, g in grads.items():
        if name not in buf:
            raise UnknownParameterError(f"{name!r}: gradient for an unknown parameter; known: {list(buf.names)}")
        arr = as_array(g, name, backend)
        expected = buf.layout.shape(name)
        if tuple(arr.shape) != expected:
            raise ShapeMismatchError(name, expected, arr.shape)
        for flat in protect:
            if arr.size and xp.may_share_memory(arr, flat):
                raise _alias_error(name)
        if arr.dtype not in KERNEL_DTYPES:  # e.g. float16: cast here, before anything is written
            arr = arr.astype(buf.dtype)
        out[name] = xp.ascontiguousarray(arr).reshape(-1)  # the CUDA kernels read dense memory
    return out


def ready_to_assign(buf: FlatBuffer, checked: dict, protect: tuple = ()) -> dict:
    """Arrays validated by ``buf.check`` made safe to copy in any order, without failing.

    Each array gets ``buf``'s dtype here (a cast to a narrower float cannot then
    raise under ``np.errstate(over="raise")`` half-way through a load), and one
    that shares memory with a buffer in ``protect`` (those the load writes) is
    copied unless it is exactly the view it will be written to: otherwise
    writing one buffer could change a source read later.
    """
    out = {}
    for name, arr in checked.items():
        if arr.dtype != buf.dtype:
            with np.errstate(all="ignore"):
                arr = arr.astype(buf.dtype)
        elif isinstance(arr, np.ndarray) and arr.size and any(np.may_share_memory(arr, f) for f in protect):
            dest = buf[name]
            same = (arr.__array_interface__["data"][0] == dest.__array_interface__["data"][0]
                    and arr.strides == dest.strides and arr.shape == dest.shape)
            if not same:
                arr = arr.copy()
        out[name] = arr
    return out


def write_grads(kernels, buf: FlatBuffer, grads: dict, weight: float, overwrite: bool) -> None:
    """``buf[name] (=|+=) weight * grad`` for each validated gradient."""
    layout = buf.layout
    for name, g in grads.items():
        if g.size:
            kernels.accumulate(buf.flat[layout.slice(name)], g, w=weight, overwrite=overwrite)


# -- the engine's dict path: a validated structure, reused -------------------------------------
@functools.lru_cache(maxsize=8)
def _normal_range(dtype) -> tuple[float, float]:
    """The smallest normal and the largest finite number of ``dtype`` (``np.finfo`` costs microseconds a call)."""
    info = np.finfo(dtype)
    return float(info.tiny), float(info.max)


def check_weight(weight, dtype, mean: bool, weight_sum: float, loss_scale: float) -> float:
    """A micro-batch's ``weight`` (None: 1.0) as :meth:`arraytrain.Engine.step` takes it, or its error: a
    normal number of the buffer's ``dtype``, and with the ``mean`` reduction a window's weight sum times
    the loss scale whose inverse (the mean's factor) is normal too."""
    w = 1.0 if weight is None else check_positive("weight", weight)
    tiny, big = _normal_range(dtype)
    if not tiny <= w <= big:
        raise HyperparameterError(f"weight: expected a normal {dtype} number in [{tiny!r}, {big!r}] "
                                  f"(the kernels multiply by it in {dtype}), got {w!r}")
    if mean:
        wsum = weight_sum + w
        scaled = wsum * loss_scale
        if not 1.0 / big <= scaled <= 1.0 / tiny:
            raise HyperparameterError(
                f"weight: the window's weight sum {wsum!r} times the loss scale "
                f"{loss_scale!r} is {scaled!r}, outside [{1.0 / big!r}, {1.0 / tiny!r}], so its "
                f"inverse (the mean's factor) is not a normal {dtype} number"
            )
    return w


class _Plan:
    """What validating one structure of ``{name: ndarray}`` established, for reuse.

    Valid while a micro-batch has the same names in the same order, each a plain
    ``np.ndarray`` of the same shape, all of one dtype (``dtype``, the very
    ``np.dtype`` object, so the check is an identity test). ``groups`` hold the
    small gradients: ``(positions, table, staging)`` with ``table`` rows ``[src_start,
    dst_start, size]`` into ``staging``, the group's part of the staging array; ``direct`` lists ``(position,
    slice, view)`` of the large ones.
    """

    __slots__ = ("names", "shapes", "dtype", "absent", "groups", "staging", "direct", "check_all", "_in_place")

    def __init__(self, names, shapes, dtype, buf: FlatBuffer):
        layout = buf.layout
        self.names, self.shapes, self.dtype = names, shapes, dtype
        present = set(names)
        self.absent = [n for n in layout.names if n not in present]
        groups, direct = [], []
        positions, rows, pos = [], [], 0
        for i, name in enumerate(names):
            j = layout.index(name)
            size = layout.sizes[j]
            if size >= STAGE_BELOW:
                direct.append((i, layout.slice(name), buf[name]))
                continue
            positions.append(i)  # zero-size ones too: they stage nothing
            rows.append((pos, layout.offsets[j], size))
            pos += size
            if pos >= STAGE_GROUP:
                groups.append((positions, rows, pos))
                positions, rows, pos = [], [], 0
        if positions:
            groups.append((positions, rows, pos))
        # one staging array, reused by every group so that it stays in cache; float16 (which the
        # kernels cannot read) is cast while it is staged
        self.staging = np.empty(max((n for _, _, n in groups), default=0),
                                dtype if dtype in KERNEL_DTYPES else buf.dtype)
        self.groups = [(p if len(p) < len(names) else None, np.asarray(r, np.int64).reshape(-1, 3),
                        self.staging[:n]) for p, r, n in groups]
        self.direct = direct
        self.check_all = False  # every array's aliasing checked, owning ones too (see Intake._learn)
        self._in_place = None  # what reading in place needs, made on first use (see in_place)

    def in_place(self, buf: FlatBuffer):
        """``(where, bases)`` for reading a micro-batch where it lies: the segment of each position (int64),
        and every parameter's gradient address in the buffer (read-only), which a step copies and
        overwrites with its gradients' own addresses (the buffer's stay for the absent ones)."""
        if self._in_place is None:
            layout = buf.layout
            where = np.array([layout.index(n) for n in self.names], np.int64)
            self._in_place = (where, segment_addresses(buf))
        return self._in_place


class Checked:
    """A validated micro-batch: what :meth:`Intake.write` writes. Holds nothing of the engine's."""

    __slots__ = ("absent", "contiguous", "items", "plan", "values")

    def __init__(self, absent, items=None, plan=None, values=None, contiguous=False):
        self.absent, self.items, self.plan, self.values = absent, items, plan, values
        self.contiguous = contiguous  # (a plan's values: every array C-contiguous)


class Intake:
    """Validation and copy-in of ``{name: grad}`` for one gradient buffer (the engine's dict path).

    The first micro-batch of a structure goes through :func:`check_grads`; when
    it is a plain ``dict`` of plain NumPy arrays of one float dtype, what that
    established (names, order, shapes, dtype, where each gradient goes) is kept
    as a plan. Later micro-batches with the same structure are checked against
    the plan with a few attribute reads per gradient, and written with one
    ``np.concatenate`` into a staging array plus one scatter kernel call per
    :data:`STAGE_GROUP` elements of gradients under :data:`STAGE_BELOW`
    elements (one accumulate call each for larger ones), or, for a step that reads them where they
    lie, not written at all (:meth:`place`). Anything else (another structure, another array type, a
    mapping that is not a dict, CuPy buffers) takes the general path, which
    then builds a plan for the new structure. Either way everything is
    checked before anything is written.

    Aliasing on the fast path: an array that owns its memory
    (``flags.owndata``) cannot lie inside the engine's buffers, which other
    arrays own, unless it is one of those owners (a structure with an owner's
    shape checks every array); any other array gets the full
    ``np.may_share_memory`` test.
    """

    def __init__(self, buf: FlatBuffer, protect: tuple, kernels, impl: str = "numba"):
        self.buf, self.protect, self.kernels = buf, protect, kernels
        self.fast = backend_of(buf.flat) == NUMPY  # the plan is for NumPy buffers only
        self.in_place = True  # False: every micro-batch is written into the buffer (benchmarks compare)
        self._plan: _Plan | None = None
        self._scatter = kernels.accumulate_packed
        self._numpy_ok = impl != "reference"  # the reference kernels compute in float64: keep them
        # arrays that own the memory of the protected buffers: a gradient that owns its
        # memory aliases a buffer only if it is one of these (checked when a plan is built)
        self._owners = []
        for flat in protect:
            a = flat
            while isinstance(a, np.ndarray):
                self._owners.append(a)
                a = a.base

    def check(self, grads) -> Checked:
        """Validate a micro-batch (typed errors; nothing written)."""
        if self.fast and type(grads) is dict:
            found = self._match(grads)
            if found is not None:
                return Checked(self._plan.absent, plan=self._plan, values=found[0], contiguous=found[1])
        items = check_grads(grads, self.buf, protect=self.protect)
        if self.fast and type(grads) is dict:
            self._learn(grads)
            # the plan serves this micro-batch already: the first step of a structure then runs the
            # kernels every later one runs (it reads the gradients where they lie), one signature
            # to compile, not two
            found = self._match(grads) if self._plan is not None else None
            if found is not None:
                return Checked(self._plan.absent, plan=self._plan, values=found[0], contiguous=found[1])
        present = items.keys()
        return Checked([n for n in self.buf.layout.names if n not in present], items=items)

    def _match(self, grads: dict):
        """``(values, contiguous)``: the dict's values if it has the plan's structure, and whether all
        are C-contiguous; else None (checks aliasing too)."""
        plan = self._plan
        if plan is None or len(grads) != len(plan.names) or tuple(grads) != plan.names:
            return None
        values = list(grads.values())
        dtype, ndarray, check_all = plan.dtype, np.ndarray, plan.check_all
        contiguous = True
        for a, shape in zip(values, plan.shapes):
            if type(a) is not ndarray or a.dtype is not dtype or a.shape != shape:
                return None
            flags = a.flags
            if check_all or not flags.owndata:
                self._check_alias(a, grads)
            if not flags.c_contiguous:
                contiguous = False
        return values, contiguous

    def _check_alias(self, a, grads) -> None:
        if a.size and any(np.may_share_memory(a, flat) for flat in self.protect):
            raise _alias_error(next(n for n, v in grads.items() if v is a))

    def _learn(self, grads: dict) -> None:
        """Keep a plan for this (validated) structure, if the fast path can serve it."""
        self._plan = None
        values = list(grads.values())
        if not values or any(type(a) is not np.ndarray for a in values):
            return
        dtype = values[0].dtype
        if dtype not in _FLOAT_DTYPES or any(a.dtype is not dtype for a in values):
            return
        shapes = tuple(a.shape for a in values)
        self._plan = _Plan(tuple(grads), shapes, dtype, self.buf)
        # an owning array could alias a buffer only by being its owner, which needs the owner's shape
        # (an engine of one parameter whose flat buffer has its shape): then every array is checked
        self._plan.check_all = any(s == o.shape for s in shapes for o in self._owners)

    def place(self, checked: Checked):
        """Where a validated micro-batch's gradients lie, for a step that reads them there
        (:class:`~arraytrain.buffer.GradsAt`): the address of every parameter's gradient (int64, by
        segment; the buffer's for a parameter the micro-batch leaves out), or None where the
        micro-batch must be written into the buffer instead (the general path, another dtype, a
        gradient that is not C-contiguous). Every gradient is read in the caller's array, which must
        not change until the step returns; the addresses come from one compiled call
        (:func:`arraytrain._addresses.data_addresses`), nothing is copied."""
        plan = checked.plan
        if plan is None or plan.dtype is not self.buf.flat.dtype or not self.in_place or not checked.contiguous:
            return None
        from .._addresses import data_addresses  # (numba, which a NumPy engine has loaded already)

        where, bases = plan.in_place(self.buf)
        bases = bases.copy()
        data_addresses(checked.values, where, bases)
        return bases

    def write(self, checked: Checked, weight: float, overwrite: bool) -> None:
        """``buf[name] (=|+=) weight * grad`` for a validated micro-batch (cannot fail)."""
        if checked.plan is None:
            write_grads(self.kernels, self.buf, checked.items, weight, overwrite)
            return
        plan, values, flat = checked.plan, checked.values, self.buf.flat
        for positions, table, staging in plan.groups:
            staged = values if positions is None else [values[i] for i in positions]
            np.concatenate(staged, axis=None, out=staging, casting="same_kind")
            self._scatter(flat, staging, table, w=weight, overwrite=overwrite)
        plain = weight == 1.0 and plan.dtype is flat.dtype and self._numpy_ok
        for i, where, view in plan.direct:
            g = values[i]
            if plain:
                # w = 1: the kernel's w * g is g exactly, so a NumPy copy or add gives its bits, and
                # a ufunc call costs about half a numba dispatch
                if overwrite:
                    np.copyto(view, g)
                else:
                    np.add(view, g, out=view)
                continue
            if g.dtype not in KERNEL_DTYPES:
                g = g.astype(flat.dtype)
            self.kernels.accumulate(flat[where], g.reshape(-1), w=weight, overwrite=overwrite)


class IntakeStage:
    """The :class:`~arraytrain.Engine`'s intake checks and its gradient buffer (a base class of the Engine):
    a micro-batch's weight and parameters without a gradient checked before any write (the ``missing``
    policy), gradients read where they lie, and the calls that act on the gradient buffer alone
    (``zero_grad``, ``mark_ready``). The intake stage itself is the Engine's."""

    @property
    def intake(self):
        """The dict path's validator: ``engine.intake.fast = False`` validates every micro-batch
        from scratch instead of reusing the last one's structure, ``engine.intake.in_place = False``
        copies every micro-batch into ``engine.grads`` instead of reading it where it lies
        (benchmarks compare them)."""
        return self._intake

    def check_weight(self, weight) -> float:
        """``weight`` (None: 1.0) as :meth:`step` takes it, or the error step() would raise.

        For a binding that writes a micro-batch into ``engine.grads`` itself and then
        calls ``step()`` with no gradients: it checks the weight before it writes.
        """
        return check_weight(weight, self.params.dtype, self.reduction == "mean", self.counters.weight_sum,
                            self.loss_scale)

    def check_absent(self, absent) -> tuple:
        """``absent`` (None, a name, or an iterable of names) as :meth:`step` takes it, as a tuple, or the
        error step() would raise: an unknown name, or any name under ``missing="error"``. For a
        binding that finds parameters without a gradient and checks them before it writes."""
        if absent is None:
            return ()
        if isinstance(absent, str):
            absent = (absent,)
        try:
            absent = tuple(absent)
        except TypeError:
            raise ArgumentTypeError(f"absent: expected an iterable of parameter names, got "
                                    f"{type(absent).__name__}") from None
        for name in absent:
            self.layout.index(name)  # UnknownParameterError naming the known ones
        self._missing(absent)
        return absent

    def _missing(self, absent) -> None:
        """The ``missing`` policy on a micro-batch's parameters without a gradient (before any write)."""
        if absent and self.missing == "error":
            raise MissingGradientError(
                f"no gradient for {list(absent)} (policy missing='error'; use missing='zero' to count them as "
                "zero, or missing='skip' to leave them untouched, as torch.optim does)")

    def read_in_place(self, bases) -> None:
        """This micro-batch's gradients lie at ``bases`` (int64, by segment: the address of each
        parameter's gradient, contiguous, of the buffer's dtype; a parameter whose gradient is in
        ``engine.grads`` gives that address), not in ``engine.grads``: the step reads them there.

        For a binding that holds the gradients elsewhere (the torch drop-ins' fresh ``.grad``
        tensors): start from a copy of :attr:`grad_addresses`. The dict path does it by itself.
        Only where :attr:`reads_in_place`; the addresses themselves cannot be checked, so the memory
        must be what they say and stay valid and unchanged until the boundary's :meth:`step` returns."""
        if not self._in_place_ok:
            raise ArgumentTypeError("read_in_place: this engine reads its gradient buffer (reads_in_place is False)")
        if not isinstance(bases, np.ndarray) or bases.dtype != np.int64 or bases.shape != (len(self.layout),):
            raise ArgumentTypeError(f"bases: expected an int64 array of {len(self.layout)} addresses (one per "
                                    f"parameter), got {getattr(bases, 'dtype', type(bases).__name__)}"
                                    f"{getattr(bases, 'shape', '')}")
        self._grads_at = GradsAt(self.grads, bases, self._grad_offsets)

    @property
    def grad_addresses(self) -> np.ndarray | None:
        """Where each parameter's gradient lies in ``engine.grads`` (int64 by segment, read-only): what
        a binding copies and overwrites for :meth:`read_in_place`; None where the engine does not
        read in place."""
        return self._grad_addresses

    @property
    def reads_in_place(self) -> bool:
        """Whether a step may read gradients where they lie (:meth:`read_in_place`): one process, the CPU,
        one micro-batch per window, ``zero_grad_on_step``, an optimizer whose kernels take ``grad_ptrs``,
        no compressor, no SAM."""
        return self._in_place_ok

    @guarded
    def zero_grad(self) -> None:
        """Zero ``engine.grads`` and drop a partly accumulated window.

        With the overlapped exchange, buckets already started in this window are first
        completed with the rest (so that every rank's collectives still match: call it on
        every rank at the same point); before any was started it costs nothing more.
        """
        self._sync.drain()
        self.grads.flat.fill(0)
        self.counters.close_window()
        self.counters.absent = None
        self._grads_at = None

    @guarded
    def mark_ready(self, names) -> None:
        """The gradients of ``names`` (a parameter name or an iterable of names) are final for this window.

        The overlapped exchange (``overlap=True`` with a group of processes) then starts every
        bucket whose gradients are all final, in bucket order (see :mod:`arraytrain.parallel.sync`);
        it polls what is in flight too. It acts during the last micro-batch of a window (before
        its :meth:`step`), when the gradients in ``engine.grads`` are the window's sums; at other
        times, and without the overlapped exchange, it only checks the names (an unknown one
        raises :class:`~arraytrain.errors.UnknownParameterError`). Until :meth:`step`, nothing
        may write a marked gradient.
        """
        self._sync.mark_ready(names, self.counters.micro == self.accumulation_steps - 1)

    def _nothing_in_flight(self, what: str) -> None:
        """Refuse ``what`` while the overlapped exchange works on the gradient buffer."""
        if self._sync.started:
            raise ConcurrentUseError(f"{what}: the gradients marked ready are being exchanged; call it before the "
                                     "window's last micro-batch or after its step()")
