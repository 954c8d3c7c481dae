"""The drop-in optimizers' param groups: a group's intake (:func:`group_params`) and
:class:`GroupReader`, which owns what the last read found of the groups and reports what changed.

A group's hyperparameters are read at every step: a tuple of the group's values is compared with the
last one (0-d tensors are read each time); only what changed is validated and mapped (see
:meth:`GroupReader.read`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping

import torch

from .._checks import check_bool, check_number
from ..errors import ArgumentTypeError, BackendError, BackendUnavailableError, DTypeError, HyperparameterError, \
    LayoutError
from ._torch_engine import group_name, plain_value
from ._torch_options import IGNORED_FLAGS, PER_PARAM, REFUSED_FLAGS

_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_VIEWABLE = (torch.float32, torch.float64)


class _Seen:
    """A group's values as the last read found them: the raw tuple, whether it holds tensors, what they mean.

    ``views``: where ``lr`` or ``weight_decay`` is a one-element floating CPU tensor and the other values
    are plain, how to read the two rates again without ``.item()`` (see :func:`_rate_views`), else None."""

    __slots__ = ("lr", "raw", "rest", "sig", "sig_tensors", "tensors", "views", "wd")

    def __init__(self, raw, tensors, sig_tensors, lr, wd, sig):
        self.raw, self.tensors, self.sig_tensors, self.lr, self.wd, self.sig = raw, tensors, sig_tensors, lr, wd, sig
        self.rest = raw[2:]  # the values after lr and weight_decay
        self.views = _rate_views(raw[0], raw[1]) if tensors and not sig_tensors else None

    def rates(self):
        """``(lr, weight_decay)`` read from :attr:`views`, or None where a tensor's memory moved (``.data`` or
        ``set_``) or a value is not a float in [0, inf) (then the group is read in full, with its checks)."""
        lt, lp, lv, wt, wp, wv = self.views
        if lt is not None:
            if lt.data_ptr() != lp:
                return None
            lv = float(lv)
        if wt is not None:
            if wt.data_ptr() != wp:
                return None
            wv = float(wv)
        if 0.0 <= lv < math.inf and 0.0 <= wv < math.inf:
            return lv, wv
        return None


def _rate_views(lr, wd):
    """For :attr:`_Seen.views`: per rate ``tensor, its address, a NumPy view of its one element``, or
    ``None, None, value`` for a float (six values in all); None where a rate is anything else. The view
    keeps the tensor's memory alive, so the address cannot be reused while it is held: the same address
    means the same memory, whose value (written by ``fill_``, ``copy_``, a scheduler) the view reads."""
    out = ()
    for v in (lr, wd):
        if type(v) is float:
            out += (None, None, v)
        elif isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dtype in _VIEWABLE and v.numel() == 1 \
                and v.layout == torch.strided:
            out += (v, v.data_ptr(), v.detach().numpy().reshape(()))
        else:
            return None
    return out


def _rate(gi: int, key: str, v) -> float:
    """``lr`` or ``weight_decay``: a finite number >= 0 (a float, an int, or a one-element tensor)."""
    if type(v) is not float:
        v = plain_value(v)
    if type(v) is float and 0.0 <= v < math.inf:  # the common case, in a few tens of ns
        return v
    name = group_name(gi, key)
    if isinstance(v, torch.Tensor):
        raise HyperparameterError(f"{name}: expected a number or a one-element tensor, got a tensor of shape "
                                  f"{tuple(v.shape)}")
    return check_number(name, v, 0.0)


def _named(where: str | None, key: str) -> str:
    """``key`` as messages name it: alone (the constructor's defaults) or in its group."""
    return key if where is None else f"{where}[{key!r}]"


def _plain_values(group: Mapping, keys, where: str | None) -> tuple:
    """The group's values of ``keys`` as plain Python (one-element tensors read), after the flags torch
    has and arraytrain refuses; a typed error naming the group and key for either."""
    for flag, why in REFUSED_FLAGS.items():
        if group.get(flag):
            raise HyperparameterError(f"{_named(where, flag)}: {why}; got {flag}={group[flag]!r}")
    out = tuple(plain_value(group[k]) for k in keys)
    for k, v in zip(keys, out):
        if isinstance(v, torch.Tensor):
            raise HyperparameterError(f"{_named(where, k)}: expected a number or a one-element tensor, got a "
                                      f"tensor of shape {tuple(v.shape)}")
    return out


def _same(a: tuple, b: tuple) -> bool:
    try:
        return a == b
    except RuntimeError:  # a tensor of several elements, refused by the checks that follow
        return False


def _plain_same(a, b) -> bool:
    """``a == b`` for plain values (numbers, strings, None, tuples and lists of them); False for anything else."""
    if a is b:
        return True
    t = type(a)
    if t is not type(b):
        return False
    if t in (float, int, bool, str):
        return a == b
    if t in (tuple, list):
        return len(a) == len(b) and all(_plain_same(x, y) for x, y in zip(a, b))
    return False


def _tune_betas(new, old):
    """``betas`` as :func:`~arraytrain._checks.check_betas` takes them, for two floats in [0, 1); else None."""
    if type(new) in (tuple, list) and len(new) == 2:
        b1, b2 = new
        if type(b1) is float and type(b2) is float and 0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0:
            return (b1, b2)
    return None


def _tune_momentum(new, old):
    """A momentum > 0 that replaces one > 0 (the momentum buffer stays): a finite float; else None."""
    if type(new) is float and 0.0 < new < math.inf and type(old) in (float, int) and old > 0:
        return new
    return None


#: What a scheduler changes every step besides the rate (OneCycleLR's and CyclicLR's
#: ``cycle_momentum``: beta1, or ``momentum``), each with a check that accepts the common case
#: exactly as the optimizer's constructor would, or None (then the group is validated in full).
TUNE_CHECKS = {"betas": _tune_betas, "momentum": _tune_momentum}


def _has_tensor(values) -> bool:
    return any(isinstance(v, torch.Tensor) or (isinstance(v, (tuple, list)) and _has_tensor(v)) for v in values)


def flag(values: Mapping, key: str) -> bool:
    """A group's boolean value, checked (a drop-in's ``arraytrain_optimizer`` reads its switches so)."""
    return check_bool(key, values[key])


class GroupReader:
    """What the last read found of every param group, and the reads that report what changed.

    ``defaults``: the constructor's group values (their keys are the values a group must hold);
    ``tunable``: the keys of :data:`TUNE_CHECKS` whose new values are set on the arraytrain optimizer
    as they are (a class's ``TUNABLE``); ``make(values)``: the arraytrain optimizer of one group's
    values (plain Python), the class's ``arraytrain_optimizer``.

    ``keys``: the kernel-wide values (all but :data:`~._torch_options.PER_PARAM` and torch's flags),
    whose tuple is a group's signature; ``rates``: per group lr, weight_decay (a flat list: one
    ``np.array`` call a step).
    """

    def __init__(self, defaults: Mapping, tunable: tuple, make):
        self.make = make
        self.keys = tuple(k for k in defaults if k not in PER_PARAM and k not in IGNORED_FLAGS
                          and k not in REFUSED_FLAGS)
        self.read_keys = ("lr", "weight_decay", *self.keys)
        self._read_values = operator.itemgetter(*self.read_keys)  # a group's values as a tuple, in one C call
        self.tunable = {i: TUNE_CHECKS[k] for i, k in enumerate(self.keys) if k in tunable}
        self._by_sig: dict = {}  # kernel-wide values -> their arraytrain optimizer (see optimizer_of)
        self._seen: list = []  # per group: a _Seen (the values the last read found), None: read it anew
        self.rates: list = []

    def check_values(self, group: Mapping, where: str | None):
        """Validate a group's values; returns ``(lr, weight_decay, signature)``."""
        for flag in IGNORED_FLAGS:
            v = group.get(flag)
            if v is not None and not isinstance(v, bool):
                raise HyperparameterError(f"{_named(where, flag)}: expected None or a bool, got {v!r}")
        for k in self.read_keys:
            if k not in group:
                raise HyperparameterError(f"{where}: lacks {k!r}")
        values = dict(zip(self.read_keys, _plain_values(group, self.read_keys, where)))
        try:
            opt = self.make(values)
        except HyperparameterError as exc:
            if where is None:
                raise
            raise HyperparameterError(f"{where}: {exc}") from None
        sig = tuple(values[k] for k in self.keys)
        return opt.lr, opt.weight_decay, sig

    def optimizer_for(self, group: Mapping):
        """The arraytrain optimizer of a group's values as they are (an engine's, at a rebuild)."""
        return self.make({k: plain_value(group[k]) for k in self.read_keys})

    def forget(self, groups: int) -> None:
        """The next read reads every one of ``groups`` groups anew (the engines were rebuilt or loaded)."""
        self._seen = [None] * groups
        self.rates = [0.0] * (2 * groups)

    def signatures(self) -> list:
        """Each group's kernel-wide values as the last read found them."""
        return [s.sig for s in self._seen]

    def read(self, param_groups, cohorts) -> tuple[bool, bool]:
        """Read every group: ``(rates, signatures)``, whether a rate changed and whether a group's
        kernel-wide values did (:meth:`signatures` then has them, for the cohorts to follow).

        The fast path: a group's values, as a tuple, equal the last read's (tensors are read every
        time). ``lr`` and ``weight_decay`` are checked alone; the other values build the group's
        arraytrain optimizer (the full validation) only when they changed. A refused value raises
        :class:`~arraytrain.errors.HyperparameterError` naming the group and key, and changes nothing.
        """
        rates = retuned = False
        resig, updates, rated = [], [], []
        read, seen_all, inf = self._read_values, self._seen, math.inf
        for gi, group in enumerate(param_groups):
            try:
                raw = read(group)
            except KeyError as exc:
                raise HyperparameterError(f"{group_name(gi)}: lacks {exc.args[0]!r}") from None
            seen = seen_all[gi]
            if seen is not None and not seen.tensors:
                if _same(raw, seen.raw):
                    continue
                lr, wd = raw[0], raw[1]
                # a scheduler's usual change: lr (or weight_decay) alone, floats in [0, inf)
                if (type(lr) is float and type(wd) is float and 0.0 <= lr < inf and 0.0 <= wd < inf
                        and _same(raw[2:], seen.rest)):
                    rated.append((gi, seen, raw, lr, wd))
                    rates = True
                    continue
            elif (seen is not None and seen.views is not None and raw[0] is seen.raw[0] and raw[1] is seen.raw[1]
                  and _same(raw, seen.raw)):  # (the tensors compared by identity: a tuple's == tries that first)
                # the same one-element tensors (a scheduler writing its rate into them): read through views
                found = seen.rates()
                if found is not None:
                    lr, wd = found
                    if lr != seen.lr or wd != seen.wd:
                        rated.append((gi, seen, raw, lr, wd))
                        rates = True
                    continue
            lr, wd = raw[0], raw[1]
            if type(lr) is not float or not 0.0 <= lr < math.inf:
                lr = _rate(gi, "lr", lr)
            if type(wd) is not float or not 0.0 <= wd < math.inf:
                wd = _rate(gi, "weight_decay", wd)
            if seen is not None and not seen.sig_tensors and _same(raw[2:], seen.raw[2:]):
                sig, sig_tensors = seen.sig, False
            elif (sig := self._retuned(raw, seen)) is not None:  # a scheduler's beta1 or momentum: no rebuild
                sig_tensors, retuned = False, True
            else:
                sig_tensors = _has_tensor(raw[2:])
                sig = self._signature(group, gi)
                if seen is None or sig != seen.sig:
                    resig.append((gi, sig))
            if seen is None or lr != seen.lr or wd != seen.wd:
                rates = True
            tensors = sig_tensors or isinstance(raw[0], torch.Tensor) or isinstance(raw[1], torch.Tensor)
            updates.append((gi, _Seen(raw, tensors, sig_tensors, lr, wd, sig)))
        for gi, sig in resig:
            self._check_same_state(gi, sig, cohorts)
        values = self.rates
        for gi, seen in updates:
            self._seen[gi] = seen
            values[2 * gi], values[2 * gi + 1] = seen.lr, seen.wd
        for gi, seen, raw, lr, wd in rated:
            seen.raw, seen.lr, seen.wd = raw, lr, wd
            values[2 * gi], values[2 * gi + 1] = lr, wd
        return rates, bool(resig or retuned)

    def _signature(self, group: Mapping, gi: int):
        """A group's kernel-wide values (plain Python), validated (a scheduler that changes them every step,
        such as OneCycleLR's momentum, builds one arraytrain optimizer per new signature, not per group)."""
        sig = _plain_values(group, self.keys, group_name(gi))
        try:
            self.optimizer_of(sig)
        except HyperparameterError as exc:
            raise HyperparameterError(f"{group_name(gi)}: {exc}") from None
        return sig

    def optimizer_of(self, sig):
        """The arraytrain optimizer of the kernel-wide values ``sig`` (lr 1, no decay), kept for the few
        signatures seen last."""
        try:
            return self._by_sig[sig]
        except (KeyError, TypeError):  # TypeError: a value that cannot be a key (built every time)
            pass
        values = dict(zip(self.keys, sig))
        values.update(lr=1.0, weight_decay=0.0)
        opt = self.make(values)
        try:
            if len(self._by_sig) >= 8:
                self._by_sig.clear()
            self._by_sig[sig] = opt
        except TypeError:
            pass
        return opt

    def _check_same_state(self, gi: int, sig, cohorts) -> None:
        """A group's kernel-wide values may change, but not into another state (amsgrad, momentum 0 or not)."""
        for c in cohorts:
            if gi in c.group_of:
                values = dict(zip(self.keys, sig))
                new, cur = self.optimizer_of(sig), c.engine.optimizer
                if type(new) is not type(cur) or new.slot_names != cur.slot_names:
                    before = dict(zip(self.keys, c.signature))
                    diff = {k: (before[k], values[k]) for k in self.keys if before[k] != values[k]}
                    raise HyperparameterError(
                        f"{group_name(gi)}: changing "
                        f"{', '.join(f'{k} from {a!r} to {b!r}' for k, (a, b) in diff.items())} changes the "
                        f"optimizer's state ({list(cur.slot_names)} -> {list(new.slot_names)}); set it when the "
                        "group is created")

    def _retuned(self, raw: tuple, seen):
        """The group's signature when it differs from the last read only in :attr:`tunable` values, each
        of plain numbers its check takes as the state's structure stands (the check is the constructor's,
        on the common case: a scheduler's ``betas`` or ``momentum``); else None (the full validation)."""
        tunable = self.tunable
        if seen is None or not tunable or seen.sig_tensors:
            return None
        sig = list(seen.sig)
        before = seen.raw
        for i in range(len(sig)):
            new = raw[i + 2]
            if new is before[i + 2]:
                continue
            check = tunable.get(i)
            if check is None:
                if _plain_same(new, before[i + 2]):
                    continue
                return None
            sig[i] = check(new, sig[i])
            if sig[i] is None:
                return None
        return tuple(sig)


def group_params(param_group: Mapping, param_groups, state_dtype) -> list:
    """The parameters of a group that ``add_param_group`` takes (after ``param_groups``), validated: a
    list of tensors or of ``(name, tensor)`` pairs, none already in a group, every tensor one the
    optimizer can train."""
    gi = len(param_groups)
    where = group_name(gi)
    if "params" not in param_group:
        raise HyperparameterError(f"{where}: lacks 'params'")
    params = param_group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, (set, frozenset)):
        raise ArgumentTypeError(f"{where}['params']: a set has no order; give a list")
    else:
        try:
            params = list(params)
        except TypeError:
            raise ArgumentTypeError(f"{where}['params']: expected an iterable of tensors or (name, tensor) "
                                    f"pairs, got {type(params).__name__}") from None
    if not params:
        raise LayoutError(f"{where}: an empty parameter list")
    named = [isinstance(p, tuple) for p in params]
    if any(named) and not all(named):
        raise ArgumentTypeError(f"{where}['params']: give every parameter with a name or none")
    existing = {id(p) for g in param_groups for p in g["params"]}
    names_in_use = {n for g in param_groups for n in g.get("param_names", ())}
    seen, names = set(), []
    for j, item in enumerate(params):
        if all(named):
            if len(item) != 2 or not isinstance(item[0], str) or not item[0]:
                raise ArgumentTypeError(f"{where}['params'][{j}]: expected a (name, tensor) pair with a "
                                        f"non-empty str name, got {item!r:.80}")
            name, p = item
            if name in names_in_use or name in names:
                raise LayoutError(f"{where}: the name {name!r} is given twice")
            names.append(name)
        else:
            p, name = item, f"{where}.params[{j}]"
        _check_tensor(name, p)
        if state_dtype in ("8bit", "float8"):
            _check_8bit_tensor(name, p)
        if id(p) in existing:
            raise LayoutError(f"{name!r}: the tensor is already in another param group")
        if id(p) in seen:
            raise LayoutError(f"{name!r}: the tensor appears twice in the group")
        seen.add(id(p))
    if param_groups and (bool(names) != ("param_names" in param_groups[0])):
        raise ArgumentTypeError(f"{where}: every param group gives names (named_parameters()) or none does")
    return params


def _check_tensor(name: str, p) -> None:
    """A tensor the drop-ins can train: a dense floating leaf on the CPU or CUDA."""
    if not isinstance(p, torch.Tensor):
        raise ArgumentTypeError(f"{name!r}: expected a torch.Tensor, got {type(p).__name__}")
    if not (p.is_leaf or p.retains_grad):
        raise ArgumentTypeError(f"{name!r}: a non-leaf tensor (the result of an operation) cannot be optimized")
    if p.layout != torch.strided:
        raise BackendError(f"{name!r}: a {p.layout} tensor; the drop-in optimizers take dense (strided) tensors")
    if p.dtype not in _FLOATS:
        raise DTypeError(f"{name!r}: dtype {p.dtype}; the optimizers train float32/float64 tensors, or "
                         "bfloat16/float16 ones on float32 master weights")
    if p.device.type not in ("cpu", "cuda"):
        raise BackendUnavailableError(f"{name!r}: on {p.device}; the drop-in optimizers run on the CPU and CUDA")


def _check_8bit_tensor(name: str, p) -> None:
    """8-bit state is kept for float32 values (a bfloat16/float16 model's are its float32 masters); the
    device is the engine's to accept (CPU, and CUDA through the engine's 8-bit CUDA kernels)."""
    if p.dtype == torch.float64:
        raise HyperparameterError(f"state_dtype: '8bit' state is kept for float32 parameters (or the float32 master "
                                  f"weights of a bfloat16/float16 model), {name!r} is {p.dtype}; use "
                                  "state_dtype=None for a float64 model")
