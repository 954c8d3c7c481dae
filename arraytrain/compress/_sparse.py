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


#: The ramp's kept fractions: 1/4, 1/16, 1/64, ... down to the target (DGC's exponential warm-up).
RAMP_FACTOR = 4
#: Calls of the ramp when ``ramp=None``: torch's PowerSGD hook starts compressing after 1,000 calls by
#: default (``start_powerSGD_iter``), the field's one library default in calls; DGC's 4 epochs are
#: thousands of steps. A ramp keeps compressing (at 1/4 kept, top-k sends half a dense all-reduce's
#: bytes on 2 processes), so it costs far less than a dense start. ``arraytrain train`` puts it in
#: epochs instead (``RAMP_EPOCHS``).
DEFAULT_RAMP = 1000


class _Sparsifier(Compressor):
    """``k`` of ``n`` elements: ``ratio`` or ``k`` (exactly one), fixed at :meth:`bind`; a ramp toward it.

    After the dense warm-up (``warmup`` calls), ``ramp`` calls keep more than ``k``: the kept
    fraction starts at 1/4 and is quartered stage by stage (equal stages) until the next would be at
    most the target, which then holds — Deep Gradient Compression's exponential sparsity warm-up
    (Lin et al. 2018: 75%, 93.75%, 98.4375%, 99.6% sparsity, then 99.9%), in calls rather than
    epochs. For ``ratio=0.01``: 1/4, 1/16, 1/64, then 0.01. Every process derives a call's ``k``
    from the call number (``payload.meta["step"]``): nothing more travels. ``ramp=0`` starts at the
    target; a target of 1/4 or more has no ramp.
    """

    def __init__(self, ratio=None, k=None, *, ramp: int | None = None, min_size: int = 0, warmup: int | None = None,
                 seed: int = 0, kernels: str = "numba"):
        super().__init__(min_size=min_size, warmup=warmup, seed=seed, kernels=kernels)
        if (ratio is None) == (k is None):
            raise HyperparameterError(f"ratio, k: expected exactly one of them, got ratio={ratio!r}, k={k!r}")
        self.ratio = None if ratio is None else check_number("ratio", ratio, 0.0, 1.0, lo_open=True)
        self.k = None if k is None else check_int("k", k, 1)
        self.ramp = DEFAULT_RAMP if ramp is None else check_int("ramp", ramp, 0)
        self._k = 0
        self._ramp_ks: tuple[int, ...] = ()

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
        ks, frac = [], Fraction(1, RAMP_FACTOR)
        while self.ramp and math.ceil(frac * n) > k:
            ks.append(math.ceil(frac * n))
            frac /= RAMP_FACTOR
        self._ramp_ks = tuple(ks)

    @property
    def k_selected(self) -> int:
        """``k`` for the bound domain (0 before :meth:`bind` or for an empty domain)."""
        return self._k

    def k_at(self, step: int) -> int:
        """The elements call ``step`` keeps: the ramp's stage, else the target ``k`` (bound compressors)."""
        j = step - self.warmup
        if 0 <= j < self.ramp and self._ramp_ks:
            return self._ramp_ks[j * len(self._ramp_ks) // self.ramp]
        return self._k

    def phase(self, step: int) -> str:
        if step < self.warmup:
            return "dense"
        return "ramp" if self._ramp_ks and step - self.warmup < self.ramp else "compressed"

    @property
    def schedule(self) -> str:
        if self.layout is None:
            return f"warm-up {self.warmup} dense calls, ramp {self.ramp} calls (bind to see its stages)"
        parts = [f"dense for {self.warmup} calls"] if self.warmup else []
        if self._ramp_ks:
            stages = ", ".join(f"1/{RAMP_FACTOR ** (s + 1)}" for s in range(len(self._ramp_ks)))
            parts.append(f"{stages} kept over the next {self.ramp} calls")
        parts.append(f"then {'ratio ' + repr(self.ratio) if self.ratio is not None else f'k={self.k}'}")
        return "; ".join(parts)

    def _call_k(self, meta) -> int:
        """``k`` of the call that made a payload, from its call number (checked: it comes with the payload)."""
        step = meta.get("step") if isinstance(meta, Mapping) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ArgumentTypeError(f"payload.meta['step']: expected the call number (an int >= 0), got {step!r}")
        return self.k_at(step)

    def hyperparameters(self) -> dict:
        sel = {"ratio": self.ratio} if self.ratio is not None else {"k": self.k}
        return {**sel, "ramp": self.ramp, **super().hyperparameters()}

    def describe(self) -> str:
        """As the repr; without a ramp (``ramp=0``), as before the ramp existed, so that a checkpoint
        written then resumes into a compressor that sends the same."""
        if self.ramp:
            return repr(self)
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items() if k != "ramp")
        return f"{type(self).__name__}({args})"


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
        xp, k = self._xp(), self._call_k(meta)
        idx = xp.empty(k, self._idx_dtype)
        values = xp.empty(k, x.dtype)
        self._kern.topk(x, idx, values, k=k)
        return {"indices": idx, "values": values}

    def _decode(self, arrays: Mapping[str, np.ndarray], meta: Mapping, out: np.ndarray) -> None:
        k = self._call_k(meta)
        idx = check_wire(arrays, "indices", (k,), self._idx_dtype, out)
        values = check_wire(arrays, "values", (k,), out.dtype, out)
        if k and int(idx.max()) >= out.size:
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

    def __init__(self, ratio=None, k=None, *, rescale: bool = True, ramp: int | None = None, min_size: int = 0,
                 warmup: int | None = None, seed: int = 0, kernels: str = "numba"):
        super().__init__(ratio, k, ramp=ramp, min_size=min_size, warmup=warmup, seed=seed, kernels=kernels)
        self.rescale = check_bool("rescale", rescale)
        self._last: tuple[int, int, np.ndarray] | None = None

    def _indices(self, key: int, k: int) -> np.ndarray:
        # encode and decode of one call draw the same indices: keep the last draw
        if self._last is None or self._last[:2] != (key, k):
            self._last = (key, k, self._kern.randk_indices(n=self.domain.size, k=k, key=key))
        return self._last[2]

    def _encode(self, x: np.ndarray, meta: dict) -> dict[str, np.ndarray]:
        k = self._call_k(meta)
        values = self._xp().empty(k, x.dtype)
        self._kern.gather(x, self._indices(meta["key"], k), values)
        return {"values": values}

    def _decode(self, arrays: Mapping[str, np.ndarray], meta: Mapping, out: np.ndarray) -> None:
        k = self._call_k(meta)
        values = check_wire(arrays, "values", (k,), out.dtype, out)
        key = meta.get("key")
        if not isinstance(key, int):
            raise ArgumentTypeError(f"payload.meta['key']: expected the draw key (an int), got {key!r}")
        factor = out.size / k if self.rescale else 1.0
        self._kern.scatter(self._indices(key, k), values, out, factor=factor)

    def _summed(self, payload) -> list[str]:
        return ["values"]

    def hyperparameters(self) -> dict:
        hp = super().hyperparameters()
        return {**{k: hp.pop(k) for k in ("ratio", "k") if k in hp}, "rescale": self.rescale, **hp}

    @property
    def contraction(self) -> bool:
        return not self.rescale
