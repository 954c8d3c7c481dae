"""Shared helpers for the arraytrain tests.

Import the plain helpers with ``from conftest import ...`` (pytest puts this
directory on ``sys.path``); fixtures are picked up automatically.
"""

from __future__ import annotations

import os

# pytest-xdist runs one worker process per core: there torch and BLAS take one thread each, set
# before numpy or torch is imported (N workers of N threads on N cores spin against each other: a
# drop-in test of 0.1 s took 2.3 s with both workers in torch). numba keeps its threads, so the
# parallel twins still run on every core.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import functools
import struct
from typing import Callable, NamedTuple

import ml_dtypes
import numba
import numpy as np
import pytest

from arraytrain import Layout
from arraytrain.kernels import cpu

# Flat-buffer sizes every kernel is checked at: empty, single element, below a
# SIMD vector, odd mid-size, and large enough for the parallel (prange) path
# with several reduction chunks and a ragged last block.
SIZES = (0, 1, 7, 1037, 278011)
DTYPES = (np.float32, np.float64)
sizes = pytest.mark.parametrize("n", SIZES)
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
#: Tolerance of float32 weights or state stepped through a bfloat16/float16 copy, fast vs. reference.
LP_TOL = {"rtol": 5e-3, "atol": 5e-3}

# Tiers (numpy's and scipy's "fast" and "full"): the README's command runs the default tier;
# ``--tier slow`` runs the tests marked ``slow`` (exhaustive matrices, builds, subprocess
# races, examples, benchmark smoke runs: CI runs them after the default tier), ``--tier full``
# both. What each tier holds: the README's "Tests" section.
TIERS = ("default", "slow", "full")
def tiered(values, default):
    """A test's parameter values: those in ``default`` run in the default tier, the others carry the
    ``slow`` mark (the exhaustive part of a matrix)."""
    return [v if v in default else pytest.param(v, marks=pytest.mark.slow) for v in values]


#: The dtypes of a test that runs the parallel twins only: float32 in the default tier, float64 in the
#: slow tier (see _float64_parallel_twin).
parallel_dtypes = pytest.mark.parametrize("dtype", tiered(DTYPES, default=(np.float32,)),
                                          ids=lambda d: np.dtype(d).name)


def zero_grad_at(t: int, dtype, odd: bool = False) -> bool:
    """A kernel matrix's ``zero_grad`` at step ``t``: alternating in float32 (on at even ``t``, or odd
    ones with ``odd``), so both compiled variants run, at both twins' sizes; always on in float64,
    the engines' default (``zero_grad_on_step=True``), so float64 compiles the one variant the
    engine tests share (the zeroing is the same store in either dtype)."""
    return t % 2 == int(odd) if np.dtype(dtype) == np.float32 else True


def _float64_parallel_twin(item) -> bool:
    """A float64 case of a kernel matrix at a size that runs the parallel twin (a parameter ``n``
    over SERIAL_BELOW, or a ``layout`` that large): slow tier. The default tier runs float32 at
    every size (both twins) and float64 at the serial twin's sizes, which compiles one float64
    kernel signature instead of two."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    n, dtype = params.get("n"), params.get("dtype")
    if isinstance(params.get("layout"), Layout):
        n = params["layout"].size
    try:
        return isinstance(n, int) and n >= cpu.SERIAL_BELOW and np.dtype(dtype) == np.float64
    except TypeError:
        return False


# The kernels nearly every test file steps (every optimizer's fused update on float32 parameters,
# both twins, the gradient zeroed in the kernel or not, the norm pass and the accumulation),
# compiled ahead by ``arraytrain compile`` in one process per xdist worker before the workers
# start, so that two workers never wait on the same compile (arraytrain.precompile).
WARM_UP = {"optimizers": "all", "dtypes": "float32", "state_dtypes": "float32"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_setupnodes(config, specs):
    """pytest-xdist's controller, before its workers start: :data:`WARM_UP` for a run of the whole
    suite (a run of chosen files or tests compiles what it meets instead)."""
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS or config.getoption("--tier") == "slow":
        return
    from arraytrain import precompile

    summary = precompile.compile_ahead(precompile.jobs(**WARM_UP), processes=len(specs), progress=False)
    config.pluginmanager.get_plugin("terminalreporter").write_line(
        f"arraytrain compile --optimizers all: {summary['signatures']} kernel signatures compiled ahead in "
        f"{summary['seconds']:.0f} s ({summary['processes']} processes)")


def pytest_addoption(parser):
    parser.addoption("--tier", choices=TIERS, default="default",
                     help="default: the tests not marked slow (the README's command); slow: only those; full: all")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _float64_parallel_twin(item):
            item.add_marker(pytest.mark.slow)
    tier = config.getoption("--tier")
    if tier == "full":
        return
    keep, drop = [], []
    for item in items:
        (keep if (item.get_closest_marker("slow") is not None) == (tier == "slow") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# The project's tolerance rule (fast kernels vs. references, arraytrain vs. torch).
TOLERANCES = {
    np.dtype(np.float64): {"rtol": 1e-7, "atol": 1e-7},
    np.dtype(np.float32): {"rtol": 1.3e-6 * 5, "atol": 1e-5 * 5},
}


def rosenbrock(p) -> float:
    """Rosenbrock's function of ``p = (x, y)``: minimum 0 at (1, 1)."""
    x, y = p
    return (1.0 - x) ** 2 + 100.0 * (y - x * x) ** 2


def rosenbrock_grad(p) -> np.ndarray:
    x, y = p
    return np.array([-2.0 * (1.0 - x) - 400.0 * x * (y - x * x), 200.0 * (y - x * x)])


def tol(dtype) -> dict:
    """``{"rtol": ..., "atol": ...}`` for a storage dtype."""
    return dict(TOLERANCES[np.dtype(dtype)])


def assert_close(actual, desired, dtype=None, err_msg: str = "") -> None:
    """``assert_allclose`` at the project's tolerance for ``dtype`` (default: ``actual``'s)."""
    actual, desired = np.asarray(actual), np.asarray(desired)
    dtype = actual.dtype if dtype is None else dtype
    t = tol(dtype)
    a, d = actual.astype(np.float64), desired.astype(np.float64)
    if a.shape == d.shape and np.all(np.abs(a - d) <= t["atol"] + t["rtol"] * np.abs(d)):
        return  # fast path; NaN anywhere fails it and gets assert_allclose's report
    np.testing.assert_allclose(actual, desired, err_msg=err_msg, **t)


def decoded(a) -> np.ndarray:
    """float64 values of a state slot or working copy (uint16 arrays hold bfloat16 bits)."""
    return a.view(ml_dtypes.bfloat16).astype(np.float64) if a.dtype == np.uint16 else a.astype(np.float64)


def padded_shapes(n: int) -> dict:
    """Shapes with zero-size parameters first, in the middle and last around an ``n``-element one."""
    return {"empty0": (0,), "a": (n,), "empty1": (0, 3), "b": (5, 3), "empty2": (0,)}


def padded_layout(n: int) -> Layout:
    return Layout(padded_shapes(n))


@functools.lru_cache(maxsize=64)
def _live_mask(layout: Layout) -> np.ndarray:
    mask = np.zeros(layout.size, dtype=bool)
    for name in layout.names:
        mask[layout.slice(name)] = True
    mask.flags.writeable = False
    return mask


def live_mask(layout: Layout) -> np.ndarray:
    """True where the flat buffer holds a parameter element, False on padding (read-only, cached)."""
    return _live_mask(layout)


def live_indices(layout: Layout) -> np.ndarray:
    return np.flatnonzero(live_mask(layout))


def random_flat(layout: Layout, dtype, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """A flat buffer with standard-normal * ``scale`` parameter elements and zero padding."""
    flat = np.zeros(layout.size, dtype=dtype)
    for name in layout.names:
        s = layout.slice(name)
        flat[s] = rng.standard_normal(s.stop - s.start) * scale
    return flat


def assert_padding_zero(flat: np.ndarray, layout: Layout, what: str = "buffer") -> None:
    pad = np.where(live_mask(layout), 0, flat)
    assert not np.any(pad), f"{what}: padding is not zero ({np.count_nonzero(pad)} non-zero elements)"


# Optimizer configurations shared by the torch comparisons and the convergence
# smoke tests: (name, class name in both arraytrain.optim and torch.optim,
# hyperparameters with torch's names). Learning rates are tuned for gradients
# of scale ~1e3; weight decays, eps and the AMSGrad rows' short beta2 are
# chosen so that each option changes the trajectory beyond the comparison
# tolerance (with beta2=0.999 the running max would not matter in 50 steps).
# Add a row to test a new configuration everywhere. Each row's independent
# oracle (torch.optim, optax, or none) is given by ``oracle(row)`` below:
# test_optim_torch.py runs TORCH_CONFIGS, test_optim_table.py OPTAX_CONFIGS,
# test_convergence.py every row.
def _fallback_adamw():
    """Muon's rows: AdamW for the parameters that are not matrices (a fresh instance per row)."""
    from arraytrain import optim

    return optim.AdamW(lr=1e-2, weight_decay=0.5)


OPTIMIZER_CONFIGS = [
    ("sgd", "SGD", {"lr": 1e-4}),
    ("sgd_wd", "SGD", {"lr": 1e-4, "weight_decay": 10.0}),
    ("sgd_momentum", "SGD", {"lr": 1e-4, "momentum": 0.9}),
    ("sgd_dampening", "SGD", {"lr": 1e-4, "momentum": 0.9, "dampening": 0.3}),
    ("sgd_nesterov", "SGD", {"lr": 1e-4, "momentum": 0.9, "nesterov": True}),
    ("sgd_nesterov_wd", "SGD", {"lr": 1e-4, "momentum": 0.8, "nesterov": True, "weight_decay": 10.0}),
    ("adam", "Adam", {"lr": 1e-2}),
    ("adam_betas_eps", "Adam", {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 5.0}),
    ("adam_amsgrad", "Adam", {"lr": 1e-2, "betas": (0.9, 0.9), "amsgrad": True}),
    ("adam_wd", "Adam", {"lr": 1e-2, "weight_decay": 10.0}),
    ("adam_wd_amsgrad", "Adam", {"lr": 1e-2, "betas": (0.9, 0.9), "weight_decay": 10.0, "amsgrad": True}),
    ("adamw", "AdamW", {"lr": 1e-2, "weight_decay": 0.5}),
    ("adamw_amsgrad", "AdamW", {"lr": 1e-2, "betas": (0.9, 0.9), "weight_decay": 0.5, "amsgrad": True}),
    # Adagrad / RMSprop: torch's names; the eps and initial-accumulator values are of the
    # gradients' scale (sqrt of the accumulated squares ~1e3), so that they change the trajectory
    ("adagrad", "Adagrad", {"lr": 5e-2}),
    ("adagrad_lr_decay", "Adagrad", {"lr": 5e-2, "lr_decay": 0.1}),
    ("adagrad_init_acc_eps", "Adagrad", {"lr": 0.1, "initial_accumulator_value": 1e6, "eps": 300.0}),
    ("adagrad_wd", "Adagrad", {"lr": 5e-2, "lr_decay": 0.05, "weight_decay": 10.0}),
    ("rmsprop", "RMSprop", {"lr": 3e-3}),
    ("rmsprop_alpha_eps", "RMSprop", {"lr": 1e-2, "alpha": 0.9, "eps": 100.0}),
    ("rmsprop_momentum", "RMSprop", {"lr": 3e-4, "momentum": 0.9}),
    ("rmsprop_centered", "RMSprop", {"lr": 3e-3, "centered": True}),
    ("rmsprop_centered_momentum_wd", "RMSprop", {"lr": 1e-3, "momentum": 0.5, "centered": True, "weight_decay": 10.0}),
    # maximize (torch negates the gradient first, then adds L2 decay): every optimizer has it;
    # these rows meet torch, the others are checked by test_optim_table's sign-flip identity
    ("sgd_momentum_wd_maximize", "SGD", {"lr": 1e-4, "momentum": 0.9, "weight_decay": 10.0, "maximize": True}),
    ("adam_wd_maximize", "Adam", {"lr": 1e-2, "weight_decay": 10.0, "maximize": True}),
    ("adamw_maximize", "AdamW", {"lr": 1e-2, "weight_decay": 0.5, "maximize": True}),
    ("adagrad_wd_maximize", "Adagrad", {"lr": 5e-2, "lr_decay": 0.05, "weight_decay": 10.0, "maximize": True}),
    ("rmsprop_centered_maximize", "RMSprop", {"lr": 1e-3, "momentum": 0.5, "centered": True, "maximize": True}),
    # Lion / LAMB: optax's hyperparameters (torch has neither) under the torch names used by every
    # optimizer here (betas = (b1, b2)); LAMB's step is lr * ||p|| per parameter
    ("lion", "Lion", {"lr": 2e-2, "weight_decay": 0.0}),
    ("lion_betas_wd", "Lion", {"lr": 5e-3, "betas": (0.5, 0.95), "weight_decay": 2.0}),
    ("lamb", "LAMB", {"lr": 0.1}),
    ("lamb_wd_eps", "LAMB", {"lr": 0.1, "betas": (0.8, 0.99), "eps": 1e-2, "eps_root": 1e-4, "weight_decay": 0.3}),
    # Adafactor / Sophia: compared with torch (zero-size parameters excluded) in test_adafactor.py
    # and with the reference in test_sophia.py; SAM takes two windows a step (test_sam.py)
    ("adafactor", "Adafactor", {"lr": 0.3}),
    ("adafactor_wd", "Adafactor", {"lr": 0.3, "weight_decay": 0.1, "d": 2.0}),
    ("sophia", "Sophia", {"lr": 2e-2, "betas": (0.5, 0.99), "weight_decay": 0.0}),
    # NAdam / RAdam / Adamax / Adadelta: torch's names. RAdam moves by lr * m (~1e3) until
    # rho_t > 5, hence its small lr and short beta2 (rectified from step 6 on); Adadelta's
    # first steps are ~sqrt(eps), hence its lr
    ("nadam", "NAdam", {"lr": 1e-2}),
    ("nadam_betas_eps", "NAdam", {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 5.0}),
    ("nadam_momentum_decay_wd", "NAdam", {"lr": 1e-2, "momentum_decay": 6e-3, "weight_decay": 10.0}),
    ("nadamw", "NAdam", {"lr": 1e-2, "weight_decay": 0.5, "decoupled_weight_decay": True}),
    ("nadam_wd_maximize", "NAdam", {"lr": 1e-2, "weight_decay": 10.0, "maximize": True}),
    ("radam", "RAdam", {"lr": 4e-4, "betas": (0.8, 0.9)}),
    ("radam_eps", "RAdam", {"lr": 5e-4, "betas": (0.5, 0.9), "eps": 100.0}),
    ("radam_wd", "RAdam", {"lr": 4e-4, "betas": (0.8, 0.9), "weight_decay": 10.0}),
    ("radamw", "RAdam", {"lr": 4e-4, "betas": (0.8, 0.9), "weight_decay": 0.5, "decoupled_weight_decay": True}),
    ("radam_wd_maximize", "RAdam", {"lr": 4e-4, "betas": (0.8, 0.9), "weight_decay": 10.0, "maximize": True}),
    ("adamax", "Adamax", {"lr": 2e-2}),
    ("adamax_betas_eps_wd", "Adamax", {"lr": 2e-2, "betas": (0.8, 0.9), "eps": 100.0, "weight_decay": 10.0}),
    ("adamax_wd_maximize", "Adamax", {"lr": 2e-2, "weight_decay": 10.0, "maximize": True}),
    ("adadelta", "Adadelta", {"lr": 10.0}),
    ("adadelta_eps", "Adadelta", {"lr": 5.0, "eps": 1e-5}),
    ("adadelta_rho_wd", "Adadelta", {"lr": 10.0, "rho": 0.8, "weight_decay": 10.0}),
    ("adadelta_wd_maximize", "Adadelta", {"lr": 10.0, "weight_decay": 10.0, "maximize": True}),
]

# Muon and Schedule-Free AdamW. Muon takes the matrices (torch refuses other parameters): its
# rows give an AdamW fallback for the rest and are compared with torch.optim.Muon + AdamW in
# test_muon_torch.py (oracle "none" here); Schedule-Free AdamW meets optax.contrib.
OPTIMIZER_CONFIGS += [
    ("muon", "Muon", {"lr": 0.01, "fallback": _fallback_adamw()}),
    ("muon_plain_wd_maximize", "Muon", {"lr": 0.02, "momentum": 0.9, "nesterov": False, "weight_decay": 0.5,
                                        "adjust_lr_fn": "match_rms_adamw", "fallback": _fallback_adamw(),
                                        "maximize": True}),
    ("schedule_free_adamw", "ScheduleFreeAdamW", {"lr": 1e-2}),
    # (a warm-up holds optax's first step at lr 0, which the convergence test's "better after every
    # step" would not take: test_schedule_free.py meets optax with warm-ups)
    ("schedule_free_adamw_wd_power", "ScheduleFreeAdamW", {"lr": 2e-2, "betas": (0.8, 0.99), "eps": 1e-3,
                                                           "weight_decay": 0.5, "weight_lr_power": 1.0}),
]


class Oracle(NamedTuple):
    """The independent implementation a row of OPTIMIZER_CONFIGS is compared with.

    ``kind``: "torch" (``torch.optim.<class name>(params, foreach=False, **kwargs)``,
    slots compared under torch's state keys), "optax" (``make(**kwargs)`` builds the
    optax transformation from the row's hyperparameters, ``slots(opt_state)`` maps
    arraytrain slot names to optax's state trees, ``count(opt_state)`` is its step), or
    "none".
    """

    kind: str
    make: Callable | None = None
    slots: Callable | None = None
    count: Callable | None = None


def _optax_lion(lr, betas=(0.9, 0.99), weight_decay=1e-3):
    import optax

    return optax.lion(learning_rate=lr, b1=betas[0], b2=betas[1], weight_decay=weight_decay)


def _optax_lamb(lr, betas=(0.9, 0.999), eps=1e-6, eps_root=0.0, weight_decay=0.0):
    import optax

    return optax.lamb(learning_rate=lr, b1=betas[0], b2=betas[1], eps=eps, eps_root=eps_root,
                      weight_decay=weight_decay)


TORCH = Oracle("torch")
# per optimizer class; a row's entry in ORACLE_BY_ROW wins
ORACLE_BY_CLASS = {
    "Lion": Oracle("optax", _optax_lion, lambda st: {"exp_avg": st[0].mu}, lambda st: int(st[0].count)),
    "LAMB": Oracle("optax", _optax_lamb, lambda st: {"exp_avg": st[0].mu, "exp_avg_sq": st[0].nu},
                   lambda st: int(st[0].count)),
}
ORACLE_BY_ROW: dict[str, Oracle] = {}
ORACLE_BY_CLASS.update({"Adafactor": Oracle("none"), "Sophia": Oracle("none")})


def _optax_schedule_free_adamw(lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, warmup_steps=0,
                               weight_lr_power=2.0):
    import optax

    return optax.contrib.schedule_free_adamw(learning_rate=lr, warmup_steps=warmup_steps or None, b1=betas[0],
                                             b2=betas[1], eps=eps, weight_decay=weight_decay,
                                             weight_lr_power=weight_lr_power)


def _schedule_free_slots(st):
    # optax keeps one max_lr and weight sum; arraytrain one per parameter (each equal to optax's here)
    return {"z": st.z, "exp_avg_sq": st.base_optimizer_state[0].nu,
            "max_lr": {k: st.max_lr for k in st.z}, "weight_sum": {k: st.weight_sum for k in st.z}}


ORACLE_BY_CLASS.update({
    "Muon": Oracle("none"),  # test_muon_torch.py: torch.optim.Muon on the matrices, AdamW on the rest
    "ScheduleFreeAdamW": Oracle("optax", _optax_schedule_free_adamw, _schedule_free_slots,
                                lambda st: int(st.step_count) - 1),
})


def oracle(row) -> Oracle:
    """The oracle of a row ``(name, class name, kwargs)`` of OPTIMIZER_CONFIGS (default: torch)."""
    name, cls_name, _ = row
    return ORACLE_BY_ROW.get(name, ORACLE_BY_CLASS.get(cls_name, TORCH))


TORCH_CONFIGS = [row for row in OPTIMIZER_CONFIGS if oracle(row).kind == "torch"]
OPTAX_CONFIGS = [row for row in OPTIMIZER_CONFIGS if oracle(row).kind == "optax"]


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240611)


@pytest.fixture(params=["cpu", "cuda"])
def family(request):
    """The fast kernel family a kernel-vs-reference test checks against the reference twins.

    "cpu": :mod:`arraytrain.kernels.cpu` (numba). "cuda": the CUDA family behind NumPy
    arguments (:data:`cuda_family.ON_DEVICE`: arrays copied to the GPU and back), so it runs
    the CPU family's tests unchanged (same sizes, steps, per-parameter values, working
    copies, bfloat16 state, masks, NaN/Inf cases and tolerances); skipped without a usable GPU.
    """
    if request.param == "cpu":
        return cpu
    from cuda_family import ON_DEVICE, require_cuda

    require_cuda()
    return ON_DEVICE


@pytest.fixture(params=["cpu", "cuda"])
def numba_family(request, monkeypatch):
    """What ``kernels="numba"`` runs on NumPy arrays inside a compressor or a GradientPredictor.

    "cpu": the numba family, as always. "cuda": the CUDA family behind NumPy arguments, by
    patching the family lookup of :mod:`arraytrain.compress` and :mod:`arraytrain.phase.predict`,
    so their tests run the CUDA kernels unchanged; skipped without a usable GPU. Returns the
    family in use.
    """
    if request.param == "cpu":
        return cpu
    from cuda_family import ON_DEVICE, require_cuda

    from arraytrain.kernels.interface import family as lookup

    require_cuda()

    def on_device(backend, impl="numba", domain=None):
        return ON_DEVICE if (backend, impl) == ("numpy", "numba") else lookup(backend, impl, domain)

    for where in ("arraytrain.compress._base.family", "arraytrain.phase.predict.family"):
        monkeypatch.setattr(where, on_device)
    return ON_DEVICE


@pytest.fixture
def restore_threads():
    """numba's thread count put back after a test that changes it."""
    before = numba.get_num_threads()
    yield
    numba.set_num_threads(before)


def _frozen(x):
    """A value made comparable bit for bit: arrays as dtype + bytes, floats as their 64 bits."""
    if isinstance(x, np.ndarray):
        return ("array", x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, (float, np.floating)):
        return ("float", struct.pack("<d", float(x)))
    if isinstance(x, dict):
        return ("dict", tuple((k, _frozen(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_frozen(v) for v in x))
    return x


def engine_snapshot(engine) -> dict:
    """Everything a refused call must leave unchanged, bit for bit (dtype included).

    Two snapshots compare equal exactly when params, grads, every optimizer
    slot, the step count, the accumulation window, the skip counter and SAM's
    flag, the schedule's state, the loss scale and its growth tracker, the
    compressor's state (call count, residuals, warm-start factors), the pruning
    mask, the working copy and the optimizer's scalar state are all bitwise equal.
    """

    def bits(a):
        return a.dtype.str.encode() + a.tobytes()

    return {
        "params": bits(engine.params.flat),
        "grads": bits(engine.grads.flat),
        "slots": {k: bits(b.flat) for k, b in engine.state.slots.items()},
        "step": engine.state.step,
        "micro": engine.micro_batches,
        "wsum": engine.counters.weight_sum,
        "layout": engine.layout,
        "skips": engine.consecutive_skips,
        "perturbed": engine.perturbed,
        # as text, so that every value of a snapshot compares with == and with assert_array_equal
        "schedule": None if engine.schedule is None else repr(_frozen(engine.schedule.state_dict())),
        "loss_scaler": None if engine.loss_scaler is None else repr(_frozen(engine.loss_scaler.state_dict())),
        "compression": None if engine.compressor is None else repr(_frozen(engine.compressor.state_dict())),
        "mask": None if engine.mask is None else bits(engine.mask.flat),
        "working": None if engine.working is None else bits(engine.working.flat),
        "scalars": repr(_frozen(engine.state.scalars)),
    }
