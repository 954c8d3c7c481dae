r"""VSA projection: a subsampled randomized Hadamard transform (SRHT) with O(n) memory.

The domain vector :math:`x` (``n`` elements, zero-padded to ``N = nb * B``
with ``B`` a power of two) is sent as ``d`` numbers

.. math::
    y = S\, H\, D\, x, \qquad
    \hat x = c\; D\, H\, S^\top y, \qquad c = N / d \ (\text{unbiased}) \text{ or } 1,

with :math:`D = \mathrm{diag}(s)` a ±1 key, :math:`H` the orthonormal
Walsh–Hadamard transform of every block of ``B`` elements, and :math:`S` the
selection of ``d`` coordinates (``d // nb`` or one more per block, a uniform
subset in each; every coordinate is kept with probability :math:`d/N`). Key
and selection are drawn afresh at each call from ``(seed, call)`` with the
counter-based generator, so :math:`E[S^\top S] = (d/N) I` and, :math:`H D`
being orthogonal, :math:`E[\hat x] = x` for ``unbiased=True`` (Ailon and
Chazelle 2009, the fast Johnson–Lindenstrauss transform; Tropp 2011 for the
SRHT). The error is exact in expectation:

.. math::
    E\,\lVert \hat x - x\rVert^2 = (N/d - 1)\,\lVert x\rVert^2 \quad (c = N/d), \qquad
    E\,\lVert \hat x - x\rVert^2 = (1 - d/N)\,\lVert x\rVert^2 \quad (c = 1),

so the relative L2 error of the unbiased decode is about
:math:`\sqrt{N/d - 1}` (3.0 at ``ratio=0.1``): an unbiased compressor pays in
variance, which averaging over many ranks removes. With ``unbiased=False`` the
decode is the orthogonal projection onto the kept coordinates, a contraction
(:math:`\delta = d/N`), which is what error feedback needs: under
:class:`~arraytrain.compress.ErrorFeedback` the unbiased decode's residual
grows by about :math:`\sqrt{N/d - 1}` a call, the projection's shrinks.

In VSA terms (vector-symbolic architectures, MAP-B: bipolar keys, binding is
the elementwise product, bundling the sum): :math:`D x` *binds* the gradient
to a random bipolar hypervector; row ``r`` of :math:`H` is a Walsh hypervector
:math:`h_r` of its block, and the kept coordinate
:math:`y_r = \langle h_r, s \odot x\rangle` is the *bundle* (sum) of the
block's bound coordinates, weighted by that code. Decoding superposes the kept
codes (:math:`H^\top S^\top y`) and *unbinds* with the same key (``s ⊙ s = 1``).

Why no ``n x d`` matrix exists: the projection :math:`S H D` is never
materialised. :math:`D` is a sign recomputed from ``(key, i)``, :math:`H` is
applied with :math:`\log_2 B` butterfly passes per block (time
:math:`O(N \log B)`), and :math:`S` is a set of positions recomputed from the
key. The compressor holds one ``N``-element scratch vector (``N < n + B``;
``B`` is capped at the next power of two above ``n``, so ``N < 2n``), and
the payload is the ``d`` kept values and nothing else: the receiver re-derives
key and positions from the seed and the call number (``payload.meta["key"]``).
A dense Gaussian projection of a 1M-element gradient to ``d = 100k`` would be
1e11 numbers (400 GB in float32); here it is 1M numbers of scratch.

Kernels (``kernels="numba"``): :mod:`arraytrain.kernels.cpu.projection` on NumPy
gradients, :mod:`arraytrain.kernels.cuda.projection` on CuPy ones (the same
signs and kept positions: a payload encoded on one device decodes on the other);
the reference twins are :mod:`arraytrain.kernels.reference.projection`.

In a group of processes every process draws the same key and selection (the
shared seed and call number), so :math:`y` is linear in :math:`x` with the
same :math:`S H D` everywhere: the processes' ``values`` are all-reduced and
decoded once, :math:`\sum_r \hat x_r = c\, D H S^\top \sum_r y_r`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .._checks import check_bool, check_int, check_number
from ..errors import HyperparameterError
from ..kernels.counter_rng import step_key
from ._base import Compressor, Domain, check_wire
from ._summed import Summed


class VSA(Summed, Compressor):
    """Randomized Hadamard projection to ``d`` coordinates (bind, mix, bundle); O(n) memory.

    Parameters
    ----------
    ratio : float in (0, 1], optional
        ``d = max(1, round(ratio * n))`` of the ``n`` compressed elements.
        The spread is over the padded ``N >= n``, so even ``ratio=1`` loses
        a little (relative error ``sqrt(N/n - 1)``, 0.15 at ``n = 1e5`` with
        4096-blocks); ``N = n`` when ``n`` is a multiple of the block.
    dim : int >= 1, optional
        ``d`` directly (at most ``n``). Give exactly one of ``ratio`` and ``dim``.
    block : int, a power of two
        Hadamard block length ``B`` (default 4096); capped at the next power
        of two above ``n``. Larger blocks mix more coordinates per kept value
        (better concentration) at ``log2 B`` passes per element.
    unbiased : bool
        Decode scale ``N / d`` (unbiased, the default) or 1 (the orthogonal
        projection, a contraction: use this one under error feedback).
    min_size, warmup, seed, kernels
        As in :class:`~arraytrain.compress.Compressor`.

    Notes
    -----
    The payload holds one array, ``"values"``: the ``d`` kept coordinates in
    the gradient's dtype, so ``nbytes = d * itemsize`` (plus the ``raw``
    parameters below ``min_size``).
    """

    method = "vsa"
    stochastic = True
    family = "projection"

    def __init__(self, ratio=None, *, dim=None, block: int = 4096, unbiased: bool = True,
                 min_size: int = 0, warmup: int | None = None, seed: int = 0, kernels: str = "numba"):
        super().__init__(min_size=min_size, warmup=warmup, seed=seed, kernels=kernels)
        if (ratio is None) == (dim is None):
            raise HyperparameterError(f"ratio, dim: give exactly one, got ratio={ratio!r}, dim={dim!r}")
        self.ratio = None if ratio is None else check_number("ratio", ratio, 0.0, 1.0, lo_open=True)
        self.dim = None if dim is None else check_int("dim", dim, 1)
        self.block = check_int("block", block, 1, 2**30)
        if self.block & (self.block - 1):
            raise HyperparameterError(f"block: expected a power of two, got {block!r}")
        self.unbiased = check_bool("unbiased", unbiased)

    def _bind(self, domain: Domain) -> None:
        n = domain.size
        if self.dim is not None:
            if self.dim > n:
                raise HyperparameterError(f"dim: expected at most the {n} compressed elements, got {self.dim}")
            d = self.dim
        else:
            d = max(1, int(round(self.ratio * n))) if n else 0
        b = min(self.block, 1 << max(n - 1, 0).bit_length())
        padded = -(-n // b) * b
        self.d, self.block_used, self.padded = d, b, padded
        self.scale = padded / d if (self.unbiased and d) else 1.0
        self._z = np.zeros(padded, domain.dtype)

    def _move(self, xp) -> None:
        self._z = xp.asarray(self._z)

    @staticmethod
    def _keys(meta: Mapping) -> tuple[int, int]:
        """The sign key (the call's draw key) and the selection key (derived from it)."""
        key = int(meta["key"])
        return key, step_key(key, 0, 1)

    def _encode(self, x: np.ndarray, meta: dict) -> dict[str, np.ndarray]:
        sign_key, sel_key = self._keys(meta)
        n, z = x.size, self._z
        self._kern.sign_bind(x, z[:n], key=sign_key)
        z[n:] = 0
        self._kern.fwht(z, block=self.block_used)
        y = self._xp().empty(self.d, z.dtype)
        self._kern.select_gather(z, y, key=sel_key, block=self.block_used)
        return {"values": y}

    def _decode(self, arrays: Mapping[str, np.ndarray], meta: Mapping, out: np.ndarray) -> None:
        y = check_wire(arrays, "values", (self.d,), out.dtype, out)
        sign_key, sel_key = self._keys(meta)
        z = self._z
        self._kern.select_scatter(y, z, key=sel_key, block=self.block_used, factor=self.scale)
        self._kern.fwht(z, block=self.block_used)
        self._kern.sign_bind(z, out, key=sign_key)

    def _summed(self, payload) -> list[str]:
        return ["values"]

    def hyperparameters(self) -> dict:
        size = {"ratio": self.ratio} if self.ratio is not None else {"dim": self.dim}
        return {**size, "block": self.block, "unbiased": self.unbiased, **super().hyperparameters()}

    @property
    def contraction(self) -> bool:
        return not self.unbiased
