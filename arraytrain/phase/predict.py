r"""Gradient prediction: a per-element linear trend over the last ``H`` recorded gradients.

:class:`GradientPredictor` keeps a ring of the last ``H`` gradients
:math:`g_{t_1}, \dots, g_{t_m}` (``m <= H``, recorded at strictly increasing
steps :math:`t_k`) and a correction :math:`r`. The prediction at step :math:`t`
is the least-squares line through the points :math:`(t_k, g_{t_k,i})`,
element by element, evaluated at :math:`t`, plus the correction:

.. math::

    \bar t = \frac1m \sum_k t_k, \qquad S = \sum_k (t_k - \bar t)^2, \qquad
    c_k(t) = \frac1m + \frac{(t - \bar t)(t_k - \bar t)}{S}, \qquad
    \hat g_i(t) = \sum_k c_k(t)\, g_{t_k,i} + r_i .

The weights :math:`c_k` (one line fit serves every element, since the
abscissae are shared) are computed on the host in float64
(:func:`trend_weights`); the kernel forms the weighted sum in one pass over
the flat buffer (:mod:`arraytrain.kernels.cpu.trend`). With one record the fit is
the constant through it (:math:`c = 1`): the prediction is the last recorded
gradient plus the correction. ``H = 1`` therefore predicts "the last
gradient", a useful baseline.

Correction (:meth:`GradientPredictor.correct`), on a step whose true gradient
:math:`g` was computed: an exponential moving average of the trend's residual,

.. math::  r \leftarrow \beta r + (1 - \beta)\,\big(g - \textstyle\sum_k c_k(t)\, g_{t_k}\big),

where the trend excludes the correction (including it would make the fixed
point :math:`r = \text{residual}/2`), fused in the same pass with recording
:math:`g` into the ring. The trend is the closed-form least-squares line; the
FULL / PREDICT / CORRECT cycle that uses it is :mod:`arraytrain.phase`'s.

Memory: ``(H + 1) * n`` elements of the buffer's dtype (the ring and the
correction), ``n`` the flat size of the layout.

Backends: the ring and the correction live where the parameters do — a CuPy
FlatBuffer or mapping (or ``device="cuda"`` with a Layout) puts them on the GPU,
where the CUDA trend kernels (:mod:`arraytrain.kernels.cuda.trend`) run; gradients
must then be CuPy arrays. The weights ``c`` are formed on the host (``H`` floats,
copied to the device per call); the finiteness check of :meth:`record` and
:meth:`correct` reads one flag back.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .._checks import check_count, check_int, check_number
from ..engine.intake import ready_to_assign
from ..backend import CUPY, NUMPY, backend_of, is_device_array, module_of_backend, require_cuda
from ..buffer import FlatBuffer
from ..errors import (
    AliasingError,
    ArgumentTypeError,
    BackendError,
    DTypeError,
    HyperparameterError,
    LayoutError,
    NoGradientsError,
    ReadOnlyError,
    StateDictError,
)
from ..kernels.interface import IMPLS, family
from ..layout import Layout

#: The values of ``kernels``: the fast kernels of the buffers' backend, or the reference twins.
KERNELS = IMPLS


def trend_weights(steps, count: int, t: float) -> np.ndarray:
    r"""Weights ``c`` (float64, one per ring slot) of the least-squares line through
    the first ``count`` slots' steps, evaluated at ``t``; unused slots get 0.

    ``sum(c) == 1`` and ``sum(c * steps) == t``, so a gradient that is exactly
    linear in the step is reproduced exactly (up to rounding). One record: ``c = 1``.
    """
    steps = np.asarray(steps, dtype=np.float64)
    c = np.zeros(steps.size, dtype=np.float64)
    if count == 1:
        c[0] = 1.0
    elif count > 1:
        ts = steps[:count]
        mean = ts.mean()
        d = ts - mean
        c[:count] = 1.0 / count + (float(t) - mean) * d / float(d @ d)
    return c


class GradientPredictor:
    """Predict gradients from a linear trend over the last ``history`` recorded ones.

    Parameters
    ----------
    layout_or_params : Layout, FlatBuffer or mapping name -> array
        What the gradients look like: a flat buffer of this layout (padding
        included, as ``engine.grads.flat``). A FlatBuffer or a mapping also
        gives the dtype.
    history : int >= 1
        ``H``, the gradients kept in the ring.
    correction_beta : float in [0, 1]
        Decay of the correction's moving average; 1 keeps the correction at 0.
    dtype : float32 or float64, optional
        Storage dtype for a Layout (default float32); must agree with a
        FlatBuffer's or mapping's.
    kernels : "numba" or "reference"
        numba (NumPy) or CUDA (CuPy) kernels as the buffers' backend is; the
        reference twins run on NumPy only.
    device : "cpu", "cuda" or None
        Where the ring lives: None takes it from the parameters (the host for
        a Layout); a device other than the parameters' is an error.

    Notes
    -----
    Usage: :meth:`record` true gradients, :meth:`predict` into a buffer,
    :meth:`correct` with a true gradient (updates the correction and records
    it). Steps must increase strictly from one record to the next. A gradient
    with a NaN or Inf is not recorded: :meth:`record` and :meth:`correct`
    return False and change nothing. Memory: ``(history + 1) * n`` elements
    (:attr:`nbytes`).
    """

    def __init__(self, layout_or_params, history: int = 4, correction_beta: float = 0.9, *, dtype=None,
                 kernels: str = "numba", device: str | None = None):
        self.history = check_int("history", history, 1)
        self.correction_beta = check_number("correction_beta", correction_beta, 0.0, 1.0)
        if kernels not in KERNELS:
            raise HyperparameterError(f"kernels: expected one of {KERNELS}, got {kernels!r}")
        layout, found, backend = self._layout_of(layout_or_params)
        if device is not None:
            if device not in ("cpu", "cuda"):
                raise HyperparameterError(f"device: expected None, 'cpu' or 'cuda', got {device!r}")
            want = NUMPY if device == "cpu" else CUPY
            if backend is not None and backend != want:
                raise BackendError(f"device: the parameters are {backend} arrays, got device={device!r}; "
                                   "arraytrain never moves data between host and device implicitly")
            backend = want
        backend = backend or NUMPY
        if backend == CUPY:
            require_cuda("device")
        if dtype is not None and found is not None and np.dtype(dtype) != found:
            raise DTypeError(f"dtype: the parameters are {found}, got dtype={np.dtype(dtype)}")
        dtype = np.dtype(dtype if dtype is not None else (found if found is not None else np.float32))
        if dtype not in (np.float32, np.float64):
            raise DTypeError(f"dtype: the trend kernels run on float32 or float64, got {dtype}")
        self.layout, self.dtype, self.kernels, self.backend = layout, dtype, kernels, backend
        # the trend kernels, and the reductions for all_finite (refused: reference kernels on CuPy)
        self._trend, self._base = family(backend, kernels, "trend"), family(backend, kernels, "reductions")
        xp = self._xp = module_of_backend(backend)
        n = layout.size
        self._ring = xp.zeros((self.history, n), dtype=dtype)
        self._slots = [FlatBuffer(layout, self._ring[k]) for k in range(self.history)]
        self.correction = FlatBuffer.zeros(layout, dtype, xp)
        self._steps = np.zeros(self.history, dtype=np.int64)
        self.count = 0    # records held (<= history)
        self._head = 0    # the slot the next record goes to (the oldest once the ring is full)

    @staticmethod
    def _layout_of(obj):
        """``(layout, dtype or None, backend or None)``."""
        if isinstance(obj, Layout):
            return obj, None, None
        if isinstance(obj, FlatBuffer):
            return obj.layout, obj.dtype, backend_of(obj.flat)
        if isinstance(obj, Mapping):
            kinds = {is_device_array(a) for a in obj.values()}
            if len(kinds) > 1:
                raise BackendError("layout_or_params: NumPy and CuPy arrays mixed")
            backend = (CUPY if kinds.pop() else NUMPY) if kinds else None
            dtypes = [a.dtype if backend == CUPY else np.asarray(a).dtype for a in obj.values()]
            found = np.result_type(*dtypes) if dtypes else None
            return Layout.from_arrays(obj), found, backend
        raise ArgumentTypeError(f"layout_or_params: expected a Layout, FlatBuffer or mapping name -> array, "
                                f"got {type(obj).__name__}")

    # -- properties ---------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes held: ``(history + 1) * n * itemsize``."""
        return self._ring.nbytes + self.correction.flat.nbytes

    @property
    def last_step(self) -> int | None:
        """The step of the newest record (None before the first)."""
        return None if self.count == 0 else int(self._steps[(self._head - 1) % self.history])

    @property
    def steps(self) -> list[int]:
        """Recorded steps, oldest first."""
        order = [(self._head - self.count + j) % self.history for j in range(self.count)]
        return [int(self._steps[k]) for k in order]

    def weights(self, step: int) -> np.ndarray:
        """The per-slot weights :math:`c_k` of a prediction at ``step`` (float64)."""
        # slots in use are 0..count-1 (the ring fills from slot 0), in any order of steps
        c = np.zeros(self.history, dtype=np.float64)
        if self.count:
            c[: self.count] = trend_weights(self._steps[: self.count], self.count, step)[: self.count]
        return c

    # -- validation ---------------------------------------------------------------------
    def _grad(self, g, name: str):
        if isinstance(g, FlatBuffer):
            if g.layout != self.layout:
                raise LayoutError(f"{name}: FlatBuffer layout differs from the predictor's")
            g = g.flat
        try:
            kind = backend_of(g)
        except BackendError:
            raise ArgumentTypeError(f"{name}: expected a flat NumPy or CuPy array or FlatBuffer, "
                                    f"got {type(g).__name__}") from None
        if kind != self.backend:
            raise BackendError(f"{name}: a {kind} array was given to a predictor on {self.backend} arrays; "
                               "arraytrain never moves data between host and device implicitly")
        if g.dtype != self.dtype:
            raise DTypeError(f"{name}: expected dtype {self.dtype}, got {g.dtype}")
        if g.ndim != 1 or g.shape[0] != self.layout.size:
            raise LayoutError(f"{name}: expected a 1-D array of {self.layout.size} elements, got shape {g.shape}")
        if not g.flags.c_contiguous:
            raise LayoutError(f"{name}: the array must be contiguous")
        if self._xp.shares_memory(g, self._ring) or self._xp.shares_memory(g, self.correction.flat):
            raise AliasingError(f"{name}: shares memory with the predictor's own buffers")
        return g

    def _next_step(self, step) -> int:
        last = self.last_step
        return check_count("step", step, 0 if last is None else last + 1)

    # -- the operations ------------------------------------------------------------------
    def record(self, grad_flat, step: int) -> bool:
        """Record a true gradient taken at ``step`` (> the last recorded step).

        Returns False, changing nothing, when the gradient has a NaN or Inf.
        """
        g = self._grad(grad_flat, "grad_flat")
        step = self._next_step(step)
        if not self._base.all_finite(g):
            return False
        self._ring[self._head] = g
        self._commit(step)
        return True

    def _commit(self, step: int) -> None:
        self._steps[self._head] = step
        self._head = (self._head + 1) % self.history
        self.count = min(self.count + 1, self.history)

    def predict(self, step: int, out=None):
        """The predicted gradient at ``step`` written into ``out`` (or a new array); returns it."""
        step = check_count("step", step, 0)
        if out is None:
            out = self._xp.empty(self.layout.size, dtype=self.dtype)
        else:
            out = self._grad(out, "out")
            if not getattr(out.flags, "writeable", True):  # CuPy arrays are always writable
                raise ReadOnlyError("out: the array is read-only")
        if self.count == 0:
            raise NoGradientsError("predict: no gradient has been recorded yet")
        self._trend.trend_predict(self._ring, self.weights(step), self.correction.flat, out)
        return out

    def correct(self, grad_flat, step: int) -> bool:
        """Update the correction with the trend's residual at ``step`` and record the gradient.

        Before the first record there is no trend: the gradient is only
        recorded. Returns False, changing nothing, for a NaN/Inf gradient.
        """
        g = self._grad(grad_flat, "grad_flat")
        step = self._next_step(step)
        if not self._base.all_finite(g):
            return False
        if self.count == 0:
            self._ring[self._head] = g
        else:
            self._trend.trend_correct(self._ring, self.weights(step), self.correction.flat, g, slot=self._head,
                                      beta=self.correction_beta)
        self._commit(step)
        return True

    def reset(self) -> None:
        """Forget every record and zero the correction."""
        self._ring.fill(0)
        self.correction.flat.fill(0)
        self._steps.fill(0)
        self.count, self._head = 0, 0

    # -- state ---------------------------------------------------------------------------
    def state_dict(self, copy: bool = True) -> dict:
        """Name-keyed arrays (ring slot ``k`` under ``history[str(k)]``, the correction) and scalars.

        The slots keep their physical order, so a loaded predictor sums them
        in the same order: its predictions are bitwise those of the original.
        """
        return {
            "history": {str(k): buf.as_dict(copy=copy) for k, buf in enumerate(self._slots)},
            "correction": self.correction.as_dict(copy=copy),
            "steps": [int(s) for s in self._steps],
            "count": self.count,
            "head": self._head,
            "history_size": self.history,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Load :meth:`state_dict` output; everything is validated before anything is written."""
        self.apply_state(self.check_state(state))

    def check_state(self, state: Mapping) -> tuple:
        """Validate a :meth:`state_dict` against this predictor; change nothing.

        Returns what :meth:`apply_state` takes (the engine's protocol for its
        parts: a caller loading several parts checks them all, then applies).
        """
        try:
            hist, corr = state["history"], state["correction"]
            steps, count, head, size = state["steps"], state["count"], state["head"], state["history_size"]
        except (KeyError, TypeError) as exc:
            raise StateDictError(f"predictor state dict lacks {exc}") from None
        if size != self.history:
            raise StateDictError(f"history_size: the predictor keeps {self.history}, the state {size!r}")
        count = check_int("count", count, 0, self.history, error=StateDictError)
        head = check_int("head", head, 0, self.history - 1, error=StateDictError)
        if count < self.history and head != count:
            raise StateDictError(f"head: expected {count} with {count} records, got {head}")
        if not isinstance(steps, (list, tuple)) or len(steps) != self.history:
            raise StateDictError(f"steps: expected a list of {self.history} ints, got {steps!r}")
        steps = [check_count(f"steps[{k}]", s, 0, error=StateDictError) for k, s in enumerate(steps)]
        order = [(head - count + j) % self.history for j in range(count)]
        if any(steps[a] >= steps[b] for a, b in zip(order, order[1:])):
            raise StateDictError(f"steps: recorded steps must increase from the oldest slot on, got {steps}")
        if not isinstance(hist, Mapping) or set(hist) != {str(k) for k in range(self.history)}:
            raise StateDictError(f"history: expected slots {[str(k) for k in range(self.history)]}")
        # sources that overlap the ring or the correction (a state_dict(copy=False) of this
        # predictor, slots permuted) are copied here, so the writes cannot depend on their order
        protect = (self._ring, self.correction.flat)
        try:
            checked = [(buf, ready_to_assign(buf, buf.check(arrays), protect))
                       for buf, arrays in [*((self._slots[k], hist[str(k)]) for k in range(self.history)),
                                           (self.correction, corr)]]
        except (LayoutError, KeyError, ValueError, TypeError) as exc:
            raise StateDictError(f"predictor state dict does not match the layout: {exc}") from exc
        return checked, steps, count, head

    def apply_state(self, checked: tuple) -> None:
        """Load a state validated by :meth:`check_state` (same-dtype copies: cannot fail)."""
        buffers, steps, count, head = checked
        for buf, arrays in buffers:
            buf.assign(arrays)
        self._steps[...] = steps
        self.count, self._head = count, head

    def __repr__(self) -> str:
        return (f"GradientPredictor(history={self.history}, correction_beta={self.correction_beta}, "
                f"n={self.layout.size}, dtype={self.dtype}, records={self.count})")
