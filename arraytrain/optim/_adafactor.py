"""Adafactor: factored second moments, relative step size, update clipping."""

from __future__ import annotations

import functools
import math

import numpy as np

from .._checks import check_bool, check_number
from ..backend import array_module
from ..buffer import FlatBuffer
from ..errors import HyperparameterError
from ..layout import Layout
from ._base import Optimizer, OptState, decoupled_decay, mask_arg, working_args

# column block width of the fast kernel's column-sum pass (arraytrain.kernels.cpu.optimizers)
_COL_BLOCK = 256


class Adafactor(Optimizer):
    r"""Adafactor (Shazeer & Stern, 2018) with torch.optim.Adafactor's defaults and formulas.

    With :math:`G_t = \pm g_t` (``maximize``), :math:`\hat\beta_{2,t} = 1 - t^{\tau}`
    (``beta2_decay`` :math:`\tau`), :math:`\rho_t = \min(\gamma, 1/\sqrt t)`:

    .. math::
        \alpha_t = \max(\epsilon_2, \mathrm{RMS}(\theta_{t-1}))\,\rho_t, \quad
        \theta \leftarrow \theta\,(1 - \gamma\lambda), \\
        R_t = \hat\beta_{2,t} R_{t-1} + (1-\hat\beta_{2,t})\,\mathrm{mean}_c(G_t^2), \quad
        C_t = \hat\beta_{2,t} C_{t-1} + (1-\hat\beta_{2,t})\,\mathrm{mean}_r(G_t^2), \\
        \hat V_t = \frac{R_t\,C_t^\top}{\max(\mathrm{mean}_r R_t, \epsilon_1)} \text{ (factored), or }
        \hat V_t = \hat\beta_{2,t}\hat V_{t-1} + (1-\hat\beta_{2,t}) G_t^2, \\
        U_t = G_t / \sqrt{\max(\hat V_t, \epsilon_1^2)}, \quad
        \theta_t = \theta - \frac{\alpha_t}{\max(1, \mathrm{RMS}(U_t)/d)}\,U_t

    A parameter with two or more dims is factored over its last two (row statistics
    ``row_var`` of shape ``shape[:-1]``, column statistics ``col_var`` of shape
    ``shape[:-2] + shape[-1:]``), as torch does; others keep ``variance`` of their own
    shape. The three slots are FlatBuffers with the parameters' names and their own
    layouts (size 0 where a parameter does not use the slot). ``eps=(None, 1e-3)``: a
    ``None`` eps1 is the machine epsilon of the parameters' dtype. ``lr`` and
    ``weight_decay`` may differ per parameter through ``overrides``. The relative step
    :math:`\rho_t` is derived from ``lr``, not an argument (torch's ``rho_t``; the
    kernels' ``rel_step``).

    The RMS of the parameters and of the update need reductions before the update:
    see the pass list in :mod:`arraytrain.kernels.cpu.optimizers` (row, column, stats, apply
    passes, float64 accumulation per row/column block/piece in a fixed order).
    Zero-size parameters are skipped (torch divides 0 by 0 there and stores NaN row
    or column statistics; here they stay zero).
    """

    reads_in_place = False  # its kernels read the flat gradient buffer

    per_param_steps = False
    per_param_steps_refusal = "its factored statistics are worked per matrix, not per piece"

    fallback_capable = False  # its statistics have layouts of their own
    shard_refusal = ("its factored second moment is formed from whole rows and columns of each matrix; train "
                     "Adafactor replicated (shard_state=False), or shard an element-wise optimizer (AdamW, LAMB, ...)")

    def __init__(self, lr: float = 1e-2, beta2_decay: float = -0.8, eps=(None, 1e-3), d: float = 1.0,
                 weight_decay: float = 0.0, *, maximize: bool = False, overrides=None):
        self.lr = self._checked_lr(lr)
        self.beta2_decay = check_number("beta2_decay", beta2_decay, hi=0.0)
        try:
            e1, e2 = eps
        except (TypeError, ValueError):
            raise HyperparameterError(f"eps: expected a pair (eps1 or None, eps2), got {eps!r}") from None
        self.eps = (None if e1 is None else check_number("eps[0]", e1, 0.0), check_number("eps[1]", e2, 0.0))
        self.d = check_number("d", d, 1.0)
        self.weight_decay = check_number("weight_decay", weight_decay, 0.0)
        self.maximize = check_bool("maximize", maximize)
        self._set_overrides(overrides)

    @property
    def slot_names(self) -> tuple[str, ...]:
        return ("row_var", "col_var", "variance")

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "beta2_decay": self.beta2_decay, "eps": self.eps, "d": self.d,
                "weight_decay": self.weight_decay, "maximize": self.maximize, "overrides": self.overrides}

    def init(self, params: FlatBuffer) -> OptState:
        layouts = slot_layouts(params.layout)
        slots = {name: FlatBuffer.zeros(lay, params.dtype, array_module(params.flat)) for name, lay in layouts.items()}
        return OptState(0, slots, self.resolve(params.layout))

    def update(self, kernels, params, grads, state, *, gscale=1.0, lr=None, zero_grad=False, working=None,
               mask=None):
        lr = self._lr(state, lr)
        wd = self.per_param(state, "weight_decay")
        t = state.step + 1
        eps1 = float(np.finfo(params.dtype).eps) if self.eps[0] is None else self.eps[0]
        geo = geometry(params.layout)
        s = state.slots
        kernels.adafactor_step(
            params.flat, grads.flat, s["row_var"].flat, s["col_var"].flat, s["variance"].flat, params.layout.pieces,
            geo.segs, geo.rows, geo.cols, geo.batches, gscale=self._signed(gscale),
            rel_step=np.minimum(lr, 1.0 / math.sqrt(t)), decay=decoupled_decay(lr, wd),
            one_minus_beta2=float(t) ** self.beta2_decay, eps1=eps1, eps2=self.eps[1], d=self.d,
            **working_args(working), zero_grad=zero_grad, mask=mask_arg(mask, params),
        )
        state.step = t


def _factored(shape) -> bool:
    return len(shape) >= 2


@functools.lru_cache(maxsize=32)
def slot_layouts(layout: Layout) -> dict[str, Layout]:
    """The layouts of ``row_var``, ``col_var`` and ``variance`` for a parameter layout."""
    rows, cols, full = {}, {}, {}
    for name, shape in zip(layout.names, layout.shapes):
        f = _factored(shape)
        rows[name] = shape[:-1] if f else (0,)
        cols[name] = shape[:-2] + shape[-1:] if f else (0,)
        full[name] = (0,) if f else shape
    return {"row_var": Layout(rows, layout.align), "col_var": Layout(cols, layout.align),
            "variance": Layout(full, layout.align)}


class Geometry:
    """int64 work tables of the Adafactor kernels (see :mod:`arraytrain.kernels.cpu.optimizers`)."""

    def __init__(self, layout: Layout):
        lays = slot_layouts(layout)
        segs, rows, cols, batches = [], [], [], []
        for name, shape, off, n in zip(layout.names, layout.shapes, layout.offsets, layout.sizes):
            ro, co, vo = (lays[k].offsets[lays[k].index(name)] for k in ("row_var", "col_var", "variance"))
            f = _factored(shape)
            nb, nr, nc = (math.prod(shape[:-2]), shape[-2], shape[-1]) if f else (0, 0, 0)
            segs.append((off, n, int(f), nb, nr, nc, ro, co, vo))
            if not f or n == 0:
                continue
            k = np.arange(nb * nr, dtype=np.int64)
            seg = len(segs) - 1
            rows.append(np.stack([off + k * nc, np.full_like(k, nc), ro + k, np.full_like(k, seg)], axis=1))
            for b in range(nb):
                starts = np.arange(0, nc, _COL_BLOCK, dtype=np.int64)
                width = np.minimum(_COL_BLOCK, nc - starts)
                cols.append(np.stack([off + b * nr * nc + starts, np.full_like(starts, nr), np.full_like(starts, nc),
                                      width, co + b * nc + starts], axis=1))
                batches.append((ro + b * nr, nr))
        self.segs = np.asarray(segs, np.int64).reshape(-1, 9)
        self.rows = np.concatenate(rows) if rows else np.zeros((0, 4), np.int64)
        self.cols = np.concatenate(cols) if cols else np.zeros((0, 5), np.int64)
        self.batches = np.asarray(batches, np.int64).reshape(-1, 2)
        for a in (self.segs, self.rows, self.cols, self.batches):
            a.flags.writeable = False


@functools.lru_cache(maxsize=32)
def geometry(layout: Layout) -> Geometry:
    return Geometry(layout)
