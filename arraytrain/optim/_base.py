"""The optimizer protocol: hyperparameters on the host, state in flat buffers."""

from __future__ import annotations

import fnmatch
import functools
import numbers
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .._checks import check_bool, check_number
from ..backend import array_module, dtype_named
from ..buffer import FlatBuffer, kernel_view
from ..errors import ArgumentTypeError, DTypeError, HyperparameterError, LayoutError
from ..kernels.interface import F8, QUANTIZED
from ..layout import REDUCE_CHUNK, Layout
from .. import lowbit
from . import state8


@dataclass
class OptState:
    """Optimizer state: a step count, named flat buffers, and per-parameter hyperparameters.

    ``slots`` usually share the parameters' layout; an optimizer may keep slots of
    another layout with the same names (Adafactor's row/column statistics).
    ``hp`` maps each per-parameter hyperparameter (``lr``, ``weight_decay``) to a
    float64 array with one value per parameter resolved from the optimizer's
    name-pattern ``overrides``, NaN where the optimizer's own (possibly changed
    since) value applies; it is derived, not saved. ``scalars``: state that is one
    float for the whole buffer (NAdam's ``mu_product``), kept on the host, saved
    and restored with the slots. ``counts``: per-parameter step counts where they
    differ from ``step`` (see :mod:`arraytrain.param_steps`); ``param_scalars``: for a scalar
    state whose parameters came to differ (NAdam's ``mu_product`` once parameters skipped steps for
    want of a gradient), its float64 value per parameter, which then stands for every parameter
    instead of ``scalars[key]``; saved and restored with the rest. ``present``: set by the engine
    for the length of one ``update`` call that steps some parameters only (a bool per parameter,
    every rank's same: see :func:`arraytrain.parallel.placement.run_groups`), else None.
    """

    step: int = 0
    slots: dict[str, FlatBuffer] = field(default_factory=dict)
    hp: dict[str, np.ndarray] = field(default_factory=dict)
    scalars: dict[str, float] = field(default_factory=dict)
    #: the steps each parameter took (int64 by segment) where some parameter skipped a step for want
    #: of a gradient (``missing="skip"``, :mod:`arraytrain.param_steps`); None while all equal ``step``
    counts: np.ndarray | None = None
    param_scalars: dict[str, np.ndarray] = field(default_factory=dict)
    present: np.ndarray | None = None



def _looks_like_parameters(value) -> bool:
    """``value`` is what torch's optimizers take first (an iterator of tensors, a list of them or of
    param groups, a tensor), not a number."""
    if isinstance(value, (str, bytes, numbers.Number)):
        return False
    if hasattr(value, "__next__") or isinstance(value, (list, tuple, set, dict)):
        return True
    return getattr(value, "ndim", 0) >= 1

class Optimizer(ABC):
    """Base class. Subclasses set ``slot_names`` and implement :meth:`update`.

    ``update`` runs one fused kernel over the whole flat buffer. ``gscale``
    multiplies the gradient inside that kernel (clip factor, accumulation mean,
    loss-scale unscale), so no pass is spent rescaling the gradient buffer.

    Per-parameter hyperparameters: ``overrides`` maps glob patterns (matched
    with :func:`fnmatch.fnmatchcase` against parameter names) to values of the
    hyperparameters in ``PER_PARAM``, e.g. ``{"*.bias": {"weight_decay": 0.0},
    "head.*": {"lr": 1e-2}}``. Every matching pattern applies, in order, so a
    later pattern wins. They become arrays indexed by parameter that the kernel
    reads once per piece: the step stays one launch. A pattern that matches no
    parameter is an error when the optimizer meets the parameters (a typo would
    otherwise silently change nothing).

    Names: torch's, in torch's positional order, where torch has the optimizer; the others
    use the same names for the same things (``lr``, ``betas=(beta1, beta2)`` for the two
    decay rates of the moments, ``eps``, ``weight_decay``), and the paper's or reference
    code's names for the rest (Sophia's ``rho`` and ``bs``, LAMB's ``eps_root``).
    ``maximize``, ``state_dtype`` and ``overrides`` are keyword-only everywhere.

    Every optimizer takes ``maximize`` (torch's flag: ascend, by negating the gradient
    before anything else, so L2 decay still pulls towards 0; the sign flip is exact), and
    every optimizer with element-wise state (all but Adafactor and Sophia) takes
    ``state_dtype="bfloat16"``: its slots stored as bfloat16 for float32 parameters, read
    and written through the kernels' one state accessor (math in float32, each store
    rounded to nearest even and the update continuing from the stored value), and
    ``state_dtype="8bit"`` (bitsandbytes' blockwise dynamic maps) or ``"float8"`` (e4m3 codes
    for signed slots, e5m2 for slots that are never negative, with a float32 scale per block of 256):
    one byte per element of parameters of ``min_8bit_size`` elements or more
    (:mod:`arraytrain.optim.state8`).
    """

    PER_PARAM = ("lr", "weight_decay")
    lr: float
    weight_decay: float
    overrides: dict

    @property
    @abstractmethod
    def slot_names(self) -> tuple[str, ...]:
        """Names of the state buffers this configuration keeps."""

    @abstractmethod
    def hyperparameters(self) -> dict:
        """The constructor arguments, for repr and checkpoints."""

    def _set_overrides(self, overrides) -> None:
        """Validate ``overrides`` (see the class docstring) at construction."""
        if overrides is None:
            overrides = {}
        if not isinstance(overrides, Mapping):
            raise HyperparameterError(f"overrides: expected a mapping pattern -> {{hyperparameter: value}}, got {overrides!r}")
        checked = {}
        for pattern, values in overrides.items():
            if not isinstance(pattern, str) or not pattern:
                raise HyperparameterError(f"overrides: patterns must be non-empty strings, got {pattern!r}")
            if not isinstance(values, Mapping):
                raise HyperparameterError(f"overrides[{pattern!r}]: expected a mapping hyperparameter -> value, got {values!r}")
            entry = {}
            for key, value in values.items():
                if key not in self.PER_PARAM:
                    raise HyperparameterError(
                        f"overrides[{pattern!r}]: {key!r} cannot differ per parameter; "
                        f"{type(self).__name__} allows {list(self.PER_PARAM)}"
                    )
                entry[key] = check_number(f"overrides[{pattern!r}][{key!r}]", value, 0.0)
            checked[pattern] = entry
        self.overrides = checked

    def resolve(self, layout: Layout) -> dict[str, np.ndarray]:
        """Per-parameter overrides of every ``PER_PARAM`` hyperparameter (NaN: not overridden)."""
        hp = {key: np.full(len(layout), np.nan) for key in self.PER_PARAM}
        for pattern, values in self.overrides.items():
            hits = [i for i, name in enumerate(layout.names) if fnmatch.fnmatchcase(name, pattern)]
            if not hits:
                raise HyperparameterError(f"overrides[{pattern!r}]: matches no parameter; names: {list(layout.names)}")
            for key, value in values.items():
                hp[key][hits] = value
        return hp

    def init(self, params: FlatBuffer) -> OptState:
        """A fresh :class:`OptState` for ``params``: step 0, zero slots and the overrides resolved by name."""
        return OptState(0, {name: self._new_slot(params, name) for name in self.slot_names}, self.resolve(params.layout))

    def _new_slot(self, params: FlatBuffer, name: str):
        """A zero element-wise slot ``name`` for ``params`` in ``state_dtype``'s storage."""
        if self.state_dtype in QUANTIZED_STATE:
            check_8bit(params, self.state_dtype)
            partition = getattr(params, "partition", None)  # sharded state: this rank's partition only
            return state8.Quant8Buffer(params.layout if partition is None else partition.layout,
                                       signed=name not in UNSIGNED_SLOTS, threshold=self.min_8bit_size,
                                       xp=array_module(params.flat),  # the parameters' device
                                       window=None if partition is None else (partition.lo, partition.length),
                                       codec=QUANTIZED_STATE[self.state_dtype])
        return params.zeros_like(self._slot_dtype(params))

    def _slot_dtype(self, params: FlatBuffer):
        """The storage of element-wise slots: None (the parameters' dtype) or ``state_dtype``'s."""
        if self.state_dtype is None or dtype_named(self.state_dtype) == params.dtype:
            return None
        if params.dtype != np.float32:
            raise HyperparameterError(f"state_dtype: {self.state_dtype} state needs float32 parameters, "
                                      f"got {params.dtype}")
        return dtype_named(self.state_dtype)

    @staticmethod
    def _slot(state: OptState, name: str):
        """A slot as the kernels take it: the flat array, its uint16 bits for bfloat16 storage, or
        the :class:`arraytrain.kernels.interface.Q8` of an 8-bit slot (a float8 e5m2 slot with the stochastic
        rounding's key of the step that takes ``state.step`` to ``state.step + 1``)."""
        arg = slot_arg(state.slots[name])
        if isinstance(arg, F8) and arg.wide:
            return type(arg)(*arg[:-1], lowbit.sr_salt(state.step + 1, name))  # (salt: the last field)
        return arg

    def _pieces(self, params) -> np.ndarray:
        """The pieces the kernels walk: the layout's, or with 8-bit state in a layout whose offsets
        are not on 256-element blocks the same parameters cut at multiples of 16384 elements from
        each parameter's start, so no block is split."""
        pieces = params.layout.pieces
        if self.state_dtype not in QUANTIZED_STATE or params.layout.align % lowbit.BLOCK == 0:
            return pieces  # offsets on blocks: the layout's chunks cut no block
        return _block_pieces(params.layout, np.ascontiguousarray(pieces[:, 2]).tobytes())

    def _grad_ptrs(self, params, grads):
        """The kernels' ``grad_ptrs`` for the pieces this optimizer walks: None for a flat gradient
        buffer, else (:class:`~arraytrain.buffer.GradsAt`, gradients read where they lie) an address
        per piece."""
        return None if getattr(grads, "bases", None) is None else grads.ptrs(self._pieces(params))

    @abstractmethod
    def update(self, kernels, params: FlatBuffer, grads: FlatBuffer, state: OptState, *,
               gscale: float = 1.0, lr=None, zero_grad: bool = False, working=None, mask=None) -> None:
        """One step in place: params and every slot, then ``state.step += 1``.

        ``lr``: per-parameter learning rates for this step (the schedule's
        output), or None for the base values. ``zero_grad`` also zeroes the
        gradient buffer inside the same kernel. ``working``: ``(bits, kind)``
        of a low-precision working copy the kernel writes too, or None.
        ``mask``: a pruning mask (see :func:`mask_arg`), or None: the kernel
        writes the weights whose mask is 0 as exactly 0 after updating them
        (before the working copy), so pruned weights stay 0 through training
        whatever momentum or weight decay say. The update is otherwise the
        unmasked one: moments, norms and trust ratios see every element, and
        each step is projected onto the pruned pattern.
        """

    maximize = False  # set per instance by every optimizer's ``maximize`` argument
    # Storage of the state slots: None (the parameters' dtype) or, where an optimizer offers
    # it (``state_dtype`` argument), "bfloat16" for float32 parameters: math stays float32,
    # each slot is read and written through the kernels' one state accessor.
    STATE_DTYPES: tuple = ("float32", "bfloat16", "8bit", "float8")
    state_dtype: str | None = None
    #: With ``state_dtype="8bit"``: parameters with fewer elements keep their slots in float32
    #: (bitsandbytes' ``min_8bit_size``); set it on the optimizer before the engine is built.
    min_8bit_size: int = state8.DEFAULT_THRESHOLD

    def _checked_lr(self, lr) -> float:
        """``lr >= 0``. Parameters where the learning rate goes (``AdamW(model.parameters())``: torch's
        signature) are refused with an :class:`~arraytrain.errors.ArgumentTypeError` that names the two
        doors: an Engine over the parameters, or the drop-in torch optimizer of the same name."""
        if _looks_like_parameters(lr):
            name = type(self).__name__
            raise ArgumentTypeError(
                f"lr: got {type(lr).__name__} where {name}'s learning rate goes. arraytrain.optim.{name} takes "
                f"hyperparameters; the parameters go to an Engine (Engine(params, arraytrain.optim.{name}(lr=...)), or "
                f"arraytrain.interop.torch.bind(model, ...)). For torch's form, {name}(model.parameters(), lr=...), "
                f"use arraytrain.interop.torch.{name}")
        return check_number("lr", lr, 0.0)

    def _set_basics(self, lr, eps, weight_decay, maximize, state_dtype, overrides) -> None:
        """Check and set what every optimizer names alike: ``lr >= 0``, ``eps > 0``, ``weight_decay >= 0``,
        ``maximize``, ``state_dtype`` and ``overrides``."""
        self.lr = self._checked_lr(lr)
        self.eps = check_number("eps", eps, 0.0, lo_open=True)
        self.weight_decay = check_number("weight_decay", weight_decay, 0.0)
        self.maximize = check_bool("maximize", maximize)
        self._set_state_dtype(state_dtype)
        self._set_overrides(overrides)

    def _set_state_dtype(self, state_dtype) -> None:
        if state_dtype is not None and state_dtype not in self.STATE_DTYPES:
            raise HyperparameterError(f"state_dtype: expected None or one of {self.STATE_DTYPES}, got {state_dtype!r}")
        self.state_dtype = state_dtype

    def _signed(self, gscale):
        """The kernels' ``gscale``: negated with ``maximize`` (torch negates the gradient; exact)."""
        return -gscale if self.maximize else gscale

    def per_param(self, state: OptState, key: str) -> np.ndarray:
        """Per-parameter values of hyperparameter ``key`` now: overrides, else the optimizer's value."""
        over = state.hp[key]
        return np.where(np.isnan(over), float(getattr(self, key)), over)

    def _step_rates(self, state: OptState, lr, lr_div: float, dtype, decoupled: bool):
        """``(lr / lr_div, l2, decay)``: the kernels' per-parameter step rate, L2 coefficient and decay
        factor in ``dtype``; decoupled weight decay: ``l2 = 0``, ``decay = 1 - lr * weight_decay``,
        else ``l2 = weight_decay``, ``decay = 1``. From the overrides in one compiled call
        (:mod:`arraytrain.optim._rates`), or with a schedule's rates ``lr`` by the NumPy expressions,
        which that call reproduces bit for bit."""
        if lr is None:
            from ._rates import empty_of, step_rates  # (numba: imported at the first step, not with the package)

            hp = state.hp
            return step_rates(hp["lr"], hp["weight_decay"], float(self.lr), float(self.weight_decay), lr_div,
                              decoupled, empty_of(dtype))
        lr = self._lr(state, lr)
        wd = self.per_param(state, "weight_decay")
        if decoupled:
            l2, decay = np.zeros(wd.shape, dtype), decoupled_decay(lr, wd)
        else:
            l2, decay = wd, np.ones_like(wd)
        return lr / lr_div, l2, decay

    def _lr(self, state: OptState, lr) -> np.ndarray:
        if lr is None:
            return self.per_param(state, "lr")
        return np.broadcast_to(np.asarray(lr, np.float64), state.hp["lr"].shape)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}({args})"

    # Declared capabilities (class attributes, overridden where they differ):
    # ``fallback_capable``: another optimizer may run this one on a subset of the parameters
    # (Muon's ``fallback``): its slots share the parameters' layout, ``init`` needs nothing
    # but the parameters, and ``update`` touches only ``params.layout.pieces`` and needs no
    # engine hook of its own. ``has_eval_params``: the weights to evaluate the model at are not
    # the parameters themselves (schedule-free optimizers: ``params`` hold y, :meth:`eval_params`
    # gives x); :meth:`arraytrain.Engine.evaluation` swaps them in for a block.
    fallback_capable = True
    has_eval_params = False
    # ``shard_refusal``: None where the state is element-wise, so that ``Engine(shard_state=True)``
    # can give each rank one contiguous partition of it (see :mod:`arraytrain.parallel.shard`); else why
    # not and what to use instead, the message of the typed error the engine raises.
    # ``segment_sums``: ``update`` takes ``reduce_sums``, a callable that completes the float64
    # per-parameter partial sums it forms over a partition (LAMB's trust ratios) in place.
    shard_refusal: str | None = None
    segment_sums = False
    # ``per_param_steps``: ``update`` depends on nothing but the element-wise slots, the pieces it
    # is given and ``state.step``, so the engine can step the parameters that have a gradient alone,
    # each group at its own step count (``missing="skip"``, torch's rule: see
    # :mod:`arraytrain.param_steps`); ``per_param_steps_refusal`` says why not where it cannot.
    per_param_steps = True
    per_param_steps_refusal = ""
    # ``reads_in_place``: ``update`` passes its kernels ``grad_ptrs`` (:meth:`_grad_ptrs`), so the
    # engine may hand it gradients that lie outside the flat buffer (:class:`~arraytrain.buffer.GradsAt`)
    reads_in_place = True

    @property
    def shard_align(self) -> int:
        """Elements every parameter's offset must be a multiple of for this state to shard: 8-bit
        state's block (a partition boundary then never cuts a block), else 1. The sharded engine
        lays the parameters out so (:func:`arraytrain.parallel.shard.aligned_to`)."""
        return lowbit.BLOCK if self.state_dtype in QUANTIZED_STATE else 1

    def eval_params(self, params: FlatBuffer, state: OptState, out: FlatBuffer | None = None) -> FlatBuffer:
        """The weights to evaluate the model at: ``params`` themselves here (a copy into ``out`` if given)."""
        if out is None:
            return params
        out.flat[...] = params.flat
        return out


def mask_arg(mask, params: FlatBuffer):
    """The kernels' ``mask`` argument: None, or a flat uint8 array of ``params``' size.

    ``mask`` is None, a flat 1-D uint8 array of ``params.flat.size`` elements (1 = keep,
    0 = pruned; any non-zero keeps), or a uint8 buffer of the same layout (as made by
    :func:`arraytrain.prune.magnitude_mask`). Padding elements are never read. Checked in
    O(1), before any buffer is written; a non-contiguous array is refused (the kernels
    slice it per piece).
    """
    if mask is None:
        return None
    if isinstance(mask, FlatBuffer):
        if mask.layout != getattr(params.layout, "whole", params.layout):  # (a Subset: its whole layout's)
            raise LayoutError(f"mask: its layout {mask.layout!r} differs from the parameters' {params.layout!r}")
        mask = mask.flat
    if type(mask) is not type(params.flat):
        raise ArgumentTypeError(f"mask: expected a {type(params.flat).__name__} like the parameters or None, "
                                f"got {type(mask).__name__}")
    if mask.dtype != np.uint8:
        raise DTypeError(f"mask: expected dtype uint8 (1 = keep, 0 = pruned), got {mask.dtype}")
    if mask.shape != params.flat.shape:
        raise LayoutError(f"mask: expected a flat array of shape {params.flat.shape}, got {mask.shape}")
    if not mask.flags.c_contiguous:
        raise LayoutError("mask: the array must be contiguous")
    return mask


def working_args(working) -> dict:
    """The kernels' ``working`` and ``kind`` keywords for an optional working copy ``(bits, kind)``."""
    bits, kind = (None, 0) if working is None else working
    return {"working": bits, "kind": kind}


def decoupled_decay(lr, weight_decay):
    """The kernels' ``decay``: ``1 - lr * weight_decay`` per parameter, the factor a decoupled weight
    decay multiplies the parameters by before the step (AdamW's rule, Loshchilov & Hutter 2019).

    The one place the factor is formed, so every optimizer that decays this way has the same bits.
    """
    return 1.0 - lr * weight_decay


#: The state dtypes kept block-quantized in one byte per element (:class:`arraytrain.optim.state8.Quant8Buffer`),
#: and their codecs: bitsandbytes' dynamic maps ("8bit"), float8 e4m3 with a float32 scale per block.
QUANTIZED_STATE = {"8bit": "dynamic", "float8": "float8"}

#: Slots never negative (second moments, sums of squares): the unsigned dynamic map. Every other
#: slot (first moments, momentum buffers, RMSprop's mean gradient) takes the signed map.
UNSIGNED_SLOTS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "sum", "square_avg", "acc_delta", "exp_inf"})

def unused_slot(slot):
    """What the kernels take for a slot a configuration lacks (never read): an empty array of the
    same storage as ``slot``, or ``slot`` itself when it is 8-bit, so that every configuration of
    an optimizer shares one compiled signature per state dtype."""
    return slot if isinstance(slot, QUANTIZED) else slot[:0]


def slot_arg(buf):
    """A slot as the kernels take it (see :meth:`Optimizer._slot`)."""
    if isinstance(buf, state8.Quant8Buffer):
        return buf.kernel_arg()
    return kernel_view(buf.flat)


def check_8bit(params, state_dtype: str = "8bit") -> None:
    """8-bit and float8 state need float32 parameters, NumPy or CuPy (a typed error, before any state exists)."""
    if params.dtype != np.float32:
        raise HyperparameterError(f"state_dtype: {state_dtype} state needs float32 parameters, got {params.dtype}")


@functools.lru_cache(maxsize=32)
def _block_pieces(layout: Layout, segs: bytes) -> np.ndarray:
    wanted = np.unique(np.frombuffer(segs, np.int64))
    rows = state8.block_pieces(layout, REDUCE_CHUNK)
    out = np.ascontiguousarray(rows[np.isin(rows[:, 2], wanted)])
    out.flags.writeable = False
    return out


def check_optimizer(optimizer, name: str = "optimizer"):
    """``optimizer`` if it is an :class:`Optimizer`; else an :class:`~arraytrain.errors.ArgumentTypeError`
    naming the argument, and for a torch optimizer (``torch.optim.AdamW``, or the drop-in
    ``arraytrain.interop.torch.AdamW``) the arraytrain optimizer to give instead."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    kind = type(optimizer)
    if any(k.__name__ == "Optimizer" and k.__module__.startswith("torch.optim") for k in kind.__mro__):
        from . import by_name

        ours = kind.__name__ if kind.__name__.lower() in by_name() else "AdamW"
        raise ArgumentTypeError(
            f"{name}: got {kind.__module__}.{kind.__name__}, a torch.optim.Optimizer: it steps a model by itself "
            f"(optimizer.step()), without an Engine or bind. Here give an arraytrain optimizer, e.g. "
            f"arraytrain.optim.{ours}(lr=...)")
    raise ArgumentTypeError(f"{name}: expected an arraytrain.optim.Optimizer, got {kind.__name__}")
