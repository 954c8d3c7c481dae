"""int8 weight quantization: symmetric or asymmetric, per tensor or per output channel.

Uniform affine quantization (Jacob et al. 2018, "Quantization and Training of Neural
Networks for Efficient Integer-Arithmetic-Only Inference"), in the conventions of
``torch.quantize_per_tensor`` / ``torch.quantize_per_channel`` with ``torch.qint8``:
``q = clamp(rint(x / s) + z, qmin, qmax)``, ``x' = (q - z) * s``. Codes are real
``np.int8`` arrays; a one-off conversion, vectorised NumPy (not a per-step kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .backend import as_array
from .buffer import FlatBuffer
from .errors import ArgumentTypeError, DataError, HyperparameterError, UnknownParameterError
from ._checks import check_choice
from .prune import host_params, select_names

#: The values of ``scheme``: zero point 0 and codes in [-127, 127], or an integer zero point and the
#: whole int8 range over ``[min(x), max(x)]`` widened to hold 0.
SCHEMES = ("symmetric", "asymmetric")
#: The values of ``granularity``: one scale for the tensor, or one per index along ``axis``.
GRANULARITIES = ("tensor", "channel")
#: scheme -> the codes' range. Symmetric: [-127, 127], so the grid is symmetric about 0 and -x quantizes to -q
#: (torch's qint8 allows -128; nothing here produces it); asymmetric: the full int8 range.
QRANGE = {"symmetric": (-127, 127), "asymmetric": (-128, 127)}


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """int8 codes plus float32 scales (and int8 zero points when asymmetric).

    ``scale`` (and ``zero_point``) have shape ``()`` for ``granularity="tensor"`` and
    ``(shape[axis],)`` for ``"channel"``. ``zero_point`` is None for the symmetric scheme
    (all zero, nothing stored). ``dtype``: the original floating dtype, which
    :meth:`dequantize` returns.
    """

    codes: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None
    shape: tuple
    scheme: str
    granularity: str
    axis: int
    dtype: np.dtype

    def _bcast(self, a: np.ndarray) -> np.ndarray:
        """``a`` (per channel) shaped to broadcast against the codes."""
        if self.granularity == "tensor":
            return a
        shape = [1] * len(self.shape)
        shape[self.axis] = -1
        return a.reshape(shape)

    def dequantize(self) -> np.ndarray:
        """``(q - z) * s`` in float64, rounded once to :attr:`dtype`."""
        q = self.codes.astype(np.float64)
        if self.zero_point is not None:
            q = q - self._bcast(self.zero_point.astype(np.float64))
        return (q * self._bcast(self.scale.astype(np.float64))).astype(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes actually stored: codes + scales + zero points."""
        return int(self.codes.nbytes + self.scale.nbytes + (0 if self.zero_point is None else self.zero_point.nbytes))

    def error(self, original) -> dict:
        """What the quantization changed, against the array it was made from.

        ``max_abs`` = ``max |x - x'|``, ``rms`` = ``sqrt(mean (x - x')^2)``, ``relative_rms`` =
        ``||x - x'|| / ||x||`` (0.0 for a zero ``x``), ``bound`` = max over channels of
        ``scale / 2``: the theoretical bound on every element's error (``x`` is never
        clipped: the range always covers it), up to the rounding of ``x'`` to its dtype.
        """
        x = np.asarray(original)
        if x.shape != self.shape:
            raise HyperparameterError(f"original: expected shape {self.shape}, got {x.shape}")
        x = x.astype(np.float64)
        d = x - self.dequantize().astype(np.float64)
        n = float(np.linalg.norm(d.reshape(-1)))
        nx = float(np.linalg.norm(x.reshape(-1)))
        return {
            "max_abs": float(np.max(np.abs(d))) if d.size else 0.0,
            "rms": n / np.sqrt(d.size) if d.size else 0.0,
            "relative_rms": n / nx if nx else (0.0 if n == 0 else float("inf")),
            "bound": float(np.max(self.scale)) / 2 if self.scale.size else 0.0,
        }


def _scale_up(s: np.ndarray) -> np.ndarray:
    """float64 scales to float32, rounded up: the range ``s * qmax`` still covers the data."""
    s32 = s.astype(np.float32)
    low = s32.astype(np.float64) < s
    s32[low] = np.nextafter(s32[low], np.float32(np.inf))
    return s32


def quantize(array, *, scheme: str = "symmetric", granularity: str = "tensor", axis: int = 0) -> QuantizedTensor:
    r"""int8 codes of a floating array.

    Per group (the whole tensor, or each index along ``axis`` for ``"channel"``):

    * ``"symmetric"``: :math:`s = \max|x| / 127`, :math:`q = \mathrm{rint}(x / s)` in
      ``[-127, 127]``, zero point 0.
    * ``"asymmetric"``: the range :math:`[\min(x_{min}, 0), \max(x_{max}, 0)]` (it holds 0,
      so 0 is exact: pruned weights stay 0), :math:`s = (hi - lo) / 255`, integer zero
      point :math:`z = -128 - \mathrm{rint}(lo / s)` in ``[-128, 127]`` (stored int8),
      :math:`q = \mathrm{clip}(\mathrm{rint}(x / s) + z, -128, 127)`. The minimum
      and maximum take the extreme codes (when the range does not have to be widened to
      hold 0), and every element is within ``s/2`` of its code's value.

    ``rint`` rounds half to even; :math:`x / s` is in float64. Scales are float32,
    rounded up from the float64 value so the range never clips. A zero group gets
    scale 1 (no division by zero). Non-finite values are refused (no scale fits them).
    """
    x = as_array(array, "array")
    if not isinstance(x, np.ndarray):
        raise ArgumentTypeError(f"array: quantization runs on NumPy arrays, got {type(x).__name__}")
    scheme = check_choice("scheme", scheme, SCHEMES)
    granularity = check_choice("granularity", granularity, GRANULARITIES)
    if granularity == "channel":
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -x.ndim <= axis < x.ndim:
            raise HyperparameterError(
                f"axis: expected an int in [{-x.ndim}, {x.ndim}) for shape {x.shape}, got {axis!r}")
        axis = int(axis) % x.ndim
    else:
        axis = 0
    x64 = x.astype(np.float64)
    if not np.isfinite(x64).all():
        raise DataError("array: non-finite values cannot be quantized")
    if granularity == "channel":
        red = tuple(i for i in range(x.ndim) if i != axis)
        groups = x64.shape[axis]
        lo = x64.min(axis=red) if x64.size else np.zeros(groups)
        hi = x64.max(axis=red) if x64.size else np.zeros(groups)
    else:
        lo = np.asarray(x64.min() if x64.size else 0.0)
        hi = np.asarray(x64.max() if x64.size else 0.0)
    qmin, qmax = QRANGE[scheme]
    if scheme == "symmetric":
        span = np.maximum(np.abs(lo), np.abs(hi)) / qmax
    else:
        lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
        span = (hi - lo) / (qmax - qmin)
    scale = _scale_up(np.where(span > 0, span, 1.0))
    s64 = scale.astype(np.float64)
    shape = [1] * x.ndim
    if granularity == "channel":
        shape[axis] = -1
    q = np.rint(x64 / s64.reshape(shape))
    zero_point = None
    if scheme == "asymmetric":
        z = np.clip(qmin - np.rint(lo / s64), qmin, qmax)
        zero_point = z.astype(np.int8)
        q = q + z.reshape(shape)
    codes = np.clip(q, qmin, qmax).astype(np.int8)
    return QuantizedTensor(codes, scale, zero_point, tuple(x.shape), scheme, granularity, axis, x.dtype)


def quantize_params(params, *, names=None, **kw) -> dict:
    """``{name: QuantizedTensor}`` for the selected parameters of a FlatBuffer or an Engine.

    ``names``: glob patterns as in :func:`arraytrain.prune.magnitude_mask` (default:
    every parameter with ``ndim >= 2``); ``kw``: :func:`quantize`'s options, the same
    for each. ``"channel"`` with the default ``axis=0`` quantizes per row; the output
    channels of :class:`arraytrain.nn.Dense` weights ``(in, out)`` are ``axis=1``.
    """
    buf = host_params(params, task="quantization")
    return {name: quantize(buf[name], **kw) for name in select_names(buf.layout, names)}


def dequantize_params(q: dict, *, into) -> FlatBuffer:
    """Write the dequantized tensors of ``q`` into the parameters ``into`` (a FlatBuffer or
    an Engine) by name; other parameters are left as they are. Everything is checked
    (names, shapes) before anything is written. Returns the buffer.
    """
    buf = host_params(into, "into", task="quantization")
    if not isinstance(q, dict):
        raise ArgumentTypeError(f"q: expected a dict name -> QuantizedTensor, got {type(q).__name__}")
    for name, t in q.items():
        if not isinstance(t, QuantizedTensor):
            raise ArgumentTypeError(f"q[{name!r}]: expected a QuantizedTensor, got {type(t).__name__}")
        if name not in buf:
            raise UnknownParameterError(f"{name!r}: no such parameter; known: {list(buf.names)}")
    buf.assign(buf.check({name: t.dequantize() for name, t in q.items()}, strict=False))
    return buf
