r"""Sparsifiers: top-k and random-k over the whole compressed domain.

Both select ``k`` of the domain's ``n`` elements and send their values; the
receiver writes them into a zero vector. In a group of processes, top-k's
selections differ from process to process: its payloads are gathered and
each decoded (:meth:`~arraytrain.compress.Compressor.aggregate`); random-k's
indices are shared, so its values are all-reduced. ``k`` is given directly or as a
fraction: ``ratio`` in (0, 1] gives ``k = max(1, ceil(ratio * n))``, with
``ratio`` read as its shortest decimal repr (``ratio=0.07`` of 100 elements is
7, not the 8 that ``ceil(0.07 * 100)`` in binary floating point gives).

The selection is one global selection over the domain (every parameter of at
least ``min_size`` elements, packed in layout order), not ``k`` per
parameter: the largest entries anywhere win.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction

import numpy as np

from .._checks import check_bool, check_int, check_number
from ..errors import ArgumentTypeError, HyperparameterError
from ._base import Compressor, Domain, check_wire
from ._summed import Summed


class _Sparsifier(Compressor):
    """``k`` of ``n`` elements: ``ratio`` or ``k`` (exactly one), fixed at :meth:`bind`."""

    def __init__(self, ratio=None, k=None, *, min_size: int = 0, warmup: int = 0, seed: int = 0,
                 kernels: str = "numba"):
        super().__init__(min_size=min_size, warmup=warmup, seed=seed, kernels=kernels)
        if (ratio is None) == (k is None):
            raise HyperparameterError(f"ratio, k: expected exactly one of them, got ratio={ratio!r}, k={k!r}")
        self.ratio = None if ratio is None else check_number("ratio", ratio, 0.0, 1.0, lo_open=True)
        self.k = None if k is None else check_int("k", k, 1)
        self._k = 0

    def _bind(self, domain: Domain) -> None:
        n = domain.size
        if n == 0:
            k = 0
        elif self.ratio is not None:
            k = max(1, math.ceil(Fraction(repr(self.ratio)) * n))
        elif self.k > n:
            raise HyperparameterError(f"k: expected at most the {n} elements compressed "
                                      f"(parameters with >= {self.min_size} elements), got {self.k}")
        else:
            k = self.k
        self._k = k

    @property
    def k_selected(self) -> int:
        """``k`` for the bound domain (0 before :meth:`bind` or for an empty domain)."""
        return self._k

    def hyperparameters(self) -> dict:
        sel = {"ratio": self.ratio} if self.ratio is not None else {"k": self.k}
        return {**sel, **super().hyperparameters()}


class TopK(_Sparsifier):
    r"""Top-k sparsification (Aji and Heafield 2017; Stich et al. 2018; Lin et al. 2018, DGC).

    .. math::  C(x)_i = x_i \text{ if } |x_i| \text{ is among the } k \text{ largest of } |x|, \text{ else } 0

    One exact global selection over the domain, without a sort: a radix
    select on the bits of ``|x|`` (see :func:`arraytrain.kernels.cpu.compression.topk`,
    two passes over the gradient). Ties — equal magnitudes at the k-th place —
    go to the lowest indices, so the selection is deterministic. A NaN ranks
    above every number (its magnitude bits are the largest), so it is always
    sent. A contraction: ``||x - C(x)||^2 <= (1 - k/n) ||x||^2``; use it with
    :class:`~arraytrain.compress.ErrorFeedback`.

    Payload: ``indices`` (uint32 when the domain has fewer than 2**32
    elements, else int64), ascending, and ``values`` (the gradient dtype):
    ``k * (4 + itemsize)`` bytes. On CuPy gradients the CUDA radix select
    (:func:`arraytrain.kernels.cuda.compression.topk`) gives the same indices.
    """

    method = "topk"

    def _bind(self, domain: Domain) -> None:
        super()._bind(domain)
        self._idx_dtype = np.dtype(np.uint32 if domain.size < 2**32 else np.int64)

    def _encode(self, x: np.ndarray, meta: dict) -> dict[str, np.ndarray]:
        xp = self._xp()
        idx = xp.empty(self._k, self._idx_dtype)
        values = xp.empty(self._k, x.dtype)
        self._kern.topk(x, idx, values, k=self._k)
        return {"indices": idx, "values": values}

    def _decode(self, arrays: Mapping[str, np.ndarray], meta: Mapping, out: np.ndarray) -> None:
        idx = check_wire(arrays, "indices", (self._k,), self._idx_dtype, out)
        values = check_wire(arrays, "values", (self._k,), out.dtype, out)
        if self._k and int(idx.max()) >= out.size:
            raise ArgumentTypeError(f"payload['indices']: expected indices < {out.size}, got {int(idx.max())}")
        self._kern.scatter(idx, values, out, factor=1)


class RandomK(Summed, _Sparsifier):
    r"""Random-k sparsification (Stich, Cordonnier and Jaggi 2018, "Sparsified SGD with memory").

    ``k`` indices drawn uniformly without replacement (Floyd's algorithm on the
    counter-based generator, keyed by ``(seed, call number)``).

    .. math::
        C(x)_i = \frac{n}{k} x_i \ (\text{rescale=True}), \qquad C(x)_i = x_i \ (\text{rescale=False})

    for the drawn ``i``, 0 elsewhere. ``rescale=True`` is unbiased,
    :math:`E[C(x)] = x`, with variance :math:`(n/k - 1) x_i^2` per element;
    ``rescale=False`` is the contraction error feedback wants,
    :math:`E||x - C(x)||^2 = (1 - k/n)||x||^2`.

    Payload: ``values`` only (``k * itemsize`` bytes). The indices are not
    sent: a receiver re-derives them from the draw key in ``payload.meta``
    (the shared seed and the call number), which is the point of random-k
    over top-k at equal ``k``: half the bytes for float32.

    In a group of processes (``bind(..., comm=...)``) every process draws the
    same indices (the shared seed and call number), so the payloads add up:
    :meth:`aggregate` all-reduces the values and decodes once, and each
    process sends ``k * itemsize`` bytes however many there are.
    """

    method = "randomk"
    stochastic = True

    def __init__(self, ratio=None, k=None, *, rescale: bool = True, min_size: int = 0, warmup: int = 0,
                 seed: int = 0, kernels: str = "numba"):
        super().__init__(ratio, k, min_size=min_size, warmup=warmup, seed=seed, kernels=kernels)
        self.rescale = check_bool("rescale", rescale)
        self._last: tuple[int, np.ndarray] | None = None

    def _indices(self, key: int) -> np.ndarray:
        # encode and decode of one call draw the same indices: keep the last draw
        if self._last is None or self._last[0] != key:
            self._last = (key, self._kern.randk_indices(n=self.domain.size, k=self._k, key=key))
        return self._last[1]

    def _encode(self, x: np.ndarray, meta: dict) -> dict[str, np.ndarray]:
        values = self._xp().empty(self._k, x.dtype)
        self._kern.gather(x, self._indices(meta["key"]), values)
        return {"values": values}

    def _decode(self, arrays: Mapping[str, np.ndarray], meta: Mapping, out: np.ndarray) -> None:
        values = check_wire(arrays, "values", (self._k,), out.dtype, out)
        key = meta.get("key")
        if not isinstance(key, int):
            raise ArgumentTypeError(f"payload.meta['key']: expected the draw key (an int), got {key!r}")
        factor = out.size / self._k if self.rescale else 1.0
        self._kern.scatter(self._indices(key), values, out, factor=factor)

    def _summed(self, payload) -> list[str]:
        return ["values"]

    def hyperparameters(self) -> dict:
        hp = super().hyperparameters()
        return {**{k: hp.pop(k) for k in ("ratio", "k") if k in hp}, "rescale": self.rescale, **hp}

    @property
    def contraction(self) -> bool:
        return not self.rescale
