"""The drop-in optimizers' engines: an :class:`~arraytrain.Engine` over some param groups' tensors.

A :class:`GroupEngine` re-points its tensors' ``.data`` (and ``.grad``) into its flat buffers; a
:class:`Cohort` is one engine and where its parameters sit in the param groups
(:mod:`arraytrain.interop._torch_cohorts` explains when parameters share an engine).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping

import numpy as np
import torch

from .. import param_steps
from ..amp import LossScaler
from ..buffer import GradsAt
from ..engine import Engine
from ..ops import NormPass
from ..optim import Adam, AdamW
from ..engine.stages import StepReport, Verdict
from ._torch_views import TensorBinding

# who holds the tensors, and when a model must be converted or moved (check_kind's messages)
_HELD = {"holder": "the optimizer", "before": "before building the optimizer"}
#: Model dtypes kept on float32 master weights (the engine's working copy is the model's tensors).
LOWP = (torch.bfloat16, torch.float16)


def plain_value(v):
    """A group's value as plain Python: a 0-d (one-element) tensor read as a float, tuples element-wise."""
    if isinstance(v, torch.Tensor):
        try:
            return v.item()  # a float (an int, a bool) for a one-element tensor
        except RuntimeError:
            return v  # several elements: refused by the checks, which name the key
    if isinstance(v, (tuple, list)):
        return tuple(plain_value(x) for x in v)
    return v


def group_name(gi: int, key: str | None = None) -> str:
    """``param_groups[gi]`` (and ``[key]``) as messages name a group and its value."""
    return f"param_groups[{gi}]" + ("" if key is None else f"[{key!r}]")


class Divisor(LossScaler):
    """The factor a step's gradients carry, which the engine divides out in its norm pass and kernel:
    torch.amp.GradScaler's scale (1.0 without one). The optimizer sets :attr:`scale` before every step;
    unlike a loss scaler it never adjusts itself (GradScaler does)."""

    adjusts = False  # set by the optimizer before every step, never adapted

    def __init__(self):
        super().__init__(init_scale=1.0)

    def update(self, found_inf: bool) -> None:
        """Nothing: the optimizer sets the divisor before each step."""


class GroupEngine(Engine):
    """An :class:`~arraytrain.Engine` over some param groups' tensors, which it re-points into its buffers.

    ``entries`` are ``(name, tensor)`` pairs of one dtype and device; ``masters`` maps names to
    the values the engine starts from (an earlier engine's float32 master weights), else the
    tensors' values are taken. The tensors' ``.data`` become views of the engine's parameters
    (of its low-precision working copy for a bfloat16/float16 model). ``.grad`` is left alone
    until a step finds it (see :meth:`check`).
    """

    def __init__(self, entries, optimizer, masters: Mapping, *, dtype, device, kernels: str,
                 max_consecutive_skips, clip_eps: float, nonfinite: str = "skip", parallel: Mapping | None = None):
        lowp = dtype in LOWP
        # torch's rule for a parameter whose .grad is None: untouched by the step, its own step count
        # (where the optimizer can step parameters alone; see arraytrain.param_steps)
        kw = {"kernels": kernels, "max_consecutive_skips": max_consecutive_skips, "clip_eps": clip_eps,
              "loss_scaler": Divisor(), "missing": "skip" if optimizer.per_param_steps else "zero",
              "nonfinite": nonfinite,
              **(parallel or {})}
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
        self.binding = TensorBinding(self, entries, torch, set_grad=False, **_HELD)
        self.lowp, self.bound = lowp, self.binding.bound
        # parameters whose .grad was None at the last applied step, when the kernel zeroed the buffer
        self.clean: set[int] = set()
        # the whole step as one compiled call where it can be (lean_step): numba's kernels, float32 weights
        # read in place, nothing the staged step has to do (a schedule, a non-finite gradient applied)
        self.lean = (kernels == "numba" and self.reads_in_place and not lowp and self.params.dtype == np.float32
                     and self.schedule is None)
        self._offsets = GradsAt.offsets_of(self.grads)[0]  # (the parameters' first elements: the lean step's)
        self._empty = np.zeros(0, np.float32)  # (the lean step's AMSGrad slot without AMSGrad)
        self._lean_tables = {}  # (_tables: the lean step's pieces by which parameters are present, and their counts)
        self.hooks = []
        if self.overlapped:  # the exchange starts while backward runs (see bind's hooks)
            me = weakref.ref(self)
            self.hooks = [p.register_post_accumulate_grad_hook(lambda t, i=i: _ready(me, i, t))
                          for i, (_, p, *_) in enumerate(self.bound)]

    def close(self) -> None:
        """Remove the backward hooks (the optimizer replaced this engine)."""
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def check(self) -> tuple[list, list, list, np.ndarray | None]:
        """What a step must repair (:meth:`TensorBinding.check <._torch_views.TensorBinding.check>`)."""
        return self.binding.check(self)

    def connect(self, data_fixes, grad_fixes, absent) -> None:
        """Apply what :meth:`check` found: every ``.grad`` that is not None then points into the buffer."""
        if absent and self.missing != "skip":  # an absent parameter's gradient must read 0: the moments see
            with torch.no_grad():  # it (with "skip" the engine zeroes it and the step leaves it alone)
                for i in absent:
                    if i not in self.clean:
                        self.bound[i][3].zero_()
        self.binding.repair(data_fixes, grad_fixes, overwrite=True)

    def lean_step(self, bases: np.ndarray, max_grad_norm, rates: np.ndarray, absent=()) -> StepReport | None:
        """The step in one compiled call (the CPU family's ``adam_checked``),
        bitwise the staged :meth:`~arraytrain.Engine.step`'s, where it applies: Adam or AdamW with
        float32 state and no mask, every gradient a ``.grad`` read where it lies (``bases``, by segment,
        as :meth:`~arraytrain.Engine.read_in_place` takes them) but the parameters ``absent`` (segments
        whose ``.grad`` is None: left out, torch's rule, with ``missing="skip"``), no divisor
        (GradScaler); ``nonfinite`` either way; parameters at different step counts each with its own
        bias corrections (:mod:`arraytrain.param_steps`). ``rates``: the groups' lr and weight decay per
        parameter (a row each).
        Returns the step's report; None where it does not apply or the gradient is not finite, and
        then nothing changed (the staged step takes it, and skips it)."""
        opt = self.optimizer
        if (not self.lean or type(opt) not in (Adam, AdamW) or opt.state_dtype is not None or self.counters.micro
                or self.placement.kernel_mask is not None or (absent and self.missing != "skip")):
            return None
        return self.with_compile_notice(self._lean_step, bases, max_grad_norm, rates, absent)

    def _tables(self, absent):
        """``(pieces, upieces, bounds, lags)``: the norm pass's rows (the present parameters'), the
        update's rows by step count and their bounds, and each group's count before this step less the
        engine's (int64; :func:`arraytrain.param_steps.groups`' order). ``absent``: a bool per segment,
        or None. Cached by which parameters are present and by their counts against the engine's."""
        state = self.state
        # (the present parameters' counts against the engine's: an absent one's own count does not matter)
        key = (None if absent is None else absent.tobytes(), None if state.counts is None else
               (state.counts - state.step if absent is None else state.counts[~absent] - state.step).tobytes())
        cached = self._lean_tables.get(key)
        if cached is None:
            whole = self.layout.pieces
            groups = param_steps.groups(absent, state.counts, state.step)
            tables = [param_steps.pieces_of(whole, keep) for _, keep in groups]
            bounds = np.cumsum([0] + [len(t) for t in tables]).astype(np.int64)
            upieces = np.concatenate(tables) if len(tables) > 1 else tables[0]
            upieces.flags.writeable = False
            cached = (param_steps.pieces_of(whole, None if absent is None else ~absent), upieces, bounds,
                      np.array([c - state.step for c, _ in groups], np.int64))
            if len(self._lean_tables) >= 8:  # (a few patterns recur: frozen layers, branches at a lag)
                self._lean_tables.clear()
            self._lean_tables[key] = cached
        return cached

    def _lean_step(self, bases, max_grad_norm, rates, absent):
        opt, state = self.optimizer, self.state
        with self.exclusive("step()"):
            step = state.step
            absent_mask = None
            if absent:
                absent_mask = np.zeros(len(self.layout), dtype=bool)
                absent_mask[list(absent)] = True
            pieces, upieces, bounds, lags = self._tables(absent_mask)
            b1, b2 = opt.betas
            ts = [step + 1 + int(lag) for lag in lags]  # (each group's t: its count before the step, plus one)
            slots = state.slots
            self.max_grad_norm = max_grad_norm
            self.loss_scaler.scale = 1.0
            total, per_seg, applied = self.kernels.adam_checked(
                self.params.flat, self.grads.flat, slots["exp_avg"].flat, slots["exp_avg_sq"].flat,
                slots["max_exp_avg_sq"].flat if opt.amsgrad else self._empty, state.hp["lr"], state.hp["weight_decay"],
                rates, bases, self._offsets, upieces, bounds, pieces, unscale=1.0, max_norm=max_grad_norm,
                clip_eps=self.clip_eps, check=self.nonfinite == "skip", maximize=opt.maximize,
                decoupled=isinstance(opt, AdamW), beta1=b1, beta2=b2, eps=opt.eps, amsgrad=opt.amsgrad,
                lr_div=[1.0 - b1**t for t in ts], inv_bc2_sqrt=[1.0 / math.sqrt(1.0 - b2**t) for t in ts])
            if not applied:
                return None
            state.step = step + 1
            if absent_mask is not None or state.counts is not None:
                state.counts = param_steps.advanced(absent_mask, state.counts, step, len(self.layout))
            # the staged step's finding: the sums' norms, or NaN where there was no pass or a NaN/Inf applied
            found = NormPass.of_sums(math.sqrt(total), per_seg) if math.isfinite(total) else \
                NormPass.lazy(math.nan, lambda: np.full(len(per_seg), math.nan))
            return self.finish_applied(Verdict(found, unscale=1.0, max_norm=max_grad_norm, eps=self.clip_eps), opt.lr)

    def zero_grad(self) -> None:
        """:meth:`Engine.zero_grad`, and the low-precision gradient buffer of a bf16/fp16 model."""
        super().zero_grad()
        self.binding.zero_lowp()

    def refresh(self) -> None:
        """Rewrite the working copy (the model's bf16/fp16 weights) from the master weights."""
        self.refresh_working()


def _ready(engine_ref, i: int, p) -> None:
    """A parameter's post-accumulate-grad hook under the overlapped exchange: a gradient torch allocated
    (after ``zero_grad()``'s ``set_to_none=True``) is copied into the buffer here, while backward still
    runs, and ``.grad`` pointed at it; then the gradient is marked ready, which may start its bucket."""
    engine = engine_ref()
    if engine is None:
        return
    name, _, _, grad, _, dtype, shape = engine.bound[i]
    g = p.grad
    if g is not grad:
        if g is None or g.dtype is not dtype or tuple(g.shape) != shape or g.device != grad.device \
                or g.layout != torch.strided:
            return  # not marked: the step's checks deal with it
        grad.copy_(g)
        p.grad = grad
    engine.mark_ready(name)


class Cohort:
    """One engine and where its parameters sit in the param groups."""

    __slots__ = ("engine", "flat_rates", "group_of", "groups", "index", "lrs", "pairs", "rates", "rates_zeroed",
                 "scalar_tensors", "scalars", "signature", "steps", "step_tensors", "wds")

    def __init__(self, engine: GroupEngine, index: list, signature):
        self.engine = engine
        self.index = index  # (group, position in the group) per engine parameter, in layout order
        self.group_of = np.array([g for g, _ in index], np.intp)
        self.groups = tuple(sorted({g for g, _ in index}))  # the groups it holds parameters of
        self.signature = signature
        # state[p]["step"]: a 0-d view each of one float32 array of the parameters' step counts
        self.steps = np.zeros(len(index), dtype=np.float32)
        whole = torch.from_numpy(self.steps)
        self.step_tensors = [whole[i] for i in range(len(index))]
        # state[p][k] of a scalar state (NAdam's mu_product): a 0-d view each of one float32 array by parameter
        self.scalars = {k: np.zeros(len(index), dtype=np.float32) for k in engine.state.scalars}
        self.scalar_tensors = {k: [torch.from_numpy(a)[i] for i in range(len(index))] for k, a in self.scalars.items()}
        n = len(index)
        # each parameter's group's lr and weight_decay (columns), set by the first read of the groups, taken
        # from the groups' (lr, weight_decay) pairs, flat, at ``pairs``
        self.rates, self.rates_zeroed = np.zeros((n, 2)), False
        self.lrs, self.wds, self.flat_rates = self.rates[:, 0], self.rates[:, 1], self.rates.reshape(-1)
        self.pairs = np.stack([2 * self.group_of, 2 * self.group_of + 1], axis=1).reshape(-1)
        self.sync_tensors()

    def sync_tensors(self) -> None:
        """``state[p]["step"]`` and the scalar states' tensors follow the engine's counters (each parameter's
        own value where they differ: ``OptState.param_scalars``)."""
        state = self.engine.state
        self.steps[...] = state.step if state.counts is None else state.counts
        for k, a in self.scalars.items():
            a[...] = state.param_scalars.get(k, state.scalars[k])
