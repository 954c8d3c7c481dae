"""Muon: orthogonalised momentum for the matrices, a fallback optimizer for every other parameter."""

from __future__ import annotations

import fnmatch
import functools
import importlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .._checks import check_bool, check_int, check_number
from ..backend import array_module
from ..buffer import Subset, SubsetLayout
from ..errors import HyperparameterError
from ..kernels import newton_schulz
from ..layout import Layout
from ._base import QUANTIZED_STATE, Optimizer, OptState, decoupled_decay, mask_arg, working_args

# torch.optim.Muon's defaults (Keller Jordan's quintic coefficients and eps)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
# the fallback's slots and per-parameter values sit in Muon's state under this prefix
FALLBACK = "fallback."


class Muon(Optimizer):
    r"""Muon (Jordan et al., 2024, "Muon: an optimizer for hidden layers in neural networks"),
    torch.optim.Muon's semantics, with a fallback optimizer for the parameters it does not take.

    For a matrix parameter :math:`\theta` with gradient :math:`g` (negated with ``maximize``),
    momentum :math:`\mu`, ``ns_coefficients`` :math:`(a, b, c)`:

    .. math::
        B_t = B_{t-1} + (1-\mu)(g_t - B_{t-1}), \quad
        U_t = B_t + (1-\mu)(g_t - B_t) \text{ (Nesterov) or } B_t, \\
        X_0 = U_t / \max(\lVert U_t\rVert_F, \epsilon), \quad
        X_{k+1} = a X_k + (b A_k + c A_k^2) X_k, \ A_k = X_k X_k^\top \ (k < \text{ns\_steps}), \\
        \theta_t = \theta_{t-1}(1 - \eta\lambda) - \eta\, r(\theta)\, X_{\text{ns\_steps}}

    with the iteration on :math:`U^\top` for a tall matrix (more rows than columns), as torch
    does, and :math:`r` from ``adjust_lr_fn``: ``None``/``"original"`` :math:`\sqrt{\max(1, R/C)}`
    (Keller Jordan's), ``"match_rms_adamw"`` :math:`0.2\sqrt{\max(R, C)}` (Moonshot's), for an
    :math:`R \times C` matrix. Weight decay is decoupled and uses the unadjusted lr. The slot
    ``momentum_buffer`` is torch's :math:`B`.

    Which parameters Muon updates: those with two or more dims that match none of the glob
    patterns ``fallback_for``; a parameter with more than two dims is the matrix of its first
    dim by the product of the others (as Keller Jordan's code flattens convolution filters;
    torch refuses them), and ``adjust_lr_fn`` sees that matrix. Every other parameter (1-D
    biases and gains, scalars, and whatever ``fallback_for`` names: embeddings, the output
    head) goes to ``fallback``, an optimizer with element-wise state (SGD, Adam, AdamW,
    Adagrad, RMSprop, Lion, LAMB...) that runs its own fused kernel over those parameters only,
    as in Keller Jordan's recipe (AdamW for embeddings, head, biases and gains). Without a
    fallback such non-empty parameters are refused, as torch refuses them. The fallback's
    slots live in Muon's state as ``"fallback.<slot>"`` (saved and resumed with the rest);
    every slot spans the whole flat buffer, so the regions of the other optimizer's
    parameters stay zero (memory, not traffic: the kernels never touch them).

    ``maximize`` applies to every parameter (the fallback's own must be False);
    ``state_dtype="bfloat16"`` stores the momentum buffer in bfloat16, and the fallback's slots
    too when it was built with ``state_dtype=None``. ``overrides`` (``lr``, ``weight_decay``)
    apply to every parameter they match, whichever optimizer updates it, and win over the
    fallback's own; a schedule scales both optimizers' rates alike.

    The kernels walk the matrices one at a time: a fused kernel for the momentum (into a work
    matrix, with the float64 sum of squares the normalisation needs), the Newton-Schulz GEMMs
    on BLAS (NumPy) or cuBLAS (CuPy) in the parameters' dtype (torch iterates in bfloat16),
    and a fused kernel for the apply (weight decay, lr, mask, working copy). The work buffer
    (the largest matrix twice plus two square blocks of its smaller side) is kept by the
    optimizer between steps, one per array type, dtype and device: an optimizer instance
    must not step two engines from two threads at once.
    """

    reads_in_place = False  # its kernels read the flat gradient buffer

    per_param_steps = False
    per_param_steps_refusal = "its Newton-Schulz step works per matrix on a shared work buffer"

    fallback_capable = False
    shard_refusal = ("Newton-Schulz orthogonalises each whole matrix, which a partition may cut; train Muon "
                     "replicated (shard_state=False), or shard an element-wise optimizer (AdamW, LAMB, ...)")

    def __init__(self, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = 1e-7,
                 ns_steps: int = 5, adjust_lr_fn: str | None = None, *, fallback=None, fallback_for=(),
                 maximize: bool = False, state_dtype: str | None = None, overrides=None):
        self.lr = self._checked_lr(lr)
        self.weight_decay = check_number("weight_decay", weight_decay, 0.0)
        self.momentum = check_number("momentum", momentum, 0.0, 1.0, hi_open=True)
        self.nesterov = check_bool("nesterov", nesterov)
        self.ns_coefficients = _coefficients(ns_coefficients)
        self.eps = check_number("eps", eps, 0.0, lo_open=True)
        self.ns_steps = check_int("ns_steps", ns_steps, 0, 99)  # torch refuses 100 and more
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise HyperparameterError(f"adjust_lr_fn: expected one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
        self.adjust_lr_fn = adjust_lr_fn
        self.maximize = check_bool("maximize", maximize)
        self._set_state_dtype(state_dtype)
        self._set_overrides(overrides)
        self.fallback = _fallback(fallback)
        self.fallback_for = _patterns(fallback_for)
        if self.fallback_for and self.fallback is None:
            raise HyperparameterError(f"fallback_for: {list(self.fallback_for)} route parameters to the fallback, "
                                      "but fallback is None")
        self._work_buffers: dict = {}

    @property
    def slot_names(self) -> tuple[str, ...]:
        theirs = () if self.fallback is None else tuple(FALLBACK + k for k in self.fallback.slot_names)
        return ("momentum_buffer",) + theirs

    def hyperparameters(self) -> dict:
        fb = None if self.fallback is None else {"type": type(self.fallback).__name__,
                                                  "hyperparameters": self.fallback.hyperparameters()}
        return {"lr": self.lr, "weight_decay": self.weight_decay, "momentum": self.momentum,
                "nesterov": self.nesterov, "ns_coefficients": self.ns_coefficients, "eps": self.eps,
                "ns_steps": self.ns_steps, "adjust_lr_fn": self.adjust_lr_fn, "fallback": fb,
                "fallback_for": self.fallback_for, "maximize": self.maximize, "state_dtype": self.state_dtype,
                "overrides": self.overrides}

    # -- state ------------------------------------------------------------------------------
    def init(self, params) -> OptState:
        route = routing(params.layout, self.fallback_for)
        if self.fallback is None:
            stray = [n for n, k, m in zip(params.layout.names, params.layout.sizes, route.muon) if k and not m]
            if stray:
                raise HyperparameterError(
                    f"Muon updates parameters with 2 or more dims; {stray} have fewer: pass fallback=AdamW(...) "
                    "(or another optimizer with element-wise state) for them"
                )
        hp = self.resolve(params.layout)
        slots, scalars = {"momentum_buffer": self._new_slot(params, "momentum_buffer")}, {}
        if self.fallback is not None:
            inner = self._fallback_to_init().init(params)
            slots.update({FALLBACK + k: v for k, v in inner.slots.items()})
            scalars.update({FALLBACK + k: v for k, v in inner.scalars.items()})  # (NAdam's mu_product)
            for key, theirs in inner.hp.items():  # Muon's overrides win where both set a value
                ours = hp.get(key)
                hp[FALLBACK + key] = theirs if ours is None else np.where(np.isnan(ours), theirs, ours)
        hp["_muon"] = route.muon.astype(np.float64)  # 1: Muon updates the parameter, 0: the fallback
        return OptState(0, slots, hp, scalars)

    def _fallback_to_init(self) -> Optimizer:
        """The fallback, with Muon's ``state_dtype`` when its own is None."""
        fb = self.fallback
        hp = fb.hyperparameters()
        if self.state_dtype is None or fb.state_dtype is not None or "state_dtype" not in hp:
            return fb
        out = type(fb)(**{**hp, "state_dtype": self.state_dtype})
        out.min_8bit_size = self.min_8bit_size
        return out

    def _inner(self, state: OptState) -> OptState:
        """The fallback's view of the state: its slots, per-parameter values and scalar states, the same step."""
        cut = len(FALLBACK)
        return OptState(state.step, {k[cut:]: v for k, v in state.slots.items() if k.startswith(FALLBACK)},
                        {k[cut:]: v for k, v in state.hp.items() if k.startswith(FALLBACK)},
                        {k[cut:]: v for k, v in state.scalars.items() if k.startswith(FALLBACK)})

    def per_param(self, state: OptState, key: str) -> np.ndarray:
        """Per-parameter values of ``key``: Muon's for its matrices, the fallback's for the others."""
        ours = super().per_param(state, key)
        if self.fallback is None or FALLBACK + key not in state.hp:
            return ours
        return np.where(state.hp["_muon"] != 0, ours, self.fallback.per_param(self._inner(state), key))

    # -- the step -----------------------------------------------------------------------------
    def update(self, kernels, params, grads, state, *, gscale=1.0, lr=None, zero_grad=False, working=None,
               mask=None):
        mask = mask_arg(mask, params)
        layout = params.layout
        if self.state_dtype in QUANTIZED_STATE:  # pieces that split no 8-bit block (see Optimizer._pieces)
            layout = SubsetLayout(layout, self._pieces(params))
        route = routing(layout, self.fallback_for)
        lr = self._lr(state, lr)
        gs = self._signed(gscale)
        if route.pieces.shape[0]:
            wd = self.per_param(state, "weight_decay")
            kernels.muon_step(params.flat, grads.flat, self._slot(state, "momentum_buffer"),
                              self._work(params.flat, route.work), route.mats, route.pieces, gscale=gs,
                              momentum=self.momentum, nesterov=self.nesterov,
                              adjusted_lr=lr * lr_ratios(params.layout, self.fallback_for, self.adjust_lr_fn),
                              decay=decoupled_decay(lr, wd), eps_norm=self.eps, ns_coefficients=self.ns_coefficients,
                              ns_steps=self.ns_steps, **working_args(working), zero_grad=zero_grad, mask=mask)
        if self.fallback is not None and route.fallback_pieces.shape[0]:
            # the fallback's own fused kernel over its parameters' pieces; gscale carries Muon's sign
            inner = self._inner(state)
            self.fallback.update(kernels, Subset(params, route.fallback_pieces),
                                 Subset(grads, route.fallback_pieces), inner, gscale=gs, lr=lr,
                                 zero_grad=zero_grad, working=working, mask=mask)
            state.scalars.update({FALLBACK + k: v for k, v in inner.scalars.items()})
        state.step += 1

    def _work(self, flat, size: int):
        """The Newton-Schulz scratch for ``flat``'s array type, dtype and device (kept between steps)."""
        key = (type(flat), flat.dtype, getattr(getattr(flat, "device", None), "id", None))
        work = self._work_buffers.get(key)
        if work is None or work.size < size:
            work = self._work_buffers[key] = array_module(flat).empty(size, flat.dtype)
        return work


def _coefficients(value) -> tuple[float, float, float]:
    try:
        a, b, c = value
    except (TypeError, ValueError):
        raise HyperparameterError(f"ns_coefficients: expected three numbers (a, b, c), got {value!r}") from None
    return tuple(check_number(f"ns_coefficients[{i}]", x) for i, x in enumerate((a, b, c)))


def _patterns(value) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    try:
        patterns = tuple(value)
    except TypeError:
        raise HyperparameterError(f"fallback_for: expected glob patterns (strings), got {value!r}") from None
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise HyperparameterError(f"fallback_for: patterns must be non-empty strings, got {p!r}")
    return patterns


def _fallback(value):
    """``fallback``: None, an optimizer, or ``{"type": name, "hyperparameters": {...}}`` (what
    :meth:`Muon.hyperparameters` returns, so a Muon rebuilds from its hyperparameters)."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        optim = importlib.import_module(__package__)
        name, hp = value.get("type"), value.get("hyperparameters")
        cls = getattr(optim, name, None) if isinstance(name, str) and name in optim.__all__ else None
        if not (isinstance(cls, type) and issubclass(cls, Optimizer)) or not isinstance(hp, Mapping):
            raise HyperparameterError(f"fallback: expected an optimizer or {{'type': <an arraytrain.optim class>, "
                                      f"'hyperparameters': {{...}}}}, got {value!r}")
        value = cls(**hp)
    if not isinstance(value, Optimizer) or not value.fallback_capable:
        raise HyperparameterError(f"fallback: expected an optimizer with element-wise state (SGD, Adam, AdamW, "
                                  f"Adagrad, RMSprop, Lion, LAMB, ...), got {value!r}")
    if value.maximize:
        raise HyperparameterError("fallback: build it with maximize=False; Muon's maximize applies to every "
                                  "parameter, the fallback's too")
    return value


@dataclass(frozen=True)
class Routing:
    """Which optimizer updates which parameter, and the tables of Muon's kernels.

    ``muon``: bool per parameter. ``pieces``: the layout's pieces of Muon's parameters;
    ``mats``: one int64 row per Muon parameter, ``[seg, offset, rows, cols, piece_lo,
    piece_hi]`` (its matrix and its range of ``pieces``). ``fallback_pieces``: the pieces of
    the others. ``work``: the scratch the largest matrix needs (its work copy plus the
    Newton-Schulz iteration's, see :mod:`arraytrain.kernels.newton_schulz`).
    """

    muon: np.ndarray
    mats: np.ndarray
    pieces: np.ndarray
    fallback_pieces: np.ndarray
    work: int


def matrix_of(shape) -> tuple[int, int]:
    """The matrix Muon sees for a parameter of 2 or more dims: first dim x the product of the others."""
    return shape[0], math.prod(shape[1:])


@functools.lru_cache(maxsize=32)
def routing(layout: Layout, fallback_for: tuple[str, ...] = ()) -> Routing:
    for pattern in fallback_for:  # a typo would silently leave a parameter to Muon
        if not any(fnmatch.fnmatchcase(n, pattern) for n in layout.names):
            raise HyperparameterError(f"fallback_for: {pattern!r} matches no parameter; names: {list(layout.names)}")
    muon = np.array([len(s) >= 2 and not any(fnmatch.fnmatchcase(n, p) for p in fallback_for)
                     for n, s in zip(layout.names, layout.shapes)], dtype=bool)
    all_pieces = layout.pieces
    mine = muon[all_pieces[:, 2]] if len(all_pieces) else np.zeros(0, bool)
    pieces, fallback_pieces = all_pieces[mine], all_pieces[~mine]
    mats, work = [], 0
    for seg in np.flatnonzero(muon):
        rows, cols = matrix_of(layout.shapes[seg])
        lo, hi = np.searchsorted(pieces[:, 2], [seg, seg + 1]) if len(pieces) else (0, 0)
        mats.append((seg, layout.offsets[seg], rows, cols, lo, hi))
        work = max(work, rows * cols + newton_schulz.work_size(rows, cols))
    out = Routing(muon, np.asarray(mats, np.int64).reshape(-1, 6), np.ascontiguousarray(pieces),
                  np.ascontiguousarray(fallback_pieces), work)
    for a in (out.muon, out.mats, out.pieces, out.fallback_pieces):
        a.flags.writeable = False
    return out


@functools.lru_cache(maxsize=32)
def lr_ratios(layout: Layout, fallback_for: tuple[str, ...], adjust_lr_fn: str | None) -> np.ndarray:
    """torch's ``adjust_lr_fn`` factor per parameter (1 where Muon does not update it)."""
    ratios = np.ones(len(layout))
    for seg, _, rows, cols, _, _ in routing(layout, fallback_for).mats.tolist():
        if adjust_lr_fn in (None, "original"):
            ratios[seg] = math.sqrt(max(1.0, rows / cols)) if cols else 1.0
        else:
            ratios[seg] = 0.2 * math.sqrt(max(rows, cols))
    ratios.flags.writeable = False
    return ratios
