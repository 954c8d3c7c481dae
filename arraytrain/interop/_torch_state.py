"""The drop-in optimizers' state in torch's format: ``state[p]`` as live views of the engines' slots
(:func:`published`; 8-bit slots as ``{"codes", "absmax", "map"}``), the ``state_dict`` structure
(:func:`torch_state_dict`), and a saved one checked against the engines (:func:`check_state`) and
written into them (:func:`load_entries`).
"""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from collections.abc import Mapping

import numpy as np
import torch

from .. import lowbit, param_steps
from ..optim import state8
from ..parallel.shard import ShardBuffer
from .._checks import check_number
from ..errors import HyperparameterError, StateDictError
from ._torch_engine import group_name
from ._torch_views import host_array, tensor_view


def published(cohorts, param_groups, sharded: bool) -> defaultdict:
    """``state[p]``: torch's per-parameter state, as live views of the engines' slots (``sharded``: the
    slots are spread over the ranks, and ``state[p]`` holds ``"step"`` and the scalar states only)."""
    state = defaultdict(dict)
    for c in cohorts:
        e = c.engine
        # sharded state: the slots are spread over the ranks (state_dict() gathers them)
        views = {} if sharded else {slot: slot_views(buf, e.layout.names) for slot, buf in e.state.slots.items()}
        for k, ((gi, j), name) in enumerate(zip(c.index, e.layout.names)):
            p = param_groups[gi]["params"][j]
            entry = {"step": c.step_tensors[k]}
            for slot, by_name in views.items():
                entry[slot] = by_name[name]
            for key, tensors in c.scalar_tensors.items():
                entry[key] = tensors[k]
            if e.lowp:
                entry["master"] = tensor_view(e.params[name], torch)
            state[p] = entry
    return state


def gathered_state(cohorts, param_groups) -> dict:
    """Sharded state: every parameter's entry with its whole slots, gathered from the ranks (a
    collective), as copies."""
    out = {}
    for c in cohorts:
        e = c.engine
        slots = e.state_dict(copy=True)["optimizer"]["slots"]
        for k, ((gi, j), name) in enumerate(zip(c.index, e.layout.names)):
            entry = {"step": c.step_tensors[k].clone()}
            for slot, arrays in slots.items():
                entry[slot] = tensor_view(np.ascontiguousarray(arrays[name]), torch)
            entry.update({key: tensors[k].clone() for key, tensors in c.scalar_tensors.items()})
            out[param_groups[gi]["params"][j]] = entry
    return out


def torch_state_dict(param_groups, entries: Mapping) -> dict:
    """torch's structure, ``{"state": {index: {"step", slots...}}, "param_groups": [...]}``, of the
    per-parameter ``entries`` (``state[p]``, or :func:`gathered_state`): groups with their values and
    ``params`` as indices, each entry's 8-bit slots as new dicts of the same views."""
    ids, groups, start = {}, [], 0
    for group in param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = list(range(start, start + len(group["params"])))
        for i, p in zip(packed["params"], group["params"]):
            ids[id(p)] = i
        start += len(group["params"])
        groups.append(packed)
    state = {ids[id(p)]: {k: dict(v) if isinstance(v, dict) else v for k, v in entry.items()}
             for p, entry in entries.items() if id(p) in ids}
    return {"state": state, "param_groups": groups}


def check_state(sd, param_groups, cohorts, check_group_values) -> dict:
    """A torch-structured state dict checked against the optimizer's ``param_groups`` and its engines
    (``cohorts``): the plan that :func:`load_entries` and the optimizer's rebuild apply, or a
    :class:`~arraytrain.errors.StateDictError` before any write. ``check_group_values(group, where)``
    validates a group's values as the optimizer's constructor does."""
    if "state" not in sd or "param_groups" not in sd:
        raise StateDictError(f"state_dict: expected the keys 'state' and 'param_groups', got {sorted(sd)}")
    saved_state, saved_groups = sd["state"], sd["param_groups"]
    if not isinstance(saved_state, Mapping):
        raise StateDictError(f"state_dict['state']: expected a mapping, got {type(saved_state).__name__}")
    if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(param_groups):
        got = len(saved_groups) if isinstance(saved_groups, (list, tuple)) else type(saved_groups).__name__
        raise StateDictError(f"state_dict['param_groups']: expected {len(param_groups)} groups, got {got}")
    groups, sources = [], {}
    for gi, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        where = f"state_dict['param_groups'][{gi}]"
        if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), (list, tuple)):
            raise StateDictError(f"{where}: expected a mapping with a 'params' list")
        ids = list(saved["params"])
        if len(ids) != len(group["params"]):
            raise StateDictError(f"{where}: {len(ids)} parameters, this optimizer's group has "
                                 f"{len(group['params'])}")
        ours, theirs = group.get("param_names"), saved.get("param_names")
        if ours is not None and theirs is not None:
            theirs = list(theirs)
            if sorted(map(str, theirs)) != sorted(ours):
                missing = sorted(set(ours) - set(theirs))
                extra = sorted(set(map(str, theirs)) - set(ours))
                raise StateDictError(f"{where}: parameter names differ: missing {missing}, unexpected {extra}")
            by_name = dict(zip(theirs, ids))
            ids = [by_name[n] for n in ours]
        values = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        merged = {**group, **values}
        try:
            _, _, sig = check_group_values(merged, where)
        except HyperparameterError as exc:
            raise StateDictError(str(exc)) from None
        groups.append((values, sig))
        for j, i in enumerate(ids):
            sources[(gi, j)] = i
    # each parameter's entry, checked against what its engine holds
    where_now = {}
    for c in cohorts:
        for (gi, j), name in zip(c.index, c.engine.layout.names):
            where_now[(gi, j)] = (c, name)
    entries, steps, param_steps = {}, {}, {}
    for (gi, j), sid in sources.items():
        c, name = where_now[(gi, j)]
        entry = saved_state.get(sid)
        label = f"state_dict['state'][{sid!r}] ({name!r})"
        if entry is None:
            entries[(gi, j)] = None
            continue
        if not isinstance(entry, Mapping):
            raise StateDictError(f"{label}: expected a mapping, got {type(entry).__name__}")
        slots = c.engine.state.slots
        allowed = {"step", *slots, *c.engine.state.scalars} | ({"master"} if c.engine.lowp else set())
        unknown = sorted(k for k in set(entry) - allowed if entry[k] is not None)
        absent = sorted(set(slots) - set(entry))
        if unknown or absent:
            raise StateDictError(f"{label}: expected the state {sorted(allowed)}, missing {absent}, "
                                 f"unexpected {unknown} (another optimizer's, or another configuration's, state?)")
        step = entry.get("step", 0)
        step = float(step.item()) if isinstance(step, torch.Tensor) and step.numel() == 1 else step
        if isinstance(step, bool) or not isinstance(step, numbers.Real) or not math.isfinite(step) \
                or step < 0 or step != int(step) or step > 2**53:
            raise StateDictError(f"{label}['step']: expected a whole number of steps >= 0, got {step!r}")
        steps.setdefault(gi, {}).setdefault(int(step), []).append(name)
        param_steps[(gi, j)] = int(step)
        checked = {}
        for k, v in entry.items():
            if k == "step":
                continue
            if v is None and k not in slots:  # torch's SGD keeps momentum_buffer None without momentum
                continue
            if k in c.engine.state.scalars:
                v = float(v.item()) if isinstance(v, torch.Tensor) and v.numel() == 1 else v
                checked[k] = check_number(f"{label}[{k!r}]", v, error=StateDictError)
                continue
            buf = slots[k] if k != "master" else c.engine.params
            shape = tuple(buf.layout.shape(name))
            if k != "master" and isinstance(v, Mapping):  # a quantized slot's {"codes", "absmax"|"scale", "map"}
                checked[k] = saved_8bit(f"{label}[{k!r}]", name, buf, v, shape)
                continue
            if not isinstance(v, torch.Tensor) or not v.is_floating_point():
                raise StateDictError(f"{label}[{k!r}]: expected a floating-point tensor (or an 8-bit slot's "
                                     f"{{'codes', 'absmax', 'map'}}), got {getattr(v, 'dtype', type(v).__name__)}")
            if tuple(v.shape) != shape:
                raise StateDictError(f"{label}[{k!r}]: shape {tuple(v.shape)} != {shape}")
            if not torch.isfinite(v).all() and k == "master":
                raise StateDictError(f"{label}['master']: holds NaN/Inf")
            if isinstance(buf, state8.Quant8Buffer):  # float state into an 8-bit slot: encoded
                try:
                    v = Encoded(buf.check({name: host_array(v, torch, copy=False)}, strict=False)[name])
                except (ValueError, TypeError, KeyError) as exc:
                    raise StateDictError(f"{label}[{k!r}]: {exc}") from None
            checked[k] = v
        entries[(gi, j)] = checked
    group_steps, alone = [], {gi for c in cohorts if c.engine.optimizer.per_param_steps for gi in c.group_of}
    for gi in range(len(param_groups)):
        found = steps.get(gi, {})
        if len(found) > 1 and gi not in alone:
            raise StateDictError(f"state_dict: {group_name(gi)}'s parameters stand at different steps "
                                 f"{ {s: n[:3] for s, n in found.items()} }, which its optimizer cannot hold (it "
                                 "steps all its parameters together)")
        group_steps.append(max(found) if found else 0)
    return {"groups": groups, "entries": entries, "steps": group_steps, "param_steps": param_steps}


def load_entries(cohorts, plan: dict, param_groups) -> None:
    """Write :func:`check_state`'s checked entries into the engines (rebuilt for the plan's steps), one
    parameter at a time: the saved tensors may be views of these very buffers
    (``opt.load_state_dict(opt.state_dict())``, accelerate's device round trip)."""
    for c in cohorts:
        e = c.engine
        e.state.scalars.update(e.initial_scalars)
        e.state.param_scalars.clear()
        e.state.step = step = plan["steps"][int(c.group_of[0])]
        if e.optimizer.per_param_steps:  # each parameter at its own count (0: no state saved for it)
            counts = np.array([plan["param_steps"].get(gj, 0) for gj in c.index], dtype=np.int64)
            e.state.counts = None if (counts == step).all() else counts
        if any(isinstance(b, ShardBuffer) for b in e.state.slots.values()):
            _load_sharded(c, plan)
            continue
        # a scalar state per parameter (NAdam's mu_product; a fresh state's where none was saved)
        values = {k: np.full(len(e.layout), v, dtype=np.float64) for k, v in e.initial_scalars.items()}
        with torch.no_grad():
            for seg, ((gi, j), name) in enumerate(zip(c.index, e.layout.names)):
                entry = plan["entries"][(gi, j)]
                if e.lowp and (entry is None or "master" not in entry):
                    tensor_view(e.params[name], torch).copy_(param_groups[gi]["params"][j].detach())
                if entry is None:  # no state saved for it (torch's, before its first gradient)
                    for slot in e.state.slots.values():
                        zero_slot(slot, name)
                    continue
                # written one parameter at a time: the saved tensors may be views of these very
                # buffers (opt.load_state_dict(opt.state_dict()), accelerate's device round trip)
                for k, v in entry.items():
                    if k in e.state.scalars:
                        values[k][seg] = v
                    elif k == "master":
                        tensor_view(e.params[name], torch).copy_(v)
                    elif isinstance(v, Encoded):
                        e.state.slots[k].assign({name: v.raw})
                    else:
                        tensor_view(e.state.slots[k][name], torch).copy_(v)
        for k, v in values.items():
            param_steps.set_values(e.state, k, v)
        e.refresh()
        e.clean.clear()
        c.sync_tensors()


def _load_sharded(c, plan: dict) -> None:
    """Sharded state: the entries as the engine's own state dict (whole arrays, each rank keeping its
    partition), loaded by the engine: a collective, as the state dict it starts from."""
    e = c.engine
    tree = e.state_dict(copy=True)
    opt = tree["optimizer"]
    opt["step"] = e.state.step
    opt.pop("param_steps", None)
    if e.state.counts is not None:
        opt["param_steps"] = dict(zip(e.layout.names, e.state.counts.tolist()))
    each = {k: {} for k in e.initial_scalars}  # per parameter (the engine's check makes agreeing ones the scalar)
    for (gi, j), name in zip(c.index, e.layout.names):
        entry = plan["entries"][(gi, j)] or {}
        for k, arrays in opt["slots"].items():
            v = entry.get(k)
            arrays[name] = np.zeros_like(arrays[name]) if v is None else \
                host_array(v, torch, copy=True).astype(arrays[name].dtype)
        for k in each:
            each[k][name] = entry.get(k, e.initial_scalars[k])
    opt.pop("param_scalars", None)
    if each:
        opt["scalars"] = dict(e.initial_scalars)
        opt["param_scalars"] = each
    e.load_state_dict(tree)
    c.sync_tensors()


def slot_views(buf, names) -> dict:
    """Per name, what ``state[p]`` shows of a slot: a live tensor view, or for an 8-bit parameter
    ``{"codes", "absmax", "map"}`` (float8: ``"scale"``) with live views of its codes and block scales."""
    if not isinstance(buf, state8.Quant8Buffer):
        return {name: tensor_view(buf[name], torch) for name in names}
    out = {}
    for name, v in buf.as_dict().items():
        if lowbit.is_q8_entry(v):
            key = lowbit.scale_key(v["map"])
            out[name] = {"codes": tensor_view(v["codes"], torch), key: tensor_view(v[key], torch), "map": v["map"]}
        else:  # a parameter under min_8bit_size: its float32 state
            out[name] = tensor_view(v, torch)
    return out


class Encoded:
    """A slot's checked bytes for one parameter of an 8-bit slot (:meth:`Quant8Buffer.check`'s form)."""

    __slots__ = ("raw",)

    def __init__(self, raw):
        self.raw = raw


def zero_slot(buf, name: str) -> None:
    """A parameter's state in one slot back to a fresh slot's (8-bit: the codes of 0, a zero block scale)."""
    if isinstance(buf, state8.Quant8Buffer):  # the codes of 0 and a zero block scale, as a fresh slot's
        buf.load({name: np.zeros(buf.layout.shape(name), np.float32)}, strict=False)
    else:
        buf[name][...] = 0


def saved_8bit(label: str, name: str, buf, v: Mapping, shape):
    """A saved quantized entry ``{"codes", "absmax", "map"}`` (8-bit; float8: ``"scale"``) for a slot:
    checked, and converted the engine's way (:mod:`arraytrain.optim.state8`): kept bitwise by a
    quantized slot of its map (re-encoded if the map differs), decoded to float32 for a
    float32/bfloat16 slot."""
    key = lowbit.scale_key(v.get("map")) if isinstance(v.get("map"), str) else "absmax"
    if set(v) != {"codes", key, "map"}:
        raise StateDictError(f"{label}: a quantized slot is {{'codes', 'absmax', 'map'}} (8-bit) or "
                             f"{{'codes', 'scale', 'map'}} (float8), got the keys {sorted(map(str, v))}")
    for part in ("codes", key):
        if not isinstance(v[part], torch.Tensor):
            raise StateDictError(f"{label}[{part!r}]: expected a tensor, got {type(v[part]).__name__}")
    entry = {"codes": host_array(v["codes"], torch, copy=False), key: host_array(v[key], torch, copy=False),
             "map": v["map"]}
    try:
        if isinstance(buf, state8.Quant8Buffer):
            return Encoded(buf.check({name: entry}, strict=False)[name])
        return torch.from_numpy(lowbit.decode_entry(name, entry, shape))
    except (ValueError, TypeError, KeyError) as exc:
        raise StateDictError(f"{label}: {exc}") from None
