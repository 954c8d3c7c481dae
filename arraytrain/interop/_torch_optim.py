"""Drop-in ``torch.optim.Optimizer`` classes whose step is an arraytrain engine's.

Imported with torch, lazily, by :mod:`arraytrain.interop.torch` (``at_torch.AdamW``): see that
module's docstring for what the classes do; this module is their implementation.

How a step runs. The parameters of the param groups live in one or a few engines
(:class:`GroupEngine`, a "cohort" each): parameters that share a dtype and device, a step
count and every hyperparameter that is one number for a whole kernel (betas, eps, momentum,
...). ``lr`` and ``weight_decay`` may differ freely between the groups of one cohort: they are
the engine's per-parameter values (``engine.state.hp``), rewritten from the groups when a group
changed, without a pass over any buffer. Usually there is one cohort, so one step is one norm
pass and one fused kernel over every parameter.

A group's hyperparameters are read at every :meth:`TorchOptimizer.step`: a tuple of the group's
values is compared with the last one (0-d tensors are read each time); only what changed is
validated and mapped. Groups that come to disagree on a kernel-wide value (a scheduler giving
two groups different momenta), a group added by ``add_param_group`` after the first step (torch
counts steps per parameter: the new group starts at step 1), and a ``load_state_dict`` whose
groups stand at different steps split the cohorts; the engines are rebuilt once, their state
carried over by parameter name.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections import defaultdict
from collections.abc import Mapping

import numpy as np
import torch

from .. import optim, state8
from .._checks import check_bool, check_int, check_number
from ..amp import LossScaler
from ..engine import Engine
from ..errors import (
    ArgumentTypeError,
    BackendError,
    BackendUnavailableError,
    ConcurrentUseError,
    DTypeError,
    HyperparameterError,
    LayoutError,
    NonFiniteError,
    ShapeMismatchError,
    StateDictError,
)
from ..ops import CLIP_EPS, clip_coef, norm_pass
from ._torch_views import check_cuda_device, host_array, tensor_view

__all__ = [
    "LAMB",
    "SAM",
    "SGD",
    "Adadelta",
    "Adafactor",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "Lion",
    "Muon",
    "NAdam",
    "RAdam",
    "RMSprop",
    "ScheduleFreeAdamW",
    "Sophia",
    "TorchOptimizer",
]

PUBLIC_MODULE = "arraytrain.interop.torch"
# torch.optim's implementation switches: foreach and fused choose among torch's own kernels (the
# step here is always one fused kernel: accepted, kept in the groups as torch keeps them, and
# otherwise ignored); capturable (CUDA graphs) and differentiable (autograd through the step) are
# modes arraytrain does not have: True is refused
IGNORED_FLAGS = ("foreach", "fused")
REFUSED_FLAGS = {
    "capturable": "torch's CUDA-graph mode (step and lr kept on the device) is not built: arraytrain forms "
                  "its step-dependent scalars on the host",
    "differentiable": "autograd through the optimizer step is not built",
}
PER_PARAM = ("lr", "weight_decay")
_LOWP = (torch.bfloat16, torch.float16)
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _value(v):
    """A group's value as plain Python: a 0-d (one-element) tensor read as a float, tuples element-wise."""
    if isinstance(v, torch.Tensor):
        try:
            return v.item()  # a float (an int, a bool) for a one-element tensor
        except RuntimeError:
            return v  # several elements: refused by the checks, which name the key
    if isinstance(v, (tuple, list)):
        return tuple(_value(x) for x in v)
    return v


class _Seen:
    """A group's values as the last read found them: the raw tuple, whether it holds tensors, what they mean."""

    __slots__ = ("lr", "raw", "sig", "sig_tensors", "tensors", "wd")

    def __init__(self, raw, tensors, sig_tensors, lr, wd, sig):
        self.raw, self.tensors, self.sig_tensors, self.lr, self.wd, self.sig = raw, tensors, sig_tensors, lr, wd, sig


def _rate(gi: int, key: str, v) -> float:
    """``lr`` or ``weight_decay``: a finite number >= 0 (a float, an int, or a one-element tensor)."""
    if type(v) is not float:
        v = _value(v)
    if type(v) is float and 0.0 <= v < math.inf:  # the common case, in a few tens of ns
        return v
    name = _group_name(gi, key)
    if isinstance(v, torch.Tensor):
        raise HyperparameterError(f"{name}: expected a number or a one-element tensor, got a tensor of shape "
                                  f"{tuple(v.shape)}")
    return check_number(name, v, 0.0)


def _same(a: tuple, b: tuple) -> bool:
    try:
        return a == b
    except RuntimeError:  # a tensor of several elements, refused by the checks that follow
        return False


def _has_tensor(values) -> bool:
    return any(isinstance(v, torch.Tensor) or (isinstance(v, (tuple, list)) and _has_tensor(v)) for v in values)


def _group_name(gi: int, key: str | None = None) -> str:
    return f"param_groups[{gi}]" + ("" if key is None else f"[{key!r}]")


class GroupEngine(Engine):
    """An :class:`~arraytrain.Engine` over some param groups' tensors, which it re-points into its buffers.

    ``entries`` are ``(name, tensor)`` pairs of one dtype and device; ``masters`` maps names to
    the values the engine starts from (an earlier engine's float32 master weights), else the
    tensors' values are taken. The tensors' ``.data`` become views of the engine's parameters
    (of its low-precision working copy for a bfloat16/float16 model). ``.grad`` is left alone
    until a step finds it (see :meth:`check`).
    """

    def __init__(self, entries, optimizer, masters: Mapping, *, dtype, device, kernels: str,
                 max_consecutive_skips, clip_eps: float):
        lowp = dtype in _LOWP
        kw = {"kernels": kernels, "max_consecutive_skips": max_consecutive_skips, "clip_eps": clip_eps,
              # carries the scale of the step's gradients (torch.amp.GradScaler's, or a clip factor
              # across engines): set before every step, unscaled in the norm pass and the kernel
              "loss_scaler": LossScaler(init_scale=1.0)}
        if lowp:
            kw["working_dtype"] = "bfloat16" if dtype == torch.bfloat16 else "float16"
        with torch.no_grad():
            params = {}
            for n, p in entries:
                if n in masters:
                    params[n] = masters[n]
                    continue
                t = (p.detach().float() if lowp else p.detach()).contiguous()
                params[n] = t.numpy() if device.type == "cpu" else t
            super().__init__(params, optimizer, **kw)
        self.initial_scalars = dict(self.state.scalars)  # a fresh state's (NAdam's mu_product: 1)
        self.lowp = lowp
        weights = self.working if lowp else self.params
        if lowp:  # .grad must have the parameter's dtype: a low-precision buffer, added into the float32 one
            self.lp_grads = torch.zeros(self.layout.size, dtype=dtype, device=device)
            self.grads_tensor = tensor_view(self.grads.flat, torch)
        self.bound = []
        with torch.no_grad():
            for n, p in entries:
                data = tensor_view(weights[n], torch)
                grad = self.lp_grads[self.layout.slice(n)].view(p.shape) if lowp else tensor_view(self.grads[n], torch)
                p.data = data
                self.bound.append((n, p, data, grad, data.data_ptr(), p.dtype, tuple(p.shape)))
        # parameters whose .grad was None at the last applied step, when the kernel zeroed the buffer
        self.clean: set[int] = set()

    def check(self) -> tuple[list, list, list]:
        """Find what a step must repair, changing nothing: ``(data_fixes, grad_fixes, held)``.

        ``.data`` replaced by a tensor of the same dtype, device and shape: its values are taken
        into the engine; ``.grad`` allocated by torch (after ``zero_grad(set_to_none=True)``): its
        values are copied into the buffer; ``.grad`` None: the parameter is held this step.
        Anything else raises before a write.
        """
        data_fixes, grad_fixes, held = [], [], []
        for i, (n, p, data, grad, ptr, dtype, shape) in enumerate(self.bound):
            if p.data_ptr() != ptr or p.dtype is not dtype or p.shape != shape:
                _check_kind(n, "parameter", p, data)
                data_fixes.append(i)
            g = p.grad
            if g is grad:
                continue
            if g is None:
                held.append(i)
            else:
                if g.is_sparse or g.layout != torch.strided:
                    raise BackendError(f"{n!r}: a {g.layout} gradient; the drop-in optimizers take dense gradients")
                _check_kind(n, "gradient", g, grad)
                grad_fixes.append(i)
        return data_fixes, grad_fixes, held

    def connect(self, data_fixes, grad_fixes, held) -> None:
        """Apply what :meth:`check` found: every ``.grad`` that is not None then points into the buffer."""
        with torch.no_grad():
            for i in data_fixes:
                _, p, data, *_ = self.bound[i]
                data.copy_(p.detach())
                p.data = data
            for i in grad_fixes:
                _, p, _, grad, *_ = self.bound[i]
                grad.copy_(p.grad)
                p.grad = grad
            for i in held:  # a held parameter's gradient must read 0: the norm and the moments see it
                if i not in self.clean:
                    self.bound[i][3].zero_()
            if self.lowp:
                self.grads_tensor.copy_(self.lp_grads)
                self.lp_grads.zero_()

    def zero_grad(self) -> None:
        """:meth:`Engine.zero_grad`, and the low-precision gradient buffer of a bf16/fp16 model."""
        super().zero_grad()
        if self.lowp:
            self.lp_grads.zero_()

    def refresh(self) -> None:
        """Rewrite the working copy (the model's bf16/fp16 weights) from the master weights."""
        self.refresh_working()


def _check_kind(name: str, what: str, got, bound) -> None:
    if got.dtype != bound.dtype:
        raise DTypeError(f"{name!r}: {what} dtype {got.dtype} != {bound.dtype} the optimizer holds (convert "
                         "the model before building the optimizer)")
    if got.device != bound.device:
        raise BackendError(f"{name!r}: {what} on {got.device}, the optimizer holds it on {bound.device} (move "
                           "the model before building the optimizer)")
    if tuple(got.shape) != tuple(bound.shape):
        raise ShapeMismatchError(name, tuple(bound.shape), tuple(got.shape), what=what)


class _Cohort:
    """One engine and where its parameters sit in the param groups."""

    __slots__ = ("engine", "group_of", "held", "index", "lrs", "scalar_tensors", "signature", "step_tensor", "wds")

    def __init__(self, engine: GroupEngine, index: list, signature):
        self.engine = engine
        self.index = index  # (group, position in the group) per engine parameter, in layout order
        self.group_of = np.array([g for g, _ in index], np.intp)
        self.signature = signature
        self.step_tensor = torch.tensor(float(engine.state.step))
        self.scalar_tensors = {k: torch.tensor(v, dtype=torch.float32) for k, v in engine.state.scalars.items()}
        n = len(index)
        self.lrs, self.wds, self.held = np.zeros(n), np.zeros(n), False  # set by the first read of the groups

    def sync_tensors(self) -> None:
        self.step_tensor.fill_(float(self.engine.state.step))
        for k, t in self.scalar_tensors.items():
            t.fill_(self.engine.state.scalars[k])


class TorchOptimizer(torch.optim.Optimizer):
    """Base of the drop-in optimizers: a ``torch.optim.Optimizer`` whose step is arraytrain's.

    Subclasses give torch's constructor (their hyperparameters become each group's defaults)
    and :meth:`arraytrain_optimizer`, which builds the arraytrain optimizer for one group's
    values. See :mod:`arraytrain.interop.torch` for the behaviour; the options every class takes
    after its hyperparameters (keyword-only) are:

    max_grad_norm : float or None
        Clip the global L2 norm of the gradient (torch's ``clip_grad_norm_`` rule), inside the
        step: the norm pass the step makes anyway, and the factor folded into the kernel.
    clip_eps : float
        The clip factor is ``max_grad_norm / (norm + clip_eps)`` (1e-6: torch's).
    state_dtype : None, "float32", "bfloat16" or "8bit"
        Where the optimizer has element-wise state (every class but ``Adafactor`` and ``Sophia``,
        which refuse the argument): None or "float32" keep it in the parameters' dtype (float32
        for a bfloat16/float16 model's master weights); "bfloat16" stores it in bfloat16, math in
        float32; "8bit" stores it as ``bnb.optim.AdamW8bit`` and its siblings do (bitsandbytes'
        blockwise dynamic quantization: a uint8 code per element and a float32 ``absmax`` per
        256-element block, see :mod:`arraytrain.state8`), math in float32, for float32 parameters
        or a bfloat16/float16 model's float32 master weights (float64 parameters are refused at
        construction), on the CPU or CUDA as the engine runs it. A parameter with fewer than ``min_8bit_size``
        elements keeps float32 state. An 8-bit slot shows in ``state[p]`` and ``state_dict()`` as
        ``{"codes": uint8 tensor (the parameter's shape), "absmax": float32 tensor (blocks,),
        "map": "signed" or "unsigned"}``, the tensors live views of the engine's bytes (a write
        into them is a write into the state): see :meth:`state_dict`.
    min_8bit_size : int or None
        With ``state_dtype="8bit"``: parameters with fewer elements keep their state in float32
        (bitsandbytes' argument of that name; None: its default, 4096). Refused with another
        ``state_dtype``, where it would mean nothing.
    kernels : "numba" or "reference"
        The fused kernels, or their slow reference twins.
    max_consecutive_skips : int or None
        A step whose gradient holds NaN/Inf changes nothing (GradScaler's found_inf, or the
        engine's own check); after this many in a row :class:`~arraytrain.NonFiniteError`
        is raised (None: never). A step under a GradScaler that found an inf is not counted.
    """

    _step_supports_amp_scaling = True
    # an arraytrain optimizer that takes two gradient windows per step (SAM) needs a closure
    two_windows = False
    # state_dtype is refused where the arraytrain optimizer takes none (Adafactor, Sophia)
    takes_state_dtype = True

    def __init__(self, params, defaults: dict, *, max_grad_norm=None, clip_eps=CLIP_EPS, state_dtype=None,
                 min_8bit_size=None, kernels="numba", max_consecutive_skips=50):
        if params is _PROBE:
            raise _Defaults(defaults)
        self.max_grad_norm = None if max_grad_norm is None else check_number("max_grad_norm", max_grad_norm, 0.0,
                                                                             lo_open=True)
        self.clip_eps = check_number("clip_eps", clip_eps, 0.0)
        if state_dtype is not None and not self.takes_state_dtype:
            raise HyperparameterError(f"state_dtype: {type(self).__name__} keeps its state in the parameters' "
                                      "dtype (its arraytrain optimizer takes no state_dtype), got "
                                      f"state_dtype={state_dtype!r}")
        if state_dtype is not None and state_dtype not in optim.Optimizer.STATE_DTYPES:
            allowed = ", ".join(repr(d) for d in optim.Optimizer.STATE_DTYPES)
            raise HyperparameterError(f"state_dtype: expected None or one of {allowed}, got {state_dtype!r}")
        self.state_dtype = state_dtype
        if min_8bit_size is None:
            min_8bit_size = state8.DEFAULT_THRESHOLD
        elif state_dtype != "8bit":
            raise HyperparameterError(f"min_8bit_size: the size under which a parameter keeps float32 state applies "
                                      f"with state_dtype='8bit' only, got min_8bit_size={min_8bit_size!r} with "
                                      f"state_dtype={state_dtype!r}")
        self.min_8bit_size = check_int("min_8bit_size", min_8bit_size, 0)
        if kernels not in ("numba", "reference"):
            raise HyperparameterError(f"kernels: expected 'numba' or 'reference', got {kernels!r}")
        self.kernels = kernels
        if max_consecutive_skips is not None:
            max_consecutive_skips = check_int("max_consecutive_skips", max_consecutive_skips, 1)
        self.max_consecutive_skips = max_consecutive_skips
        self._keys = tuple(k for k in defaults if k not in PER_PARAM and k not in IGNORED_FLAGS
                           and k not in REFUSED_FLAGS)
        self._read_keys = ("lr", "weight_decay", *self._keys)
        self._cohorts: list[_Cohort] = []
        self._seen: list = []  # per group: (raw tuple, has tensors, (lr, wd, signature))
        self._built = False
        self._skips = 0
        self._evaluating = None
        self.reports = ()
        self._check_group_values(defaults, None)
        if isinstance(params, torch.Tensor):
            raise ArgumentTypeError("params: expected an iterable of tensors, of (name, tensor) pairs or of "
                                    "param-group dicts, got a single tensor")
        try:
            params = list(params)
        except TypeError:
            raise ArgumentTypeError(f"params: expected an iterable of tensors, of (name, tensor) pairs or of "
                                    f"param-group dicts, got {type(params).__name__}") from None
        if not params:
            raise LayoutError("params: an empty parameter list")
        super().__init__(params, defaults)
        self._rebuild(self._partition())
        self._built = True

    # -- the arraytrain optimizer of a group ------------------------------------------------
    def arraytrain_optimizer(self, values: Mapping):
        """The :mod:`arraytrain.optim` optimizer for one group's hyperparameters (plain Python values)."""
        raise NotImplementedError

    def _check_group_values(self, group: Mapping, where: str | None):
        """Validate a group's values; returns ``(lr, weight_decay, signature)``."""
        def named(k):
            return k if where is None else f"{where}[{k!r}]"

        for flag, why in REFUSED_FLAGS.items():
            if group.get(flag):
                raise HyperparameterError(f"{named(flag)}: {why}; got {flag}={group[flag]!r}")
        for flag in IGNORED_FLAGS:
            v = group.get(flag)
            if v is not None and not isinstance(v, bool):
                raise HyperparameterError(f"{named(flag)}: expected None or a bool, got {v!r}")
        values = {}
        for k in self._read_keys:
            if k not in group:
                raise HyperparameterError(f"{where}: lacks {k!r}")
            v = _value(group[k])
            if isinstance(v, torch.Tensor):
                raise HyperparameterError(f"{named(k)}: expected a number or a one-element tensor, got a tensor "
                                          f"of shape {tuple(v.shape)}")
            values[k] = v
        try:
            opt = self.arraytrain_optimizer(values)
        except HyperparameterError as exc:
            if where is None:
                raise
            raise HyperparameterError(f"{where}: {exc}") from None
        sig = tuple(values[k] for k in self._keys)
        return opt.lr, opt.weight_decay, sig

    # -- param groups -----------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``: the group's parameters join the optimizer, validated first.

        A group added before the first step joins the engine of the groups it agrees with; one
        added later gets an engine of its own, whose step count starts at 0, as torch's
        per-parameter state does.
        """
        if not isinstance(param_group, dict):
            raise ArgumentTypeError(f"param_group: expected a dict, got {type(param_group).__name__}")
        if self._evaluating is not None:
            raise ConcurrentUseError("add_param_group: the optimizer is in eval() mode; call train() first")
        gi = len(self.param_groups)
        where = _group_name(gi)
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
        existing = {id(p) for g in self.param_groups for p in g["params"]}
        names_in_use = {n for g in self.param_groups for n in g.get("param_names", ())}
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
            if self.state_dtype == "8bit":
                _check_8bit_tensor(name, p)
            if id(p) in existing:
                raise LayoutError(f"{name!r}: the tensor is already in another param group")
            if id(p) in seen:
                raise LayoutError(f"{name!r}: the tensor appears twice in the group")
            seen.add(id(p))
        if self.param_groups and (bool(names) != ("param_names" in self.param_groups[0])):
            raise ArgumentTypeError(f"{where}: every param group gives names (named_parameters()) or none does")
        group = {k: v for k, v in param_group.items() if k != "params"}
        for k, v in self.defaults.items():
            group.setdefault(k, v)
        self._check_group_values(group, where)
        super().add_param_group({**param_group, "params": params})
        if self._built:
            self._rebuild(self._partition())

    def _partition(self, steps: Mapping | None = None, signatures: list | None = None) -> list:
        """Cohorts for the groups as they are now: ``[(key, [(group, position), ...]), ...]``.

        Parameters stay with the engine they are in unless their group's kernel-wide values now
        differ from its cohort's; ``steps`` (a load) gives each group's step instead.
        """
        where = {}
        for c in self._cohorts:
            for gp in c.index:
                where[gp] = c
        keyed: dict = {}
        for gi, group in enumerate(self.param_groups):
            sig = signatures[gi] if signatures is not None else self._check_group_values(group, _group_name(gi))[2]
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

    def _entries(self, index) -> list:
        out = []
        for gi, j in index:
            group = self.param_groups[gi]
            names = group.get("param_names")
            out.append((names[j] if names else f"{_group_name(gi)}.params[{j}]", group["params"][j]))
        return out

    def _rebuild(self, partition) -> None:
        """Engines for ``partition``, state carried over by name from the engines there were."""
        old = {}
        for c in self._cohorts:
            for (gi, j), name in zip(c.index, c.engine.layout.names):
                old[(gi, j)] = (c, name)
        if [c.index for c in self._cohorts] == [index for _, index in partition]:
            return  # nothing moves
        cohorts, saved8 = [], {}
        for (dtype, device, _origin, sig), index in partition:
            entries = self._entries(index)
            masters, sources = {}, []
            for (gi, j), (name, _) in zip(index, entries):
                if (gi, j) in old:
                    c, oname = old[(gi, j)]
                    masters[name] = c.engine.params[oname]
                    sources.append((name, c, oname))
            values = {k: _value(self.param_groups[index[0][0]][k]) for k in self._read_keys}
            opt = self.arraytrain_optimizer(values)
            opt.min_8bit_size = self.min_8bit_size  # read when the engine makes its slots
            if device.type == "cuda":
                check_cuda_device(device, "params")
            elif device.type != "cpu":
                raise BackendUnavailableError(f"params: tensors on {device}; the drop-in optimizers run on the CPU "
                                              "and CUDA")
            engine = GroupEngine(entries, opt, masters, dtype=dtype, device=device, kernels=self.kernels,
                                 max_consecutive_skips=self.max_consecutive_skips, clip_eps=self.clip_eps)
            for name, c, oname in sources:
                for slot, buf in engine.state.slots.items():
                    src = c.engine.state.slots.get(slot)
                    if isinstance(buf, state8.Quant8Buffer) and isinstance(src, state8.Quant8Buffer):
                        if (id(c), slot) not in saved8:
                            saved8[(id(c), slot)] = src.as_dict()
                        buf.assign(buf.check({name: saved8[(id(c), slot)][oname]}, strict=False))  # bitwise
                    elif src is not None and src.dtype == buf.dtype:
                        buf[name][...] = src[oname]
            if sources:
                src = sources[0][1].engine
                engine.state.step = src.state.step
                engine.state.scalars.update(src.state.scalars)
            cohorts.append(_Cohort(engine, list(index), sig))
        self._cohorts = cohorts
        self._seen = [None] * len(self.param_groups)
        self._publish_state()

    def _publish_state(self) -> None:
        """``self.state[p]``: torch's per-parameter state, as live views of the engines' slots."""
        state = defaultdict(dict)
        for c in self._cohorts:
            e = c.engine
            views = {slot: _slot_views(buf, e.layout.names) for slot, buf in e.state.slots.items()}
            for (gi, j), name in zip(c.index, e.layout.names):
                p = self.param_groups[gi]["params"][j]
                entry = {"step": c.step_tensor}
                for slot, by_name in views.items():
                    entry[slot] = by_name[name]
                entry.update(c.scalar_tensors)
                if e.lowp:
                    entry["master"] = tensor_view(e.params[name], torch)
                state[p] = entry
        self.state = state

    # -- the step ---------------------------------------------------------------------------
    def read_param_groups(self) -> bool:
        """Read every group and map what changed onto the engines; True when a rate changed.

        Every :meth:`step` calls it first; call it yourself to have a group you edited validated
        at once (a refused value raises :class:`~arraytrain.errors.HyperparameterError` naming the
        group and key, and changes nothing). The fast path: a group's values, as a tuple, equal the last step's (tensors are read every
        time). ``lr`` and ``weight_decay`` are checked alone; the other values build the group's
        arraytrain optimizer (the full validation) only when they changed.
        """
        rates = False
        resig, updates = [], []
        keys, seen_all = self._read_keys, self._seen
        for gi, group in enumerate(self.param_groups):
            try:
                raw = tuple([group[k] for k in keys])
            except KeyError as exc:
                raise HyperparameterError(f"{_group_name(gi)}: lacks {exc.args[0]!r}") from None
            seen = seen_all[gi]
            if seen is not None and not seen.tensors and _same(raw, seen.raw):
                continue
            lr = _rate(gi, "lr", raw[0])
            wd = _rate(gi, "weight_decay", raw[1])
            if seen is not None and not seen.sig_tensors and _same(raw[2:], seen.raw[2:]):
                sig, sig_tensors = seen.sig, False
            else:
                sig_tensors = _has_tensor(raw[2:])
                sig = self._check_group_values(group, _group_name(gi))[2]
                if seen is None or sig != seen.sig:
                    resig.append((gi, sig))
            if seen is None or lr != seen.lr or wd != seen.wd:
                rates = True
            tensors = sig_tensors or isinstance(raw[0], torch.Tensor) or isinstance(raw[1], torch.Tensor)
            updates.append((gi, _Seen(raw, tensors, sig_tensors, lr, wd, sig)))
        for gi, sig in resig:
            self._check_same_state(gi, sig)
        for gi, seen in updates:
            self._seen[gi] = seen
        if resig:
            split = False
            for c in self._cohorts:
                sigs = {self._seen[gi].sig for gi in set(c.group_of.tolist())}
                if len(sigs) > 1:
                    split = True
                elif sigs != {c.signature}:
                    self._reconfigure(c, sigs.pop())
            if split:
                self._rebuild(self._partition(signatures=[s.sig for s in self._seen]))
                return self.read_param_groups()
        if rates:
            lrs = np.array([s.lr for s in self._seen])
            wds = np.array([s.wd for s in self._seen])
            for c in self._cohorts:
                c.lrs, c.wds = lrs[c.group_of], wds[c.group_of]
                opt = getattr(c.engine.optimizer, "base", c.engine.optimizer)  # SAM reports its base's
                opt.lr, opt.weight_decay = float(c.lrs[0]), float(c.wds[0])
        return rates

    def _check_same_state(self, gi: int, sig) -> None:
        """A group's kernel-wide values may change, but not into another state (amsgrad, momentum 0 or not)."""
        for c in self._cohorts:
            if gi in c.group_of:
                values = dict(zip(self._keys, sig))
                values.update(lr=1.0, weight_decay=0.0)
                new, cur = self.arraytrain_optimizer(values), c.engine.optimizer
                if type(new) is not type(cur) or new.slot_names != cur.slot_names:
                    before = dict(zip(self._keys, c.signature))
                    diff = {k: (before[k], values[k]) for k in self._keys if before[k] != values[k]}
                    raise HyperparameterError(
                        f"{_group_name(gi)}: changing "
                        f"{', '.join(f'{k} from {a!r} to {b!r}' for k, (a, b) in diff.items())} changes the "
                        f"optimizer's state ({list(cur.slot_names)} -> {list(new.slot_names)}); set it when the "
                        "group is created")

    def _reconfigure(self, c: _Cohort, sig) -> None:
        """A cohort's kernel-wide values changed alike in all its groups (checked by :meth:`_check_same_state`)."""
        values = dict(zip(self._keys, sig))
        values.update(lr=1.0, weight_decay=0.0)
        _assign(c.engine.optimizer, self.arraytrain_optimizer(values))
        c.signature = sig

    def _amp(self):
        """``(scale, found_inf)`` from torch.amp.GradScaler's ``grad_scale`` and ``found_inf``, where it set them.

        GradScaler sets both before it calls a step of an optimizer with
        ``_step_supports_amp_scaling`` (``grad_scale`` None when ``scaler.unscale_`` ran already).
        """
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        scale = 1.0 if grad_scale is None else float(grad_scale)
        return scale, found_inf is not None and float(found_inf) != 0.0

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step; returns what ``closure`` (called first, with gradients on) returned.

        The groups are read, the parameters reconnected (see the module docstring), and each engine
        takes its zero-copy step: the norm pass (unscaling a GradScaler's scale, finding NaN/Inf,
        the global norm for ``max_grad_norm``), then one fused kernel that updates the parameters
        and every state slot and zeroes the gradient buffer. A step where no parameter has a
        gradient changes nothing, as torch's.
        """
        if self._evaluating is not None:
            raise ConcurrentUseError("step: the optimizer is in eval() mode (the parameters hold the evaluation "
                                     "weights); call train() first")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        elif self.two_windows:
            raise ArgumentTypeError(f"closure: {type(self).__name__}.step needs a closure that zeroes the "
                                    "gradients, computes the loss, calls backward() and returns the loss: "
                                    "it takes a second gradient at the perturbed weights")
        divisor, found_inf = self._amp()
        if found_inf:  # GradScaler skips the step and backs its scale off
            for c in self._cohorts:
                c.engine.clean.clear()
            self.reports = ()
            return loss
        rates = self.read_param_groups()
        reports = self._take(divisor, rates)
        if self.two_windows and reports and all(r.perturbed for r in reports):
            with torch.enable_grad():
                closure()
            reports = self._take(1.0, False)
        self.reports = tuple(reports)
        return loss

    def _take(self, divisor: float, rates: bool) -> list:
        plans = [c.engine.check() for c in self._cohorts]
        if all(len(held) == len(c.engine.bound) for c, (_, _, held) in zip(self._cohorts, plans)):
            return []  # no gradient anywhere: torch's optimizers do nothing either
        for c, plan in zip(self._cohorts, plans):
            held = plan[2]
            c.engine.connect(*plan)
            if rates or held or c.held:
                hp = c.engine.state.hp
                hp["lr"][...] = c.lrs
                hp["weight_decay"][...] = c.wds
                if held:  # a parameter without a gradient stays where it is, as torch leaves it
                    hp["lr"][held] = 0.0
                    hp["weight_decay"][held] = 0.0
            c.held = bool(held)
        if len(self._cohorts) == 1:
            c = self._cohorts[0]
            c.engine.max_grad_norm = self.max_grad_norm
            return [self._engine_step(c, divisor, plans[0][2])]
        return self._take_across(divisor, plans)

    def _engine_step(self, c: _Cohort, divisor: float, held):
        e = c.engine
        e.loss_scaler.scale = divisor
        report = e.step()
        e.clean = set(held)
        c.sync_tensors()
        return report

    def _take_across(self, divisor: float, plans) -> list:
        """Several engines: one global norm (and NaN/Inf verdict) over all of them, then each steps."""
        total, bad = 0.0, False
        for c in self._cohorts:
            found = norm_pass(c.engine.kernels, c.engine.grads.flat, c.engine.layout)
            bad = bad or found.nonfinite
            total += found.norm ** 2
        if bad:
            for c in self._cohorts:
                c.engine.zero_grad()
                c.engine.clean.clear()
            self._skips += 1
            if self.max_consecutive_skips is not None and self._skips >= self.max_consecutive_skips:
                raise NonFiniteError(f"{self._skips} consecutive steps had NaN/Inf gradients and were skipped "
                                     f"(max_consecutive_skips={self.max_consecutive_skips})")
            return []
        self._skips = 0
        coef = clip_coef(math.sqrt(total) / divisor, self.max_grad_norm, self.clip_eps)
        out = []
        for c, plan in zip(self._cohorts, plans):
            c.engine.max_grad_norm = None
            out.append(self._engine_step(c, divisor / coef, plan[2]))
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``: ``.grad`` set to None, or (``set_to_none=False``) the gradient buffers zeroed.

        ``set_to_none=False`` keeps every ``.grad`` a view of the engine's buffer, so the next
        ``backward()`` adds into it and the step copies nothing; since each step already zeroes the
        buffer inside its kernel, not calling ``zero_grad`` at all between steps does the same.
        """
        set_to_none = check_bool("set_to_none", set_to_none, error=ArgumentTypeError)
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.grad = None
        if not set_to_none:
            for c in self._cohorts:
                c.engine.zero_grad()
                with torch.no_grad():
                    for _, p, _, grad, *_ in c.engine.bound:
                        if p.grad is not None and p.grad is not grad:
                            p.grad.zero_()

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch's structure: ``{"state": {index: {"step", slots...}}, "param_groups": [...]}``.

        Per parameter: ``"step"`` (a float tensor, as torch's), one tensor per state slot under
        torch's names (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...), a scalar state such as
        NAdam's ``mu_product``, and for a bfloat16/float16 model ``"master"``, its float32 master
        weights. Groups carry their hyperparameters, ``params`` (indices) and, where the parameters
        were given with names, ``param_names``. The tensors are live views, as torch's are:
        ``torch.save`` them, or copy them to keep a snapshot.

        With ``state_dtype="8bit"`` a slot of a parameter of ``min_8bit_size`` elements or more is
        ``{"codes": uint8 tensor of the parameter's shape, "absmax": float32 tensor (one per
        256-element block), "map": "signed" or "unsigned"}`` (bitsandbytes' ``state1``/``absmax1``
        and the dynamic map its ``qmap1`` holds; value = ``map[code] * absmax``, decoded by
        :func:`arraytrain.state8.dequantize`), the same form as the engine's checkpoints; the
        codes and scales are live views, and ``torch.save`` / ``torch.load(weights_only=True)``
        keep them bitwise. A smaller parameter's slot is a float32 tensor. No decoded float copy
        is offered in ``state[p]``: writes into it would be lost.
        """
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        ids, groups, start = {}, [], 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(start, start + len(group["params"])))
            for i, p in zip(packed["params"], group["params"]):
                ids[id(p)] = i
            start += len(group["params"])
            groups.append(packed)
        state = {ids[id(p)]: {k: dict(v) if isinstance(v, dict) else v for k, v in entry.items()}
                 for p, entry in self.state.items() if id(p) in ids}
        out = {"state": state, "param_groups": groups}
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, out)
            if result is not None:
                out = result
        return out

    def load_state_dict(self, state_dict) -> None:
        """Load :meth:`state_dict` output (or torch.optim's own, for the same slots), validated first.

        Groups are matched in order; within a group, parameters are matched by name where both
        sides have ``param_names`` (a renamed or missing name is an error), by position otherwise.
        Each group's hyperparameters become the saved ones (torch's rule). A parameter absent
        from ``state`` starts from zero state. Every parameter of a group must stand at the same
        step. A bfloat16/float16 model's float32 master weights come from ``"master"``, or without
        it from the model's current weights. Anything refused raises
        :class:`~arraytrain.errors.StateDictError` before any write.

        Slots convert as the engine's ``load_state_dict`` converts them (:mod:`arraytrain.state8`):
        an 8-bit entry into an 8-bit slot is kept bitwise, into a float32/bfloat16 slot decoded;
        a float tensor (float32, bfloat16, torch.optim's own) into an 8-bit slot is encoded.
        """
        if self._evaluating is not None:
            raise ConcurrentUseError("load_state_dict: the optimizer is in eval() mode; call train() first")
        if not isinstance(state_dict, Mapping):
            raise StateDictError(f"state_dict: expected a mapping, got {type(state_dict).__name__}")
        state_dict = dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        plan = self._check_state(state_dict)
        self._apply_state(plan)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _check_state(self, sd) -> dict:
        if "state" not in sd or "param_groups" not in sd:
            raise StateDictError(f"state_dict: expected the keys 'state' and 'param_groups', got {sorted(sd)}")
        saved_state, saved_groups = sd["state"], sd["param_groups"]
        if not isinstance(saved_state, Mapping):
            raise StateDictError(f"state_dict['state']: expected a mapping, got {type(saved_state).__name__}")
        if not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(self.param_groups):
            got = len(saved_groups) if isinstance(saved_groups, (list, tuple)) else type(saved_groups).__name__
            raise StateDictError(f"state_dict['param_groups']: expected {len(self.param_groups)} groups, got {got}")
        groups, sources = [], {}
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
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
                _, _, sig = self._check_group_values(merged, where)
            except HyperparameterError as exc:
                raise StateDictError(str(exc)) from None
            groups.append((values, sig))
            for j, i in enumerate(ids):
                sources[(gi, j)] = i
        # each parameter's entry, checked against what its engine holds
        where_now = {}
        for c in self._cohorts:
            for (gi, j), name in zip(c.index, c.engine.layout.names):
                where_now[(gi, j)] = (c, name)
        entries, steps = {}, {}
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
                if k != "master" and isinstance(v, Mapping):  # an 8-bit slot's {"codes", "absmax", "map"}
                    checked[k] = _saved_8bit(f"{label}[{k!r}]", name, buf, v, shape)
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
                        v = _Encoded(buf.check({name: host_array(v, torch, copy=False)}, strict=False)[name])
                    except (ValueError, TypeError, KeyError) as exc:
                        raise StateDictError(f"{label}[{k!r}]: {exc}") from None
                checked[k] = v
            entries[(gi, j)] = checked
        group_steps = []
        for gi in range(len(self.param_groups)):
            found = steps.get(gi, {})
            if len(found) > 1:
                raise StateDictError(f"state_dict: {_group_name(gi)}'s parameters stand at different steps "
                                     f"{ {s: n[:3] for s, n in found.items()} }; arraytrain counts steps per group")
            group_steps.append(next(iter(found)) if found else 0)
        return {"groups": groups, "entries": entries, "steps": group_steps}

    def _apply_state(self, plan) -> None:
        for gi, (values, _) in enumerate(plan["groups"]):
            self.param_groups[gi].update(values)
        self._rebuild(self._partition(steps=plan["steps"], signatures=[s for _, s in plan["groups"]]))
        for c in self._cohorts:
            e = c.engine
            e.state.scalars.update(e.initial_scalars)
            e.state.step = plan["steps"][int(c.group_of[0])]
            with torch.no_grad():
                for (gi, j), name in zip(c.index, e.layout.names):
                    entry = plan["entries"][(gi, j)]
                    if e.lowp and (entry is None or "master" not in entry):
                        tensor_view(e.params[name], torch).copy_(self.param_groups[gi]["params"][j].detach())
                    if entry is None:  # no state saved for it (torch's, before its first gradient)
                        for slot in e.state.slots.values():
                            _zero_slot(slot, name)
                        continue
                    # written one parameter at a time: the saved tensors may be views of these very
                    # buffers (opt.load_state_dict(opt.state_dict()), accelerate's device round trip)
                    for k, v in entry.items():
                        if k in e.state.scalars:
                            e.state.scalars[k] = v
                        elif k == "master":
                            tensor_view(e.params[name], torch).copy_(v)
                        elif isinstance(v, _Encoded):
                            e.state.slots[k].assign({name: v.raw})
                        else:
                            tensor_view(e.state.slots[k][name], torch).copy_(v)
            e.refresh()
            e.clean.clear()
            c.sync_tensors()
        self._seen = [None] * len(self.param_groups)

    def __reduce_ex__(self, protocol):
        raise ArgumentTypeError(f"{type(self).__name__} cannot be pickled or deep-copied (its state lives in "
                                "arraytrain's buffers): save optimizer.state_dict() and load it into a new one")


def _check_tensor(name: str, p) -> None:
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


def _slot_views(buf, names) -> dict:
    """Per name, what ``state[p]`` shows of a slot: a live tensor view, or for an 8-bit parameter
    ``{"codes", "absmax", "map"}`` with live views of its codes and block scales."""
    if not isinstance(buf, state8.Quant8Buffer):
        return {name: tensor_view(buf[name], torch) for name in names}
    out = {}
    for name, v in buf.as_dict().items():
        if state8.is_q8_entry(v):
            out[name] = {"codes": tensor_view(v["codes"], torch), "absmax": tensor_view(v["absmax"], torch),
                         "map": v["map"]}
        else:  # a parameter under min_8bit_size: its float32 state
            out[name] = tensor_view(v, torch)
    return out


class _Encoded:
    """A slot's checked bytes for one parameter of an 8-bit slot (:meth:`Quant8Buffer.check`'s form)."""

    __slots__ = ("raw",)

    def __init__(self, raw):
        self.raw = raw


def _zero_slot(buf, name: str) -> None:
    if isinstance(buf, state8.Quant8Buffer):  # the codes of 0 and a zero block scale, as a fresh slot's
        buf.load({name: np.zeros(buf.layout.shape(name), np.float32)}, strict=False)
    else:
        buf[name][...] = 0


def _saved_8bit(label: str, name: str, buf, v: Mapping, shape):
    """A saved 8-bit entry ``{"codes", "absmax", "map"}`` for a slot: checked, and converted the
    engine's way (:mod:`arraytrain.state8`): kept bitwise by an 8-bit slot (re-encoded if its map
    differs), decoded to float32 for a float32/bfloat16 slot."""
    if set(v) != {"codes", "absmax", "map"}:
        raise StateDictError(f"{label}: an 8-bit slot is {{'codes', 'absmax', 'map'}}, got the keys "
                             f"{sorted(map(str, v))}")
    for part in ("codes", "absmax"):
        if not isinstance(v[part], torch.Tensor):
            raise StateDictError(f"{label}[{part!r}]: expected a tensor, got {type(v[part]).__name__}")
    entry = {"codes": host_array(v["codes"], torch, copy=False), "absmax": host_array(v["absmax"], torch, copy=False),
             "map": v["map"]}
    try:
        if isinstance(buf, state8.Quant8Buffer):
            return _Encoded(buf.check({name: entry}, strict=False)[name])
        return torch.from_numpy(state8.decode_entry(name, entry, shape))
    except (ValueError, TypeError, KeyError) as exc:
        raise StateDictError(f"{label}: {exc}") from None


def _assign(dst, src) -> None:
    """Copy ``src``'s hyperparameters (but lr, weight_decay and overrides) onto ``dst``, SAM's base too."""
    for k, v in src.hyperparameters().items():
        if k in ("lr", "weight_decay", "overrides", "state_dtype", "base", "base_hyperparameters"):
            continue
        setattr(dst, k, v)
    base = getattr(src, "base", None)
    if base is not None:
        _assign(dst.base, base)




class _Defaults(Exception):
    def __init__(self, defaults):
        super().__init__()
        self.defaults = defaults


_PROBE = object()


def group_defaults(cls, **hyperparameters) -> dict:
    """The param-group defaults ``cls(params, **hyperparameters)`` would make (its constructor's binding)."""
    probe = cls.__new__(cls)
    try:
        cls.__init__(probe, _PROBE, **hyperparameters)
    except _Defaults as found:
        return found.defaults
    raise AssertionError(f"{cls.__name__}.__init__ does not pass its defaults to TorchOptimizer")  # pragma: no cover


def _bool(h, key) -> bool:
    return check_bool(key, h[key])


# -- the optimizers, torch's constructors ---------------------------------------------------------

class Adam(TorchOptimizer):
    """torch.optim.Adam's constructor, :class:`arraytrain.optim.Adam`'s step (AdamW's with ``decoupled_weight_decay``)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False, max_grad_norm=None, clip_eps=CLIP_EPS, state_dtype=None,
                 min_8bit_size=None, kernels="numba", max_consecutive_skips=50):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad,
                    "maximize": maximize, "foreach": foreach, "capturable": capturable,
                    "differentiable": differentiable, "fused": fused, "decoupled_weight_decay": decoupled_weight_decay}
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, clip_eps=clip_eps, state_dtype=state_dtype,
                         min_8bit_size=min_8bit_size, kernels=kernels, max_consecutive_skips=max_consecutive_skips)

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.Adam`, or :class:`~arraytrain.optim.AdamW` with ``decoupled_weight_decay``."""
        cls = optim.AdamW if _bool(values, "decoupled_weight_decay") else optim.Adam
        return cls(values["lr"], values["betas"], values["eps"], values["weight_decay"], values["amsgrad"],
                   maximize=values["maximize"], state_dtype=self.state_dtype)


class AdamW(Adam):
    """torch.optim.AdamW's constructor, :class:`arraytrain.optim.AdamW`'s step (decoupled weight decay)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 max_grad_norm=None, clip_eps=CLIP_EPS, state_dtype=None, min_8bit_size=None, kernels="numba",
                 max_consecutive_skips=50):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, max_grad_norm=max_grad_norm, clip_eps=clip_eps,
                         state_dtype=state_dtype, min_8bit_size=min_8bit_size, kernels=kernels,
                         max_consecutive_skips=max_consecutive_skips)


class SGD(TorchOptimizer):
    """torch.optim.SGD's constructor, :class:`arraytrain.optim.SGD`'s step (momentum, dampening, Nesterov)."""

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None, max_grad_norm=None,
                 clip_eps=CLIP_EPS, state_dtype=None, min_8bit_size=None, kernels="numba",
                 max_consecutive_skips=50):
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay,
                    "nesterov": nesterov, "maximize": maximize, "foreach": foreach, "differentiable": differentiable,
                    "fused": fused}
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, clip_eps=clip_eps, state_dtype=state_dtype,
                         min_8bit_size=min_8bit_size, kernels=kernels, max_consecutive_skips=max_consecutive_skips)

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.SGD` of one group's values."""
        return optim.SGD(values["lr"], values["momentum"], values["dampening"], values["weight_decay"],
                         values["nesterov"], maximize=values["maximize"], state_dtype=self.state_dtype)


class Adagrad(TorchOptimizer):
    """torch.optim.Adagrad's constructor, :class:`arraytrain.optim.Adagrad`'s step."""

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10,
                 foreach=None, *, maximize=False, differentiable=False, fused=None, max_grad_norm=None,
                 clip_eps=CLIP_EPS, state_dtype=None, min_8bit_size=None, kernels="numba",
                 max_consecutive_skips=50):
        defaults = {"lr": lr, "lr_decay": lr_decay, "eps": eps, "weight_decay": weight_decay,
                    "initial_accumulator_value": initial_accumulator_value, "foreach": foreach,
                    "maximize": maximize, "differentiable": differentiable, "fused": fused}
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, clip_eps=clip_eps, state_dtype=state_dtype,
                         min_8bit_size=min_8bit_size, kernels=kernels, max_consecutive_skips=max_consecutive_skips)

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.Adagrad` of one group's values."""
        return optim.Adagrad(values["lr"], values["lr_decay"], values["weight_decay"],
                             values["initial_accumulator_value"], values["eps"], maximize=values["maximize"],
                             state_dtype=self.state_dtype)


class RMSprop(TorchOptimizer):
    """torch.optim.RMSprop's constructor, :class:`arraytrain.optim.RMSprop`'s step (momentum, centered)."""

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False,
                 capturable=False, foreach=None, maximize=False, differentiable=False, *, max_grad_norm=None,
                 clip_eps=CLIP_EPS, state_dtype=None, min_8bit_size=None, kernels="numba",
                 max_consecutive_skips=50):
        defaults = {"lr": lr, "momentum": momentum, "alpha": alpha, "eps": eps, "centered": centered,
                    "weight_decay": weight_decay, "capturable": capturable, "foreach": foreach,
                    "maximize": maximize, "differentiable": differentiable}
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, clip_eps=clip_eps, state_dtype=state_dtype,
                         min_8bit_size=min_8bit_size, kernels=kernels, max_consecutive_skips=max_consecutive_skips)

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.RMSprop` of one group's values."""
        return optim.RMSprop(values["lr"], values["alpha"], values["eps"], values["weight_decay"], values["momentum"],
                             values["centered"], maximize=values["maximize"], state_dtype=self.state_dtype)


class NAdam(TorchOptimizer):
    """torch.optim.NAdam's constructor, :class:`arraytrain.optim.NAdam`'s step (``mu_product`` in the state)."""

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, momentum_decay=4e-3,
                 decoupled_weight_decay=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, max_grad_norm=None, clip_eps=CLIP_EPS, state_dtype=None, min_8bit_size=None,
                 kernels="numba", max_consecutive_skips=50):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "momentum_decay": momentum_decay, "decoupled_weight_decay": decoupled_weight_decay,
                    "maximize": maximize, "foreach": foreach, "capturable": capturable,
                    "differentiable": differentiable}
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, clip_eps=clip_eps, state_dtype=state_dtype,
                         min_8bit_size=min_8bit_size, kernels=kernels, max_consecutive_skips=max_consecutive_skips)

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.NAdam` of one group's values."""
        return optim.NAdam(values["lr"], values["betas"], values["eps"], values["weight_decay"],
                           values["momentum_decay"], values["decoupled_weight_decay"], maximize=values["maximize"],
                           state_dtype=self.state_dtype)


class RAdam(TorchOptimizer):
    """torch.optim.RAdam's constructor, :class:`arraytrain.optim.RAdam`'s step."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, decoupled_weight_decay=False,
                 *, foreach=None, maximize=False, capturable=False, differentiable=False, max_grad_norm=None,
                 clip_eps=CLIP_EPS, state_dtype=None, min_8bit_size=None, kernels="numba",
                 max_consecutive_skips=50):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "maximize": maximize,
                    "foreach": foreach, "capturable": capturable, "decoupled_weight_decay": decoupled_weight_decay,
                    "differentiable": differentiable}
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, clip_eps=clip_eps, state_dtype=state_dtype,
                         min_8bit_size=min_8bit_size, kernels=kernels, max_consecutive_skips=max_consecutive_skips)

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.RAdam` of one group's values."""
        return optim.RAdam(values["lr"], values["betas"], values["eps"], values["weight_decay"],
                           values["decoupled_weight_decay"], maximize=values["maximize"], state_dtype=self.state_dtype)


class Adamax(TorchOptimizer):
    """torch.optim.Adamax's constructor, :class:`arraytrain.optim.Adamax`'s step."""

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, foreach=None, *,
                 maximize=False, differentiable=False, capturable=False, max_grad_norm=None, clip_eps=CLIP_EPS,
                 state_dtype=None, min_8bit_size=None, kernels="numba", max_consecutive_skips=50):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "foreach": foreach,
                    "maximize": maximize, "differentiable": differentiable, "capturable": capturable}
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, clip_eps=clip_eps, state_dtype=state_dtype,
                         min_8bit_size=min_8bit_size, kernels=kernels, max_consecutive_skips=max_consecutive_skips)

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.Adamax` of one group's values."""
        return optim.Adamax(values["lr"], values["betas"], values["eps"], values["weight_decay"],
                            maximize=values["maximize"], state_dtype=self.state_dtype)


class Adadelta(TorchOptimizer):
    """torch.optim.Adadelta's constructor, :class:`arraytrain.optim.Adadelta`'s step."""

    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0, foreach=None, *, capturable=False,
                 maximize=False, differentiable=False, max_grad_norm=None, clip_eps=CLIP_EPS, state_dtype=None,
                 min_8bit_size=None, kernels="numba", max_consecutive_skips=50):
        defaults = {"lr": lr, "rho": rho, "eps": eps, "weight_decay": weight_decay, "maximize": maximize,
                    "capturable": capturable, "foreach": foreach, "differentiable": differentiable}
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, clip_eps=clip_eps, state_dtype=state_dtype,
                         min_8bit_size=min_8bit_size, kernels=kernels, max_consecutive_skips=max_consecutive_skips)

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.Adadelta` of one group's values."""
        return optim.Adadelta(values["lr"], values["rho"], values["eps"], values["weight_decay"],
                              maximize=values["maximize"], state_dtype=self.state_dtype)


class Adafactor(TorchOptimizer):
    """torch.optim.Adafactor's constructor, :class:`arraytrain.optim.Adafactor`'s step (factored second moments)."""

    takes_state_dtype = False

    def __init__(self, params, lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.0, *,
                 foreach=None, maximize=False, max_grad_norm=None, clip_eps=CLIP_EPS, state_dtype=None,
                 min_8bit_size=None, kernels="numba", max_consecutive_skips=50):
        defaults = {"lr": lr, "beta2_decay": beta2_decay, "eps": eps, "d": d, "weight_decay": weight_decay,
                    "foreach": foreach, "maximize": maximize}
        # state_dtype and min_8bit_size: taken to be refused with a typed error (arraytrain's Adafactor has none)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, clip_eps=clip_eps, state_dtype=state_dtype,
                         min_8bit_size=min_8bit_size, kernels=kernels, max_consecutive_skips=max_consecutive_skips)

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.Adafactor` of one group's values."""
        return optim.Adafactor(values["lr"], values["beta2_decay"], values["eps"], values["d"], values["weight_decay"],
                               maximize=values["maximize"])


class Muon(TorchOptimizer):
    """torch.optim.Muon's constructor, :class:`arraytrain.optim.Muon`'s step: matrices only, as torch's.

    Parameters with two or more dimensions (a >2-D one as its first dimension by the rest);
    give biases, norms and embeddings to another optimizer (e.g. this module's ``AdamW``), as
    with torch's Muon.
    """

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5, adjust_lr_fn=None, *,
                 max_grad_norm=None, clip_eps=CLIP_EPS, state_dtype=None, min_8bit_size=None, kernels="numba",
                 max_consecutive_skips=50):
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "ns_coefficients": ns_coefficients, "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn}
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, clip_eps=clip_eps, state_dtype=state_dtype,
                         min_8bit_size=min_8bit_size, kernels=kernels, max_consecutive_skips=max_consecutive_skips)

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``; every parameter must have two or more dimensions."""
        if isinstance(param_group, dict) and "params" in param_group:
            params = param_group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            for j, item in enumerate(params):
                name, p = item if isinstance(item, tuple) and len(item) == 2 else (f"params[{j}]", item)
                if isinstance(p, torch.Tensor) and p.dim() < 2:
                    raise LayoutError(f"{name!r}: Muon updates matrices (2 or more dims), got shape "
                                      f"{tuple(p.shape)}; give biases and norms to another optimizer, e.g. AdamW")
            param_group = {**param_group, "params": params}
        super().add_param_group(param_group)

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.Muon` of one group's values (no fallback: matrices only)."""
        return optim.Muon(values["lr"], values["weight_decay"], values["momentum"], values["nesterov"],
                          values["ns_coefficients"], values["eps"], values["ns_steps"], values["adjust_lr_fn"],
                          state_dtype=self.state_dtype)


class Lion(TorchOptimizer):
    """:class:`arraytrain.optim.Lion` (Chen et al., 2023) as a torch optimizer; arraytrain's names and defaults."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=1e-3, *, maximize=False, max_grad_norm=None,
                 clip_eps=CLIP_EPS, state_dtype=None, min_8bit_size=None, kernels="numba",
                 max_consecutive_skips=50):
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay, "maximize": maximize}
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, clip_eps=clip_eps, state_dtype=state_dtype,
                         min_8bit_size=min_8bit_size, kernels=kernels, max_consecutive_skips=max_consecutive_skips)

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.Lion` of one group's values."""
        return optim.Lion(values["lr"], values["betas"], values["weight_decay"], maximize=values["maximize"],
                          state_dtype=self.state_dtype)


class LAMB(TorchOptimizer):
    """:class:`arraytrain.optim.LAMB` (You et al., 2020) as a torch optimizer; arraytrain's names and defaults."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, *, eps_root=0.0,
                 maximize=False, max_grad_norm=None, clip_eps=CLIP_EPS, state_dtype=None, min_8bit_size=None,
                 kernels="numba",
                 max_consecutive_skips=50):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "eps_root": eps_root,
                    "maximize": maximize}
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, clip_eps=clip_eps, state_dtype=state_dtype,
                         min_8bit_size=min_8bit_size, kernels=kernels, max_consecutive_skips=max_consecutive_skips)

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.LAMB` of one group's values."""
        return optim.LAMB(values["lr"], values["betas"], values["eps"], values["weight_decay"],
                          eps_root=values["eps_root"], maximize=values["maximize"], state_dtype=self.state_dtype)


class Sophia(TorchOptimizer):
    """:class:`arraytrain.optim.Sophia` (Liu et al., 2023) as a torch optimizer, with SophiaG's ``update_hessian``.

    Every k steps, take the gradient of the loss on labels sampled from the model's own
    output distribution (the Gauss-Newton-Bartlett estimator), call :meth:`update_hessian`,
    then zero the gradients and take the ordinary step's gradient.
    """

    takes_state_dtype = False

    def __init__(self, params, lr=1e-4, betas=(0.965, 0.99), rho=0.04, weight_decay=0.1, *, eps=1e-15, bs=5120,
                 maximize=False, max_grad_norm=None, clip_eps=CLIP_EPS, state_dtype=None, min_8bit_size=None,
                 kernels="numba", max_consecutive_skips=50):
        defaults = {"lr": lr, "betas": betas, "rho": rho, "weight_decay": weight_decay, "eps": eps, "bs": bs,
                    "maximize": maximize}
        # state_dtype and min_8bit_size: taken to be refused with a typed error (arraytrain's Sophia has no state_dtype)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, clip_eps=clip_eps, state_dtype=state_dtype,
                         min_8bit_size=min_8bit_size, kernels=kernels, max_consecutive_skips=max_consecutive_skips)

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.Sophia` of one group's values."""
        return optim.Sophia(values["lr"], values["betas"], values["rho"], values["weight_decay"], eps=values["eps"],
                            bs=values["bs"], maximize=values["maximize"])

    @torch.no_grad()
    def update_hessian(self) -> None:
        """SophiaG's ``update_hessian``: ``h <- beta2 h + (1 - beta2) g*g`` from each parameter's ``.grad``.

        A parameter whose ``.grad`` is None counts as a zero estimate. The gradients are read, not changed.
        """
        if self._evaluating is not None:
            raise ConcurrentUseError("update_hessian: the optimizer is in eval() mode; call train() first")
        self.read_param_groups()
        for c in self._cohorts:
            estimates = {}
            for name, p, *_ in c.engine.bound:
                g = p.grad
                est = torch.zeros(p.shape, dtype=torch.float32, device=p.device) if g is None else g.float().square()
                estimates[name] = est.numpy() if est.device.type == "cpu" else est
            c.engine.update_hessian(estimates)


class ScheduleFreeAdamW(TorchOptimizer):
    """:class:`arraytrain.optim.ScheduleFreeAdamW` (Defazio et al., 2024) as a torch optimizer.

    As the ``schedulefree`` package's optimizers: call :meth:`train` before training steps
    and :meth:`eval` before evaluating or saving the model, whose parameters then hold the
    averaged weights x (while training they hold y, where gradients are taken).
    """

    def __init__(self, params, lr=0.0025, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, warmup_steps=0,
                 weight_lr_power=2.0, *, maximize=False, max_grad_norm=None, clip_eps=CLIP_EPS, state_dtype=None,
                 min_8bit_size=None, kernels="numba", max_consecutive_skips=50):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "warmup_steps": warmup_steps,
                    "weight_lr_power": weight_lr_power, "maximize": maximize}
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, clip_eps=clip_eps, state_dtype=state_dtype,
                         min_8bit_size=min_8bit_size, kernels=kernels, max_consecutive_skips=max_consecutive_skips)

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.ScheduleFreeAdamW` of one group's values."""
        return optim.ScheduleFreeAdamW(values["lr"], values["betas"], values["eps"], values["weight_decay"],
                                       values["warmup_steps"], values["weight_lr_power"], maximize=values["maximize"],
                                       state_dtype=self.state_dtype)

    def eval(self) -> None:
        """The parameters hold the evaluation weights x until :meth:`train` (no-op when already there)."""
        if self._evaluating is not None:
            return
        stack = contextlib.ExitStack()
        try:
            for c in self._cohorts:
                stack.enter_context(c.engine.evaluation())
        except BaseException:
            stack.close()
            raise
        self._evaluating = stack

    def train(self) -> None:
        """The parameters hold y again, bit for bit (no-op when already there)."""
        if self._evaluating is None:
            return
        stack, self._evaluating = self._evaluating, None
        stack.close()


class SAM(TorchOptimizer):
    """SAM / ASAM (Foret et al., 2021; Kwon et al., 2021) over a base optimizer, davda54/sam's constructor.

    ``SAM(params, AdamW, rho=0.05, adaptive=False, lr=..., weight_decay=...)``: the base is one
    of this module's classes (or the torch.optim class of the same name), its hyperparameters
    given as keywords; the groups hold them with ``rho`` and ``adaptive``.
    :meth:`~TorchOptimizer.step` needs a closure (zero the gradients if you like, compute the
    loss, ``backward()``, return the loss): it is called at the weights, then at the ascent
    point; the base step is then taken from the weights with the second gradient.
    """

    two_windows = True

    def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, *, max_grad_norm=None, clip_eps=CLIP_EPS,
                 state_dtype=None, min_8bit_size=None, kernels="numba", max_consecutive_skips=50,
                 **base_hyperparameters):
        if params is _PROBE:
            raise _Defaults({})
        self.base_optimizer = _base_class(base_optimizer)
        self.takes_state_dtype = self.base_optimizer.takes_state_dtype
        try:
            defaults = group_defaults(self.base_optimizer, **base_hyperparameters)
        except TypeError as exc:
            raise HyperparameterError(f"base_hyperparameters: {exc}") from None
        defaults.update(rho=rho, adaptive=adaptive)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm, clip_eps=clip_eps, state_dtype=state_dtype,
                         min_8bit_size=min_8bit_size, kernels=kernels, max_consecutive_skips=max_consecutive_skips)

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.SAM` over the base's arraytrain optimizer (which makes the state)."""
        base = self.base_optimizer.arraytrain_optimizer(self, values)
        base.min_8bit_size = self.min_8bit_size
        return optim.SAM(base, values["rho"], values["adaptive"])

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``, before the first step only: SAM's ascent is along the whole gradient."""
        if self._built and any(c.engine.state.step for c in self._cohorts):
            raise LayoutError("add_param_group: SAM perturbs all parameters along one gradient norm; a group "
                              "added after the first step (with a step count of its own) is not supported")
        super().add_param_group(param_group)


def _base_class(base):
    mine = {n: globals()[n] for n in __all__ if n not in ("SAM", "TorchOptimizer")}
    if isinstance(base, str) and base in mine:
        return mine[base]
    if isinstance(base, type) and issubclass(base, TorchOptimizer) and base is not SAM and base is not TorchOptimizer:
        return base
    if isinstance(base, type) and issubclass(base, torch.optim.Optimizer) and base.__name__ in mine:
        return mine[base.__name__]
    raise HyperparameterError(f"base_optimizer: expected one of {sorted(mine)} (a class of "
                              f"arraytrain.interop.torch, the torch.optim class of that name, or the name), got {base!r}")


for _cls in (TorchOptimizer, Adam, AdamW, SGD, Adagrad, RMSprop, NAdam, RAdam, Adamax, Adadelta, Adafactor, Muon,
             Lion, LAMB, Sophia, ScheduleFreeAdamW, SAM):
    _cls.__module__ = PUBLIC_MODULE
