"""Magnitude pruning: masks over a parameter layout that the optimizer kernels keep.

A mask is a uint8 buffer with the parameters' :class:`~arraytrain.Layout` (1 = keep,
0 = pruned). Passed to ``Optimizer.update(..., mask=mask)``, every optimizer kernel
writes the pruned weights as exactly 0 inside its fused step, so they stay 0 through
training whatever momentum or weight decay say (see :mod:`arraytrain.kernels.cpu.optimizers`).

Magnitude pruning (Han et al. 2015, "Learning both Weights and Connections for
Efficient Neural Networks"; the global variant as in Frankle & Carbin 2019's
lottery-ticket experiments; row-wise L2 structure as ``torch.nn.utils.prune.ln_structured``
with ``n=2, dim=0``) removes the weights, or the rows, of smallest magnitude.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping

import numpy as np

from ._checks import check_choice, check_number
from .backend import backend_of, is_device_array
from .buffer import FlatBuffer
from .errors import ArgumentTypeError, BackendError, DTypeError, HyperparameterError, LayoutError
from .layout import Layout

#: The values of ``scope``: one threshold over every selected parameter, or one per parameter.
SCOPES = ("global", "parameter")
#: The values of ``structure``: single weights, or whole rows (slices along axis 0).
STRUCTURES = ("unstructured", "rows")


class MaskBuffer(FlatBuffer):
    """A :class:`~arraytrain.FlatBuffer` of dtype uint8: 1 = keep, 0 = pruned.

    ``mask[name]`` is a view shaped like the parameter. Padding elements between
    parameters hold 1; no kernel reads them. NumPy, or CuPy for a CUDA engine.
    """

    __slots__ = ()

    @staticmethod
    def _check_kind(flat) -> None:
        backend_of(flat)  # NumPy, or CuPy for a CUDA engine's mask
        if flat.dtype != np.uint8:
            raise DTypeError(f"flat: a mask is uint8 (1 = keep, 0 = pruned), got {flat.dtype}")

    @classmethod
    def ones(cls, layout: Layout) -> "MaskBuffer":
        """A mask that prunes nothing (padding included)."""
        return cls(layout, np.ones(layout.size, dtype=np.uint8))

    def copy(self) -> "MaskBuffer":
        return MaskBuffer(self.layout, self.flat.copy())

    @classmethod
    def from_user(cls, mask, layout: Layout) -> "MaskBuffer":
        """A host mask for ``layout`` from what a user passes to :meth:`arraytrain.Engine.set_mask`.

        A uint8 :class:`FlatBuffer` of the same layout (copied; a CuPy one read back) or of
        the same names and shapes in another alignment (read by name: a sharded engine with
        8-bit state lays its parameters on blocks), or a mapping name -> array of 0/1 (bool
        or integer; names left out are kept whole). Everything is validated before the mask
        is built.
        """
        if isinstance(mask, FlatBuffer):
            if mask.dtype != np.uint8:
                raise DTypeError(f"mask: expected a uint8 buffer (1 keep, 0 pruned), got {mask.dtype}")
            if mask.layout == layout:
                return cls(layout, _host_array(mask.flat).copy())
            if (mask.layout.names, mask.layout.shapes) != (layout.names, layout.shapes):
                raise LayoutError(f"mask: its layout {mask.layout!r} differs from the parameters' {layout!r}")
        if not isinstance(mask, Mapping):
            raise ArgumentTypeError(f"mask: expected a uint8 FlatBuffer, a mapping name -> 0/1 array, or None; "
                                    f"got {type(mask).__name__}")
        for name, m in mask.items():
            if isinstance(m, np.ma.MaskedArray):  # np.asarray would drop its mask
                raise BackendError(f"mask[{name!r}]: a masked array; pass 0/1 values (e.g. m.filled(0))")
            if name not in layout:
                raise LayoutError(f"mask: {name!r} is not a parameter; names: {list(layout.names)}")
            a = _host_array(m)
            if a.shape != layout.shape(name):
                raise LayoutError(f"mask[{name!r}]: expected shape {layout.shape(name)}, got {a.shape}")
            if not (a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer)) or not np.isin(a, (0, 1)).all():
                raise DTypeError(f"mask[{name!r}]: expected 0/1 values (bool or integer), got {a.dtype}")
        new = cls.ones(layout)
        for name, m in mask.items():
            new[name][...] = _host_array(m)
        return new

    def __repr__(self) -> str:
        kept = sum(int((v != 0).sum()) for v in self.values())
        return f"MaskBuffer({len(self)} params, {kept}/{self.layout.num_elements} kept)"


def _host_array(a) -> np.ndarray:
    """A mask given by the caller, on the host for validation (a CuPy array is read back)."""
    if is_device_array(a):
        return a.get()
    return np.asarray(a)


def host_params(params, what: str = "params", task: str = "pruning") -> FlatBuffer:
    """The NumPy :class:`~arraytrain.FlatBuffer` of ``params``: a FlatBuffer, or an object holding one
    as ``.params`` (an :class:`~arraytrain.Engine`); ``task`` names the caller in the error."""
    buf = params if isinstance(params, FlatBuffer) else getattr(params, "params", None)
    if not isinstance(buf, FlatBuffer):
        raise ArgumentTypeError(f"{what}: expected a FlatBuffer or an Engine, got {type(params).__name__}")
    if not isinstance(buf.flat, np.ndarray):
        raise ArgumentTypeError(f"{what}: {task} runs on NumPy buffers, got {type(buf.flat).__name__}")
    return buf


def select_names(layout: Layout, names, what: str = "names") -> list[str]:
    """Parameter names matched by glob ``names`` (fnmatchcase), in layout order.

    ``None``: every parameter with ``ndim >= 2`` (weights, not biases). A pattern that
    matches no parameter is a :class:`HyperparameterError` (a typo would otherwise
    silently prune nothing), as for optimizer overrides.
    """
    if names is None:
        return [n for n, s in zip(layout.names, layout.shapes) if len(s) >= 2]
    patterns = [names] if isinstance(names, str) else names
    try:
        patterns = list(patterns)
    except TypeError:
        raise HyperparameterError(f"{what}: expected a glob pattern or a sequence of them, got {names!r}") from None
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise HyperparameterError(f"{what}: expected non-empty glob pattern strings, got {names!r}")
    chosen = set()
    for pattern in patterns:
        hits = [n for n in layout.names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise HyperparameterError(f"{what}[{pattern!r}]: matches no parameter; names: {list(layout.names)}")
        chosen.update(hits)
    return [n for n in layout.names if n in chosen]


def _k_smallest(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of exactly ``k`` smallest scores; ties at the cut go to the lower index.

    ``np.partition`` finds the k-th smallest value (introselect, O(n), no full sort);
    every score below it is taken, then the first (by position) scores equal to it.
    NaN sorts last in NumPy, so a non-finite magnitude is the last to be taken.
    """
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    cut = np.partition(scores, k - 1)[k - 1]
    below = np.flatnonzero(scores < cut)
    tied = np.flatnonzero(scores == cut)[: k - below.size]
    return np.concatenate([below, tied])


def magnitude_mask(params, *, ratio=None, threshold=None, scope: str = "global",
                   structure: str = "unstructured", names=None) -> MaskBuffer:
    r"""A pruning mask from the magnitudes of ``params`` (a FlatBuffer or an Engine's params).

    Scores: :math:`|w|` per weight (``structure="unstructured"``), or the L2 norm
    :math:`\lVert W_{r,:}\rVert_2` of each row (``"rows"``: whole slices along axis 0,
    the output channels of a ``(out, in, ...)`` weight; :class:`arraytrain.nn.Dense`
    stores ``(in, out)``, so there a row is an input unit), computed in float64.

    Exactly one of:

    * ``ratio`` in ``[0, 1)``: prune :math:`k = \lfloor \text{ratio} \cdot N\rfloor` of
      the :math:`N` scores (weights, or rows for ``"rows"``) with the smallest values,
      over all selected parameters at once (``scope="global"``: one magnitude cut, so
      parameters of small weights lose more) or within each parameter
      (``scope="parameter"``: :math:`\lfloor \text{ratio} \cdot N_p\rfloor` each). The
      k-th smallest score comes from ``np.partition`` (exact, no full sort); ties at the
      cut are broken by position (earlier elements/rows are pruned first), so exactly
      ``k`` are pruned.
    * ``threshold >= 0``: prune every score ``<= threshold`` (``<=``, so ``threshold=0``
      prunes exact zeros), compared in float64 (``float32(0.3)`` is above ``0.3``);
      ``scope`` does not change the result.

    ``names``: glob patterns (:func:`fnmatch.fnmatchcase`) of the parameters to prune;
    default every parameter with ``ndim >= 2`` (weights, not biases). Unselected
    parameters get mask 1. Under ``structure="rows"`` selected 1-D (and 0-D) parameters
    are not pruned (a row of a vector is a single weight: prune those with
    ``"unstructured"``); their elements are not counted in :math:`N`. NaN magnitudes
    rank above every number (never pruned by a ratio; ``NaN <= threshold`` is false).
    Padding elements of the layout get mask 1 (no kernel reads them).

    Everything is validated before any work; ``params`` is never modified.
    """
    buf = host_params(params)
    if (ratio is None) == (threshold is None):
        raise HyperparameterError(f"ratio, threshold: give exactly one, got ratio={ratio!r}, threshold={threshold!r}")
    if ratio is not None:
        ratio = check_number("ratio", ratio, 0.0, 1.0, hi_open=True)
    else:
        threshold = check_number("threshold", threshold, 0.0)
    scope = check_choice("scope", scope, SCOPES)
    structure = check_choice("structure", structure, STRUCTURES)
    layout = buf.layout
    chosen = select_names(layout, names)
    if structure == "rows":
        chosen = [n for n in chosen if len(layout.shape(n)) >= 2]

    mask = MaskBuffer.ones(layout)
    scores = {}
    for name in chosen:
        w = np.asarray(buf[name], dtype=np.float64)
        if structure == "rows":
            rows = w.reshape(w.shape[0], math.prod(w.shape[1:]))  # (0, 4) has 0 rows
            scores[name] = np.sqrt(np.einsum("ij,ij->i", rows, rows))
        else:
            scores[name] = np.abs(w.reshape(-1))

    def prune(name, idx):
        view = mask[name]
        if structure == "rows":
            view[idx] = 0
        else:
            view.reshape(-1)[idx] = 0

    if threshold is not None:
        for name, s in scores.items():
            prune(name, np.flatnonzero(s <= threshold))
    elif scope == "parameter":
        for name, s in scores.items():
            prune(name, _k_smallest(s, math.floor(ratio * s.size)))
    elif scores:
        flat = np.concatenate(list(scores.values()))
        idx = _k_smallest(flat, math.floor(ratio * flat.size))
        start = 0
        for name, s in scores.items():
            hit = idx[(idx >= start) & (idx < start + s.size)] - start
            prune(name, hit)
            start += s.size
    return mask


def apply_mask(params, mask) -> None:
    """Write 0 into the pruned weights of ``params`` now (in place; padding untouched).

    The optimizer kernels do the same inside each step; this makes the weights pruned
    before the next step (for an evaluation, or a checkpoint).
    """
    buf = host_params(params)
    if not isinstance(mask, FlatBuffer) or mask.flat.dtype != np.uint8:
        raise ArgumentTypeError(f"mask: expected a uint8 mask buffer (magnitude_mask), got {type(mask).__name__}")
    if mask.layout != buf.layout:
        raise LayoutError(f"mask: its layout {mask.layout!r} differs from the parameters' {buf.layout!r}")
    for name in buf.names:
        buf[name][mask[name] == 0] = 0


def sparsity(buf) -> dict:
    """Fractions of zeros: ``{"total": f, "parameters": {name: f}}``.

    ``buf``: a mask (zeros = pruned), a parameter FlatBuffer or an Engine (zeros =
    weights equal to 0). Padding is not counted; a zero-size parameter has fraction 0.0,
    and ``total`` is over every parameter element (0.0 when there are none).
    """
    buf = host_params(buf, "buf")
    per = {}
    zeros = 0
    for name, view in buf.items():
        z = int(view.size - np.count_nonzero(view))
        zeros += z
        per[name] = z / view.size if view.size else 0.0
    n = buf.layout.num_elements
    return {"total": zeros / n if n else 0.0, "parameters": per}
