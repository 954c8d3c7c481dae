"""The kernel interface: every kernel a family provides, what it does, and how to get a family.

Three families implement it with the same names and argument names, domain by domain
(``reductions``, ``optimizers``, ``compression``, ``projection``, ``trend``):

* ``reference`` — NumPy, float64 math rounded once to the storage: the oracle of the tests;
* ``cpu`` — numba, one parallel (or serial, for small buffers) pass per kernel;
* ``cuda`` — CuPy raw kernels, one launch per stage over a chunk table.

Conventions shared by all: kernels take arrays and scalars only and trust their inputs (the
public layer validates); flat buffers are 1-D and contiguous; ``pieces`` is a Layout's
``[start, stop, segment]`` table (padding is never touched) and per-parameter values are
arrays indexed by segment; ``gscale`` multiplies the gradient inside the kernel (clip
factor, accumulation mean, loss-scale unscale, the sign of ``maximize``); state arrays are
float storage, or uint16 bfloat16 bits read and written through the family's one state
accessor; ``working``/``kind`` is an optional low-precision working copy of the new weights
(uint16 bits, :data:`LP_BF16` or :data:`LP_F16`); ``zero_grad`` zeroes the gradient in the
same pass; ``mask`` (uint8, 1 keep) writes pruned weights as exactly 0.

Every kernel, in every domain, takes its arguments in one convention: the arrays first,
positionally (buffers, state slots, outputs, and the tables that index them: ``pieces``,
Adafactor's work tables, Muon's ``mats``, ``accumulate_packed``'s ``table``), then every
scalar, flag and per-parameter value keyword-only, so a call names them and a swapped pair
cannot pass silently. Each keyword means the same in every kernel that takes it
(:data:`ARGUMENTS`). Every derived value is formed once, by the optimizer or the engine, on
the host: bias corrections (as the factors the kernel multiplies by), decoupled decays
``1 - lr*wd``, bias-corrected step sizes, Adagrad's decayed rate, Adafactor's relative step,
Sophia's batch-scaled ``rho``, the norm pass's ``1/max|x|``. A kernel wrapper only casts what
it receives to the storage dtype, and may form the complement ``1 - x`` of a rate it receives
(``beta1``, ``alpha``, ``dampening``) or a square (Adafactor's ``eps1**2``) for its loop.
Weight decay has three forms, one name each: ``l2`` (coupled, torch's ``weight_decay`` of
SGD/Adam/Adagrad/RMSprop: added to the gradient), ``decay`` (decoupled: the parameter is
multiplied by it first) and LAMB's ``weight_decay`` (added to the update before the trust
ratio).

:func:`family` is the one way to get an implementation: by the arrays' backend and the
``impl`` a caller chose (:data:`IMPLS`: "numba", the fast family of the backend, or
"reference", the oracle).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import NamedTuple

import numpy as np

#: Kinds of low-precision working copies (uint16 bits), as the kernels take them (``kind``).
LP_NONE, LP_BF16, LP_F16 = 0, 1, 2
#: Elements per block of 8-bit state (:mod:`arraytrain.lowbit`): one float32 absmax each.
Q8_BLOCK = 256


class Q8(NamedTuple):
    """An 8-bit slot (:mod:`arraytrain.optim.state8`) as the kernels take it (every family): arrays
    and integers only.

    ``codes``: uint8, one per element of the flat buffer (at the parameters' offsets);
    ``aux``: float32, per segment from ``base[seg]``: one absmax per block where
    ``quant[seg]``, else the segment's float32 values; ``offset``: the segments' flat
    offsets; the codebook's ``qmap``, ``table``, ``shift``, ``bias``, ``nb``.
    """

    codes: np.ndarray
    aux: np.ndarray
    base: np.ndarray
    quant: np.ndarray
    offset: np.ndarray
    qmap: np.ndarray
    table: np.ndarray
    shift: int
    bias: int
    nb: int


class F8(NamedTuple):
    """A float8 slot (:mod:`arraytrain.optim.state8`, ``state_dtype="float8"``) as the kernels take it
    (every family): :class:`Q8`'s layout (``codes``, ``aux``, ``base``, ``quant``, ``offset``,
    value ``qmap[code] * aux[block]``), with float8 codes and the scale ``absmax / top`` per
    block in place of the dynamic map and its absmax: ``wide`` 0, e4m3 codes (``top`` 448),
    ``wide`` 1 (a slot that is never negative), e5m2 codes (``top`` 57344); ``qmap`` the
    format's 256 values. Encoding a block is integer work (no table): see
    :func:`arraytrain.lowbit.float8_encode`, which every family's encoder equals bit for bit.
    A ``wide`` slot is re-encoded with stochastic rounding (:func:`arraytrain.lowbit.sr_codes`):
    ``start`` (int64 per segment) is the position in its parameter of the segment's first element
    held here (0 but in a partition's window), so element ``i`` of segment ``seg`` sits at position
    ``i - offset[seg] + start[seg]``; ``salt`` (uint32) is the step's key
    (:func:`arraytrain.lowbit.sr_salt`, set by the optimizer for each step).
    """

    codes: np.ndarray
    aux: np.ndarray
    base: np.ndarray
    quant: np.ndarray
    offset: np.ndarray
    qmap: np.ndarray
    wide: int
    start: np.ndarray
    salt: int


class F8E5M2(F8):
    """A wide float8 slot (``wide`` 1, e5m2 codes): :class:`F8` under a type of its own, so that a
    CPU kernel compiles the one format each slot holds (a slot's format is fixed: e4m3 for a slot
    that can be negative, e5m2 for one that cannot). Build a float8 slot with :func:`f8_slot`."""

    __slots__ = ()


def f8_slot(codes, aux, base, quant, offset, qmap, wide, start, salt) -> F8:
    """A float8 slot of format ``wide`` (0: e4m3, 1: e5m2) as the kernels take it: :class:`F8E5M2`
    where ``wide``, else :class:`F8`."""
    return (F8E5M2 if wide else F8)(codes, aux, base, quant, offset, qmap, int(wide), start, salt)


#: The slot types of block-quantized state (8-bit dynamic map, float8): ``isinstance(x, QUANTIZED)``.
QUANTIZED = (Q8, F8)

# Formats shared by every family's compression kernels.
#: int8 codes are ``round(x / absmax * 127)``: the scale is ``absmax / 127``.
INV127 = 1.0 / 127.0
#: Itemsize -> the mask that clears a float's sign bit: ``abs(x)`` as bits that order as unsigned integers.
MAGNITUDE_MASK = {4: np.uint32(0x7FFFFFFF), 8: np.uint64(0x7FFFFFFFFFFFFFFF)}

#: The domains a family's kernels are grouped in (one module of the family each).
DOMAINS = ("reductions", "optimizers", "compression", "projection", "trend")
#: The families that implement the interface.
FAMILIES = ("reference", "cpu", "cuda")
#: What a caller chooses: the fast family of the arrays' backend, or the reference.
IMPLS = ("numba", "reference")

#: name -> (domain, what it computes). Every family provides every name, with the reference's
#: argument names, kinds and defaults (tests/kernels/test_kernel_interface.py checks it).
KERNELS = {
    "accumulate": ("reductions", "acc = w*g, or acc += w*g (a micro-batch into the gradient buffer)"),
    "accumulate_packed": ("reductions", "acc[d:d+n] (=|+=) w*src[s:s+n] per row (s, d, n): many gradients, one call"),
    "scale": ("reductions", "x *= factor"),
    "all_finite": ("reductions", "no NaN or Inf in x"),
    "sumsq": ("reductions", "float64 sums of squares over the pieces: (total, per segment), fixed order"),
    "max_abs": ("reductions", "largest |x| over the pieces (the overflow-safe norm's scale)"),
    "sumsq_scaled": ("reductions", "sums of squares of x*inv (the overflow-safe norm)"),
    "sumsq_product": ("reductions", "sums of squares of x*y (ASAM's norm)"),
    "cast_working": ("reductions", "w = lowp(p): rebuild a low-precision working copy"),
    "sgd_step": ("optimizers", "SGD: momentum, dampening, Nesterov, L2 (torch.optim.SGD)"),
    "adam_step": ("optimizers", "Adam/AdamW, AMSGrad (torch.optim.Adam/AdamW)"),
    "adagrad_step": ("optimizers", "Adagrad (torch.optim.Adagrad)"),
    "rmsprop_step": ("optimizers", "RMSprop, centered, momentum (torch.optim.RMSprop)"),
    "lion_step": ("optimizers", "Lion (optax.lion)"),
    "lamb_step": ("optimizers", "LAMB with per-parameter trust ratios (optax.lamb); returns the ratios"),
    "adafactor_step": ("optimizers", "Adafactor, factored second moments (torch.optim.Adafactor)"),
    "sophia_step": ("optimizers", "SophiaG (the authors' update)"),
    "sam_perturb": ("optimizers", "SAM/ASAM's ascent: backup = p; p += scale * (p^2 if adaptive) * g"),
    "nadam_step": ("optimizers", "NAdam, momentum schedule, decoupled decay (torch.optim.NAdam)"),
    "radam_step": ("optimizers", "RAdam, rectified or plain momentum step, decoupled decay (torch.optim.RAdam)"),
    "adamax_step": ("optimizers", "Adamax, the infinity-norm moment (torch.optim.Adamax)"),
    "adadelta_step": ("optimizers", "Adadelta (torch.optim.Adadelta)"),
    "topk": ("compression", "exact global top-k by |x| (ties to the lowest index, NaN first)"),
    "randk_indices": ("compression", "k distinct indices of n from the counter RNG (Floyd's sampling)"),
    "gather": ("compression", "out = x[idx]"),
    "scatter": ("compression", "out[idx] += factor * values"),
    "int8_encode": ("compression", "absmax-per-block int8 codes (optionally stochastic rounding; or against given scales)"),
    "int8_decode": ("compression", "out = codes * scale per block"),
    "sign_encode": ("compression", "sign bits (8 per byte) and an L1 scale per block"),
    "sign_decode": ("compression", "out = +-scale per block"),
    "ternary_encode": ("compression", "TernGrad's unbiased {-1, 0, 1} codes (4 per byte), a scale per block"),
    "ternary_decode": ("compression", "out = code * scale per block"),
    "fwht": ("projection", "blockwise fast Walsh-Hadamard transform in place"),
    "sign_bind": ("projection", "out = x * (+-1 key from the counter RNG)"),
    "select_gather": ("projection", "the kept coordinates of each Hadamard block"),
    "select_scatter": ("projection", "the kept coordinates back into their blocks, scaled"),
    "trend_predict": ("trend", "least-squares extrapolation of the recorded gradients, plus a correction"),
    "trend_correct": ("trend", "the correction EMA from a true gradient"),
}


#: The keyword arguments of the kernels, every domain, and what each means (every kernel that
#: takes one means this). "per parameter": an array indexed by segment (one value per parameter).
ARGUMENTS = {
    "gscale": "multiplies the gradient (clip factor / loss scale, accumulation mean, -1 for maximize)",
    "lr": "per parameter: the learning rate of this step (scheduled; Adagrad's decayed lr/(1+(t-1)*lr_decay))",
    "step_size": "per parameter: the bias-corrected learning rate lr/(1 - beta1^t) (Adam)",
    "l2": "per parameter: coupled L2 decay, added to the gradient: d = gscale*g + l2*p",
    "decay": "per parameter: decoupled decay, the factor 1 - lr*weight_decay the parameter is multiplied by",
    "weight_decay": "per parameter: weight_decay*p added to the update (LAMB: before the trust ratio; "
                    "schedule-free: at y, before the lr)",
    "rel_step": "per parameter: Adafactor's relative step size min(lr, 1/sqrt(t)) (torch's rho_t)",
    "beta1": "first-moment decay rate (schedule-free: the weight of x in y = beta1*x + (1 - beta1)*z)",
    "beta2": "second-moment decay rate",
    "one_minus_beta2": "Adafactor's 1 - beta2_t = t**beta2_decay",
    "inv_bc1": "1/(1 - beta1^t): the first moment's bias correction as a factor (LAMB)",
    "inv_bc2": "1/(1 - beta2^t): the second moment's bias correction as a factor (LAMB)",
    "inv_bc2_sqrt": "1/sqrt(1 - beta2^t): the bias correction of sqrt(v) as a factor (Adam)",
    "eps": "added to the denominator (after the square root; Sophia: the denominator's floor; "
           "sumsq_gate: the clip factor's max_norm/(norm + eps))",
    "eps_root": "added inside the square root (LAMB)",
    "eps1": "Adafactor's floor of the second-moment estimate (squared) and of the row mean",
    "eps2": "Adafactor's floor of the parameter RMS",
    "d": "Adafactor's update-clipping threshold on RMS(U)",
    "alpha": "RMSprop's smoothing constant of the squared-gradient average",
    "momentum": "momentum factor (SGD, RMSprop); 0: no momentum buffer",
    "dampening": "SGD's dampening of the momentum update",
    "nesterov": "SGD: Nesterov momentum",
    "first": "SGD: the first step (the momentum buffer starts at d)",
    "centered": "RMSprop: subtract the squared mean gradient",
    "amsgrad": "Adam: use the running maximum of v",
    "rho_bs": "Sophia's rho times its batch-size factor bs (the clipping denominator's scale)",
    "scale": "SAM's ascent factor rho*gscale/(norm + 1e-12)",
    "adaptive": "SAM: ASAM's element-wise p^2 scaling",
    "working": "low-precision working copy of the new weights (uint16 bits) or None",
    "kind": "kind of the low-precision working copy: LP_BF16 or LP_F16 (LP_NONE: none, with working=None)",
    "zero_grad": "zero the gradient in the same pass",
    "mask": "pruning mask (uint8, 1 keep) or None: pruned weights written as exactly 0",
    "grad_ptrs": ("None (the gradient is the flat buffer g), or int64, one per row of pieces: the address of "
                  "the gradient's element at the piece's start, wherever it lies (a torch .grad, a NumPy array), "
                  "contiguous, of g's dtype: the gradient read where it lies, never copied in. Callers pass "
                  "zero_grad=False with it (that memory is not the kernel's to clear). CPU families only: the "
                  "CUDA kernels raise BackendUnavailableError"),
    "reduce_sums": ("LAMB: None, or a callable that completes the float64 per-parameter sums of squares "
                    "[||p||^2..., ||u||^2...] of a partition in place (sharded state: one all-reduce)"),
    "grad_step": "per parameter: NAdam's step of the gradient term, lr*(1 - mu_t)/(1 - mu_1*...*mu_t)",
    "moment_step": "per parameter: NAdam's step of the first moment, lr*mu_{t+1}/(1 - mu_1*...*mu_{t+1})",
    "rect": "RAdam's rectification r_t times sqrt(1 - beta2^t): the factor of m/(sqrt(v) + eps)",
    "rectified": "RAdam: rho_t > 5, the rectified adaptive step; else the plain step_size*m",
    "rho": "Adadelta's decay rate of the squared-gradient and squared-update averages",
}


# -- Muon and schedule-free AdamW ----------------------------------------------------------
# Muon's step walks a table of matrices (``mats``: one row per Muon parameter, see
# arraytrain.optim._muon) in a work buffer: per matrix, a fused element-wise kernel for the
# momentum (into the work buffer, with the float64 sum of squares the iteration normalises
# by), the Newton-Schulz iteration's GEMMs on BLAS/cuBLAS through NumPy/CuPy matmul, and a
# fused element-wise apply.
KERNELS.update({
    "muon_step": ("optimizers", "Muon: momentum, Newton-Schulz orthogonalisation per matrix, apply (torch.optim.Muon)"),
    "schedule_free_adamw_step": ("optimizers", "Schedule-Free AdamW: v, z, the averaging weight, y "
                                               "(optax.contrib.schedule_free_adamw)"),
})
ARGUMENTS.update({
    "adjusted_lr": "per parameter: Muon's lr times its shape factor (torch's adjust_lr_fn)",
    "eps_norm": "Muon: the floor of the Frobenius norm the matrix is divided by (torch's eps)",
    "ns_coefficients": "Muon: (a, b, c) of the quintic X <- a X + (b A + c A^2) X, A = X X^T",
    "ns_steps": "Muon: Newton-Schulz iterations",
    "weight_lr": "per parameter: schedule-free's lr of the averaging weights (max_lr tracks it)",
    "weight_lr_power": "schedule-free: the weight of a step is max_lr**weight_lr_power",
})

# -- the other domains' keywords --------------------------------------------------------------
ARGUMENTS.update({
    # reductions
    "w": "accumulate: the weight of the gradient written into the accumulator, acc (=|+=) w*g",
    "overwrite": "accumulate: acc = w*g (the first micro-batch of a window) instead of acc += w*g",
    "factor": "multiplies the values written: x *= factor (scale), out[idx] = factor*values (scatter), "
              "the kept coordinates times factor (select_scatter)",
    "nseg": "the number of segments (parameters) the pieces name: the length of the per-segment sums",
    "inv": "x is multiplied by it before squaring (1/max|x|: the overflow-safe norm's second pass)",
    "unscale": "the loss scale the gradient carries: the norm and the clip factor are of g/unscale",
    "max_norm": "the global-norm clipping threshold: factor min(1, max_norm/(norm + eps)); None: no clipping",
    # compression and projection
    "k": "how many elements are kept (top-k) or drawn (random-k)",
    "n": "the size of the range the indices are drawn from",
    "key": "the counter RNG's key of this draw (uint64): element i's uniform is u(key, i)",
    "block": "elements per block: one scale per block (int8, sign, ternary), the Walsh-Hadamard "
             "transform's size, a power of two (fwht, select_*)",
    "stochastic": "int8: round up with probability frac(t) (stochastic rounding) instead of to nearest",
    "shared": "int8: the codes are taken against the given scales, which are read, not written",
    # trend
    "slot": "the ring slot (row of the history) the true gradient is recorded into",
    "beta": "decay of the correction's moving average: corr = beta*corr + (1 - beta)*(g - trend)",
})

#: Kernels of the CUDA family alone, as KERNELS (the engine's device-side gate: the norm pass, the
#: clip factor and the skip decision without a host synchronisation before the update).
DEVICE_KERNELS = {
    "sumsq_gate": ("reductions", "sumsq's sums and the gate (clip factor / unscale, skip flag) on the device"),
    "read_sums": ("reductions", "(total, per segment) of sumsq_gate's sums: the one device-to-host read"),
}

#: Kernels of the CPU family alone, as KERNELS: the torch drop-ins' Adam/AdamW step in one call (the norm
#: pass, the NaN/Inf verdict, the clip factor and the update by step-count group; bitwise the staged step's).
HOST_KERNELS = {
    "adam_checked": ("optimizers", "Adam/AdamW's whole step: norm pass, verdict, clip factor, update by step count"),
}
ARGUMENTS.update({
    "clip_eps": "the clip factor's min(1, max_norm/(norm + clip_eps))",
    "check": "judge the gradient: a NaN/Inf one is not applied (nothing written)",
    "maximize": "ascend the objective: the gradient's sign flipped",
    "decoupled": "Adam: AdamW's decoupled weight decay (else coupled L2)",
    "lr_div": "per step-count group: the bias correction 1 - beta1^t the lr is divided by",
})


def export(namespace: dict, package: str, kernels: dict = KERNELS) -> list[str]:
    """Put every kernel of ``kernels`` (name -> (domain, what)) into a family package's ``namespace``,
    each from the package's module of its domain, and the low-precision kinds beside them; returns
    the names (the package's ``__all__``). The one list of a family's kernels is the table above."""
    names = ["LP_BF16", "LP_F16", "LP_NONE"]
    namespace.update(LP_BF16=LP_BF16, LP_F16=LP_F16, LP_NONE=LP_NONE)
    for name, (domain, _) in kernels.items():
        namespace[name] = getattr(importlib.import_module(f"{package}.{domain}"), name)
        names.append(name)
    return names


def family_name(backend: str, impl: str = "numba") -> str:
    """``"reference"``, ``"cpu"`` or ``"cuda"`` for arrays of ``backend`` ("numpy"/"cupy")."""
    from ..errors import BackendUnavailableError, HyperparameterError

    if impl not in IMPLS:
        raise HyperparameterError(f"kernels: expected one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        if backend != "numpy":
            raise BackendUnavailableError("kernels='reference': the reference kernels run on NumPy arrays only")
        return "reference"
    return "cpu" if backend == "numpy" else "cuda"


def family(backend: str, impl: str = "numba", domain: str | None = None) -> ModuleType:
    """The kernels for arrays of ``backend`` ("numpy"/"cupy") and ``impl``: the family, or one ``domain`` of it.

    The one way every caller (engine, optimizers, accumulator, compressors, predictor)
    gets kernels. ``impl``: one of :data:`IMPLS`; "reference" runs on NumPy arrays only
    (:class:`~arraytrain.errors.BackendUnavailableError` for "cupy"). A buffer's dtype
    is the caller's to check (:func:`arraytrain.backend.check_kernel_dtype`).
    """
    name = family_name(backend, impl)
    if domain is None:
        return importlib.import_module(f"{__package__}.{name}")
    if domain not in DOMAINS:
        raise KeyError(f"domain: expected one of {DOMAINS}, got {domain!r}")
    return importlib.import_module(f"{__package__}.{name}.{domain}")
