"""What the benchmarks share: the clipped step's settings, its bytes, its builders, and the clocks.

:mod:`arraytrain.bench.compare` (CPU) and :mod:`arraytrain.bench.cuda` (GPU) time one
clipped optimizer step with the same hyperparameters for every contestant (the tables
below), count the same unavoidable bytes per step (:data:`OPTIMIZERS`,
:func:`step_bytes`) and build arraytrain's and torch's optimizers the same way
(:func:`arraytrain_optimizer`, :func:`make_engine`, :func:`torch_optimizer`). The
helpers at the end time calls (:func:`timeit`), split a parameter count into tensors
(:func:`split`, :func:`shapes`) and measure the machine's streaming bandwidth
(:func:`make_triad`, :func:`make_inplace`) and a fresh process's first step
(:func:`first_step_seconds`). :mod:`arraytrain.bench.compression` uses the clock and the
triad too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

N_TENSORS = 100
LR, BETAS, EPS, WD, MOMENTUM, MAX_NORM = 1e-3, (0.9, 0.999), 1e-8, 1e-2, 0.9, 1.0
# the other optimizers' own settings, identical for every contestant
ADAGRAD = {"lr": 1e-2, "eps": 1e-10, "weight_decay": WD}  # L2 decay, torch's form
RMSPROP = {"lr": LR, "alpha": 0.99, "eps": EPS, "momentum": MOMENTUM, "centered": True}
ADAFACTOR = {"lr": 1e-2, "beta2_decay": -0.8, "eps": (None, 1e-3), "d": 1.0, "weight_decay": WD}
LION = {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": WD}
# eps after the square root of the bias-corrected v, eps_root inside it (0): optax.lamb's
# form, which arraytrain.optim.LAMB follows, so both sides are configured alike
LAMB = {"lr": LR, "betas": BETAS, "eps": 1e-6, "eps_root": 0.0, "weight_decay": WD}
# torch's defaults (RAdam's update is rectified from step 6 with beta2 = 0.999: see compare.WARM_STEPS)
NADAM = {"lr": 2e-3, "betas": BETAS, "eps": EPS, "momentum_decay": 4e-3}
RADAM = {"lr": LR, "betas": BETAS, "eps": EPS}
ADAMAX = {"lr": 2e-3, "betas": BETAS, "eps": EPS}
ADADELTA = {"lr": 1.0, "rho": 0.9, "eps": 1e-6}
# torch.optim.Muon's names (its default coefficients and 5 Newton-Schulz steps); optax's
# schedule_free_adamw under the shared names, constant lr (no warm-up)
MUON = {"lr": 0.02, "weight_decay": WD, "momentum": 0.95, "nesterov": True}
SCHEDULE_FREE = {"lr": 2.5e-3, "betas": BETAS, "eps": EPS, "weight_decay": WD}

# Element accesses per parameter of one clipped step after the norm pass's read of g:
# reads and writes of parameter-sized arrays that the method cannot avoid.
OPTIMIZERS = {
    "adamw": 7,      # read p, g, m, v; write p, m, v
    "adam": 7,
    "sgd": 5,        # read p, g, momentum; write p, momentum
    "adagrad": 5,    # read p, g, sum; write p, sum
    "rmsprop": 9,    # read p, g, square_avg, grad_avg, momentum; write all but g
    "lion": 5,       # read p, g, m; write p, m
    # the trust ratio needs ||p|| and ||u|| before any p moves: read p, g, m, v, write m, v;
    # then read p, m, v, write p
    "lamb": 10,
    # factored statistics (O(rows + cols)) left out; the step size needs the update's RMS,
    # which needs the row/column sums of all of g: read g; read p, g; read p, g, write p
    "adafactor": 6,
    "nadam": 7,      # read p, g, m, v; write p, m, v
    "radam": 7,
    "adamax": 7,     # read p, g, exp_avg, exp_inf; write p, exp_avg, exp_inf
    "adadelta": 7,   # read p, g, square_avg, acc_delta; write p, square_avg, acc_delta
    # the element-wise part (read p, g, momentum; write p, momentum); the Newton-Schulz GEMMs
    # (O(rows^2 cols) per matrix) dominate, so time, not GB/s, is Muon's figure
    "muon": 5,
    "schedule_free_adamw": 7,  # read y, g, z, v; write y, z, v
}
# optimizers whose contestants get matrices: Adafactor factors its statistics per matrix, Muon
# orthogonalises a matrix's update
MATRIX_OPTIMIZERS = ("adafactor", "muon")

#: The optimizers DeepSpeed has a fused CPU step for (ZeRO-Offload's: csrc/adam, lion, adagrad).
DEEPSPEED_OPTIMIZERS = ("adamw", "adam", "lion", "adagrad")


# (contestant, optimizer) pairs without an implementation, and why
NOT_AVAILABLE = {
    **{(c, o): f"torch.optim has no {title}" for c in ("torch-foreach", "torch-fused", "torch-forloop")
       for o, title in (("lion", "Lion"), ("lamb", "LAMB"))},
    ("arraytrain-bf16", "adafactor"): "Adafactor keeps its factored statistics in the parameters' dtype",
    ("arraytrain-8bit", "adafactor"): "Adafactor keeps its factored statistics in the parameters' dtype",
    ("arraytrain-float8", "adafactor"): "Adafactor keeps its factored statistics in the parameters' dtype",
    **{("bnb-8bit", o): f"bitsandbytes has no 8-bit {o}" for o in
       ("adafactor", "nadam", "radam", "adamax", "adadelta", "muon", "schedule_free_adamw")},
    ("bnb-8bit", "rmsprop"): "bitsandbytes' RMSprop8bit has no centered variant",
    **{(c, o): f"DeepSpeed has no fused CPU {o}" for c in ("deepspeed", "deepspeed-working-bf16",
                                                           "deepspeed-working-f16")
       for o in OPTIMIZERS if o not in DEEPSPEED_OPTIMIZERS},
    ("bnb-8bit", "lamb"): "bitsandbytes' LAMB8bit is another variant (its trust ratio is not optax's)",
    ("torch-fused", "rmsprop"): "torch.optim.RMSprop has no fused implementation",
    ("torch-fused", "adafactor"): "torch.optim.Adafactor has no fused implementation",
    ("numpy", "adafactor"): "no hand-written NumPy Adafactor (factored statistics and two RMS reductions)",
    ("optax", "adagrad"): "optax.adagrad puts eps inside the square root (another variant than torch's)",
    ("optax", "rmsprop"): "optax.rmsprop applies momentum after the learning rate; not configured here",
    ("optax", "adafactor"): "optax.adafactor is the paper's variant (update clipping, parameter scale, "
                            "factoring from 128 rows), not torch's",
    **{("torch-fused", o): f"torch.optim.{title} has no fused implementation"
       for o, title in (("nadam", "NAdam"), ("radam", "RAdam"), ("adamax", "Adamax"), ("adadelta", "Adadelta"))},
    ("optax", "nadam"): "optax.nadam is Dozat's NAdam with a constant beta1 momentum, not torch's momentum_decay "
                        "schedule",
    **{(c, "muon"): "torch.optim.Muon has one implementation, per tensor: see torch-forloop"
       for c in ("torch-foreach", "torch-fused")},
    ("optax", "muon"): "optax.contrib.muon is another variant (bias-corrected momentum, its own shape scaling)",
    **{(c, "schedule_free_adamw"): "torch.optim has no schedule-free AdamW"
       for c in ("torch-foreach", "torch-fused", "torch-forloop")},
}


def slowest(comm, seconds: float) -> float:
    """The largest of every rank's ``seconds`` (a collective finishes when the last rank does)."""
    t = np.array([seconds])
    comm.allreduce(t, "max")
    return float(t[0])


def step_bytes(opt: str, itemsize: int = 4) -> int:
    """Bytes per parameter of a clipped step: the norm pass's read of g + :data:`OPTIMIZERS` accesses."""
    return itemsize * (1 + OPTIMIZERS[opt])


def bnb_optimizer(opt: str, params):
    """bitsandbytes' 8-bit optimizer ``opt`` (AdamW8bit, Adam8bit, SGD8bit, Adagrad8bit, RMSprop8bit,
    Lion8bit) over torch ``params`` (CPU or CUDA) with the benchmark's hyperparameters; bitsandbytes
    is a benchmark-only dependency (an ImportError that says so where it is missing)."""
    try:
        import bitsandbytes as bnb
    except ImportError as exc:
        raise ImportError(f"bitsandbytes: {exc}") from None
    o = bnb.optim
    return {"adamw": lambda: o.AdamW8bit(params, LR, BETAS, EPS, WD),
            "adam": lambda: o.Adam8bit(params, LR, BETAS, EPS),
            "sgd": lambda: o.SGD8bit(params, LR, momentum=MOMENTUM),
            "adagrad": lambda: o.Adagrad8bit(params, **ADAGRAD),
            "rmsprop": lambda: o.RMSprop8bit(params, **RMSPROP),
            "lion": lambda: o.Lion8bit(params, **LION)}[opt]()


def deepspeed_optimizer(opt: str, params):
    """DeepSpeed's fused CPU optimizer ``opt`` (``DeepSpeedCPUAdam`` in AdamW or Adam mode,
    ``DeepSpeedCPULion``, ``DeepSpeedCPUAdagrad``) over CPU torch ``params`` with the benchmark's
    hyperparameters. A benchmark-only dependency (``DS_BUILD_OPS=0 pip install deepspeed ninja``): its
    op is built with g++ on first use (minutes; then cached in ``~/.cache/torch_extensions``); an
    ImportError that says why where it is missing or cannot build."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no GPU: DeepSpeed's CPU accelerator
    try:
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.lion import DeepSpeedCPULion
    except Exception as exc:  # ImportError, or DeepSpeed's own failure to set up its accelerator
        raise ImportError(f"deepspeed: {type(exc).__name__}: {exc}") from None
    make = {"adamw": lambda: DeepSpeedCPUAdam(params, LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True),
            "adam": lambda: DeepSpeedCPUAdam(params, LR, betas=BETAS, eps=EPS, weight_decay=0.0, adamw_mode=False),
            "lion": lambda: DeepSpeedCPULion(params, LION["lr"], betas=LION["betas"],
                                             weight_decay=LION["weight_decay"]),
            "adagrad": lambda: DeepSpeedCPUAdagrad(params, ADAGRAD["lr"], eps=ADAGRAD["eps"],
                                                   weight_decay=ADAGRAD["weight_decay"])}[opt]
    try:
        return make()
    except Exception as exc:  # the JIT build (g++, ninja) failing
        raise ImportError(f"deepspeed: its CPU {opt} op did not build: {type(exc).__name__}: {exc}") from None


def arraytrain_optimizer(opt: str, state_dtype: str | None = None):
    """arraytrain's optimizer ``opt`` with the benchmark's hyperparameters (and ``state_dtype``)."""
    import arraytrain as at

    if state_dtype is not None:
        return arraytrain_optimizer(opt).__class__(**{**arraytrain_optimizer(opt).hyperparameters(),
                                                      "state_dtype": state_dtype})
    return {"adamw": lambda: at.optim.AdamW(LR, BETAS, EPS, WD),
            "adam": lambda: at.optim.Adam(LR, BETAS, EPS),
            "sgd": lambda: at.optim.SGD(LR, momentum=MOMENTUM),
            "adagrad": lambda: at.optim.Adagrad(**ADAGRAD),
            "rmsprop": lambda: at.optim.RMSprop(**RMSPROP),
            "adafactor": lambda: at.optim.Adafactor(**ADAFACTOR),
            "lion": lambda: at.optim.Lion(**LION),
            "lamb": lambda: at.optim.LAMB(**LAMB),
            "nadam": lambda: at.optim.NAdam(**NADAM),
            "radam": lambda: at.optim.RAdam(**RADAM),
            "adamax": lambda: at.optim.Adamax(**ADAMAX),
            "adadelta": lambda: at.optim.Adadelta(**ADADELTA),
            "muon": lambda: at.optim.Muon(**MUON),
            "schedule_free_adamw": lambda: at.optim.ScheduleFreeAdamW(**SCHEDULE_FREE)}[opt]()


def make_engine(opt: str, params: list, grads: list, zero_grad: bool = False, state_dtype: str | None = None,
                working_dtype: str | None = None):
    """A clipping engine over ``params`` (NumPy or CuPy) with ``grads`` already in ``engine.grads``
    (and a ``working_dtype`` working copy of the weights, written by the step)."""
    import arraytrain as at

    engine = at.Engine({f"p{i}": p for i, p in enumerate(params)}, arraytrain_optimizer(opt, state_dtype),
                       max_grad_norm=MAX_NORM, zero_grad_on_step=zero_grad, working_dtype=working_dtype)
    engine.grads.load({f"p{i}": g for i, g in enumerate(grads)})
    return engine


def torch_optimizer(opt: str, ps: list, flag: dict):
    """torch.optim's ``opt`` over ``ps`` with the benchmark's hyperparameters and ``flag`` (foreach/fused)."""
    import torch

    return {"adamw": lambda: torch.optim.AdamW(ps, LR, BETAS, EPS, WD, **flag),
            "adam": lambda: torch.optim.Adam(ps, LR, BETAS, EPS, **flag),
            "sgd": lambda: torch.optim.SGD(ps, LR, momentum=MOMENTUM, **flag),
            "adagrad": lambda: torch.optim.Adagrad(ps, **ADAGRAD, **flag),
            "rmsprop": lambda: torch.optim.RMSprop(ps, **RMSPROP, **flag),
            "adafactor": lambda: torch.optim.Adafactor(ps, **ADAFACTOR, **flag),
            "nadam": lambda: torch.optim.NAdam(ps, **NADAM, **flag),
            "radam": lambda: torch.optim.RAdam(ps, **RADAM, **flag),
            "adamax": lambda: torch.optim.Adamax(ps, **ADAMAX, **flag),
            "adadelta": lambda: torch.optim.Adadelta(ps, **ADADELTA, **flag),
            # torch's Muon is per tensor only and takes no foreach flag (its Newton-Schulz in bfloat16)
            "muon": lambda: torch.optim.Muon(ps, **MUON)}[opt]()


# -- clocks, shapes and bandwidth ------------------------------------------------------------------


def timeit(fn, reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn``."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def best_of(fns: dict, calls: int, repeats: int) -> dict:
    """Each of ``fns``'s best seconds a call: two warm-up calls each (kernels compiled, state and plans
    made), then ``repeats`` rounds of ``calls`` calls, the contestants alternating round by round."""
    for fn in fns.values():
        fn(), fn()
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            best[k] = min(best[k], (time.perf_counter() - t) / calls)
    return best


def split(n: int, parts: int | None = None) -> list[int]:
    """``n`` elements in ``parts`` tensors (None: :data:`N_TENSORS`) as even as integers allow."""
    parts = N_TENSORS if parts is None else parts
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


def matrix(k: int) -> tuple[int, int]:
    """``k`` elements as a 2-D shape, rows <= columns, as square as ``k``'s divisors allow."""
    r = max(int(np.sqrt(k)), 1)
    while r > 1 and k % r:
        r -= 1
    return (r, k // r)


def shapes(n: int, opt: str = "") -> list[tuple[int, ...]]:
    """The shapes of ``n`` elements in :data:`N_TENSORS` tensors: matrices for :data:`MATRIX_OPTIMIZERS`."""
    return [matrix(k) if opt in MATRIX_OPTIMIZERS else (k,) for k in split(n)]


def make_triad(n: int = 50_000_000):
    """A numba triad ``a = b + s*c`` over ``n`` float32 elements (12 B/element), compiled and warm."""
    from numba import njit, prange

    @njit(parallel=True, cache=False)
    def triad(a, b, c, s):
        for i in prange(a.size):
            a[i] = b[i] + s * c[i]

    a, b, c, s = np.zeros(n, np.float32), np.ones(n, np.float32), np.ones(n, np.float32), np.float32(3.0)
    triad(a, b, c, s)
    return (lambda: triad(a, b, c, s)), 12 * n


def make_inplace(n: int = 50_000_000):
    """A numba in-place update ``a += s*b`` over ``n`` float32 elements (12 B/element), compiled and warm.

    An optimizer step is in place too (it writes only arrays it has read), so this is the
    streaming bandwidth such a step can reach; the triad's store to an array it has not
    read costs a write-allocate read that its 12 B/element do not count.
    """
    from numba import njit, prange

    @njit(parallel=True, cache=False)
    def inplace(a, b, s):
        for i in prange(a.size):
            a[i] += s * b[i]

    a, b, s = np.zeros(n, np.float32), np.ones(n, np.float32), np.float32(1e-3)
    inplace(a, b, s)
    return (lambda: inplace(a, b, s)), 12 * n


def first_step_seconds(cache_dir: str, device: str = "cpu") -> float:
    """Seconds from interpreter start to the end of the first ``engine.step`` in a fresh process.

    ``cache_dir`` holds the compiled kernels: numba's cache on the CPU, CuPy's kernel cache on
    ``device="cuda"`` (an empty directory: the cold start; the same again: the warm one).
    """
    xp = "cupy" if device == "cuda" else "numpy"
    code = (
        "import time; t0 = time.perf_counter()\n"
        f"import numpy as np, {xp} as xp, arraytrain as at\n"
        "e = at.Engine({'w': np.ones((256, 256), np.float32)}, at.optim.AdamW(), max_grad_norm=1.0, "
        f"device={device!r})\n"
        "e.step({'w': xp.ones((256, 256), np.float32)})\n"
        "print(time.perf_counter() - t0)\n"
    )
    cache_var = "CUPY_CACHE_DIR" if device == "cuda" else "NUMBA_CACHE_DIR"
    env = dict(os.environ, **{cache_var: cache_dir})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])
