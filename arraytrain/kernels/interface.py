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
accessor; ``w``/``wkind`` is an optional low-precision working copy of the new weights
(uint16 bits, :data:`LP_BF16` or :data:`LP_F16`); ``zero_grad`` zeroes the gradient in the
same pass; ``mask`` (uint8, 1 keep) writes pruned weights as exactly 0.

:func:`family` is the one way to get an implementation: by the array's backend and the
``impl`` a caller chose ("numba": the fast family of the backend, "reference": the oracle).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np

# Kinds of low-precision working copies, as the optimizer kernels take them (uint16 bits).
LP_NONE, LP_BF16, LP_F16 = 0, 1, 2
# Formats shared by every family's compression kernels.
INV127 = 1.0 / 127.0  # int8 codes are round(x / absmax * 127): the scale is absmax / 127
MAGNITUDE_MASK = {4: np.uint32(0x7FFFFFFF), 8: np.uint64(0x7FFFFFFFFFFFFFFF)}  # |x| as ordered bits

DOMAINS = ("reductions", "optimizers", "compression", "projection", "trend")
FAMILIES = ("reference", "cpu", "cuda")
IMPLS = ("numba", "reference")

# name -> (domain, what it computes). Every family provides every name, with the reference's
# argument names (tests/test_kernel_interface.py checks it).
KERNELS = {
    "accumulate": ("reductions", "acc = w*g, or acc += w*g (a micro-batch into the gradient buffer)"),
    "accumulate_packed": ("reductions", "acc[d:d+n] (=|+=) w*src[s:s+n] per row (s, d, n): many gradients, one call"),
    "scale": ("reductions", "x *= s"),
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
    "topk": ("compression", "exact global top-k by |x| (ties to the lowest index, NaN first)"),
    "randk_indices": ("compression", "k distinct indices of n from the counter RNG (Floyd's sampling)"),
    "gather": ("compression", "out = x[idx]"),
    "scatter": ("compression", "out[idx] += factor * values"),
    "int8_encode": ("compression", "absmax-per-block int8 codes (optionally stochastic rounding)"),
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
    """The family package for ``backend`` and ``impl`` (every kernel), or one ``domain`` module of it."""
    name = family_name(backend, impl)
    if domain is None:
        return importlib.import_module(f"{__package__}.{name}")
    if domain not in DOMAINS:
        raise KeyError(f"domain: expected one of {DOMAINS}, got {domain!r}")
    return importlib.import_module(f"{__package__}.{name}.{domain}")
