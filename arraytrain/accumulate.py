"""GradientAccumulator: per-parameter gradient sums over micro-batches, on a flat buffer.

Each registered parameter keeps its own count of micro-batches seen (and the
sum of their weights); ``get_gradients`` divides each parameter's sum by its
own total weight, so a parameter that skipped a micro-batch is averaged over
the micro-batches it took part in. The sums live in one flat buffer and are
written by the same numba kernels the Engine uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .engine import intake
from ._checks import check_int, check_number, check_positive
from .backend import backend_of, check_kernel_dtype
from .buffer import FlatBuffer
from .errors import (
    ArgumentTypeError,
    AccumulatorFullError,
    HyperparameterError,
    NoGradientsError,
    ShapeMismatchError,
    UnknownParameterError,
)
from .kernels.interface import family
from .layout import Layout, check_shape
from .ops import CLIP_EPS, clip_coef, norm_pass

#: The values of ``reduction``: the (weighted) mean or the sum of the micro-batches.
REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True, init=False)
class AccumulationConfig:
    """How many micro-batches make one update, how they combine, and clipping.

    ``reduction``: ``"mean"``, each parameter's (weighted) mean over the micro-batches it
    took part in, or ``"sum"`` (as the Engine's ``reduction``). ``max_grad_norm``: the
    result is scaled by ``min(1, max_grad_norm / (norm + clip_eps))`` (its global L2 norm;
    None: no clipping). ``clip_eps=1e-6`` (:data:`arraytrain.ops.CLIP_EPS`) is torch's
    ``clip_grad_norm_`` rule, which the Engine applies; ``clip_eps=0.0`` scales to exactly
    ``max_grad_norm`` (optax's ``clip_by_global_norm``, and this accumulator's rule before
    ``clip_eps`` existed).
    """

    accumulation_steps: int = 4
    reduction: str = "mean"
    max_grad_norm: float | None = None
    clip_eps: float = CLIP_EPS

    def __init__(self, accumulation_steps: int = 4, reduction: str = "mean", max_grad_norm: float | None = None,
                 clip_eps: float = CLIP_EPS):
        check_int("accumulation_steps", accumulation_steps, 1)
        if not isinstance(reduction, str) or reduction not in REDUCTIONS:
            raise HyperparameterError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
        if max_grad_norm is not None:
            check_positive("max_grad_norm", max_grad_norm)
        clip_eps = check_number("clip_eps", clip_eps, 0.0)
        for name, value in (("accumulation_steps", accumulation_steps), ("reduction", reduction),
                            ("max_grad_norm", max_grad_norm), ("clip_eps", clip_eps)):
            object.__setattr__(self, name, value)

    def effective_batch_size(self, micro_batch_size: int) -> int:
        """Samples per update: ``micro_batch_size * accumulation_steps``."""
        return check_int("micro_batch_size", micro_batch_size, 0) * self.accumulation_steps


@dataclass(frozen=True)
class AccumulationStats:
    """Counters of a :class:`GradientAccumulator`, from :meth:`GradientAccumulator.stats`.

    ``total_micro_batches``: calls of ``step`` so far; ``total_updates``: calls of
    ``reset`` (one per update); ``accumulation_steps``: micro-batches per update, from
    the config; ``registered_params`` and ``total_param_elements``: the parameters
    registered and their elements.
    """

    total_micro_batches: int
    total_updates: int
    accumulation_steps: int
    registered_params: int
    total_param_elements: int

    def effective_batch_multiplier(self) -> int:
        """Micro-batches per update: ``accumulation_steps``."""
        return self.accumulation_steps


class GradientAccumulator:
    """Sum gradients of k micro-batches per parameter; hand back their mean (or sum).

    ``accumulate(name, grad, weight=n)`` adds ``n * grad`` and ``n`` to the
    parameter's total weight, so ``get_gradients`` returns the weighted mean
    (e.g. token-weighted for variable-length batches); without weights it is
    the plain mean over the micro-batches seen. Sums are kept in ``dtype``
    (float64 by default; float32 halves the memory).
    """

    def __init__(self, config: AccumulationConfig | None = None, dtype=np.float64):
        self.config = AccumulationConfig() if config is None else config
        if not isinstance(self.config, AccumulationConfig):
            raise ArgumentTypeError(f"config: expected an AccumulationConfig, got {type(config).__name__}")
        self._buf = FlatBuffer.zeros(Layout({}), dtype)
        self._counts = np.zeros(0, dtype=np.int64)
        self._weights = np.zeros(0, dtype=np.float64)
        check_kernel_dtype(self._buf.dtype)
        self._kernels = family(backend_of(self._buf.flat))
        self.total_micro_batches = 0
        self.total_updates = 0

    # -- registration -----------------------------------------------------------------
    def register(self, name: str, shape) -> None:
        """Add a parameter. Registering a name again with the same shape is a no-op."""
        if name in self._buf:
            expected = self._buf.layout.shape(name)
            if check_shape(name, shape) != expected:
                raise ShapeMismatchError(name, expected, tuple(shape), what="registered")
            return
        shapes = dict(zip(self._buf.layout.names, self._buf.layout.shapes))
        shapes[name] = shape
        grown = FlatBuffer.zeros(Layout(shapes), self._buf.dtype)
        grown.assign(self._buf.as_dict())
        self._buf = grown
        self._counts = np.append(self._counts, 0)
        self._weights = np.append(self._weights, 0.0)

    # -- accumulation -------------------------------------------------------------------
    def _check_room(self, names) -> list[int]:
        idx = [self._buf.layout.index(n) for n in names]
        for i, n in zip(idx, names):
            if self._counts[i] >= self.config.accumulation_steps:
                raise AccumulatorFullError(
                    f"{n!r}: already holds {self.config.accumulation_steps} micro-batches; call reset() first"
                )
        return idx

    def _add(self, items: dict, w: float) -> None:
        idx = self._check_room(items)
        intake.write_grads(self._kernels, self._buf, items, w, overwrite=False)
        self._counts[idx] += 1
        self._weights[idx] += w

    def accumulate(self, name: str, grad, weight: float | None = None) -> None:
        """Add one micro-batch's gradient for ``name`` (times ``weight``, default 1)."""
        if name not in self._buf:
            raise UnknownParameterError(f"{name!r}: not registered; call register(name, shape) first")
        w = 1.0 if weight is None else check_positive("weight", weight)
        self._add(intake.check_grads({name: grad}, self._buf, protect=(self._buf.flat,)), w)

    def step(self, gradients, weight: float | None = None) -> bool:
        """Accumulate a whole micro-batch; returns whether an update is due.

        Every gradient is validated (names, shapes, dtypes, room left) before
        any is added, so a refused micro-batch changes nothing.
        """
        w = 1.0 if weight is None else check_positive("weight", weight)
        items = intake.check_grads(gradients, self._buf, protect=(self._buf.flat,))
        self._add(items, w)
        self.total_micro_batches += 1
        return self.should_update()

    def should_update(self) -> bool:
        """True once any parameter holds ``accumulation_steps`` micro-batches."""
        return bool((self._counts >= self.config.accumulation_steps).any())

    # -- results ---------------------------------------------------------------------------
    def get_gradients(self) -> dict[str, np.ndarray]:
        """``{name: gradient}``: each parameter's weighted mean (or sum), then clipped.

        Clipping scales all gradients together when their global L2 norm
        exceeds ``max_grad_norm`` (by ``max_grad_norm / (norm + clip_eps)``, see
        :class:`AccumulationConfig`). The result is a fresh copy per parameter.
        Parameters that received no gradient since the last reset are zeros.
        """
        if len(self._buf) == 0 or not self._counts.any():
            raise NoGradientsError("no gradients accumulated" if len(self._buf) else "no parameters registered")
        out = self._buf.copy()
        if self.config.reduction == "mean":
            for i, name in enumerate(out.names):
                if self._weights[i] > 0 and out.layout.sizes[i]:
                    self._kernels.scale(out.flat[out.layout.slice(name)], factor=1.0 / self._weights[i])
        if self.config.max_grad_norm is not None:
            found = norm_pass(self._kernels, out.flat, out.layout)
            coef = clip_coef(found.norm, self.config.max_grad_norm, eps=self.config.clip_eps)
            if coef < 1.0:
                self._kernels.scale(out.flat, factor=coef)
        return out.as_dict()

    def global_norm(self) -> float:
        """L2 norm of the raw accumulated sums (before normalisation and clipping)."""
        return norm_pass(self._kernels, self._buf.flat, self._buf.layout).norm

    def reset(self) -> None:
        """Zero the sums and counts, and count one update."""
        self._buf.flat.fill(0)
        self._counts[:] = 0
        self._weights[:] = 0.0
        self.total_updates += 1

    def stats(self) -> AccumulationStats:
        """Counters of this accumulator so far, as an :class:`AccumulationStats`."""
        return AccumulationStats(
            total_micro_batches=self.total_micro_batches,
            total_updates=self.total_updates,
            accumulation_steps=self.config.accumulation_steps,
            registered_params=len(self._buf),
            total_param_elements=self._buf.layout.num_elements,
        )
