"""The engine's state protocol: what a state dict holds, how one is checked, and how it is loaded.

It works on data, not on the engine: :class:`StateParts` names the buffers, the
optimizer and its state, the window's :class:`Counters`, the optional parts (schedule,
loss scaler, compressor, mask) and the communicator. The engine builds one per call and
offers the protocol as public methods (``state_dict``, ``state_template``,
``check_state``, ``apply_state``, ``load_state_dict``), which :mod:`arraytrain.checkpoint`,
:mod:`arraytrain.phase` and the bindings use.

Loading has two phases, as for the loss scaler, schedules and compressors: :func:`check_state`
validates every part of a state against the engine and returns the writes that load it
(callables that cannot fail: same-dtype copies and assignments); only then are they run.
A refused state raises :class:`~arraytrain.errors.StateDictError` and changes nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .. import param_steps
from ..optim import state8
from . import intake
from ..parallel import shard
from .._checks import check_count, check_int, check_number, shown
from ..buffer import FlatBuffer
from ..errors import ArgumentTypeError, LayoutError, StateDictError
from .guard import guarded
from ..parallel.communicator import PerRank

#: The version of the state dict's structure (``state["format"]``).
STATE_FORMAT = 3

# (state key, StateParts field, what a message calls it): the optional parts, each with its
# own check_state / apply_state
_PARTS = (("schedule", "schedule", "one"), ("loss_scaler", "loss_scaler", "one"),
          ("compression", "compressor", "a compressor"))


@dataclass
class Counters:
    """The engine's counters that a state dict carries besides the optimizer's step.

    ``micro`` micro-batches and their ``weight_sum`` in the open accumulation window,
    ``consecutive_skips`` boundaries in a row with NaN/Inf gradients, and ``perturbed``
    (SAM: the weights sit at the ascent point between its two windows).
    """

    micro: int = 0
    weight_sum: float = 0.0
    consecutive_skips: int = 0
    perturbed: bool = False
    #: ``missing="skip"``: the open window's parameters without a gradient so far (a bool array by
    #: segment; None: every parameter had one)
    absent: np.ndarray | None = None

    def close_window(self) -> float:
        """End the accumulation window; return its weight sum."""
        wsum = self.weight_sum
        self.micro, self.weight_sum = 0, 0.0
        return wsum


class CheckedState:
    """A state dict validated against one engine: the writes that load it.

    What :meth:`arraytrain.Engine.check_state` returns and only that engine's
    :meth:`~arraytrain.Engine.apply_state` takes. ``writes`` are callables that
    cannot fail (same-dtype copies and assignments); :meth:`extended` adds more
    (a binding's own part) to a new object.
    """

    __slots__ = ("writes", "owner")

    def __init__(self, writes, owner):
        self.writes, self.owner = tuple(writes), owner

    def extended(self, writes) -> CheckedState:
        """These writes followed by ``writes``, for the same engine."""
        return CheckedState(self.writes + tuple(writes), self.owner)


@dataclass(frozen=True)
class StateParts:
    """What the state protocol reads and writes: an engine's data, not the engine itself."""

    params: FlatBuffer
    grads: FlatBuffer
    optimizer: object
    opt_state: object
    counters: Counters
    accumulation_steps: int
    two_windows: bool
    schedule: object
    loss_scaler: object
    compressor: object
    mask: object
    comm: object


def state_dict(parts: StateParts, copy: bool, gather: bool, root: int | None = None) -> dict | None:
    """The state tree (see :meth:`arraytrain.Engine.state_dict`).

    ``gather=True``: with a group of processes, the per-rank parts (the open window, the
    compressor's state) are gathered by rank, a collective. ``gather=False``: this rank's
    own share, the per-rank parts wrapped in :class:`~arraytrain.parallel.communicator.PerRank` (a
    template for a reader that takes a state saved by any number of ranks). ``root``
    (with ``gather``): the gathered parts reach that rank only, and the others return None.
    """
    if root is not None and gather and not parts.comm.is_local:
        return _state_to_root(parts, copy, root)
    acc = _window(parts, copy)
    comp = None if parts.compressor is None else parts.compressor.state_dict()
    if not gather:
        acc = PerRank(acc)
        comp = None if comp is None else PerRank(comp)
    elif not parts.comm.is_local:
        acc = {"ranks": _gather_by_rank(parts.comm, acc)}
        comp = None if comp is None else {"ranks": _gather_by_rank(parts.comm, comp)}
    slots = {k: _arrays(parts, buf, copy, gather) for k, buf in parts.opt_state.slots.items()}
    return _tree(parts, _arrays(parts, parts.params, copy, gather), slots, acc, comp, copy)


def _window(parts: StateParts, copy: bool) -> dict:
    """The open accumulation window: its micro-batches, weight sum, gradient sums, and (only where
    some parameter had no gradient in it yet, ``missing="skip"``) the names of those parameters."""
    c = parts.counters
    acc = {"micro_batches": c.micro, "weight_sum": c.weight_sum, "grads": parts.grads.as_dict(copy=copy)}
    if c.absent is not None:
        acc["absent"] = [n for n, a in zip(parts.params.layout.names, c.absent.tolist()) if a]
    return acc


def _tree(parts: StateParts, params: dict, slots: dict, acc, comp, copy: bool) -> dict:
    """The state tree around its arrays (see :func:`state_dict`)."""
    c, opt = parts.counters, parts.opt_state
    return {
        "format": STATE_FORMAT,
        "params": params,
        "optimizer": {
            "type": type(parts.optimizer).__name__,
            "hyperparameters": parts.optimizer.hyperparameters(),
            "step": opt.step,
            "slots": slots,
            # only where the optimizer keeps any (NAdam): the other states read as before
            **({"scalars": dict(opt.scalars)} if opt.scalars else {}),
            # only where some parameter skipped a step for want of a gradient (missing="skip")
            **({"param_steps": dict(zip(parts.params.layout.names, opt.counts.tolist()))}
               if opt.counts is not None else {}),
            # only where a scalar state came to differ between parameters (NAdam's mu_product after skips)
            **({"param_scalars": {k: dict(zip(parts.params.layout.names, v.tolist()))
                                  for k, v in opt.param_scalars.items()}} if opt.param_scalars else {}),
        },
        "accumulation": acc,
        "schedule": None if parts.schedule is None else parts.schedule.state_dict(),
        "loss_scaler": None if parts.loss_scaler is None else parts.loss_scaler.state_dict(),
        "consecutive_skips": c.consecutive_skips,
        "perturbed": c.perturbed,
        "compression": comp,
        "mask": None if parts.mask is None else parts.mask.as_dict(copy=copy),
    }


def _arrays(parts: StateParts, buf, copy: bool, gather: bool) -> dict:
    """A buffer's name-keyed arrays; a rank's shard (sharded state) as the full arrays: gathered over
    ranks (a collective), or for a template of their shapes only."""
    if _windowed(buf):  # a rank's partition of an 8-bit slot
        return state8.gather_window(parts.comm, buf) if gather else state8.window_template(buf)
    return shard.state_arrays(parts.comm, buf, copy, gather)


def _windowed(buf) -> bool:
    return isinstance(buf, state8.Quant8Buffer) and buf.window is not None


def check_state(parts: StateParts, state: Mapping) -> list:
    """Validate a whole state dict against ``parts``; return the writes that load it."""
    try:
        fmt = state["format"]
        opt = state["optimizer"]
        acc = state["accumulation"]
        params = state["params"]
        slots = opt["slots"]
        scalars = opt.get("scalars", {})  # absent where the optimizer keeps none
        step = opt["step"]
        param_steps = opt.get("param_steps")  # absent while every parameter took every step
        param_scalars = opt.get("param_scalars", {})  # absent while the parameters' scalar states agree
        skips, perturbed = state["consecutive_skips"], state["perturbed"]
        optional = {key: state[key] for key, _, _ in _PARTS}
        mask = state["mask"]
    except (KeyError, TypeError) as exc:
        raise StateDictError(f"state dict lacks {exc}") from None
    if fmt != STATE_FORMAT:
        raise StateDictError(f"format: expected {STATE_FORMAT}, got {shown(fmt)}")
    acc, optional["compression"] = _own_share(parts.comm, acc, optional["compression"])
    try:
        micro, wsum, grads = acc["micro_batches"], acc["weight_sum"], acc["grads"]
    except (KeyError, TypeError) as exc:
        raise StateDictError(f"accumulation lacks {exc}") from None
    kind = type(parts.optimizer).__name__
    if not isinstance(opt, Mapping) or opt.get("type") != kind:
        got = opt.get("type") if isinstance(opt, Mapping) else type(opt).__name__
        raise StateDictError(f"optimizer: state is for {got!r}, engine has {kind!r}")
    opt_state = parts.opt_state
    if not isinstance(slots, Mapping) or set(slots) != set(opt_state.slots):
        got = sorted(slots) if isinstance(slots, Mapping) else type(slots).__name__
        raise StateDictError(f"optimizer slots: expected {sorted(opt_state.slots)}, got {got}")
    scalars = _check_scalars(opt_state.scalars, scalars)
    each = _check_param_scalars(parts, param_scalars)
    step = check_count("optimizer step", step, 0, error=StateDictError)
    counts = _check_param_steps(parts, param_steps, step)
    micro = check_int("micro_batches", micro, 0, parts.accumulation_steps - 1, error=StateDictError)
    absent = _check_absent(parts, acc.get("absent"), micro)
    wsum = _check_weight_sum(parts.params.dtype, micro, wsum)
    skips = check_count("consecutive_skips", skips, 0, error=StateDictError)
    if not isinstance(perturbed, bool) or (perturbed and not parts.two_windows):
        raise StateDictError(f"perturbed: expected a bool (True only for SAM), got {shown(perturbed)}")
    # the optional parts: each present in the state exactly when the engine has one, each
    # checked by its own check_state (which changes nothing) and loaded by its apply_state
    writes = []
    for key, field, what in _PARTS:
        sub, mine = optional[key], getattr(parts, field)
        if (sub is None) != (mine is None):
            raise StateDictError(f"{key}: the state has {'none' if sub is None else what}, "
                                 f"the engine has {'none' if mine is None else 'one'}")
        if sub is not None:
            try:
                checked = mine.check_state(sub)
            except (ValueError, TypeError, KeyError) as exc:  # a custom part's own errors
                if isinstance(exc, StateDictError):
                    raise
                raise StateDictError(f"{key}: {exc}") from exc
            writes.append(functools.partial(mine.apply_state, checked))
    if (mask is None) != (parts.mask is None):
        raise StateDictError(f"mask: the state has {'none' if mask is None else 'a pruning mask'}, the engine has "
                             f"{'none' if parts.mask is None else 'one'} (set_mask(...) before loading a pruned run)")
    if mask is not None:
        writes.append(functools.partial(parts.mask.assign, _check_mask_state(parts.params, mask)))
    targets = [parts.params, parts.grads, *opt_state.slots.values()]
    protect = tuple(b.flat for b in targets)
    try:
        buffers = [(parts.params, params), (parts.grads, grads)]
        buffers += [(opt_state.slots[k], v) for k, v in slots.items()]
        for buf, arrays in buffers:
            own = shard.shard_write(buf, arrays)  # sharded state: this rank's elements of the full arrays
            if own is not None:
                writes.append(own)
                continue
            checked = intake.ready_to_assign(buf, buf.check(arrays), protect)
            writes.append(functools.partial(buf.assign, checked))
    except (LayoutError, KeyError, ValueError, TypeError) as exc:
        raise StateDictError(f"state dict does not match the engine: {exc}") from exc
    writes.append(functools.partial(_set_counters, parts, step, micro, wsum, skips, perturbed, counts, absent))
    writes.append(functools.partial(opt_state.scalars.update, scalars))
    writes.append(functools.partial(_set_param_scalars, opt_state, each))  # (after the scalars: agreeing values win)
    return writes


def _set_param_scalars(opt_state, each: dict) -> None:
    opt_state.param_scalars = {}
    for k, values in each.items():
        param_steps.set_values(opt_state, k, values)


def checked_everywhere(comm, check):
    """``check()``, with every rank of the group raising when any rank's check failed.

    With a group of processes, a state refused on one rank (a file it cannot read,
    a share that does not fit) must not leave the others loading alone: the ranks
    compare outcomes (one small collective) and all raise before any rank writes.
    """
    if comm.is_local:
        return check()
    try:
        result, failure = check(), None
    except (StateDictError, OSError) as exc:
        result, failure = None, exc
    with comm.patient():  # a rank that read a large file late is waited for
        outcomes = comm.gather_objects(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    bad = [(r, msg) for r, msg in enumerate(outcomes) if msg is not None]
    if bad:
        rank, msg = bad[0]
        raise StateDictError(f"rank {rank} refused the state ({len(bad)} of {comm.size} ranks did), "
                             f"so no rank loads it: {msg}")
    return result


def _set_counters(parts: StateParts, step: int, micro: int, wsum: float, skips: int, perturbed: bool, counts,
                  absent) -> None:
    parts.opt_state.step, parts.opt_state.counts = step, counts
    c = parts.counters
    c.micro, c.weight_sum, c.consecutive_skips, c.perturbed, c.absent = micro, wsum, skips, perturbed, absent


def _check_param_steps(parts: StateParts, saved, step: int):
    """The per-parameter step counts (by name, each in ``[0, step]``) as ``OptState.counts``, or None
    when there are none or all equal ``step``."""
    if saved is None:
        return None
    names = parts.params.layout.names
    if not isinstance(saved, Mapping) or set(saved) != set(names):
        got = sorted(saved) if isinstance(saved, Mapping) else type(saved).__name__
        raise StateDictError(f"optimizer param_steps: expected a count for each of {list(names)}, got {got}")
    counts = np.array([check_int(f"optimizer param_steps[{n!r}]", saved[n], 0, step, error=StateDictError)
                       for n in names], dtype=np.int64)
    if (counts == step).all():
        return None
    if not parts.optimizer.per_param_steps:
        raise StateDictError(f"optimizer param_steps: the parameters stand at different steps, which "
                             f"{type(parts.optimizer).__name__} cannot hold ({parts.optimizer.per_param_steps_refusal})")
    return counts


def _check_absent(parts: StateParts, saved, micro: int):
    """The open window's parameters without a gradient so far, by name, as ``Counters.absent``."""
    if saved is None:
        return None
    layout = parts.params.layout
    if not isinstance(saved, (list, tuple)) or not saved or micro == 0 \
            or not all(isinstance(n, str) and n in layout for n in saved):
        raise StateDictError(f"accumulation absent: expected a non-empty list of parameter names in an open window "
                             f"(micro_batches > 0), got {shown(saved)} with micro_batches={micro}")
    out = np.zeros(len(layout), dtype=bool)
    out[[layout.index(n) for n in saved]] = True
    return out


def _check_scalars(mine: Mapping, scalars) -> dict:
    """The optimizer's saved scalar state: the same names as the engine's, finite numbers."""
    if not isinstance(scalars, Mapping) or set(scalars) != set(mine):
        got = sorted(scalars) if isinstance(scalars, Mapping) else type(scalars).__name__
        raise StateDictError(f"optimizer scalars: expected {sorted(mine)}, got {got}")
    return {k: check_number(f"optimizer scalars[{k!r}]", v, error=StateDictError) for k, v in scalars.items()}


def _check_param_scalars(parts: StateParts, saved) -> dict:
    """Per-parameter values of the optimizer's scalar states (by key, then by name: finite numbers) as
    ``OptState.param_scalars``."""
    mine, names = parts.opt_state.scalars, parts.params.layout.names
    if not isinstance(saved, Mapping) or not set(saved) <= set(mine):
        got = sorted(saved) if isinstance(saved, Mapping) else type(saved).__name__
        raise StateDictError(f"optimizer param_scalars: expected some of {sorted(mine)}, got {got}")
    out = {}
    for k, values in saved.items():
        if not isinstance(values, Mapping) or set(values) != set(names):
            got = sorted(values) if isinstance(values, Mapping) else type(values).__name__
            raise StateDictError(f"optimizer param_scalars[{k!r}]: expected a value for each of {list(names)}, "
                                 f"got {got}")
        out[k] = np.array([check_number(f"optimizer param_scalars[{k!r}][{n!r}]", values[n], error=StateDictError)
                           for n in names], dtype=np.float64)
    return out


def _own_share(comm, acc, comp):
    """This rank's accumulation and compression state out of a state saved by some number of ranks.

    A state saved by K ranks holds K shares; on K ranks each takes its own. On another
    number of ranks (one process included) it is refused when a share is rank-specific:
    a window accumulated part-way, or error-feedback residuals (what each rank failed to
    send); otherwise the shares are equal and rank 0's is taken. A single process's
    state is one share.
    """
    shares = {}
    for key, part in (("accumulation", acc), ("compression", comp)):
        many = isinstance(part, Mapping) and set(part) == {"ranks"}
        if many and (not isinstance(part["ranks"], (list, tuple)) or not part["ranks"]):
            raise StateDictError(f"{key}: 'ranks' must be a non-empty list of per-rank states")
        shares[key] = list(part["ranks"]) if many else [part]
    saved = len(shares["accumulation"])
    if comp is None:
        shares["compression"] = [None] * saved
    if len(shares["compression"]) != saved:
        raise StateDictError(f"compression: {len(shares['compression'])} per-rank states, accumulation {saved}")
    if saved == comm.size:
        return shares["accumulation"][comm.rank], shares["compression"][comm.rank]
    where = f"the state was saved by {saved} process{'es' if saved > 1 else ''}, this group has {comm.size}"
    if any(not isinstance(a, Mapping) or a.get("micro_batches") != 0 for a in shares["accumulation"]):
        raise StateDictError(f"accumulation: {where}, and a window was accumulated part-way (each rank's partial "
                             "gradient sum is its own): resume on the same number of ranks, or save at a boundary")
    if any(isinstance(c, Mapping) and "residual" in c for c in shares["compression"]):
        raise StateDictError(f"compression: {where}, and error-feedback residuals are per rank (what each rank "
                             "has not sent yet): resume on the same number of ranks")
    return shares["accumulation"][0], shares["compression"][0]


def _check_weight_sum(dtype, micro: int, wsum) -> float:
    """The saved window's weight sum: 0 for an empty window, else a sum step() could have made."""
    wsum = check_number("weight_sum", wsum, 0.0, error=StateDictError)
    info = np.finfo(dtype)
    big = float(info.max)
    if (micro == 0) != (wsum == 0.0) or wsum > big:
        raise StateDictError(f"weight_sum: expected 0 with micro_batches=0, else a value in "
                             f"[{float(info.tiny)!r}, {big!r}]; got {wsum!r} with micro_batches={micro}")
    return wsum


def _check_mask_state(params: FlatBuffer, arrays) -> dict:
    """A saved mask: uint8 arrays of 0/1 of every parameter's shape, of the parameters' backend."""
    layout = params.layout
    if not isinstance(arrays, Mapping) or set(arrays) != set(layout.names):
        got = sorted(arrays) if isinstance(arrays, Mapping) else type(arrays).__name__
        raise StateDictError(f"mask: expected arrays for {list(layout.names)}, got {got}")
    out = {}
    for name in layout.names:
        a = arrays[name]
        if type(a) is not type(params.flat) or a.dtype != np.uint8 or a.shape != layout.shape(name):
            raise StateDictError(f"mask[{name!r}]: expected uint8 of shape {layout.shape(name)}, "
                                 f"got {getattr(a, 'dtype', type(a).__name__)}{getattr(a, 'shape', '')}")
        if a.size and a.max() > 1:
            raise StateDictError(f"mask[{name!r}]: expected 0/1 values (1 keep, 0 pruned), got max {int(a.max())}")
        out[name] = a.copy()  # the load may write the mask buffer this array views
    return out


def _state_to_root(parts: StateParts, copy: bool, root: int) -> dict | None:
    """The gathered state on rank ``root`` alone (None elsewhere): per-rank parts and sharded buffers
    travel to it only, so no other rank ever holds more than its own."""
    comm = parts.comm
    acc = _gather_by_rank(comm, _window(parts, copy), root)
    comp = None if parts.compressor is None else _gather_by_rank(comm, parts.compressor.state_dict(), root)

    def arrays(buf):
        if _windowed(buf):
            return state8.gather_window(comm, buf, root)
        return shard.state_arrays_at(comm, buf, copy, root)

    params = arrays(parts.params)
    slots = {k: arrays(buf) for k, buf in parts.opt_state.slots.items()}
    if comm.rank != root:
        return None
    return _tree(parts, params, slots, {"ranks": acc}, None if comp is None else {"ranks": comp}, copy)


def _gather_by_rank(comm, tree, root: int | None = None) -> list | None:
    """Every rank's ``tree`` (same structure everywhere), in rank order: arrays all-gathered, values gathered.
    With ``root``: to that rank only (None elsewhere)."""
    arrays: list = []

    def strip(node):
        if isinstance(node, Mapping):
            return {k: strip(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(strip(v) for v in node)
        if hasattr(node, "shape") and hasattr(node, "dtype"):
            arrays.append(node)
            return _Slot(len(arrays) - 1)
        return node

    skeleton = strip(tree)
    skeletons = comm.gather_objects(skeleton)
    received = [comm.allgather(a) if root is None else comm.gather(a, root) for a in arrays]
    if root is not None and comm.rank != root:
        return None

    def fill(node, rank):
        if isinstance(node, _Slot):
            return received[node.index][rank]
        if isinstance(node, Mapping):
            return {k: fill(v, rank) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(fill(v, rank) for v in node)
        return node

    return [fill(sk, r) for r, sk in enumerate(skeletons)]


@dataclass(frozen=True)
class _Slot:
    """Where an array stood in a tree sent without its arrays (see :func:`_gather_by_rank`)."""

    index: int


class Stateful:
    """The state protocol as the :class:`~arraytrain.Engine`'s methods (a base class of the Engine), on
    the engine's data, and what this rank holds: its memory, the full parameters, the weights'
    deferred all-gather."""

    def _parts(self) -> StateParts:
        return StateParts(params=self.params, grads=self.grads, optimizer=self.optimizer, opt_state=self.state,
                          counters=self.counters, accumulation_steps=self.accumulation_steps,
                          two_windows=self._two_windows, schedule=self.schedule, loss_scaler=self.loss_scaler,
                          compressor=self.compressor, mask=self.mask, comm=self.comm)

    @guarded
    def wait_weights(self) -> None:
        """Complete the weights' all-gather left in flight by the last update (``bind(...,
        gather_in_forward=True)``): ``engine.params`` (and the bound model's tensors) then hold every
        rank's updated weights. The bound model's forward pass and every engine call that reads the
        weights wait on their own; call this before reading the tensors any other way. Otherwise, nothing."""
        self._placement.settle()  # (entering the call has settled it already: kept explicit)

    @guarded
    def gather_params(self) -> FlatBuffer:
        """The full parameters as a new :class:`FlatBuffer`: a copy of ``engine.params``, or with
        sharded master weights (``shard_state`` under a working copy) their all-gather, a
        collective that every rank calls."""
        return self._placement.gather_params()

    def memory(self) -> dict[str, int]:
        """Bytes of the buffers this rank holds, by kind: ``params`` (0 where the float32 master
        weights are sharded), ``grads``, ``state`` (the optimizer's slots), ``master`` (this rank's
        partition of sharded masters), ``working``, ``mask`` and ``scratch`` (a sharded mask's
        partition). Sharded buffers include the end padding that makes the partitions equal;
        host arrays the kernels allocate per call are not counted."""
        out = dict.fromkeys(("params", "grads", "state", "master", "working", "mask", "scratch"), 0)
        out.update(self._placement.memory())
        out["state"] = sum(buf.flat.nbytes for buf in self.state.slots.values())
        out["mask"] = 0 if self.mask is None else self.mask.flat.nbytes
        return out

    @guarded
    def state_dict(self, copy: bool = True, *, root: int | None = None) -> dict | None:
        """Name-keyed arrays of everything a bitwise-exact resume needs, plus scalars.

        ``copy=False`` returns views into the live buffers (for a writer that serialises them
        at once, e.g. :func:`arraytrain.save`). With a group of processes (``comm``) this is a
        collective: what differs between ranks (the partly accumulated window, the
        compressor's state and residual) is gathered by rank (``state["accumulation"]`` and
        ``state["compression"]`` are ``{"ranks": [rank 0's, ...]}``), sharded slots and
        masters into the full arrays. ``root``: the state is assembled on that rank only, the
        others return None (what :func:`arraytrain.save` passes: ``root=0``).
        """
        self._nothing_in_flight("state_dict()")
        if root is not None:
            root = check_int("root", root, 0, self.comm.size - 1, error=ArgumentTypeError)
        return state_dict(self._parts(), copy, gather=True, root=root)

    @guarded
    def state_template(self) -> dict:
        """This rank's own state as views, the per-rank parts marked
        (:class:`~arraytrain.parallel.PerRank`): what a reader matches a saved state
        against, whatever number of ranks saved it (not a collective)."""
        return state_dict(self._parts(), copy=False, gather=False)

    @guarded
    def check_state(self, state: Mapping) -> CheckedState:
        """Validate a whole state dict against this engine; return it checked.

        Changes nothing; :meth:`apply_state` then loads it. A refused state raises
        :class:`~arraytrain.errors.StateDictError`. Local to this process: with a group,
        :meth:`load_state_dict` makes every rank refuse when one does.
        """
        return CheckedState(check_state(self._parts(), state), self)

    @guarded
    def apply_state(self, checked: CheckedState) -> None:
        """Load what this engine's :meth:`check_state` returned (writes that cannot fail), then
        rebuild the working copy. Anything else is refused before any write."""
        if not isinstance(checked, CheckedState) or checked.owner is not self:
            got = "another engine's" if isinstance(checked, CheckedState) else type(checked).__name__
            raise ArgumentTypeError(f"checked: expected what this engine's check_state() returned, got {got}")
        self._nothing_in_flight("apply_state()")
        for write in checked.writes:
            write()
        self._placement.keep_mask(self.mask)
        self.refresh_working()

    @guarded
    def load_state_dict(self, state: Mapping) -> None:
        """Load :meth:`state_dict` output. Everything is validated before any buffer is written.

        The optimizer type and slots must match; the optimizer's current
        hyperparameters are kept (so a resumed run may change, e.g., its lr).
        The schedule's, loss scaler's and compressor's states are restored into
        the engine's own, which must be present exactly when the state has them.
        Counters are ints in ``[0, 2**53]`` (see ``arraytrain._checks.MAX_COUNT``).

        :meth:`check_state` then :meth:`apply_state`; with a group of processes every
        rank raises when any rank's check failed. A refused state raises
        :class:`StateDictError` and changes nothing.
        """
        self.apply_state(checked_everywhere(self.comm, lambda: self.check_state(state)))
