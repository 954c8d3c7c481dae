"""The compressor protocol, the payload, and error feedback.

A compressor works on the flat gradient of a :class:`~arraytrain.layout.Layout`.
Its *domain* is the live elements (no padding) of every parameter with at
least ``min_size`` elements, in layout order; smaller parameters travel
uncompressed in the payload's ``raw`` array, as PowerSGD and 1-bit Adam users
asked for (biases and norms are a rounding error of the bytes and the most
sensitive to noise). For the first ``warmup`` calls everything travels raw.

Whether a method compresses the domain as one vector (top-k, random-k, int8,
sign, ternary, VSA: one global selection or one scale per block) or per
parameter (PowerSGD: one low-rank factorisation per matrix) is the method's
documented choice; the domain lists its parameters either way.

``nbytes`` of a :class:`Payload` is the size of the arrays it holds, measured
with ``ndarray.nbytes`` — the bytes a rank would put on the wire — not a
nominal ratio.

Backends: a compressor works on NumPy or CuPy gradients with the kernel family of
their backend (:func:`arraytrain.kernels.interface.family`: numba or CUDA, same bits
for the same format), and its payload arrays live where the gradient does. Its
state (error-feedback residual, PowerSGD's ``Q``, scratch) is created on the host
at :meth:`Compressor.bind`; the first array the compressor is given — a gradient,
an ``out`` buffer, a payload or a loaded state — fixes its backend, and a CuPy one
moves that state to the device, once. After that an array of the other backend is
a :class:`~arraytrain.errors.BackendError`: nothing moves between host and device
behind the caller's back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .._checks import check_count, check_int, shown
from ..engine.intake import ready_to_assign
from ..backend import NUMPY, backend_of, module_of_backend
from ..buffer import FlatBuffer
from ..parallel.communicator import check_comm
from ..errors import (
    ArgumentTypeError,
    BackendError,
    BackendUnavailableError,
    DTypeError,
    HyperparameterError,
    LayoutError,
    StateDictError,
)
from ..kernels.counter_rng import step_key
from ..kernels.interface import IMPLS, family
from ..layout import Layout
from ._gather import Gather

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


@dataclass(frozen=True)
class Segment:
    """One parameter inside a compressor's domain: ``x[start:start + size]`` is it, flattened."""

    name: str
    shape: tuple
    start: int

    @property
    def size(self) -> int:
        """Elements of the parameter: the product of ``shape``."""
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class Domain:
    """The compressed elements: parameters with >= ``min_size`` elements, packed in layout order."""

    size: int
    dtype: np.dtype
    segments: tuple[Segment, ...]


@dataclass
class Payload:
    """What one rank would send for one gradient.

    ``arrays``: the method's wire arrays (indices, values, codes, scales, packed
    bits, factors), NumPy or CuPy as the gradient was. ``raw``: elements sent uncompressed (parameters below
    ``min_size``, or everything during warm-up), in layout order. ``meta``: the
    small integers a receiver needs besides the arrays (the draw key of a
    stochastic method, which a receiver derives from the shared seed and step).
    """

    method: str
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    raw: np.ndarray | None = None
    meta: dict = field(default_factory=dict)
    dense_nbytes: int = 0
    #: The bytes sent where they are not the arrays' (a dense exchange of the flat buffer in place: its
    #: live elements, not its padding); None: the arrays'.
    sent_nbytes: int | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of every array in the payload, as stored (or :attr:`sent_nbytes` where set)."""
        if self.sent_nbytes is not None:
            return self.sent_nbytes
        n = sum(int(a.nbytes) for a in self.arrays.values())
        return n + (0 if self.raw is None else int(self.raw.nbytes))

    @property
    def ratio(self) -> float:
        """``dense_nbytes / nbytes``: how many times smaller than the uncompressed gradient."""
        return self.dense_nbytes / self.nbytes if self.nbytes else float("inf")


def array_backend(a) -> str | None:
    """``"numpy"`` or ``"cupy"`` for an array of either, None for anything else."""
    try:
        return backend_of(a)
    except BackendError:
        return None


def check_wire(arrays: Mapping, name: str, shape: tuple, dtype, like) -> object:
    """``arrays[name]`` if it is an array of ``shape`` and ``dtype`` on ``like``'s backend, else ArgumentTypeError."""
    a = arrays.get(name) if isinstance(arrays, Mapping) else None
    want = backend_of(like)
    if array_backend(a) != want or a.shape != shape or a.dtype != np.dtype(dtype):
        got = "nothing" if a is None else (f"{getattr(a, 'shape', type(a).__name__)} {getattr(a, 'dtype', '')} "
                                          f"({array_backend(a) or type(a).__name__})")
        raise ArgumentTypeError(f"payload {name!r}: expected shape {shape} {np.dtype(dtype)} ({want}), got {got}")
    return a


class Compressor(ABC):
    """Base class: ``compress(x) -> Payload`` and ``decompress(payload, out)`` on a flat gradient.

    Subclasses implement :meth:`_encode` and :meth:`_decode` on the dense
    domain vector and may override :meth:`_bind` (per-parameter set-up) and
    :meth:`_state` / :meth:`_load_state` (state that must survive a resume,
    e.g. PowerSGD's warm-start factors). Every compression method takes the
    parameters below, as keywords.

    Parameters
    ----------
    min_size : int
        Parameters with fewer elements travel uncompressed.
    warmup : int or None
        The first ``warmup`` calls send everything uncompressed; None (the default): the method's
        own :attr:`default_warmup` (0 for the base class; a method that needs a dense start sets
        it, see :attr:`schedule`).
    seed : int
        Stochastic methods draw from ``(seed, call number)`` with a
        counter-based generator: the draws do not depend on threads, and a
        resumed run draws the same numbers.
    kernels : "numba" or "reference"
        The fused kernels (numba on NumPy gradients, CUDA on CuPy ones) or their
        slow reference twins (NumPy only).
    """

    method: str = "compressor"
    stochastic: bool = False
    #: Dense calls at the start when ``warmup=None``: the method's own choice.
    default_warmup: int = 0
    family: str | None = "compression"  # the kernel domain of :attr:`_kern` (None: no kernels)

    @property
    def contraction(self) -> bool:
        """Whether the decode never scales up what it keeps: what :class:`ErrorFeedback` needs.

        False for the unbiased forms that multiply the kept part by ``n/k`` (``RandomK(rescale=True)``,
        ``VSA(unbiased=True)``): under error feedback their residual grows by about that factor
        each call and training diverges.
        """
        return True

    def __init__(self, *, min_size: int = 0, warmup: int | None = None, seed: int = 0, kernels: str = "numba"):
        self.min_size = check_int("min_size", min_size, 0)
        self.warmup = self.default_warmup if warmup is None else check_int("warmup", warmup, 0)
        self.seed = check_int("seed", seed, 0, 2**63 - 1)
        if kernels not in IMPLS:
            raise HyperparameterError(f"kernels: expected one of {IMPLS}, got {kernels!r}")
        self.kernels = kernels
        self.step = 0
        self.layout: Layout | None = None
        self.domain: Domain | None = None
        self._backend: str | None = None  # fixed by the first array given (see the module docstring)
        self._kern = None
        self.comm = check_comm(None)  # the group the payloads travel in (set by bind)

    @property
    def backend(self) -> str | None:
        """``"numpy"`` or ``"cupy"`` once the first array fixed it, else None (state on the host)."""
        return self._backend

    def _place(self, backend: str) -> None:
        """Fix the backend (the first call) or check it (every later call).

        Fixing it to CuPy moves the state made at :meth:`bind` to the device (:meth:`_move`).
        """
        if backend == self._backend:
            return
        if self._backend is not None:
            raise BackendError(f"{self!r} works on {self._backend} arrays (its state lives there), got a {backend} "
                               "array; arraytrain never moves data between host and device implicitly")
        kern = None if self.family is None else family(backend, self.kernels, self.family)
        if backend != NUMPY and self.kernels == "reference":
            raise BackendUnavailableError("kernels='reference': the reference twins run on NumPy arrays only")
        if backend != NUMPY:
            self._move(module_of_backend(backend))
        self._backend, self._kern = backend, kern

    def _move(self, xp) -> None:
        """Move the state made at bind to the array module ``xp`` (default: nothing to move)."""

    def _xp(self):
        return module_of_backend(self._backend or NUMPY)

    # -- set-up -------------------------------------------------------------------------
    def bind(self, layout: Layout, dtype=np.float32, comm=None) -> "Compressor":
        """Fix the layout, dtype and process group this compressor works on (the engine calls it).

        ``comm``: the :class:`~arraytrain.parallel.Communicator` that :meth:`exchange` sends
        payloads through (None: this process alone).
        """
        comm = check_comm(comm)
        if not isinstance(layout, Layout):
            raise ArgumentTypeError(f"layout: expected an arraytrain Layout, got {type(layout).__name__}")
        dtype = np.dtype(dtype)
        if dtype not in FLOAT_DTYPES:
            raise DTypeError(f"dtype: compressors work on float32 or float64 gradients, got {dtype}")
        if self.layout is not None:
            if self.layout == layout and self._dtype == dtype and (comm is self.comm or comm.is_local
                                                                   and self.comm.is_local):
                return self
            raise LayoutError(f"{self!r} is already bound to {self.layout!r} ({self._dtype}); use a new compressor")
        big = [n for n in layout.names if int(np.prod(layout.shape(n), dtype=np.int64)) >= max(self.min_size, 1)]
        small = [n for n in layout.names if n not in big]
        segs, k = [], 0
        for n in big:
            segs.append(Segment(n, layout.shape(n), k))
            k += segs[-1].size
        domain = Domain(k, dtype, tuple(segs))
        live = sum(int(np.prod(s, dtype=np.int64)) for s in layout.shapes)
        self._bind(domain)  # may raise (e.g. a shape the method cannot take): nothing is kept yet
        self.layout, self._dtype, self.domain, self.comm = layout, dtype, domain, comm
        self._big = Gather(layout, big, k, dtype)
        self._small = Gather(layout, small, live - k, dtype)
        self._all = Gather(layout, layout.names, live, dtype)
        self._dense_nbytes = live * dtype.itemsize
        return self

    def _bind(self, domain: Domain) -> None:
        """Per-method set-up once the domain is known (default: nothing)."""

    def _need_bound(self) -> None:
        if self.layout is None:
            raise LayoutError(f"{self!r} is not bound to a layout: call bind(layout, dtype) first")

    def _check_flat(self, x, name: str):
        kind = array_backend(x)
        if kind is None or x.ndim != 1 or x.size != self.layout.size:
            got = getattr(x, "shape", type(x).__name__)
            raise ArgumentTypeError(f"{name}: expected a 1-D NumPy or CuPy array of {self.layout.size} elements, "
                                    f"got {got}")
        if x.dtype != self._dtype:
            raise DTypeError(f"{name}: expected {self._dtype}, got {x.dtype}")
        if not x.flags.c_contiguous:
            raise ArgumentTypeError(f"{name}: expected a contiguous array")
        if self._backend is not None and kind != self._backend:
            raise BackendError(f"{name}: a {kind} array was given to a compressor on {self._backend} arrays; "
                               "arraytrain never moves data between host and device implicitly")
        return x

    # -- the work ---------------------------------------------------------------------------
    def compress(self, x: np.ndarray) -> Payload:
        """The payload for the flat gradient ``x`` (read only); advances the call count."""
        self._need_bound()
        self._check_flat(x, "x")
        self._place(backend_of(x))
        step = self.step
        if step < self.warmup:
            payload = Payload(self.method, raw=self._all.pack(x).copy(),
                              meta={"step": step, "warmup": True, "phase": "dense"})
        else:
            meta = {"step": step, "phase": self.phase(step)}
            if self.stochastic:
                meta["key"] = step_key(self.seed, step)
            arrays = self._encode(self._big.pack(x), meta) if self.domain.size else {}
            raw = self._small.pack(x).copy() if self._small.size else None
            payload = Payload(self.method, arrays=arrays, raw=raw, meta=meta)
        payload.dense_nbytes = self._dense_nbytes
        self.step = step + 1
        return payload

    def phase(self, step: int) -> str:
        """What call ``step`` sends: ``"dense"`` (the warm-up), ``"ramp"`` (a method that tightens in
        stages, before its final setting) or ``"compressed"``."""
        return "dense" if step < self.warmup else "compressed"

    @property
    def schedule(self) -> str:
        """The warm-up in words (the CLI's header and the step report's reader show it)."""
        return f"dense for the first {self.warmup} calls" if self.warmup else "compressed from the first call"

    def decompress(self, payload: Payload, out: np.ndarray | None = None) -> np.ndarray:
        """Write the decoded gradient into ``out`` (live elements only; padding is left as is)."""
        self._need_bound()
        if not isinstance(payload, Payload) or payload.method != self.method:
            raise ArgumentTypeError(f"payload: expected a {self.method} Payload, got {payload!r:.80}")
        if out is None:
            backend = self._backend or _payload_backend(payload) or NUMPY
            out = module_of_backend(backend).zeros(self.layout.size, self._dtype)
        self._check_flat(out, "out")
        self._place(backend_of(out))
        if payload.meta.get("warmup"):
            self._all.put(self._raw_wire(payload, self._all.size, out), out)
            return out
        raw = self._raw_wire(payload, self._small.size, out) if self._small.size else None
        if self.domain.size:
            target = self._big.target(out)
            self._decode(payload.arrays, payload.meta, target)
            self._big.finish(target, out)
        if raw is not None:
            self._small.put(raw, out)
        return out

    def _raw_wire(self, payload: Payload, size: int, out):
        """The payload's ``raw`` array, checked: ``size`` elements of the gradient dtype on ``out``'s backend."""
        return check_wire({"raw": payload.raw}, "raw", (size,), self._dtype, out)

    def roundtrip(self, x: np.ndarray) -> Payload:
        """Compress ``x`` and overwrite it with what a receiver decodes (the single-process exchange)."""
        payload = self.compress(x)
        self.decompress(payload, x)
        return payload

    # -- the exchange -------------------------------------------------------------------------
    def exchange(self, x: np.ndarray) -> Payload:
        """Send ``x`` compressed to every process of :attr:`comm`; ``x`` becomes the decoded sum.

        Returns this process's payload (its ``nbytes``: what this process put on the wire).
        With one process this is :meth:`roundtrip`.
        """
        payload = self.compress(x)
        self.aggregate(payload, x)
        return payload

    def aggregate(self, payload: Payload, out: np.ndarray) -> np.ndarray:
        """The sum over processes of every process's decoded payload, into ``out``.

        Default (payloads that do not add up: top-k, sign, ternary): every process's
        arrays are all-gathered and each is decoded and added. The ``raw`` part (the
        warm-up's whole gradient, the parameters below ``min_size``) is dense and adds up:
        it is all-reduced in place, so a process receives it once, not once per process.
        Methods whose payloads add up override this with an all-reduce of the arrays and
        one decode.
        """
        if self.comm.is_local:
            return self.decompress(payload, out)
        raw = None
        if payload.raw is not None:  # a copy: the payload stays this process's own
            raw = payload.raw.copy()
            self.comm.allreduce(raw)
        if not payload.arrays:  # the warm-up: nothing but the summed raw part
            return self.decompress(Payload(payload.method, raw=raw, meta=dict(payload.meta)), out)
        gathered = {k: self.comm.allgather(a) for k, a in payload.arrays.items()}
        zeros = None if raw is None else self._xp().zeros_like(raw)
        scratch = self._xp().empty_like(out)
        for r in range(self.comm.size):  # the summed raw part decoded with rank 0's arrays, zeros after
            theirs = Payload(payload.method, arrays={k: v[r] for k, v in gathered.items()},
                             raw=raw if r == 0 else zeros, meta=self._meta_of(payload, r))
            self.decompress(theirs, out if r == 0 else scratch)
            if r:
                self._all.add(scratch, out)
        return out

    def _meta_of(self, payload: Payload, rank: int) -> dict:
        """The meta of ``rank``'s payload: the same call number and draw key on every rank."""
        return dict(payload.meta)

    def sent(self, payload: Payload, out: np.ndarray) -> np.ndarray:
        """What this process's own ``payload`` decodes to, into ``out`` (error feedback keeps the rest)."""
        return self.decompress(payload, out)

    @abstractmethod
    def _encode(self, x: np.ndarray, meta: dict) -> dict[str, np.ndarray]:
        """Wire arrays for the dense domain vector ``x`` (read only). ``meta['key']``: the draw key."""

    @abstractmethod
    def _decode(self, arrays: Mapping[str, np.ndarray], meta: Mapping, out: np.ndarray) -> None:
        """Write the decoded domain vector into ``out`` (every element)."""

    # -- state ----------------------------------------------------------------------------------
    def _state(self) -> dict[str, np.ndarray]:
        """Arrays that must survive a resume (default: none)."""
        return {}

    def _check_state(self, arrays: Mapping) -> dict:
        """Validate :meth:`_state` output from a checkpoint; return what :meth:`_load_state` takes.

        The arrays' backend (one for all, the compressor's own once fixed) is checked by
        :meth:`check_state` before this is called.
        """
        if arrays:
            raise StateDictError(f"{self.method}: expected no state arrays, got {sorted(arrays)}")
        return {}

    def _load_state(self, checked: dict) -> None:
        pass

    def state_dict(self) -> dict:
        """What must survive a resume: the call count and the method's arrays (bound compressors only).

        The arrays are e.g. PowerSGD's warm-start factors; ``"type"`` holds :meth:`describe`,
        which :meth:`check_state` compares with the compressor's own.
        """
        self._need_bound()
        return {"type": self.describe(), "step": self.step, "arrays": self._state()}

    def check_state(self, state: Mapping, *, with_residual: bool = False, more_arrays=()) -> dict:
        """Validate a :meth:`state_dict`; raise StateDictError; change nothing.

        ``more_arrays``: further arrays of the state (error feedback's residual) that must share
        the backend of the compressor's own; the result's ``"backend"`` names it.
        """
        self._need_bound()
        try:
            kind, step, arrays = state["type"], state["step"], state["arrays"]
        except (KeyError, TypeError) as exc:
            raise StateDictError(f"compression state lacks {exc}") from None
        if kind != self.describe():
            raise StateDictError(f"compression: the state is for {shown(kind)}, the engine has {self.describe()!r}")
        check_count("compression step", step, 0, error=StateDictError)
        if ("residual" in state) != with_residual:
            has = "has" if "residual" in state else "has no"
            raise StateDictError(f"compression: the state {has} error-feedback residuals, "
                                 f"the compressor {'uses' if with_residual else 'does not use'} error feedback")
        if not isinstance(arrays, Mapping):
            raise StateDictError(f"compression arrays: expected a mapping, got {type(arrays).__name__}")
        backend = self._state_backend([*arrays.values(), *more_arrays])
        return {"step": int(step), "arrays": self._check_state(arrays), "backend": backend}

    def _state_backend(self, arrays) -> str:
        """Where a state's arrays live: one backend for all, the compressor's own once it is fixed."""
        kinds = {k for k in map(array_backend, arrays) if k is not None}
        if len(kinds) > 1:
            raise StateDictError("compression state: NumPy and CuPy arrays mixed")
        kind = kinds.pop() if kinds else (self._backend or NUMPY)
        if self._backend is not None and kind != self._backend:
            raise StateDictError(f"compression state: {kind} arrays for a compressor on {self._backend} arrays; "
                                 "arraytrain never moves data between host and device implicitly")
        return kind

    def load_state_dict(self, state: Mapping) -> None:
        """Restore a :meth:`state_dict`, validated first by :meth:`check_state`: a refused state changes nothing."""
        checked = self.check_state(state)
        self.apply_state(checked)

    def apply_state(self, checked: dict) -> None:
        """Restore what :meth:`check_state` returned (assignments only)."""
        # a device state fixes an unplaced compressor to the device; a host state leaves it free
        if checked.get("backend", NUMPY) != NUMPY:
            self._place(checked["backend"])
        self.step = checked["step"]
        self._load_state(checked["arrays"])

    def describe(self) -> str:
        """The method and the settings that change the payload (saved with the state)."""
        return repr(self)

    def hyperparameters(self) -> dict:
        """The settings that change the payload, by name (the repr and :meth:`describe` show them)."""
        return {"min_size": self.min_size, "warmup": self.warmup, "seed": self.seed}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}({args})"


class ErrorFeedback:
    r"""Error feedback over any compressor (Seide et al. 2014; Karimireddy et al. 2019, EF-SGD).

    .. math::
        t_k = g_k + r_{k-1}, \quad s_k = D(C(t_k)), \quad r_k = t_k - s_k

    so :math:`\sum_k s_k + r_K = \sum_k g_k`: nothing a compressor drops is
    lost, only delayed. The residual ``r`` is a flat buffer of the gradient's
    layout; it is named state (``state_dict()["residual"]`` by parameter name),
    saved in checkpoints and restored on resume. During the compressor's
    warm-up the payload is exact and the residual stays zero. The residual lives
    with the compressor's state: on the device once a CuPy gradient fixed it there.
    """

    def __init__(self, compressor: Compressor):
        if not isinstance(compressor, Compressor):
            raise ArgumentTypeError(f"compressor: expected an arraytrain Compressor, got {type(compressor).__name__}")
        if not compressor.contraction:
            raise HyperparameterError(
                f"compressor: {compressor!r} scales what it keeps up by n/k (unbiased), so the residual of error "
                "feedback grows every call and training diverges; use its contraction (RandomK(rescale=False), "
                "VSA(unbiased=False))")
        self.compressor = compressor
        self.residual: FlatBuffer | None = None

    @property
    def method(self) -> str:
        """The wrapped compressor's method name."""
        return self.compressor.method

    @property
    def step(self) -> int:
        """The wrapped compressor's call count."""
        return self.compressor.step

    @property
    def layout(self) -> Layout | None:
        """The layout the wrapped compressor is bound to (None before :meth:`bind`)."""
        return self.compressor.layout

    @property
    def comm(self):
        """The process group the wrapped compressor sends its payloads through."""
        return self.compressor.comm

    def bind(self, layout: Layout, dtype=np.float32, comm=None) -> "ErrorFeedback":
        """Bind the wrapped compressor (:meth:`Compressor.bind`) and create the zero residual."""
        self.compressor.bind(layout, dtype, comm)
        if self.residual is None:
            self.residual = FlatBuffer.zeros(layout, np.dtype(dtype))
        return self

    def _place(self, backend: str) -> None:
        self.compressor._place(backend)
        self._follow()

    def _follow(self) -> None:
        """The residual on the compressor's backend (moved once, when that was fixed to the device)."""
        backend = self.compressor.backend
        if backend is not None and backend_of(self.residual.flat) != backend:
            self.residual = FlatBuffer(self.residual.layout, module_of_backend(backend).asarray(self.residual.flat))

    def _send(self, x: np.ndarray) -> Payload:
        """``r += x`` and the payload of ``r`` (``x`` checked, the residual placed on its backend)."""
        self.compressor._need_bound()
        self.compressor._check_flat(x, "x")
        self._place(backend_of(x))
        self.residual.flat += x
        return self.compressor.compress(self.residual.flat)

    def compress(self, x: np.ndarray) -> Payload:
        """Compress ``g + r`` and keep what was not sent in ``r`` (``x`` is read only)."""
        payload = self._send(x)
        self.residual.flat -= self.compressor.decompress(payload)
        return payload

    def decompress(self, payload: Payload, out: np.ndarray | None = None) -> np.ndarray:
        """Decode ``payload`` into ``out`` as the wrapped compressor does (the residual is not involved)."""
        return self.compressor.decompress(payload, out)

    def roundtrip(self, x: np.ndarray) -> Payload:
        """As :meth:`compress`, then ``x`` = the decoded gradient; no scratch buffer."""
        payload = self._send(x)
        self.compressor.decompress(payload, x)
        self.residual.flat -= x
        return payload

    def exchange(self, x: np.ndarray) -> Payload:
        """Send ``g + r`` compressed to every process; ``x`` becomes the decoded sum over processes.

        The residual keeps what *this* process failed to send, ``r = g + r - sent``, where
        ``sent`` is the decode of its own payload — whatever the others sent, so the
        telescoping identity holds per process. With one process: :meth:`roundtrip`.
        """
        if self.comm.is_local:
            return self.roundtrip(x)
        payload = self._send(x)
        self.compressor.sent(payload, x)  # x is free now: it holds what this process sent
        self.residual.flat -= x
        self.compressor.aggregate(payload, x)
        return payload

    def reset(self) -> None:
        """Zero the residual (nothing pending is sent)."""
        if self.residual is not None:
            self.residual.flat.fill(0)

    def state_dict(self) -> dict:
        """The wrapped compressor's state plus ``"residual"``, the residual by parameter name."""
        state = self.compressor.state_dict()
        state["residual"] = self.residual.as_dict(copy=True)
        return state

    def check_state(self, state: Mapping) -> dict:
        """Validate a :meth:`state_dict`, the residual included; raise StateDictError; change nothing."""
        try:
            residual = state["residual"]
        except (KeyError, TypeError):
            raise StateDictError("compression state lacks 'residual' (saved without error feedback?)") from None
        more = list(residual.values()) if isinstance(residual, Mapping) else []
        checked = self.compressor.check_state(state, with_residual=True, more_arrays=more)
        target = self.residual
        if checked["backend"] != backend_of(target.flat):  # a device state for a compressor not yet placed
            target = FlatBuffer.zeros(target.layout, target.dtype, module_of_backend(checked["backend"]))
        try:
            checked["residual"] = ready_to_assign(target, target.check(residual), protect=(target.flat,))
        except (LayoutError, KeyError, ValueError, TypeError) as exc:
            raise StateDictError(f"compression residual: {exc}") from exc
        return checked

    def load_state_dict(self, state: Mapping) -> None:
        """Restore a :meth:`state_dict`, validated first by :meth:`check_state`: a refused state changes nothing."""
        self.apply_state(self.check_state(state))

    def apply_state(self, checked: dict) -> None:
        """Restore what :meth:`check_state` returned (assignments only)."""
        self.compressor.apply_state(checked)
        self._follow()
        self.residual.assign(checked["residual"])

    def describe(self) -> str:
        """The wrapper and the wrapped compressor's method and settings (saved with the state)."""
        return repr(self)

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.compressor!r})"


def _payload_backend(payload: Payload) -> str | None:
    """The backend of a payload's first array (None when it holds none)."""
    for a in [*payload.arrays.values(), payload.raw]:
        kind = array_backend(a)
        if kind is not None:
            return kind
    return None
