r"""Dense layers, activations and the MLP, with forward and backward written by hand.

Every layer works on the array module of its input (NumPy, or CuPy for CuPy
arrays), never on ``np.`` directly. Shapes: a batch ``x`` is ``(n, in)``, a
dense weight is ``(in, out)``, so :math:`y = xW + b`.

Backward of a dense layer, for :math:`\delta = \partial L / \partial y`:

.. math::
    \frac{\partial L}{\partial W} = x^\top \delta, \quad
    \frac{\partial L}{\partial b} = \textstyle\sum_n \delta_n, \quad
    \frac{\partial L}{\partial x} = \delta W^\top

The weight and bias gradients are written with ``matmul(..., out=view)`` and
``sum(..., out=view)`` straight into the arrays the layer is bound to — for a
model bound to an :class:`~arraytrain.Engine`, views of ``engine.grads``, so
nothing is copied between model and engine. Inside an accumulation window
(``engine.micro_batches > 0``) they are added instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from .._checks import check_int
from ..engine import Engine
from ..errors import ArgumentTypeError, DTypeError, HyperparameterError, LayoutError
from ._array import array_namespace
from .init import weight_init


def _as_input(x, dtype, name="x"):
    xp = array_namespace(x)
    x = xp.asarray(x)
    if x.ndim != 2:
        raise LayoutError(f"{name}: expected a 2-D batch (n, features), got shape {x.shape}")
    if x.dtype != dtype:
        x = x.astype(dtype)
    return xp, x


class Dense:
    """A fully connected layer ``y = x @ weight + bias``.

    ``weight`` is ``(in_features, out_features)``, ``bias`` ``(out_features,)``.
    The layer holds no storage of its own: :meth:`bind` points it at parameter
    and gradient arrays (views of an engine's flat buffers, or any arrays).
    """

    def __init__(self, in_features: int, out_features: int, name: str = "fc"):
        self.in_features = check_int("in_features", in_features, 1)
        self.out_features = check_int("out_features", out_features, 1)
        self.name = name
        self.weight = self.bias = self.grad_weight = self.grad_bias = None
        self._x = None

    @property
    def shapes(self) -> dict:
        """``{name: shape}`` of the layer's two parameters, ``<name>.weight`` and ``<name>.bias``."""
        return {f"{self.name}.weight": (self.in_features, self.out_features),
                f"{self.name}.bias": (self.out_features,)}

    def bind(self, weight, bias, grad_weight, grad_bias) -> None:
        """Point the layer at its parameter and gradient arrays (no copy, no check: :meth:`MLP.bind` checks)."""
        self.weight, self.bias, self.grad_weight, self.grad_bias = weight, bias, grad_weight, grad_bias

    def _check_bound(self):
        if self.weight is None:
            raise LayoutError(f"{self.name!r}: the layer has no parameters yet; call init() or bind() first")

    def forward(self, x, cache: bool = True):
        """``x @ weight + bias``; with ``cache`` the input is kept for :meth:`backward`."""
        self._check_bound()
        xp = array_namespace(x, self.weight)
        y = xp.matmul(x, self.weight)
        y += self.bias
        if cache:
            self._x = x
        return y

    def backward(self, dy, accumulate: bool = False, need_dx: bool = True):
        """Write (or with ``accumulate`` add) dL/dweight and dL/dbias; return dL/dx (or None)."""
        if self._x is None:
            raise LayoutError(f"{self.name!r}: backward() without a cached forward(x)")
        x, self._x = self._x, None
        xp = array_namespace(dy, x)
        if accumulate:
            self.grad_weight += xp.matmul(x.T, dy)
            self.grad_bias += dy.sum(axis=0)
        else:
            xp.matmul(x.T, dy, out=self.grad_weight)
            xp.sum(dy, axis=0, out=self.grad_bias)
        return xp.matmul(dy, self.weight.T) if need_dx else None


class Activation:
    """Elementwise activation. ``forward`` may work in place on an array it owns
    (``inplace=True``, used inside :class:`MLP` on the dense layer's fresh output);
    ``backward`` likewise on a gradient array it may overwrite."""

    name = "activation"

    def __init__(self):
        self._cache = None

    def forward(self, x, cache: bool = True, inplace: bool = False):
        """The activation of ``x``; with ``cache`` what :meth:`backward` needs is kept."""
        xp = array_namespace(x)
        y, saved = self._forward(xp, x, inplace)
        if cache:
            self._cache = saved
        return y

    def backward(self, dy, inplace: bool = False):
        """The gradient with respect to the input, from ``dy`` and the cached forward (used once).

        ``inplace=True`` may write it into ``dy``.
        """
        if self._cache is None:
            raise LayoutError(f"{self.name}: backward() without a cached forward(x)")
        saved, self._cache = self._cache, None
        return self._backward(array_namespace(dy), dy, saved, dy if inplace else None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ReLU(Activation):
    r""":math:`\max(x, 0)`; derivative 1 where the output is positive, else 0."""

    name = "relu"

    def _forward(self, xp, x, inplace):
        y = xp.maximum(x, 0, out=x if inplace else None)
        return y, y

    def _backward(self, xp, dy, y, out):
        return xp.multiply(dy, y > 0, out=out)


class GELU(Activation):
    r"""GELU, tanh approximation (Hendrycks & Gimpel 2016, as in GPT-2 and torch's
    ``approximate="tanh"``):

    .. math::
        y = \tfrac12 x (1 + t), \quad t = \tanh u, \quad u = \sqrt{2/\pi}\,(x + 0.044715 x^3) \\
        y' = \tfrac12 (1 + t) + \tfrac12 x (1 - t^2) \sqrt{2/\pi}\,(1 + 3 \cdot 0.044715 x^2)

    The tanh form rather than the exact :math:`x\Phi(x)` (erf) because NumPy has
    no erf ufunc; it differs from the exact GELU by less than 1e-3 everywhere.
    """

    name = "gelu"
    _C = math.sqrt(2.0 / math.pi)
    _K = 0.044715

    def _forward(self, xp, x, inplace):
        t = xp.tanh(self._C * (x + self._K * x * x * x))
        y = 0.5 * x * (1.0 + t)
        return y, (x, t)

    def _backward(self, xp, dy, saved, out):
        x, t = saved
        dydx = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * self._C * (1.0 + 3.0 * self._K * x * x)
        return xp.multiply(dy, dydx, out=out)


class Tanh(Activation):
    r""":math:`\tanh x`; derivative :math:`1 - y^2`."""

    name = "tanh"

    def _forward(self, xp, x, inplace):
        y = xp.tanh(x, out=x if inplace else None)
        return y, y

    def _backward(self, xp, dy, y, out):
        return xp.multiply(dy, 1.0 - y * y, out=out)


class Sigmoid(Activation):
    r""":math:`\sigma(x) = 1/(1+e^{-x})`; derivative :math:`y(1-y)`.

    Computed from :math:`e = e^{-|x|}` as :math:`1/(1+e)` for :math:`x \ge 0` and
    :math:`e/(1+e)` below: no overflow, and full relative precision in both tails.
    """

    name = "sigmoid"

    def _forward(self, xp, x, inplace):
        y = sigmoid(x)
        return y, y

    def _backward(self, xp, dy, y, out):
        return xp.multiply(dy, y * (1.0 - y), out=out)


def sigmoid(x):
    """The logistic function, stable in both tails (see :class:`Sigmoid`)."""
    xp = array_namespace(x)
    e = xp.exp(-xp.abs(x))
    r = 1.0 / (1.0 + e)
    return xp.where(x >= 0, r, e * r)


ACTIVATIONS = {"relu": ReLU, "gelu": GELU, "tanh": Tanh, "sigmoid": Sigmoid}
# He for the rectifier family, Xavier for the saturating ones
DEFAULT_INIT = {"relu": "he", "gelu": "he", "tanh": "xavier", "sigmoid": "xavier"}


def activation(name: str) -> Activation:
    """A fresh activation layer by name: relu, gelu, tanh, sigmoid."""
    try:
        return ACTIVATIONS[name]()
    except (KeyError, TypeError):
        raise HyperparameterError(f"activation: expected one of {tuple(ACTIVATIONS)}, got {name!r}") from None


class MLP:
    """A multilayer perceptron: dense layers ``fc1 .. fcN`` with ``activation``
    between them and none after the last (the output is logits / raw predictions).

    >>> model = MLP([64, 128, 10], activation="relu", dtype=np.float32)
    >>> params = model.init(seed=0)      # {"fc1.weight": (64, 128), "fc1.bias": (128,), ...}
    >>> engine = at.Engine(params, at.optim.AdamW(lr=1e-3), zero_grad_on_step=False)
    >>> model.bind(engine)               # weights/grads are views of engine.params/grads

    ``init`` defaults to "he" for relu/gelu and "xavier" for tanh/sigmoid.
    """

    def __init__(self, sizes: Sequence[int], activation: str = "relu", dtype=np.float32, init: str | None = None):
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or len(sizes) < 2:
            raise HyperparameterError(f"sizes: expected a sequence of at least 2 layer widths, got {sizes!r}")
        sizes = tuple(check_int(f"sizes[{i}]", s, 1) for i, s in enumerate(sizes))
        if activation not in ACTIVATIONS:
            raise HyperparameterError(f"activation: expected one of {tuple(ACTIVATIONS)}, got {activation!r}")
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise DTypeError(f"dtype: expected float32 or float64, got {self.dtype}")
        self.init_kind = DEFAULT_INIT[activation] if init is None else init
        weight_init(self.init_kind)  # validates the name
        self.sizes = sizes
        self.activation = activation
        self.layers = [Dense(a, b, f"fc{i + 1}") for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))]
        self.activations = [ACTIVATIONS[activation]() for _ in self.layers[:-1]]
        self.params = self.grads = None
        self._engine = None
        self._ready: list = []  # per layer, the names bind() marks ready after its backward

    # -- parameters ------------------------------------------------------------------
    @property
    def shapes(self) -> dict:
        """``{name: shape}`` of every parameter, in layer order."""
        out = {}
        for layer in self.layers:
            out.update(layer.shapes)
        return out

    @property
    def num_params(self) -> int:
        """Elements of every parameter together."""
        return sum(math.prod(s) for s in self.shapes.values())

    @property
    def engine(self) -> Engine | None:
        """The :class:`~arraytrain.Engine` the model is bound to (:meth:`bind`), or None."""
        return self._engine

    def init(self, seed: int = 0) -> dict:
        """Fresh parameters ``{name: array}`` drawn from ``seed`` (He or Xavier, zero biases).

        The model is also bound to them (with its own zero gradient arrays), so it
        can be used on its own; :meth:`bind` an engine built from them to train.
        """
        seed = check_int("seed", seed, 0)
        rng = np.random.default_rng(seed)
        draw = weight_init(self.init_kind)
        params = {}
        for layer in self.layers:
            params[f"{layer.name}.weight"] = draw(rng, layer.in_features, layer.out_features, self.dtype)
            params[f"{layer.name}.bias"] = np.zeros(layer.out_features, self.dtype)
        self.bind(params)
        return params

    def bind(self, engine_or_params, grads: Mapping | None = None) -> None:
        """Point the layers at parameter and gradient arrays, without copying.

        ``bind(engine)``: views of ``engine.params`` and ``engine.grads``; backward
        then adds instead of writing while ``engine.micro_batches > 0``.
        ``bind(params, grads=None)``: any mappings name -> array (``grads=None``
        allocates zero gradients). Everything is checked before anything is bound.
        """
        engine = None
        if isinstance(engine_or_params, Engine):
            engine = engine_or_params
            params, grads = engine.params, engine.grads
        elif isinstance(engine_or_params, Mapping):
            params = engine_or_params
        else:
            raise ArgumentTypeError(f"bind: expected an Engine or a mapping name -> array, "
                                    f"got {type(engine_or_params).__name__}")
        if grads is None:
            xp = array_namespace(*(params[n] for n in self.shapes if n in params))
            grads = {n: xp.zeros(s, self.dtype) for n, s in self.shapes.items()}
        views = {}
        for what, source in (("params", params), ("grads", grads)):
            for name, shape in self.shapes.items():
                if name not in source:
                    raise LayoutError(f"{name!r}: missing from the {what} being bound "
                                      f"(the model needs {list(self.shapes)})")
                arr = source[name]
                if tuple(arr.shape) != shape:
                    raise LayoutError(f"{name!r}: {what} shape {tuple(arr.shape)} != model shape {shape}")
                if arr.dtype != self.dtype:
                    raise DTypeError(f"{name!r}: {what} dtype {arr.dtype} != model dtype {self.dtype}")
                views[what, name] = arr
        array_namespace(*views.values())  # one backend for all
        for layer in self.layers:
            w, b = f"{layer.name}.weight", f"{layer.name}.bias"
            layer.bind(views["params", w], views["params", b], views["grads", w], views["grads", b])
        self.params = {n: views["params", n] for n in self.shapes}
        self.grads = {n: views["grads", n] for n in self.shapes}
        self._engine = engine
        self._ready = [(f"{layer.name}.weight", f"{layer.name}.bias") for layer in self.layers]

    # -- compute ---------------------------------------------------------------------------
    def forward(self, x, cache: bool = True):
        """Logits for a batch ``x`` of shape ``(n, sizes[0])`` (cast to the model's dtype).

        With ``cache`` (the default) every layer keeps what :meth:`backward` needs.
        """
        if self.params is None:
            raise LayoutError("model: no parameters yet; call init() or bind() first")
        _, h = _as_input(x, self.dtype)
        if h.shape[1] != self.sizes[0]:
            raise LayoutError(f"x: expected shape (n, {self.sizes[0]}), got {h.shape}")
        for i, layer in enumerate(self.layers):
            h = layer.forward(h, cache=cache)
            if i < len(self.activations):
                # the dense output is a fresh array, so the activation may overwrite it
                h = self.activations[i].forward(h, cache=cache, inplace=True)
        return h

    def predict(self, x):
        """Forward without caching anything (evaluation)."""
        return self.forward(x, cache=False)

    def backward(self, dlogits, accumulate: bool | None = None, input_grad: bool = False):
        """Back-propagate ``dlogits = dL/dlogits`` of the last :meth:`forward`.

        Parameter gradients go straight into the bound gradient arrays: written,
        or added with ``accumulate`` — by default True exactly when the model is
        bound to an engine whose accumulation window is open
        (``engine.micro_batches > 0``). Bound to an engine, each layer's gradients are
        marked ready as soon as they are written (:meth:`arraytrain.Engine.mark_ready`),
        so an overlapped exchange starts while the earlier layers still back-propagate. Returns dL/dx with ``input_grad``, else None.
        """
        if accumulate is None:
            accumulate = self._engine is not None and self._engine.micro_batches > 0
        n_out = self.sizes[-1]
        if dlogits.ndim != 2 or dlogits.shape[1] != n_out:
            raise LayoutError(f"dlogits: expected shape (n, {n_out}), got {dlogits.shape}")
        cached = self.layers[-1]._x
        if cached is None:
            raise LayoutError("model: backward() without a cached forward(x)")
        if dlogits.shape[0] != cached.shape[0]:
            raise LayoutError(f"dlogits: batch of {dlogits.shape[0]} rows, the last forward() had {cached.shape[0]}")
        if dlogits.dtype != self.dtype:
            dlogits = dlogits.astype(self.dtype)
        d = dlogits
        last = len(self.layers) - 1
        for i in range(last, -1, -1):
            d = self.layers[i].backward(d, accumulate=accumulate, need_dx=i > 0 or input_grad)
            if self._engine is not None:  # final for the window: the overlapped exchange may start it
                self._engine.mark_ready(self._ready[i])
            if i > 0:
                # d is the fresh dL/dx of layer i, ours to overwrite
                d = self.activations[i - 1].backward(d, inplace=True)
        return d

    def __repr__(self) -> str:
        return f"MLP({list(self.sizes)}, activation={self.activation!r}, dtype={self.dtype.name})"
