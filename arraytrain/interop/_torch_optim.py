"""The drop-in optimizers' contract: :class:`TorchOptimizer`, a ``torch.optim.Optimizer`` whose step is
arraytrain's, and the table its subclasses fill (torch's constructor, :data:`OPTIONS`).

Imported with torch, lazily, by :mod:`arraytrain.interop.torch` (``at_torch.AdamW``): see that
module's docstring for what the classes do. The classes are in :mod:`._torch_dropins`, their
engines in :mod:`._torch_engine`, the state dict's checks and writes in :mod:`._torch_state`.

How a step runs. The parameters of the param groups live in one or a few engines
(:class:`GroupEngine`, a "cohort" each): parameters that share a dtype and device, a step
count and every hyperparameter that is one number for a whole kernel (betas, eps, momentum,
...). ``lr`` and ``weight_decay`` may differ freely between the groups of one cohort: they are
the engine's per-parameter values (``engine.state.hp``), rewritten from the groups when a group
changed, without a pass over any buffer. Usually there is one cohort, so one step is one norm
pass and one fused kernel over every parameter; for Adam and AdamW with float32 state, both in one
compiled call (:meth:`GroupEngine.lean_step`; parameters without a gradient left out, each parameter
at its own step count), bitwise the engine's staged step. The class's ``step`` carries its own version of torch's step wrapper
(:func:`_hooked`): torch's hooks, and the profiler's range only while a profiler runs.

A group's hyperparameters are read at every :meth:`TorchOptimizer.step`: a tuple of the group's
values is compared with the last one (0-d tensors are read each time); only what changed is
validated and mapped. Groups that come to disagree on a kernel-wide value (a scheduler giving
two groups different momenta), a group added by ``add_param_group`` after the first step (torch
counts steps per parameter: the new group starts at step 1), and a ``load_state_dict`` whose
groups stand at different steps split the cohorts; the engines are rebuilt once, their state
carried over by parameter name.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
from collections import defaultdict
from collections.abc import Mapping
from itertools import chain

import numpy as np
import torch
import torch.optim.optimizer as _torch_optimizer

from .. import optim, param_steps, state8
from .._checks import check_bool, check_int, check_number
from ..errors import (
    ArgumentTypeError,
    BackendError,
    BackendUnavailableError,
    ConcurrentUseError,
    DTypeError,
    HyperparameterError,
    LayoutError,
    NonFiniteError,
    StateDictError,
)
from ..ops import CLIP_EPS, clip_coef, norm_pass
from ..parallel.communicator import check_parallel
from ._torch_engine import LOWP, Cohort, GroupEngine, group_name, plain_value
from ._torch_state import check_state, load_entries, slot_views
from ._torch_views import check_cuda_device, tensor_view

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
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
#: The options every drop-in takes after torch's hyperparameters, keyword-only, with their defaults
#: (:class:`TorchOptimizer` documents them).
OPTIONS = {"max_grad_norm": None, "clip_eps": CLIP_EPS, "state_dtype": None, "min_8bit_size": None,
           "kernels": "numba", "max_consecutive_skips": 50, "nonfinite": "skip", "comm": None, "shard_state": False,
           "overlap": None, "bucket_bytes": None}


# torch.optim.Optimizer.profile_hook_step's registries of global step hooks (torch wraps every optimizer's step
# in that function, see _hooked); None where this torch keeps them elsewhere (then torch's wrapper stays)
_GLOBAL_HOOKS = (getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None),
                 getattr(_torch_optimizer, "_global_optimizer_post_hooks", None))


def _hooked(step):
    """``step`` wrapped as torch wraps an optimizer's ``step`` (``Optimizer.profile_hook_step``): the global
    and the optimizer's step pre-hooks (which may replace the arguments), the step, then the post-hooks,
    in torch's order, inside the profiler's ``Optimizer.step#<class>.step`` range with torch's
    ``_optimizer_step_code`` entry point; but the range and that call only while a profiler runs, and
    the hooks' walk only where a hook is registered. torch's wrapper enters its range on every step, an
    op call; inside a training loop the wrapper cost the drop-in's step some 130-220 µs (the CNN and
    the small TransformerEncoder of ``python -m arraytrain.bench dropin``). Marked ``hooked``, so
    torch does not wrap it again."""
    pre_all, post_all = _GLOBAL_HOOKS

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        self = args[0]
        if torch.autograd._profiler_enabled():
            with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
                return _with_hooks(self, step, args, kwargs, True)
        if pre_all or post_all or self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks:
            return _with_hooks(self, step, args, kwargs, False)
        return step(*args, **kwargs)

    def _with_hooks(self, step, args, kwargs, profiling):
        for pre_hook in chain(pre_all.values(), self._optimizer_step_pre_hooks.values()):
            result = pre_hook(self, args, kwargs)
            if result is not None:
                if isinstance(result, tuple) and len(result) == 2:
                    args, kwargs = result
                else:
                    raise RuntimeError(f"{step} must return None or a tuple of (new_args, new_kwargs), but got "
                                       f"{result}.")
        out = step(*args, **kwargs)
        if profiling:
            self._optimizer_step_code()
        for post_hook in chain(self._optimizer_step_post_hooks.values(), post_all.values()):
            post_hook(self, args, kwargs)
        return out

    wrapper.hooked = True
    return wrapper


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


_VIEWABLE = (torch.float32, torch.float64)


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
    state_dtype : None, "float32", "bfloat16", "8bit" or "float8"
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
        into them is a write into the state): see :meth:`state_dict`. "float8" keeps the same
        layout with float8 codes (e4m3; e5m2 for second moments) and a float32 ``scale`` per block
        (``{"codes", "scale", "map": "e4m3" or "e5m2"}``), a codec
        cheaper than the dynamic map's.
    min_8bit_size : int or None
        With ``state_dtype="8bit"`` or ``"float8"``: parameters with fewer elements keep their state in float32
        (bitsandbytes' argument of that name; None: its default, 4096). Refused with another
        ``state_dtype``, where it would mean nothing.
    kernels : "numba" or "reference"
        The fused kernels, or their slow reference twins.
    max_consecutive_skips : int or None
        A step whose gradient holds NaN/Inf changes nothing (GradScaler's found_inf, or the
        engine's own check); after this many in a row :class:`~arraytrain.NonFiniteError`
        is raised (None: never). A step under a GradScaler that found an inf is not counted.
    nonfinite : "skip" or "apply"
        "skip": the step finds NaN/Inf in the gradient (in the norm pass it makes anyway) and
        changes nothing. "apply": torch.optim's choice without a GradScaler, the step applies the
        gradient as it is (NaN/Inf reach the weights), and without ``max_grad_norm`` the step
        makes no norm pass at all: one read of the gradients less. Under a GradScaler its
        ``found_inf`` still skips the step.
    comm : a :class:`~arraytrain.parallel.Communicator` or None
        Data parallelism in the optimizer, DDP's work without wrapping the model: every rank
        runs the same model on its share of the batch, and each ``step()`` averages the ranks'
        gradients (one all-reduce, or buckets that overlap the backward pass) before its norm,
        clip and update, so every rank steps identically; the ranks start from rank 0's
        weights (broadcast at construction). E.g. ``arraytrain.distributed.TorchComm()`` under
        ``torchrun``, or ``MPIComm()``. The gradients each rank's ``.grad`` holds until the step
        are its own: clip with ``max_grad_norm=`` (the clip of the averaged gradient, as
        ``clip_grad_norm_`` after DDP's backward), not ``clip_grad_norm_`` before the step. The
        param groups must share one engine (one dtype and device, the same kernel-wide
        hyperparameters). A parameter counts as having a gradient when any rank has one.
    shard_state : bool
        With ``comm``: each rank keeps and updates one contiguous partition of the optimizer state
        (ZeRO stage 1-2, as DDP + ``ZeroRedundancyOptimizer``): a step is a reduce-scatter of the
        gradients, the own partition's update and an all-gather of the weights. ``state[p]`` then
        holds ``"step"`` only (the slots are spread over the ranks), and :meth:`state_dict` and
        :meth:`load_state_dict` are collectives that every rank calls (as ZeRO's
        ``consolidate_state_dict``): ``state_dict()`` returns the whole state, torch's format, on
        every rank. For float32/float64 models, with float32 or bfloat16 state.
    overlap : bool or None
        With ``comm``: start each bucket's all-reduce while the backward pass still runs (a
        post-accumulate-grad hook per parameter copies a gradient torch allocated into the
        buffer and marks it ready). None: on where it can be (float32/float64 parameters, not
        SAM), as :func:`~arraytrain.interop.torch.bind` and DDP do. Accumulating several
        backward passes before one step is then refused by the hook (as bind refuses it):
        pass ``overlap=False`` for that.
    bucket_bytes : int or None
        The overlapped exchange's bucket size (None: an eighth of the gradient, between 1 and
        25 MiB, as :class:`~arraytrain.Engine`).
    """

    _step_supports_amp_scaling = True
    # an arraytrain optimizer that takes two gradient windows per step (SAM) needs a closure
    two_windows = False
    # state_dtype is refused where the arraytrain optimizer takes none (Adafactor, Sophia)
    takes_state_dtype = True
    #: torch's constructor of the class: ``(positional, keyword-only)`` hyperparameters, each a
    #: ``(name, default)`` pair in torch's order; the class's signature is built from it and :data:`OPTIONS`
    HYPERPARAMETERS: tuple = ((), ())
    #: Keys of :data:`TUNE_CHECKS` whose new values are set on the arraytrain optimizer as they are
    #: (the attribute of the same name), without building a new one.
    TUNABLE: tuple = ()
    #: group values the class sets itself (AdamW: ``decoupled_weight_decay=True``)
    FIXED: dict = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "HYPERPARAMETERS" in cls.__dict__:
            positional, keyword = cls.HYPERPARAMETERS
            P = inspect.Parameter
            cls.__signature__ = inspect.Signature(
                [P("params", P.POSITIONAL_OR_KEYWORD)]
                + [P(n, P.POSITIONAL_OR_KEYWORD, default=d) for n, d in positional]
                + [P(n, P.KEYWORD_ONLY, default=d) for n, d in (*keyword, *OPTIONS.items())])

    def __init__(self, params, *args, **kwargs):
        """torch's constructor of the class (its ``inspect.signature``), then :data:`OPTIONS`."""
        bound = type(self).__signature__.bind(params, *args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        options = {k: values.pop(k) for k in OPTIONS}
        del values["params"]
        self.setup(params, {**values, **self.FIXED}, options)

    @classmethod
    def group_defaults(cls, **hyperparameters) -> dict:
        """The param-group defaults ``cls(params, **hyperparameters)`` makes (a ``TypeError`` for an unknown
        or missing name, as the constructor's)."""
        positional, keyword = cls.HYPERPARAMETERS
        P = inspect.Parameter
        sig = inspect.Signature([P(n, P.KEYWORD_ONLY, default=d) for n, d in (*positional, *keyword)])
        bound = sig.bind(**hyperparameters)
        bound.apply_defaults()
        return {**bound.arguments, **cls.FIXED}

    def setup(self, params, defaults: dict, options: Mapping) -> None:
        """What every constructor does: the options (:data:`OPTIONS`, those not given at their defaults)
        checked, the groups made from ``params`` and ``defaults`` (torch's), the engines built."""
        options = {**OPTIONS, **options}
        max_grad_norm, clip_eps, state_dtype = options["max_grad_norm"], options["clip_eps"], options["state_dtype"]
        min_8bit_size, kernels = options["min_8bit_size"], options["kernels"]
        max_consecutive_skips = options["max_consecutive_skips"]
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
        elif state_dtype not in ("8bit", "float8"):
            raise HyperparameterError(f"min_8bit_size: the size under which a parameter keeps float32 state applies "
                                      f"with state_dtype='8bit' or 'float8' only, got min_8bit_size={min_8bit_size!r} with "
                                      f"state_dtype={state_dtype!r}")
        self.min_8bit_size = check_int("min_8bit_size", min_8bit_size, 0)
        if kernels not in ("numba", "reference"):
            raise HyperparameterError(f"kernels: expected 'numba' or 'reference', got {kernels!r}")
        self.kernels = kernels
        if max_consecutive_skips is not None:
            max_consecutive_skips = check_int("max_consecutive_skips", max_consecutive_skips, 1)
        self.max_consecutive_skips = max_consecutive_skips
        if options["nonfinite"] not in ("skip", "apply"):
            raise HyperparameterError(f"nonfinite: expected 'skip' or 'apply', got {options['nonfinite']!r}")
        self.nonfinite = options["nonfinite"]
        overlap = options["overlap"]  # None: on where it can be (see _engine_parallel)
        comm, shard_state, _, bucket_bytes = check_parallel(
            options["comm"], options["shard_state"], False if overlap is None else overlap, options["bucket_bytes"])
        if shard_state and state_dtype in ("8bit", "float8"):
            raise HyperparameterError(f"shard_state: sharded {state_dtype} state is not built for the drop-in optimizers "
                                      "(their state dicts show 8-bit slots by parameter); use bind(model, optimizer, "
                                      "comm=..., shard_state=True), or state_dtype='bfloat16'")
        if overlap and comm.is_local:
            raise HyperparameterError("overlap: the overlapped exchange needs a group of processes (comm=...)")
        self._overlap = overlap
        self._parallel = {"comm": comm, "bucket_bytes": bucket_bytes, "shard_state": shard_state}
        self._keys = tuple(k for k in defaults if k not in PER_PARAM and k not in IGNORED_FLAGS
                           and k not in REFUSED_FLAGS)
        self._read_keys = ("lr", "weight_decay", *self._keys)
        self._read_values = operator.itemgetter(*self._read_keys)  # a group's values as a tuple, in one C call
        self._tunable = {i: TUNE_CHECKS[k] for i, k in enumerate(self._keys) if k in self.TUNABLE}
        self._cohorts: list[Cohort] = []
        self._by_sig: dict = {}  # kernel-wide values -> their arraytrain optimizer (see _optimizer_of)
        self._seen: list = []  # per group: a _Seen (the values the last read found), None: read it anew
        self._rates: list = []  # per group: lr, weight_decay (a flat list: one np.array call a step)
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
        for flag in IGNORED_FLAGS:
            v = group.get(flag)
            if v is not None and not isinstance(v, bool):
                raise HyperparameterError(f"{_named(where, flag)}: expected None or a bool, got {v!r}")
        for k in self._read_keys:
            if k not in group:
                raise HyperparameterError(f"{where}: lacks {k!r}")
        values = dict(zip(self._read_keys, _plain_values(group, self._read_keys, where)))
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
            if self.state_dtype in ("8bit", "float8"):
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
            sig = signatures[gi] if signatures is not None else self._check_group_values(group, group_name(gi))[2]
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
            out.append((names[j] if names else f"{group_name(gi)}.params[{j}]", group["params"][j]))
        return out

    def _engine_parallel(self, partition, dtype) -> dict:
        """The data-parallel arguments of an engine: with a group of processes, one engine only (each
        step is one exchange, and the ranks' engines must pair up), overlapped where it can be."""
        comm = self._parallel["comm"]
        if comm.is_local:
            return {}
        if len(partition) > 1:
            raise HyperparameterError(
                f"comm: the param groups need {len(partition)} engines (they differ in dtype, device, step count "
                "or a hyperparameter that is one number per kernel, such as betas); under a group of processes "
                "the drop-ins take groups that share one engine (lr and weight_decay may differ)")
        if self._parallel["shard_state"] and dtype in LOWP:
            raise HyperparameterError("shard_state: a bfloat16/float16 model's float32 master weights are not sharded "
                                      "by the drop-in optimizers; use bind(model, optimizer, comm=..., "
                                      "shard_state=True)")
        can = dtype not in LOWP and not self.two_windows
        if self._overlap and not can:
            raise HyperparameterError("overlap: a bfloat16/float16 model's gradients reach the float32 buffer at "
                                      "step(), and SAM's exchange needs the whole window; pass overlap=False")
        return {**self._parallel, "overlap": can if self._overlap is None else self._overlap}

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
            values = {k: plain_value(self.param_groups[index[0][0]][k]) for k in self._read_keys}
            opt = self.arraytrain_optimizer(values)
            opt.min_8bit_size = self.min_8bit_size  # read when the engine makes its slots
            if device.type == "cuda":
                check_cuda_device(device, "params")
            elif device.type != "cpu":
                raise BackendUnavailableError(f"params: tensors on {device}; the drop-in optimizers run on the CPU "
                                              "and CUDA")
            engine = GroupEngine(entries, opt, masters, dtype=dtype, device=device, kernels=self.kernels,
                                 max_consecutive_skips=self.max_consecutive_skips, clip_eps=self.clip_eps,
                                 nonfinite=self.nonfinite, parallel=self._engine_parallel(partition, dtype))
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
                for key in engine.state.scalars:  # each parameter's own value comes along (NAdam's mu_product)
                    values = np.full(len(engine.layout), engine.initial_scalars[key])
                    for name, c, oname in sources:
                        values[engine.layout.index(name)] = param_steps.value_of(c.engine.state, key,
                                                                                 c.engine.layout.index(oname))
                    param_steps.set_values(engine.state, key, values)
                if src.state.counts is not None:  # the parameters' own step counts come along
                    counts = np.full(len(engine.layout), src.state.step, dtype=np.int64)
                    for name, c, oname in sources:
                        counts[engine.layout.index(name)] = c.engine.state.counts[c.engine.layout.index(oname)]
                    engine.state.counts = None if (counts == src.state.step).all() else counts
            cohorts.append(Cohort(engine, list(index), sig))
        for c in self._cohorts:
            c.engine.close()
        self._cohorts = cohorts
        self._forget_groups()
        self._publish_state()

    def _forget_groups(self) -> None:
        """The next read of the groups reads every group anew (the engines were rebuilt or loaded)."""
        self._seen = [None] * len(self.param_groups)
        self._rates = [0.0] * (2 * len(self.param_groups))

    def _publish_state(self) -> None:
        """``self.state[p]``: torch's per-parameter state, as live views of the engines' slots."""
        state = defaultdict(dict)
        for c in self._cohorts:
            e = c.engine
            # sharded state: the slots are spread over the ranks (state_dict() gathers them)
            views = {} if self._parallel["shard_state"] else \
                {slot: slot_views(buf, e.layout.names) for slot, buf in e.state.slots.items()}
            for k, ((gi, j), name) in enumerate(zip(c.index, e.layout.names)):
                p = self.param_groups[gi]["params"][j]
                entry = {"step": c.step_tensors[k]}
                for slot, by_name in views.items():
                    entry[slot] = by_name[name]
                for key, tensors in c.scalar_tensors.items():
                    entry[key] = tensors[k]
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
        rates = retuned = False
        resig, updates, rated = [], [], []
        read, seen_all, inf = self._read_values, self._seen, math.inf
        for gi, group in enumerate(self.param_groups):
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
            self._check_same_state(gi, sig)
        values = self._rates
        for gi, seen in updates:
            self._seen[gi] = seen
            values[2 * gi], values[2 * gi + 1] = seen.lr, seen.wd
        for gi, seen, raw, lr, wd in rated:
            seen.raw, seen.lr, seen.wd = raw, lr, wd
            values[2 * gi], values[2 * gi + 1] = lr, wd
        if resig or retuned:
            split = False
            for c in self._cohorts:
                sigs = {self._seen[gi].sig for gi in c.groups}
                if len(sigs) > 1:
                    split = True
                elif sigs != {c.signature}:
                    self._reconfigure(c, sigs.pop())
            if split:
                self._rebuild(self._partition(signatures=[s.sig for s in self._seen]))
                return self.read_param_groups()
        if rates:
            values = np.array(values)  # (few NumPy calls: each costs microseconds inside a training loop)
            for c in self._cohorts:
                values.take(c.pairs, out=c.flat_rates)
                first = self._seen[c.index[0][0]]  # (the group of the engine's first parameter)
                opt = getattr(c.engine.optimizer, "base", c.engine.optimizer)  # SAM reports its base's
                opt.lr, opt.weight_decay = first.lr, first.wd
        return rates

    def _signature(self, group: Mapping, gi: int):
        """A group's kernel-wide values (plain Python), validated (a scheduler that changes them every step,
        such as OneCycleLR's momentum, builds one arraytrain optimizer per new signature, not per group)."""
        sig = _plain_values(group, self._keys, group_name(gi))
        try:
            self._optimizer_of(sig)
        except HyperparameterError as exc:
            raise HyperparameterError(f"{group_name(gi)}: {exc}") from None
        return sig

    def _optimizer_of(self, sig):
        """The arraytrain optimizer of the kernel-wide values ``sig`` (lr 1, no decay), kept for the few
        signatures seen last."""
        try:
            return self._by_sig[sig]
        except (KeyError, TypeError):  # TypeError: a value that cannot be a key (built every time)
            pass
        values = dict(zip(self._keys, sig))
        values.update(lr=1.0, weight_decay=0.0)
        opt = self.arraytrain_optimizer(values)
        try:
            if len(self._by_sig) >= 8:
                self._by_sig.clear()
            self._by_sig[sig] = opt
        except TypeError:
            pass
        return opt

    def _check_same_state(self, gi: int, sig) -> None:
        """A group's kernel-wide values may change, but not into another state (amsgrad, momentum 0 or not)."""
        for c in self._cohorts:
            if gi in c.group_of:
                values = dict(zip(self._keys, sig))
                new, cur = self._optimizer_of(sig), c.engine.optimizer
                if type(new) is not type(cur) or new.slot_names != cur.slot_names:
                    before = dict(zip(self._keys, c.signature))
                    diff = {k: (before[k], values[k]) for k in self._keys if before[k] != values[k]}
                    raise HyperparameterError(
                        f"{group_name(gi)}: changing "
                        f"{', '.join(f'{k} from {a!r} to {b!r}' for k, (a, b) in diff.items())} changes the "
                        f"optimizer's state ({list(cur.slot_names)} -> {list(new.slot_names)}); set it when the "
                        "group is created")

    def _retuned(self, raw: tuple, seen):
        """The group's signature when it differs from the last read only in :attr:`TUNABLE` values, each
        of plain numbers its check takes as the state's structure stands (the check is the constructor's,
        on the common case: a scheduler's ``betas`` or ``momentum``); else None (the full validation)."""
        tunable = self._tunable
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

    def _reconfigure(self, c: Cohort, sig) -> None:
        """A cohort's kernel-wide values changed alike in all its groups (checked by :meth:`_check_same_state`,
        or only :attr:`TUNABLE` values, checked by :meth:`_retuned`: then set on the optimizer as they are)."""
        opt, tunable = c.engine.optimizer, self._tunable
        changed = [i for i, (a, b) in enumerate(zip(sig, c.signature)) if a != b]
        tuned = [tunable[i](sig[i], c.signature[i]) if i in tunable else None for i in changed]
        if None not in tuned:
            for i, v in zip(changed, tuned):
                setattr(opt, self._keys[i], v)
        else:
            _assign(opt, self._optimizer_of(sig))
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

    def step(self, closure=None):
        """One optimizer step; returns what ``closure`` (called first, with gradients on) returned.

        The groups are read, the parameters reconnected (see the module docstring), and each engine
        takes its zero-copy step: the norm pass (unscaling a GradScaler's scale, finding NaN/Inf,
        the global norm for ``max_grad_norm``), then one fused kernel that updates the parameters
        and every state slot and zeroes the gradient buffer. A step where no parameter has a
        gradient changes nothing, as torch's. Runs with autograd off (as torch's ``no_grad``, through its
        two C calls: the decorator cost some 12 us a step).
        """
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return self._step(closure)
        finally:
            torch._C._set_grad_enabled(enabled)

    if None not in _GLOBAL_HOOKS:
        step = _hooked(step)

    def _step(self, closure):
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
        if all(len(plan[2]) == len(c.engine.bound) for c, plan in zip(self._cohorts, plans)):
            return []  # no gradient anywhere: torch's optimizers do nothing either
        one = len(self._cohorts) == 1
        if one and divisor == 1.0:
            data_fixes, _, held, bases = plans[0]
            c = self._cohorts[0]
            if bases is not None and not data_fixes:  # the common step: in one compiled call
                report = c.engine.lean_step(bases, self.max_grad_norm, c.rates, held)
                if report is not None:
                    c.held = False
                    c.engine.clean = set()
                    c.sync_tensors()
                    return [report]
        for c, (data_fixes, grad_fixes, held, bases) in zip(self._cohorts, plans):
            if one and bases is not None:  # every gradient is a fresh .grad: read where it lies, nothing copied
                c.engine.connect(data_fixes, [], held)
                c.engine.read_in_place(bases)
            else:
                c.engine.connect(data_fixes, grad_fixes, held)
            # a parameter without a gradient: the engine leaves it out of the step (torch's rule); where
            # its optimizer cannot step parameters alone, a zero lr and decay keep its weights
            hold = held if c.engine.missing != "skip" else []
            if rates or hold or c.held:
                hp = c.engine.state.hp
                hp["lr"][...] = c.lrs
                hp["weight_decay"][...] = c.wds
                if hold:
                    hp["lr"][hold] = 0.0
                    hp["weight_decay"][hold] = 0.0
            c.held = bool(hold)
        if len(self._cohorts) == 1:
            c = self._cohorts[0]
            c.engine.max_grad_norm = self.max_grad_norm
            return [self._engine_step(c, divisor, plans[0][2])]
        return self._take_across(divisor, plans)

    def _engine_step(self, c: Cohort, divisor: float, held):
        e = c.engine
        e.loss_scaler.scale = divisor  # the engine's Divisor: what the gradients carry this step
        report = e.step(absent=[e.bound[i][0] for i in held] if held and e.missing == "skip" else None)
        e.clean = set(held)
        c.sync_tensors()
        return report

    def _take_across(self, divisor: float, plans) -> list:
        """Several engines: one global norm (and NaN/Inf verdict) over all of them, then each steps."""
        total, bad = 0.0, False
        if self.max_grad_norm is not None or self.nonfinite == "skip":
            for c in self._cohorts:
                found = norm_pass(c.engine.kernels, c.engine.grads.flat, c.engine.layout)
                bad = bad or found.nonfinite
                total += found.norm ** 2
        if bad and self.nonfinite == "skip":
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
        keep them bitwise. A smaller parameter's slot is a float32 tensor. With ``state_dtype="float8"``
        the same, as ``{"codes", "scale", "map": "e4m3" or "e5m2"}`` (value ``map[code] * scale``,
        :func:`arraytrain.state8.decode`). No decoded float copy
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
        entries = self._gathered_state() if self._parallel["shard_state"] else self.state
        state = {ids[id(p)]: {k: dict(v) if isinstance(v, dict) else v for k, v in entry.items()}
                 for p, entry in entries.items() if id(p) in ids}
        out = {"state": state, "param_groups": groups}
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, out)
            if result is not None:
                out = result
        return out

    def _gathered_state(self) -> dict:
        """Sharded state: every parameter's entry with its whole slots, gathered from the ranks (a
        collective), as copies."""
        out = {}
        for c in self._cohorts:
            e = c.engine
            slots = e.state_dict(copy=True)["optimizer"]["slots"]
            for k, ((gi, j), name) in enumerate(zip(c.index, e.layout.names)):
                entry = {"step": c.step_tensors[k].clone()}
                for slot, arrays in slots.items():
                    entry[slot] = tensor_view(np.ascontiguousarray(arrays[name]), torch)
                entry.update({key: tensors[k].clone() for key, tensors in c.scalar_tensors.items()})
                out[self.param_groups[gi]["params"][j]] = entry
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
        plan = check_state(state_dict, self.param_groups, self._cohorts, self._check_group_values)
        self._apply_state(plan)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _apply_state(self, plan) -> None:
        for gi, (values, _) in enumerate(plan["groups"]):
            self.param_groups[gi].update(values)
        self._rebuild(self._partition(steps=plan["steps"], signatures=[s for _, s in plan["groups"]]))
        load_entries(self._cohorts, plan, self.param_groups)
        self._forget_groups()

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


def _assign(dst, src) -> None:
    """Copy ``src``'s hyperparameters (but lr, weight_decay and overrides) onto ``dst``, SAM's base too."""
    for k, v in src.hyperparameters().items():
        if k in ("lr", "weight_decay", "overrides", "state_dtype", "base", "base_hyperparameters"):
            continue
        setattr(dst, k, v)
    base = getattr(src, "base", None)
    if base is not None:
        _assign(dst.base, base)


def flag(values: Mapping, key: str) -> bool:
    """A group's boolean value, checked (a drop-in's ``arraytrain_optimizer`` reads its switches so)."""
    return check_bool(key, values[key])
