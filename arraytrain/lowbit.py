"""Low-bit optimizer state's codecs: bitsandbytes' blockwise dynamic quantization and float8.

The maps, the reference encoders every kernel family equals bit for bit and the form of a
quantized state-dict entry, below the buffers, checkpoints and kernels that import them (the
slots, which the optimizers use: :class:`arraytrain.optim.state8.Quant8Buffer`).

**8-bit** (``state_dtype="8bit"``): one uint8 code per element and one float32 ``absmax`` per
block of :data:`BLOCK` (256) elements, the blocks starting at the parameter's first element. A
code indexes one of bitsandbytes' two dynamic maps (Dettmers et al. 2022, "8-bit Optimizers
via Block-wise Quantization"; ``bitsandbytes.functional.create_dynamic_map``): the signed map
for signed state (first moments, momentum buffers), the unsigned map for state that is never
negative (second moments, sums of squares). The value is ``map[code] * absmax``.

Encoding a block (every family): ``absmax = max |x|`` over the block, ``q = x * (1/absmax)``
in float32 (``0`` where ``absmax == 0``), and the code of the map value nearest to ``q`` by
float32 distance, ties to the lower code: bitsandbytes' own blockwise quantization as its
PyTorch implementation writes it (``torch.argmin`` of ``|q - map|``). A NaN ``q`` takes the
top code of its sign's half (255 for +NaN, 0 for -NaN); its block's ``absmax`` is NaN, so
every value of the block decodes as NaN. The fast kernels find the nearest code without a
search: the float32 bits of ``q`` (sign, exponent, the top mantissa bits) index
:class:`Codebook`'s ``table``, whose entry holds the code at the bucket's start and, when the
bucket holds one decision boundary, the low mantissa bits from which the next code applies
(buckets are fine enough to hold at most one; checked when the table is built).

The optimizers' update uses the float32 values it computes in the step; their 8-bit
codes are what the next step starts from (bitsandbytes' order: decode, update, encode).

**float8** (``state_dtype="float8"``): the same layout (a uint8 code per element, a float32 per
block of 256, small parameters in float32), with float8 codes in place of the dynamic map and
the block's largest magnitude scaled to the format's largest value (torchao's ``AdamWFp8`` keeps
Adam's moments so, in e4m3 with a scale per block of 256; Transformer Engine's ``FusedAdam``
keeps ``exp_avg_sq`` in e5m2): each code is the round to nearest even of ``x * (top / absmax)``,
the value of a code ``format[code] * (absmax / top)``. Signed slots (first moments, momentum
buffers) take **e4m3** (``ml_dtypes.float8_e4m3fn``: 3 mantissa bits, ``top`` 448); slots that
are never negative (second moments, sums of squares: ``UNSIGNED_SLOTS`` of the optimizers) take
**e5m2** (``ml_dtypes.float8_e5m2``: 2 mantissa bits, ``top`` 57344), whose 5 exponent bits
span the binades a square spans. Why these, against a power-of-two scale and e4m3 of the second
moment's square root: docs/guide.md#float8-state. See :func:`float8_encode`; every family's
encoder equals it bit for bit, and decoding is the map's value times the scale, as for the
dynamic map. A block holding a NaN or an infinity has a NaN scale and every code 0x7F (NaN in
both formats): it decodes as NaN.

Inside an optimizer's step the e5m2 slots are re-encoded with **stochastic rounding**
(:func:`sr_codes`): a second moment or a sum of squares moves by a fraction of a percent a step
(``1 - beta2``), far below half an e5m2 step (6-12%), so rounded to nearest its codes stop
moving and the moment falls behind its float32 twin (measured: the update 1.26x float32's at step
300, docs/guide.md#float8-state); rounded up with the probability of the distance, it follows
it on average. The noise is a hash of the element's place (its parameter and position in it) and
a key of the step (:func:`sr_salt`: the step count and the slot's name), so the bits do not
depend on threads, partitions or the family, and a resumed run repeats them. Conversions
(checkpoints, ``load_state_dict``, a first encode) round to nearest even.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from . import backend
from .errors import DTypeError, LayoutError, ShapeMismatchError, StateDictError
from .kernels.interface import Q8_BLOCK
from .owned import OwnedRange

#: Elements per block: one float32 absmax each (bitsandbytes' blocksize since 0.44).
BLOCK = Q8_BLOCK

# bitsandbytes' create_dynamic_map(signed=True) and (signed=False) as float32 bits, sorted
# (bitsandbytes 0.50.2; the test suite compares them with the installed bitsandbytes).
_SIGNED_BITS = (
    "bf7e3333 bf7a999a bf770000 bf736666 bf6fcccd bf6c3333 bf68999a bf650000 "
    "bf616666 bf5dcccd bf5a3333 bf56999a bf530000 bf4f6666 bf4bcccd bf483333 "
    "bf44999a bf410000 bf3d6666 bf39cccd bf363334 bf32999a bf2f0000 bf2b6666 "
    "bf27cccd bf243334 bf20999a bf1d0000 bf196666 bf15cccd bf123334 bf0e999a "
    "bf0b0000 bf076666 bf03cccc bf003333 bef93332 bef20000 beeacccc bee3999a "
    "bedc6666 bed53333 bece0000 bec6cccc bebf999a beb86666 beb13333 beaa0000 "
    "bea2cccc be9b999a be946666 be8d3334 be860000 be7d9999 be6f3333 be60cccd "
    "be526666 be440000 be35999a be273333 be18cccd be0a6666 bdf80000 bddb3334 "
    "bdc9eb85 bdc428f7 bdbe6667 bdb8a3d7 bdb2e148 bdad1eb8 bda75c2a bda1999a "
    "bd9bd70a bd96147b bd9051eb bd8a8f5d bd84cccd bd7e147b bd728f5d bd670a3d "
    "bd5b851f bd500000 bd447ae1 bd38f5c3 bd2d70a3 bd21eb85 bd166667 bd0ae148 "
    "bcfeb852 bce7ae15 bcd0a3d7 bcb9999a bca28f5d bc8b851f bc68f5c3 bc3ae148 "
    "bc1f3b64 bc160418 bc0ccccd bc039581 bbf4bc6a bbe24dd3 bbcfdf3b bbbd70a4 "
    "bbab020d bb989374 bb8624dd bb676c8a bb428f5c bb1db22d baf1a9fc baa7ef9d "
    "ba7765ff ba59e83e ba3c6a80 ba1eecc1 ba016f01 b9c7e283 b98ce705 b923d70b "
    "b8ba1f4b b88aefb3 b8378034 b7b24206 b70205ff b65a1a94 b513a3b7 00000000 "
    "3513a3b7 365a1a94 370205ff 37b24206 38378034 388aefb3 38ba1f4b 3923d70b "
    "398ce705 39c7e283 3a016f01 3a1eecc1 3a3c6a80 3a59e83e 3a7765ff 3aa7ef9d "
    "3af1a9fc 3b1db22d 3b428f5c 3b676c8a 3b8624dd 3b989374 3bab020d 3bbd70a4 "
    "3bcfdf3b 3be24dd3 3bf4bc6a 3c039581 3c0ccccd 3c160418 3c1f3b64 3c3ae148 "
    "3c68f5c3 3c8b851f 3ca28f5d 3cb9999a 3cd0a3d7 3ce7ae15 3cfeb852 3d0ae148 "
    "3d166667 3d21eb85 3d2d70a3 3d38f5c3 3d447ae1 3d500000 3d5b851f 3d670a3d "
    "3d728f5d 3d7e147b 3d84cccd 3d8a8f5d 3d9051eb 3d96147b 3d9bd70a 3da1999a "
    "3da75c2a 3dad1eb8 3db2e148 3db8a3d7 3dbe6667 3dc428f7 3dc9eb85 3ddb3334 "
    "3df80000 3e0a6666 3e18cccd 3e273333 3e35999a 3e440000 3e526666 3e60cccd "
    "3e6f3333 3e7d9999 3e860000 3e8d3334 3e946666 3e9b999a 3ea2cccc 3eaa0000 "
    "3eb13333 3eb86666 3ebf999a 3ec6cccc 3ece0000 3ed53333 3edc6666 3ee3999a "
    "3eeacccc 3ef20000 3ef93332 3f003333 3f03cccc 3f076666 3f0b0000 3f0e999a "
    "3f123334 3f15cccd 3f196666 3f1d0000 3f20999a 3f243334 3f27cccd 3f2b6666 "
    "3f2f0000 3f32999a 3f363334 3f39cccd 3f3d6666 3f410000 3f44999a 3f483333 "
    "3f4bcccd 3f4f6666 3f530000 3f56999a 3f5a3333 3f5dcccd 3f616666 3f650000 "
    "3f68999a 3f6c3333 3f6fcccd 3f736666 3f770000 3f7a999a 3f7e3333 3f800000 "
)
_UNSIGNED_BITS = (
    "00000000 34ae7baa 35500998 360e9b38 3692ccf6 36de4c51 3714e5d5 3783126e "
    "37e171a0 381fe868 384f1800 387e479a 3896bb99 38ae5364 38c5eb31 3906594b "
    "394154ca 397c5049 399ba5e4 39b923a2 39d6a163 39f41f22 3a08ce71 3a178d50 "
    "3a264c30 3a350b10 3a43c9ef 3a5288d0 3a6147af 3a70068e 3a7ec56e 3a958106 "
    "3aba5e35 3adf3b64 3b020c4a 3b147ae1 3b26e978 3b395810 3b4bc6a7 3b5e3540 "
    "3b70a3d7 3b818937 3b8ac082 3b93f7cf 3b9d2f1a 3ba66666 3baf9db2 3bb8d4fd "
    "3bc20c4a 3bcb4395 3bd47ae1 3bddb22e 3be6e978 3bf020c5 3bf9580f 3c0147ae "
    "3c05e354 3c0a7ef9 3c0f1aa0 3c13b645 3c1851eb 3c1ced92 3c218937 3c2f5c2a "
    "3c466667 3c5d70a3 3c747ae2 3c85c28f 3c9147af 3c9ccccd 3ca851eb 3cb3d70b "
    "3cbf5c29 3ccae147 3cd66667 3ce1eb87 3ced70a3 3cf8f5c3 3d023d70 3d080000 "
    "3d0dc28f 3d13851f 3d1947af 3d1f0a3d 3d24cccd 3d2a8f5c 3d3051eb 3d36147b "
    "3d3bd70a 3d41999a 3d475c28 3d4d1eb8 3d52e147 3d58a3d7 3d5e6667 3d6428f7 "
    "3d69eb87 3d6fae15 3d7570a3 3d7b3333 3d807ae2 3d835c2a 3d863d71 3d891eb8 "
    "3d8c0000 3d8ee148 3d91c290 3d94a3d7 3d97851f 3d9a6667 3d9d47af 3da028f6 "
    "3da30a3e 3da5eb85 3da8cccd 3dabae15 3dae8f5c 3db170a4 3db451eb 3db73333 "
    "3dba147b 3dbcf5c3 3dbfd70b 3dc2b852 3dc5999a 3dc87ae2 3dcb5c29 3dd40000 "
    "3de26666 3df0cccd 3dff3333 3e06cccc 3e0e0000 3e153334 3e1c6666 3e23999a "
    "3e2acccc 3e320000 3e393334 3e406666 3e47999a 3e4ecccc 3e560000 3e5d3334 "
    "3e646666 3e6b999a 3e72cccc 3e7a0000 3e809999 3e843333 3e87cccd 3e8b6666 "
    "3e8f0000 3e92999a 3e963333 3e99cccc 3e9d6666 3ea10000 3ea4999a 3ea83333 "
    "3eabcccc 3eaf6666 3eb30000 3eb6999a 3eba3333 3ebdcccc 3ec16666 3ec50000 "
    "3ec8999a 3ecc3333 3ecfcccc 3ed36666 3ed70000 3eda999a 3ede3333 3ee1cccc "
    "3ee56666 3ee90000 3eec999a 3ef03333 3ef3cccc 3ef76666 3efb0000 3efe9999 "
    "3f01199a 3f02e666 3f04b333 3f068000 3f084ccc 3f0a199a 3f0be666 3f0db334 "
    "3f0f8000 3f114ccd 3f13199a 3f14e666 3f16b334 3f188000 3f1a4ccd 3f1c199a "
    "3f1de666 3f1fb334 3f218000 3f234ccd 3f25199a 3f26e666 3f28b334 3f2a8000 "
    "3f2c4ccd 3f2e199a 3f2fe666 3f31b334 3f338000 3f354ccd 3f37199a 3f38e666 "
    "3f3ab334 3f3c8000 3f3e4ccd 3f40199a 3f41e666 3f43b334 3f458000 3f474ccc "
    "3f49199a 3f4ae666 3f4cb334 3f4e8000 3f504ccc 3f52199a 3f53e666 3f55b334 "
    "3f578000 3f594ccc 3f5b199a 3f5ce666 3f5eb334 3f608000 3f624ccc 3f64199a "
    "3f65e666 3f67b334 3f698000 3f6b4ccc 3f6d199a 3f6ee666 3f70b334 3f728000 "
    "3f744ccc 3f76199a 3f77e666 3f79b334 3f7b8000 3f7d4ccc 3f7f199a 3f800000 "
)


def _map(bits) -> np.ndarray:
    out = np.array([int(h, 16) for h in "".join(bits).split()], np.uint32).view(np.float32)
    assert out.size == 256 and np.all(np.diff(out) > 0)
    out.flags.writeable = False
    return out


SIGNED_MAP = _map(_SIGNED_BITS)
UNSIGNED_MAP = _map(_UNSIGNED_BITS)

# A q below 2**-23 in magnitude is nearest to 0 in both maps (their smallest magnitudes
# are 3.25e-7 and 5.5e-7), so the bucket table starts at exponent 104 (2**-23).
_LOW_EXPONENT = 104


def nearest_codes(q, qmap) -> np.ndarray:
    """The codes of float32 ``q`` clamped to [-1, 1]: how many of the map's float32 midpoints
    ``(map[i] + map[i+1]) / 2`` lie strictly below ``q`` (the nearest map value, a tie to the
    lower code; +NaN -> 255, -NaN -> 0). Every family's encoder gives these codes."""
    q = np.clip(np.asarray(q, np.float32), np.float32(-1), np.float32(1))  # bitsandbytes clamps q to [-1, 1]
    bounds = ((qmap[:-1] + qmap[1:]) / np.float32(2)).astype(np.float32)
    codes = np.searchsorted(bounds, q, side="left")
    nan = np.isnan(q)
    if nan.any():
        codes = np.where(nan, np.where(np.signbit(q), 0, 255), codes)
    return codes.astype(np.uint8)


class Codebook(NamedTuple):
    """A dynamic map and the bucket table the fast encoders read (see the module docstring).

    ``table[sign * nb + clip((|bits| >> shift) - bias, 0, nb - 1)]`` is
    ``(threshold << 8) | code``; the element's code is ``code``, or ``code + 1`` (``code - 1``
    for a negative q) where its low ``shift`` bits are ``>= threshold``.
    """

    qmap: np.ndarray
    table: np.ndarray
    shift: int
    bias: int
    nb: int


@lru_cache(maxsize=None)
def codebook(signed: bool) -> Codebook:
    """The signed or unsigned map's :class:`Codebook`, built once per process."""
    qmap = SIGNED_MAP if signed else UNSIGNED_MAP
    # bucket width below the smallest gap between neighbouring map values (top 6 mantissa
    # bits for the signed map, whose gaps near 1 are 0.014; 7 for the unsigned one, 0.007)
    shift = 17 if signed else 16
    bias = (_LOW_EXPONENT << 23) >> shift
    nb = ((127 << 23) >> shift) - bias + 1  # the last bucket starts at 1.0 and takes every larger q
    never = 1 << shift
    table = np.empty(2 * nb, np.int64)
    for sign in (0, 1):
        start = ((np.arange(nb, dtype=np.int64) + bias) << shift) | (sign << 31)
        end = start + never - 1
        end[-1] = start[-1] | 0x7FFFFF  # the top bucket: [1, 2) and beyond all saturate
        c0 = nearest_codes(start.astype(np.uint32).view(np.float32), qmap).astype(np.int64)
        c1 = nearest_codes(end.astype(np.uint32).view(np.float32), qmap).astype(np.int64)
        step = c1 - c0
        if np.any(np.abs(step) > 1):
            raise AssertionError("dynamic map: a bucket holds two decision boundaries")
        thr = np.full(nb, never, np.int64)
        moving = np.nonzero(step)[0]
        lo, hi = start[moving].copy(), end[moving].copy()
        while np.any(hi - lo > 0):  # the first u whose code moved, by bisection (the code is monotone)
            mid = (lo + hi) // 2
            moved = nearest_codes(mid.astype(np.uint32).view(np.float32), qmap).astype(np.int64) != c0[moving]
            hi = np.where(moved, mid, hi)
            lo = np.where(moved, lo, mid + 1)
        thr[moving] = lo & (never - 1)
        table[sign * nb : (sign + 1) * nb] = (thr << 8) | c0
    table = table.astype(np.int32)
    table.flags.writeable = False
    return Codebook(qmap, table, shift, bias, nb)


# -- float8 (see the module docstring) ---------------------------------------------------------

def _e4m3_values() -> np.ndarray:
    """Every e4m3 code's value: a sign, 4 exponent bits of bias 7 (0: subnormal), 3 mantissa bits; no
    infinities, 0x7F and 0xFF NaN (the tests check the table against ``ml_dtypes.float8_e4m3fn``, which
    is not imported here: its import takes over a second on some machines)."""
    codes = np.arange(256)
    exp, man = (codes >> 3) & 0xF, (codes & 7) / 8.0
    mag = np.where(exp == 0, man * 2.0 ** -6, (1.0 + man) * 2.0 ** (exp - 7.0))
    out = np.where(codes & 0x80, -mag, mag).astype(np.float32)
    out[0x7F], out[0xFF] = np.nan, -np.nan
    return out


def _quiet_nans(values: np.ndarray) -> np.ndarray:
    """``values`` with every NaN the quiet NaN of its code's sign (0x7FC00000 or 0xFFC00000), as
    ml_dtypes' casts give them; read-only."""
    bits = values.view(np.uint32)
    nan = np.isnan(values)
    bits[nan] = np.uint32(0x7FC00000) | (bits[nan] & np.uint32(0x80000000))
    values.flags.writeable = False
    return values


#: The value of every e4m3 code (``ml_dtypes.float8_e4m3fn``; codes 0x7F and 0xFF are NaN).
E4M3_MAP = _quiet_nans(_e4m3_values())
#: The value of every e5m2 code (``ml_dtypes.float8_e5m2``; 0x7C/0xFC are +-inf, 0x7D-0x7F/0xFD-0xFF NaN):
#: e5m2 is float16's upper byte.
E5M2_MAP = _quiet_nans((np.arange(256, dtype=np.uint16) << 8).view(np.float16).astype(np.float32))
#: The maps a quantized slot's codes may index, by the name its entries carry.
MAPS = {"signed": SIGNED_MAP, "unsigned": UNSIGNED_MAP, "e4m3": E4M3_MAP, "e5m2": E5M2_MAP}
FLOAT8_MAPS = ("e4m3", "e5m2")
#: Each float8 format's largest finite value: a block's largest magnitude is scaled to it.
F8_TOP = {"e4m3": 448.0, "e5m2": 57344.0}
#: The code a NaN block's elements take (NaN in both formats).
F8_NAN_CODE = 0x7F
#: A block whose largest magnitude is below this is stored as zeros (``57344 / largest`` would
#: overflow float32 below 1.7e-34; a moment that small is zero to every optimizer).
F8_TINY = 2.0 ** -111


def scale_key(map_name: str) -> str:
    """The key of a quantized entry's per-block float32: ``"absmax"`` (dynamic maps) or ``"scale"`` (float8)."""
    return "scale" if map_name in FLOAT8_MAPS else "absmax"


def _blocks(x) -> tuple[np.ndarray, np.ndarray]:
    """``x`` as a flat float32 array, and its blocks of :data:`BLOCK` from its start (zero-padded)."""
    x = np.asarray(x, np.float32).ravel()
    padded = np.zeros(-(-x.size // BLOCK) * BLOCK, np.float32)
    padded[: x.size] = x
    return x, padded.reshape(-1, BLOCK)


def float8_encode(x, map_name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, scale)`` of a 1-D array by blocks of :data:`BLOCK` from its start in float8 format
    ``map_name`` (``"e4m3"`` or ``"e5m2"``; reference code).

    Per block: ``m`` the largest ``|x|`` as float32 bits (a NaN's bits win). ``m`` not finite:
    scale NaN, every code :data:`F8_NAN_CODE`. ``m`` below :data:`F8_TINY`: scale 0, every code
    that of ``+-0``. Else each code is ml_dtypes' round-to-nearest-even cast of the float32 product
    ``x * (top / m)`` (the quotient a float32 division; ``top`` the format's largest value, see
    :data:`F8_TOP`), and the scale is ``m / top`` (float32): the block's largest value decodes to
    ``m`` within float32 rounding, and a block whose values all grow by one factor keeps its codes,
    the scale carrying the growth at float32 precision.
    """
    import ml_dtypes  # (reference code: the format's cast)

    fmt = ml_dtypes.float8_e5m2 if map_name == "e5m2" else ml_dtypes.float8_e4m3fn
    top = np.float32(F8_TOP[map_name])
    x, y = _blocks(x)
    m = (y.view(np.uint32) & np.uint32(0x7FFFFFFF)).max(axis=1) if y.size else np.zeros(0, np.uint32)
    bad = m >= 0x7F800000
    am = np.where(bad, np.uint32(0), m).view(np.float32)
    tiny = am < np.float32(F8_TINY)
    inv = np.where(tiny, np.float32(0), top / np.where(tiny, np.float32(1), am)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        codes = (y * inv[:, None]).astype(np.float32).astype(fmt).view(np.uint8)
    codes[bad] = F8_NAN_CODE
    scale = np.where(tiny, np.float32(0), am / top).astype(np.float32)
    scale[bad] = np.float32(np.nan)
    return codes.ravel()[: x.size].copy(), scale


#: The smallest normal e5m2 value as float32 bits: below it :func:`sr_codes` rounds the bits of
#: ``|q| + 2**-14`` (the subnormals' fixed step is the first binade's).
E5M2_NORMAL_BITS = 0x38800000
#: The largest finite e5m2 code: a product a little above 57344 stays there.
E5M2_TOP_CODE = 0x7B
_M32 = 0xFFFFFFFF


def _mix32(x: int) -> int:
    """A 32-bit integer hash (lowbias32: xor-shifts and two odd multipliers)."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def sr_salt(step: int, name: str) -> int:
    """The stochastic rounding's key for slot ``name`` at step ``step`` (the count the step takes
    the parameters to): a uint32 from the two, so every step and every slot draws other noise."""
    h = 0
    for b in name.encode():
        h = _mix32(h ^ b)
    return _mix32(h ^ _mix32(int(step)))


def sr_key(salt: int, seg: int) -> int:
    """The noise key of parameter ``seg`` (by its place in the layout) under ``salt``."""
    return (int(salt) ^ ((int(seg) * 0x27D4EB2F) & _M32)) & _M32


def sr_noise(pos, key: int) -> np.ndarray:
    """21 bits of noise per element (uint32): the top 21 bits of ``(pos ^ key) * 0x85EBCA77`` mod 2**32
    (``pos``: the elements' positions in their parameter, mod 2**32; an odd multiplier, so a bijection
    of the 32 bits). For one element the key is uniform over the steps (a hash of the step count and
    the slot, :func:`sr_salt`), so its noise is; within a step, neighbours' noise steps through the
    multiplier's multiples, spread evenly."""
    pos = np.asarray(pos).astype(np.uint64) & np.uint64(_M32)
    x = pos ^ np.uint64(key)
    return (((x * np.uint64(0x85EBCA77)) & np.uint64(_M32)) >> np.uint64(11)).astype(np.uint32)


def sr_codes(x, pos, key: int) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, scale)`` of one block of float32 ``x`` in e5m2 as :func:`float8_encode` forms them
    (the scale, the NaN and all-tiny blocks alike), but each product ``q = x * (top / absmax)``
    stochastically rounded: the float32 bits of ``|q|`` plus :func:`sr_noise` of the elements'
    positions ``pos`` under ``key`` (:func:`sr_key`), shifted right by the 21 mantissa bits e5m2
    lacks and rebiased, at most the largest finite code: ``|q|`` rounds up with the probability of
    its distance from the code below. Below e5m2's normal range (2**-14: 2**-30 of the block's
    largest) the bits are those of the float32 sum ``|q| + 2**-14`` and the code 4 less (the step
    is 2**-16 on both sides of 2**-14, so the subnormal codes follow from the first binade's)."""
    x = np.asarray(x, np.float32).ravel()
    if np.shape(pos) != x.shape:
        raise LayoutError(f"pos: expected one position per element of x, shape {x.shape}, got shape {np.shape(pos)}")
    codes, scale = float8_encode(x, "e5m2")
    if x.size == 0 or not (np.isfinite(scale[0]) and scale[0] > 0):
        return codes, scale
    m = (x.view(np.uint32) & np.uint32(0x7FFFFFFF)).max().view(np.float32)
    inv = np.float32(np.float32(F8_TOP["e5m2"]) / m)
    u = (x * inv).astype(np.float32).view(np.uint32)
    a = u & np.uint32(0x7FFFFFFF)
    sub = a < np.uint32(E5M2_NORMAL_BITS)
    shifted = (a.view(np.float32) + np.float32(2.0 ** -14)).astype(np.float32).view(np.uint32)
    a = np.where(sub, shifted, a).astype(np.uint64)
    up = ((a + sr_noise(pos, key)) >> np.uint64(21)) - np.where(sub, (112 << 2) + 4, 112 << 2).astype(np.uint64)
    up = np.minimum(up, np.uint64(E5M2_TOP_CODE)).astype(np.uint32) | ((u >> np.uint32(24)) & np.uint32(0x80))
    return up.astype(np.uint8), scale


def encode(x, map_name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, per-block float32)`` of a 1-D array in map ``map_name``'s form (reference code)."""
    if map_name in FLOAT8_MAPS:
        return float8_encode(x, map_name)
    return quantize(x, map_name == "signed")


def decode(codes, scale, map_name: str):
    """float32 values ``map[code] * scale[block]`` (NumPy, or CuPy on the device of CuPy ``codes``)."""
    xp = _xp(codes)
    codes = xp.asarray(codes, np.uint8).ravel()
    scale = xp.repeat(xp.asarray(scale, np.float32), BLOCK)[: codes.size]
    qmap = MAPS[map_name] if xp is np else xp.asarray(MAPS[map_name])
    with np.errstate(invalid="ignore"):
        return (qmap[codes] * scale).astype(np.float32)


def quantize(x, signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, absmax)`` of a 1-D array by blocks of :data:`BLOCK` from its start (reference code)."""
    x, blocks = _blocks(x)
    absmax = np.abs(blocks).max(axis=1) if blocks.size else np.zeros(0, np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(absmax > 0, np.float32(1) / absmax, np.float32(0)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        q = (blocks * inv[:, None]).astype(np.float32).ravel()[: x.size]
    return nearest_codes(q, codebook(signed).qmap), absmax.astype(np.float32)


def dequantize(codes, absmax, signed: bool):
    """float32 values ``map[code] * absmax`` of a block-quantized 1-D array in a dynamic map
    (NumPy, or CuPy on the device of CuPy ``codes`` and ``absmax``)."""
    return decode(codes, absmax, "signed" if signed else "unsigned")


# -- state-dict entries ----------------------------------------------------------------------


def _xp(a):
    """The array module of ``a``: CuPy for a CuPy array (already imported then), else NumPy."""
    return backend.cupy() if backend.is_device_array(a) else np


def _host(a):
    """``a`` on the host: a CuPy array read back (validating and encoding state runs on the host)."""
    return a.get() if _xp(a) is not np else a


def is_q8_entry(a) -> bool:
    """Whether a state-dict entry is a quantized ``{"codes", "absmax", "map"}`` (8-bit) or
    ``{"codes", "scale", "map"}`` (float8) entry."""
    return isinstance(a, Mapping) and len(a) == 3 and "codes" in a and "map" in a and ("absmax" in a or "scale" in a)


def check_entry(name: str, a: Mapping, shape, n: int, span=None):
    """The codes, block scales and map name of a quantized entry for a parameter of ``shape``, checked.

    ``span=(start, stop)``: only the parameter's flat elements ``[start, stop)`` (``start`` on a
    block) are wanted: the flat codes and the absmax of their blocks are returned, taken from
    full arrays or from the parts a reader took (:class:`~arraytrain.owned.OwnedRange`).
    """
    map_name = a["map"]
    if not isinstance(map_name, str) or map_name not in MAPS:
        raise StateDictError(f"{name!r}: quantized state's map: expected one of {list(MAPS)}, got {map_name!r}")
    key = scale_key(map_name)
    if key not in a:
        raise StateDictError(f"{name!r}: a {map_name!r} entry holds 'codes', {key!r} and 'map', got {sorted(a)}")
    start, stop = (0, n) if span is None else span
    codes = _own(name, a["codes"], tuple(shape), (start, stop), "codes")
    scale = _own(name, a[key], (-(-n // BLOCK),), (start // BLOCK, start // BLOCK + blocks_in(start, stop)), key)
    if codes.dtype != np.uint8 or scale.dtype != np.float32:
        raise DTypeError(f"{name!r}: quantized state expects uint8 codes and float32 {key}, got "
                         f"{codes.dtype} and {scale.dtype}")
    return codes, scale, map_name


def _own(name: str, a, shape: tuple, want: tuple, what: str):
    """The flat elements ``want = (start, stop)`` of an array of ``shape`` (on the host): sliced from
    the full array, or a reader's :class:`~arraytrain.owned.OwnedRange` of exactly that range."""
    if isinstance(a, OwnedRange):
        data = np.asarray(_host(a.data)).reshape(-1)
        if tuple(a.shape) != shape:
            raise ShapeMismatchError(name, shape, tuple(a.shape), what=what)
        if (a.start, a.start + data.size) != want:
            raise LayoutError(f"{name!r}: {what} holds elements [{a.start}, {a.start + data.size}), this slot "
                              f"keeps [{want[0]}, {want[1]})")
        return data
    arr = np.asarray(_host(a))
    if tuple(arr.shape) != shape:
        raise ShapeMismatchError(name, shape, arr.shape, what=what)
    flat = arr.reshape(-1)
    return flat if want == (0, flat.size) else flat[want[0] : want[1]]


def blocks_in(start: int, stop: int) -> int:
    """Blocks holding a parameter's elements ``[start, stop)`` (``start`` on a block; 0 if empty)."""
    return -(-stop // BLOCK) - start // BLOCK if stop > start else 0


def decode_entry(name: str, a: Mapping, shape):
    """An 8-bit entry's float32 values in ``shape`` (loading 8-bit state into float slots), on the
    device its codes are on."""
    n = int(np.prod(shape, dtype=np.int64))
    codes, scale, map_name = check_entry(name, a, shape, n)
    out = decode(codes, scale, map_name).reshape(shape)
    xp = _xp(a["codes"])
    return out if xp is np else xp.asarray(out)


def float_entry_values(name: str, a, shape, span=None) -> np.ndarray:
    """A float state entry's float32 values (flat; only the elements ``span`` with one), on the host."""
    from .backend import as_array

    data = as_array(a.data if isinstance(a, OwnedRange) else a, name)
    if data.dtype.kind != "f" and data.dtype.name != "bfloat16":
        raise DTypeError(f"{name!r}: expected a float array or an 8-bit entry, got dtype {data.dtype}")
    n = int(np.prod(shape, dtype=np.int64))
    part = _own(name, a if isinstance(a, OwnedRange) else data, tuple(shape), span or (0, n), "array")
    with np.errstate(all="ignore"):
        return np.asarray(part, np.float32)
