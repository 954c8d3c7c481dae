"""The drop-in optimizers' engines: :class:`Cohorts`, the list of cohorts the param groups' parameters
live in, and their rebuild.

A cohort (:class:`~._torch_engine.Cohort`: a :class:`~._torch_engine.GroupEngine` and where its
parameters sit in the groups) holds parameters that share a dtype and device, a step count and
every hyperparameter that is one number for a whole kernel (betas, eps, momentum, ...). ``lr`` and
``weight_decay`` may differ freely between the groups of one cohort: they are the engine's
per-parameter values (``engine.state.hp``), rewritten from the groups when a group changed
(:meth:`Cohorts.set_rates`), without a pass over any buffer. Groups that come to disagree on a
kernel-wide value (a scheduler giving two groups different momenta), a group added by
``add_param_group`` after the first step (torch counts steps per parameter: the new group starts
at step 1), and a ``load_state_dict`` whose groups stand at different steps split the cohorts; the
engines are rebuilt once (:meth:`Cohorts.rebuild`), their state carried over by parameter name
through the engines' state protocol (``state_template``, ``check_state``, ``apply_state``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .. import param_steps
from ..errors import BackendUnavailableError, HyperparameterError
from ..parallel.shard import ShardBuffer
from ..optim.state8 import Quant8Buffer
from ._torch_engine import LOWP, Cohort, GroupEngine, group_name
from ._torch_options import Options
from ._torch_views import check_cuda_device


class Cohorts(list):
    """The optimizer's cohorts (the list holds the :class:`~._torch_engine.Cohort` objects, in order),
    built and rebuilt from the param groups with the checked ``options``; ``two_windows``: the
    arraytrain optimizer takes two gradient windows per step (SAM)."""

    def __init__(self, options: Options, two_windows: bool):
        super().__init__()
        self.options, self.two_windows = options, two_windows

    def partition(self, param_groups, check_values, steps: Mapping | None = None,
                  signatures: list | None = None) -> list:
        """Cohorts for the groups as they are now: ``[(key, [(group, position), ...]), ...]``.

        Parameters stay with the engine they are in unless their group's kernel-wide values now
        differ from its cohort's; ``steps`` (a load) gives each group's step instead.
        ``check_values(group, where)``: a group's ``(lr, weight_decay, signature)``, validated
        (:meth:`~._torch_groups.GroupReader.check_values`), where ``signatures`` are not given.
        """
        where = {}
        for c in self:
            for gp in c.index:
                where[gp] = c
        keyed: dict = {}
        for gi, group in enumerate(param_groups):
            sig = signatures[gi] if signatures is not None else check_values(group, group_name(gi))[2]
            for j, p in enumerate(group["params"]):
                c = where.get((gi, j))
                if steps is not None:
                    origin = (steps[gi], "loaded")
                elif c is None or c.engine.state.step == 0:
                    origin = (0, "fresh")
                else:
                    origin = (c.engine.state.step, id(c))
                key = (p.dtype, p.device, origin, sig)
                keyed.setdefault(key, []).append((gi, j))
        return list(keyed.items())

    def engine_parallel(self, partition, dtype) -> dict:
        """The data-parallel arguments of an engine: with a group of processes, one engine only (each
        step is one exchange, and the ranks' engines must pair up), overlapped where it can be."""
        parallel, overlap = self.options.parallel, self.options.overlap
        comm = parallel["comm"]
        if comm.is_local:
            return {}
        if len(partition) > 1:
            raise HyperparameterError(
                f"comm: the param groups need {len(partition)} engines (they differ in dtype, device, step count "
                "or a hyperparameter that is one number per kernel, such as betas); under a group of processes "
                "the drop-ins take groups that share one engine (lr and weight_decay may differ)")
        if parallel["shard_state"] and dtype in LOWP:
            raise HyperparameterError("shard_state: a bfloat16/float16 model's float32 master weights are not sharded "
                                      "by the drop-in optimizers; use bind(model, optimizer, comm=..., "
                                      "shard_state=True)")
        can = dtype not in LOWP and not self.two_windows
        if overlap and not can:
            raise HyperparameterError("overlap: a bfloat16/float16 model's gradients reach the float32 buffer at "
                                      "step(), and SAM's exchange needs the whole window; pass overlap=False")
        return {**parallel, "overlap": can if overlap is None else overlap}

    def rebuild(self, partition, param_groups, optimizer_for, carry: bool = True) -> bool:
        """Engines for ``partition``, state carried over by name from the engines there were (``carry``
        False: a load, which then writes every engine's whole state); False where nothing moves.
        ``optimizer_for(group)``: the arraytrain optimizer of a group's values."""
        old = {}
        for c in self:
            for (gi, j), name in zip(c.index, c.engine.layout.names):
                old[(gi, j)] = (c, name)
        if [c.index for c in self] == [index for _, index in partition]:
            return False  # nothing moves
        opts, cohorts, trees = self.options, [], {}
        for (dtype, device, _origin, sig), index in partition:
            entries = _entries(param_groups, index)
            masters, sources = {}, []
            for (gi, j), (name, _) in zip(index, entries):
                if (gi, j) in old:
                    c, oname = old[(gi, j)]
                    masters[name] = c.engine.params[oname]
                    sources.append((name, c, oname))
            opt = optimizer_for(param_groups[index[0][0]])
            opt.min_8bit_size = opts.min_8bit_size  # read when the engine makes its slots
            if device.type == "cuda":
                check_cuda_device(device, "params")
            elif device.type != "cpu":
                raise BackendUnavailableError(f"params: tensors on {device}; the drop-in optimizers run on the CPU "
                                              "and CUDA")
            engine = GroupEngine(entries, opt, masters, dtype=dtype, device=device, kernels=opts.kernels,
                                 max_consecutive_skips=opts.max_consecutive_skips, clip_eps=opts.clip_eps,
                                 nonfinite=opts.nonfinite, parallel=self.engine_parallel(partition, dtype))
            if sources and carry:
                _carry(engine, sources, trees)
            cohorts.append(Cohort(engine, list(index), sig))
        for c in self:
            c.engine.close()
        self[:] = cohorts
        return True

    def follow(self, reader) -> bool:
        """The cohorts after a read of the :class:`~._torch_groups.GroupReader` ``reader`` that found new
        kernel-wide values: each cohort whose groups changed alike is reconfigured; True where a
        cohort's groups came to disagree (then a rebuild splits it)."""
        split, signatures = False, reader.signatures()
        for c in self:
            sigs = {signatures[gi] for gi in c.groups}
            if len(sigs) > 1:
                split = True
            elif sigs != {c.signature}:
                _reconfigure(c, sigs.pop(), reader)
        return split

    def set_rates(self, rates: list) -> None:
        """Each engine's per-parameter ``lr`` and ``weight_decay`` from the groups' (``rates``: per group
        lr, weight_decay, flat), its optimizer's from the group of its first parameter."""
        values = np.array(rates)  # (few NumPy calls: each costs microseconds inside a training loop)
        for c in self:
            values.take(c.pairs, out=c.flat_rates)
            gi = c.index[0][0]  # (the group of the engine's first parameter)
            opt = getattr(c.engine.optimizer, "base", c.engine.optimizer)  # SAM reports its base's
            opt.lr, opt.weight_decay = rates[2 * gi], rates[2 * gi + 1]


def _entries(param_groups, index) -> list:
    out = []
    for gi, j in index:
        group = param_groups[gi]
        names = group.get("param_names")
        out.append((names[j] if names else f"{group_name(gi)}.params[{j}]", group["params"][j]))
    return out


def _state_tree(engine) -> dict:
    """An engine's state as name-keyed arrays: views (``state_template``); with sharded state the whole
    arrays, gathered from the ranks (``state_dict``, a collective: every rank rebuilds its engines)."""
    if any(isinstance(b, ShardBuffer) for b in engine.state.slots.values()):
        return engine.state_dict(copy=False)
    return engine.state_template()


def _carry(engine, sources, trees: dict) -> None:
    """The state of ``sources`` (``(name, old cohort, the name there)``) into the new ``engine``, through
    its state protocol: its own state with each source's slots (an 8-bit slot's codes and scales
    bitwise), the step, scalar states and step counts of the first source's engine (a rebuild keeps
    parameters of one engine together, or of engines at step 0), each parameter's own value of a
    scalar state (NAdam's mu_product) and its own step count. ``trees``: the old engines' state trees
    by cohort, read once."""
    tree = _state_tree(engine)
    saved, state = tree["optimizer"], engine.state
    for name, c, oname in sources:
        if id(c) not in trees:
            trees[id(c)] = _state_tree(c.engine)["optimizer"]["slots"]
        theirs = trees[id(c)]
        for slot, arrays in saved["slots"].items():
            buf, src = state.slots[slot], c.engine.state.slots.get(slot)
            if (isinstance(buf, Quant8Buffer) and isinstance(src, Quant8Buffer)) or \
                    (src is not None and src.dtype == buf.dtype):
                arrays[name] = theirs[slot][oname]
    first = sources[0][1].engine.state
    names = engine.layout.names
    saved["step"] = first.step
    if state.scalars:
        saved["scalars"] = {**state.scalars, **first.scalars}
        each = {key: dict.fromkeys(names, engine.initial_scalars[key]) for key in state.scalars}
        for name, c, oname in sources:  # each parameter's own value comes along (NAdam's mu_product)
            for key, values in each.items():
                values[name] = param_steps.value_of(c.engine.state, key, c.engine.layout.index(oname))
        saved["param_scalars"] = each
    saved.pop("param_steps", None)
    if first.counts is not None:  # the parameters' own step counts come along
        counts = dict.fromkeys(names, first.step)
        for name, c, oname in sources:
            counts[name] = int(c.engine.state.counts[c.engine.layout.index(oname)])
        saved["param_steps"] = counts
    engine.apply_state(engine.check_state(tree))


def _reconfigure(c: Cohort, sig, reader) -> None:
    """A cohort's kernel-wide values changed alike in all its groups (checked by the reader's
    ``_check_same_state``, or only ``reader.tunable`` values, checked by its ``_retuned``: then set on
    the optimizer as they are)."""
    opt, tunable = c.engine.optimizer, reader.tunable
    changed = [i for i, (a, b) in enumerate(zip(sig, c.signature)) if a != b]
    tuned = [tunable[i](sig[i], c.signature[i]) if i in tunable else None for i in changed]
    if None not in tuned:
        for i, v in zip(changed, tuned):
            setattr(opt, reader.keys[i], v)
    else:
        _assign(opt, reader.optimizer_of(sig))
    c.signature = sig


def _assign(dst, src) -> None:
    """Copy ``src``'s hyperparameters (but lr, weight_decay and overrides) onto ``dst``, SAM's base too."""
    for k, v in src.hyperparameters().items():
        if k in ("lr", "weight_decay", "overrides", "state_dtype", "base", "base_hyperparameters"):
            continue
        setattr(dst, k, v)
    base = getattr(src, "base", None)
    if base is not None:
        _assign(dst.base, base)
