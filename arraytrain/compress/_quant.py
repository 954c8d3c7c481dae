r"""Quantizers: blockwise int8, scaled sign (1 bit) and TernGrad (2 bits).

Each keeps every element and sends it in fewer bits with one scale per block
of the domain (the domain as one vector, parameters packed in layout order; a
block may straddle two parameters). Inputs are expected finite — the engine
skips a non-finite step before compressing — and the scales of
:class:`Sign` and :class:`Ternary` are float32, so gradients beyond float32's
range are out of their scope.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .._checks import check_bool, check_int
from ..backend import CUPY, array_module
from ..kernels.counter_rng import step_key
from ._base import Compressor, Domain, check_wire
from ._summed import Summed


def _check_block(block, allow_none: bool):
    if block is None and allow_none:
        return None
    return check_int("block", block, 1)


class Int8Block(Summed, Compressor):
    r"""Blockwise absmax int8 (as in Dettmers et al. 2022, 8-bit optimizers, for gradients).

    Per block ``b`` of ``block`` elements:

    .. math::
        s_b = \max_{i \in b} |x_i| / 127, \quad q_i = \mathrm{round}(x_i / s_b) \in [-127, 127],
        \quad \hat x_i = q_i s_b

    Rounding to nearest (ties to even) gives :math:`|x_i - \hat x_i| \le s_b/2`;
    ``stochastic_rounding=True`` rounds up with probability
    :math:`x_i/s_b - \lfloor x_i/s_b \rfloor` (counter-based draws keyed by
    ``(seed, call number)``), which is unbiased, :math:`E[\hat x] = x`, with
    :math:`|x_i - \hat x_i| < s_b`. Both bounds hold up to the rounding of
    ``s_b`` and of ``1/s_b`` (a few ulps of the block's absmax). An all-zero
    block has ``s_b = 0`` and decodes to zeros.

    Payload: ``codes`` (int8, one per element) and ``scales`` (the gradient
    dtype, one per block): ``n + ceil(n / block) * itemsize`` bytes. One pass
    over the gradient.

    **In a group of K processes** the scale is shared: each process's block
    maxima are max-all-reduced before the codes are taken (a second pass, the
    codes against :math:`S_b = \max_r s_{b,r}`), so the codes add up,
    :math:`\sum_r \hat x_r = S_b \sum_r q_r`, and are all-reduced and decoded
    once. A sum of K codes needs more than 8 bits: the codes travel as int16
    (K <= 258; int32 beyond; CuPy arrays through NCCL, which has no int16, as
    float16 — exact for these integers — up to K = 16), and the payload holds
    them so, ``2n + ceil(n / block) * itemsize`` bytes — what each process
    puts on the wire, the shared scales' all-reduce included. Stochastic rounding draws
    independently on each process (the call's key mixed with the rank), so
    the rounding errors of the sum are independent too.
    """

    method = "int8block"

    def __init__(self, block: int = 256, stochastic_rounding: bool = False, *, min_size: int = 0,
                 warmup: int | None = None, seed: int = 0, kernels: str = "numba"):
        super().__init__(min_size=min_size, warmup=warmup, seed=seed, kernels=kernels)
        self.block = _check_block(block, False)
        self.stochastic_rounding = check_bool("stochastic_rounding", stochastic_rounding)
        self.stochastic = self.stochastic_rounding

    def _bind(self, domain: Domain) -> None:
        self._nblocks = -(-domain.size // self.block)

    def _codes_dtype(self) -> np.dtype:
        """int8 for one process; in a group, a type that holds the sum of every process's codes exactly.

        int16 over MPI; NCCL (CuPy arrays) has no int16, and float16 holds every integer up to
        2048 exactly — every partial sum of up to 16 processes' codes, in any order.
        """
        k = self.comm.size
        if k == 1:
            return np.dtype(np.int8)
        if self._backend == CUPY:
            return np.dtype(np.float16 if 127 * k <= 2048 else np.int32)
        return np.dtype(np.int16 if 127 * k <= 2**15 - 1 else np.int32)

    def _encode(self, x: np.ndarray, meta: dict) -> dict[str, np.ndarray]:
        xp = self._xp()
        codes = xp.empty(x.size, np.int8)
        scales = xp.empty(self._nblocks, x.dtype)
        key = meta.get("key", 0)
        if self.comm.is_local:
            self._kern.int8_encode(x, codes, scales, block=self.block, key=key, stochastic=self.stochastic_rounding)
            return {"codes": codes, "scales": scales}
        self._kern.int8_encode(x, codes, scales, block=self.block, key=key, stochastic=False)  # this process's scales
        self.comm.allreduce(scales, "max")  # max_r(absmax_r * fl(1/127)) == max_r(absmax_r) * fl(1/127)
        if self.stochastic_rounding:
            key = step_key(key, self.comm.rank, 2)
        self._kern.int8_encode(x, codes, scales, block=self.block, key=key, stochastic=self.stochastic_rounding,
                               shared=True)
        return {"codes": codes.astype(self._codes_dtype()), "scales": scales}

    def _decode(self, arrays: Mapping[str, np.ndarray], meta: Mapping, out: np.ndarray) -> None:
        codes = check_wire(arrays, "codes", (out.size,), self._codes_dtype(), out)
        scales = check_wire(arrays, "scales", (self._nblocks,), out.dtype, out)
        if codes.dtype == np.int8:
            self._kern.int8_decode(codes, scales, out, block=self.block)
        else:
            _decode_wide(codes, scales, self.block, out)

    def _summed(self, payload) -> list[str]:
        return ["codes"]  # the scales are the group's already

    def hyperparameters(self) -> dict:
        return {"block": self.block, "stochastic_rounding": self.stochastic_rounding, **super().hyperparameters()}


def _decode_wide(codes, scales, block: int, out) -> None:
    """``out_i = codes_i * scale_b`` for codes wider than int8 (a group's sums), NumPy or CuPy."""
    xp = array_module(out)
    n = out.size
    full = n - n % block
    if full:
        xp.multiply(codes[:full].reshape(-1, block), scales[:full // block, None], out=out[:full].reshape(-1, block))
    if full < n:
        xp.multiply(codes[full:], scales[-1], out=out[full:])


class _BlockScaled(Compressor):
    """``block=None``: one scale for the whole domain; an int: one per ``block`` elements."""

    def __init__(self, block=None, *, min_size: int = 0, warmup: int | None = None, seed: int = 0, kernels: str = "numba"):
        super().__init__(min_size=min_size, warmup=warmup, seed=seed, kernels=kernels)
        self.block = _check_block(block, True)

    def _bind(self, domain: Domain) -> None:
        self._block = max(domain.size, 1) if self.block is None else self.block
        self._nblocks = -(-domain.size // self._block)

    def hyperparameters(self) -> dict:
        return {"block": self.block, **super().hyperparameters()}


class Sign(_BlockScaled):
    r"""Scaled sign, 1 bit per element: EF-signSGD (Karimireddy et al. 2019, "Error feedback fixes SignSGD").

    .. math::  C(x)_i = \frac{\|x_b\|_1}{|b|} \operatorname{sign}(x_i), \quad i \in b

    with ``sign(0) = +1`` (the bit is ``x_i >= 0``; ``-0.0`` counts as
    ``+``). ``block=None`` (default) uses one scale for the whole domain, the
    paper's form; an int gives one scale per ``block`` elements, which tracks
    parameters of different magnitudes better for 4 more bytes a block. A
    biased compressor: use it with :class:`~arraytrain.compress.ErrorFeedback`.
    The L1 norm is summed in float64 per fixed piece, pieces added in order,
    and rounded once to float32.

    Payload: ``bits`` (uint8, 8 signs per byte, ``np.packbits(x >= 0,
    bitorder="little")``) and ``scales`` (float32): ``ceil(n / 8) + 4 *
    nblocks`` bytes. One pass over the gradient.
    """

    method = "sign"

    def _encode(self, x: np.ndarray, meta: dict) -> dict[str, np.ndarray]:
        xp = self._xp()
        bits = xp.empty(-(-x.size // 8), np.uint8)
        scales = xp.empty(self._nblocks, np.float32)
        self._kern.sign_encode(x, bits, scales, block=self._block)
        return {"bits": bits, "scales": scales}

    def _decode(self, arrays: Mapping[str, np.ndarray], meta: Mapping, out: np.ndarray) -> None:
        bits = check_wire(arrays, "bits", (-(-out.size // 8),), np.uint8, out)
        scales = check_wire(arrays, "scales", (self._nblocks,), np.float32, out)
        self._kern.sign_decode(bits, scales, out, block=self._block)


class Ternary(_BlockScaled):
    r"""TernGrad, 2 bits per element (Wen et al. 2017, "TernGrad: ternary gradients").

    .. math::
        s_b = \max_{i \in b} |x_i|, \quad C(x)_i = s_b \operatorname{sign}(x_i)\, z_i,
        \quad z_i \sim \mathrm{Bernoulli}(|x_i| / s_b)

    Unbiased, :math:`E[C(x)] = x`, with variance :math:`s_b |x_i| - x_i^2`;
    every decoded value is one of :math:`\{-s_b, 0, s_b\}`. ``block=None``
    (default) takes one scale for the whole domain, the paper's per-tensor
    scale taken over the domain as one vector; an int gives one scale per
    ``block`` elements and a lower variance. Draws are counter-based, keyed by
    ``(seed, call number)``; ``z_i = [u_i s_b < |x_i|]``. The scale is stored
    as float32, rounded up where float32 would round a float64 maximum down,
    so that :math:`|x_i| \le s_b` keeps the probability at most 1.

    Payload: ``codes`` (uint8, four 2-bit codes per byte, element ``4j + t``
    in bits ``2t`` and ``2t + 1`` of byte ``j``; 0 = zero, 1 = ``+s``, 2 =
    ``-s``) and ``scales`` (float32): ``ceil(n / 4) + 4 * nblocks`` bytes.
    Two passes over the gradient (block maxima, then codes). In a group of processes the
    payloads are gathered, and each process rounds with its own draws (the call's key
    mixed with the rank), so the rounding errors of the sum are independent.
    """

    method = "ternary"
    stochastic = True

    def _encode(self, x: np.ndarray, meta: dict) -> dict[str, np.ndarray]:
        xp = self._xp()
        codes = xp.empty(-(-x.size // 4), np.uint8)
        scales = xp.empty(self._nblocks, np.float32)
        key = meta["key"]
        if not self.comm.is_local:  # each process rounds independently (decoding needs no key)
            key = step_key(key, self.comm.rank, 2)
        self._kern.ternary_encode(x, codes, scales, block=self._block, key=key)
        return {"codes": codes, "scales": scales}

    def _decode(self, arrays: Mapping[str, np.ndarray], meta: Mapping, out: np.ndarray) -> None:
        codes = check_wire(arrays, "codes", (-(-out.size // 4),), np.uint8, out)
        scales = check_wire(arrays, "scales", (self._nblocks,), np.float32, out)
        self._kern.ternary_decode(codes, scales, out, block=self._block)
