"""The bad-input table: every refused call raises the right error, names the culprit, changes nothing.

Each case is ``(id, call, exc, match)``: ``call(engine)`` performs one bad call
(on the engine, or a constructor next to it), ``exc`` is the expected
exception type (or tuple), and ``match`` a substring (or tuple of substrings)
the message must contain -- normally the parameter's name. After every case
the engine's params, grads, optimizer state, step count and accumulation
window are compared bit for bit with a snapshot taken before the call.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np
import pytest

from arraytrain import (
    AccumulationConfig,
    AliasingError,
    ArgumentTypeError,
    BackendError,
    BackendUnavailableError,
    DTypeError,
    Engine,
    FlatBuffer,
    GradientAccumulator,
    HyperparameterError,
    Layout,
    LayoutError,
    MissingGradientError,
    ReadOnlyError,
    ShapeMismatchError,
    StateDictError,
    UnknownParameterError,
)
from conftest import engine_snapshot

from arraytrain.optim import LAMB, SGD, Adagrad, Adam, AdamW, Lion, RMSprop
from arraytrain.optim import SAM, Adafactor, Sophia
from arraytrain.optim import Adadelta, Adamax, NAdam, RAdam

SHAPES = {"W": (2, 3), "z": (0,), "b": (3,)}


class Case(NamedTuple):
    id: str
    call: Callable[[Engine], object]
    exc: type | tuple
    match: str | tuple


class CudaDLPack:
    """A DLPack exporter on CUDA device 0 (what a CuPy/torch CUDA array reports)."""

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kwargs):
        raise AssertionError("must not be exported to a CPU engine")


def _good():
    return {"W": np.full((2, 3), 0.5), "z": np.zeros(0), "b": np.full(3, -0.25)}


def _with(**over):
    """Call ``engine.step`` with good gradients, some replaced (value None removes the name)."""
    def call(e):
        grads = _good()
        for k, v in over.items():
            if v is None:
                grads.pop(k)
            else:
                grads[k] = v
        return e.step(grads)
    return call


def _step_with(make):
    """Like :func:`_with`, for a replacement built from the engine (aliasing cases)."""
    def call(e):
        name, arr = make(e)
        return e.step({**_good(), name: arr})
    return call


def _torch_alias(e):
    torch = pytest.importorskip("torch")
    return "b", torch.from_numpy(e.params["b"])


def _torch_requires_grad(e):
    torch = pytest.importorskip("torch")
    return "b", torch.zeros(3, dtype=torch.float64, requires_grad=True)


def _read_only_flatbuffer(e):
    lay = Layout(SHAPES)
    flat = np.zeros(lay.size, np.float32)
    flat.flags.writeable = False
    return FlatBuffer(lay, flat)


def _read_only_view_flatbuffer(e):
    lay = Layout(SHAPES)
    base = np.zeros(lay.size, np.float32)
    view = base[:]
    view.flags.writeable = False
    return Engine(FlatBuffer(lay, view), SGD())


def _engine_with(**kw):
    return lambda e: Engine({"x": np.zeros(2)}, SGD(), **kw)


def _bad_state(key, value):
    def call(e):
        sd = e.state_dict()
        section = sd["optimizer"] if key == "step" else sd["accumulation"]
        section[key] = value
        return e.load_state_dict(sd)
    return call


def _bad_scalars(value):
    """Load a state whose optimizer scalars are ``value`` (the table's engine is an Adam: it keeps none)."""
    def call(e):
        sd = e.state_dict()
        sd["optimizer"]["scalars"] = value
        return e.load_state_dict(sd)
    return call


def _bad_mu_product(value):
    """A NAdam engine refuses a saved ``mu_product`` of ``value`` and keeps its own state."""
    def call(e):
        nadam = Engine({n: np.zeros(s, np.float32) for n, s in SHAPES.items()}, NAdam(lr=0.1))
        nadam.step({n: np.ones(s) for n, s in SHAPES.items()})
        sd = nadam.state_dict()
        sd["optimizer"]["scalars"]["mu_product"] = value
        before = engine_snapshot(nadam)
        try:
            return nadam.load_state_dict(sd)
        finally:
            assert engine_snapshot(nadam) == before
    return call


def _accumulator_step(grads, weight=None):
    def call(e):
        acc = GradientAccumulator(AccumulationConfig(2))
        acc.register("w", (3,))
        return acc.step(grads, weight=weight)
    return call


NAN, INF = math.nan, math.inf

CASES: list[Case] = [
    # -- wrong shape (including zero-size and 0-d) -------------------------------------------
    Case("shape-transposed", _with(W=np.ones((3, 2))), ShapeMismatchError, ("'W'", "(3, 2)", "(2, 3)")),
    Case("shape-flattened", _with(W=np.ones(6)), ShapeMismatchError, "'W'"),
    Case("shape-extra-dim", _with(b=np.ones((1, 3))), ShapeMismatchError, "'b'"),
    Case("shape-scalar", _with(b=np.float64(1.0)), ShapeMismatchError, "'b'"),
    Case("shape-zero-size-param", _with(z=np.ones(1)), ShapeMismatchError, "'z'"),
    Case("shape-zero-size-grad", _with(b=np.ones(0)), ShapeMismatchError, "'b'"),
    # -- integer, bool, complex (and other non-float) gradients --------------------------------
    Case("dtype-int8", _with(b=np.ones(3, np.int8)), DTypeError, ("'b'", "int8")),
    Case("dtype-int32", _with(b=np.ones(3, np.int32)), DTypeError, ("'b'", "int32")),
    Case("dtype-int64", _with(W=np.ones((2, 3), np.int64)), DTypeError, ("'W'", "int64")),
    Case("dtype-uint16", _with(b=np.ones(3, np.uint16)), DTypeError, "'b'"),
    Case("dtype-bool", _with(b=np.ones(3, bool)), DTypeError, ("'b'", "bool")),
    Case("dtype-complex64", _with(b=np.ones(3, np.complex64)), DTypeError, ("'b'", "complex64")),
    Case("dtype-complex128", _with(W=np.ones((2, 3), np.complex128)), DTypeError, "'W'"),
    Case("dtype-int-list", _with(b=[1, 2, 3]), DTypeError, "'b'"),
    Case("dtype-str", _with(b="abc"), DTypeError, "'b'"),
    Case("not-an-array-object", _with(b=object()), BackendError, "'b'"),
    Case("not-an-array-dict", _with(b={"x": 1.0}), BackendError, "'b'"),
    Case("torch-requires-grad", _step_with(_torch_requires_grad), BackendError, ("'b'", "detach")),
    # -- unknown and missing names -------------------------------------------------------------
    Case("unknown-name", _with(nope=np.ones(3)), UnknownParameterError, "'nope'"),
    Case("unknown-name-int-key", lambda e: e.step({**_good(), 0: np.ones(3)}), UnknownParameterError,
         ("0:", "known")),
    Case("missing-name", _with(b=None), MissingGradientError, ("'b'", "missing='error'", "missing='zero'")),
    Case("missing-zero-size-name", _with(z=None), MissingGradientError, ("'z'", "missing='error'")),
    Case("missing-all", lambda e: e.step({}), MissingGradientError, ("'W'", "'b'", "'z'")),
    # -- mixed backends: NumPy next to a CUDA-device DLPack object ------------------------------
    Case("mixed-cuda-dlpack", _with(b=CudaDLPack()), (BackendError, BackendUnavailableError), "'b'"),
    Case("mixed-cuda-dlpack-flatbuffer",
         lambda e: FlatBuffer.from_arrays({"a": np.ones(2), "c": CudaDLPack()}),
         (BackendError, BackendUnavailableError), "'c'"),
    # -- read-only flat buffer -----------------------------------------------------------------
    Case("read-only-flat", _read_only_flatbuffer, ReadOnlyError, ("flat", "writable")),
    Case("read-only-view-flat", _read_only_view_flatbuffer, ReadOnlyError, "writable"),
    # -- aliasing the engine's buffers -----------------------------------------------------------
    Case("alias-param-view", _step_with(lambda e: ("W", e.params["W"])), AliasingError, ("'W'", "engine.grads")),
    Case("alias-param-other-name", _step_with(lambda e: ("b", e.params.flat[:3])), AliasingError, "'b'"),
    Case("alias-param-strided", _step_with(lambda e: ("W", e.params.flat[0:12:2].reshape(2, 3))),
         AliasingError, "'W'"),
    Case("alias-param-torch", _step_with(_torch_alias), AliasingError, "'b'"),
    Case("alias-grad-view", _step_with(lambda e: ("b", e.grads["b"])), AliasingError, "'b'"),
    Case("alias-grad-flat", _step_with(lambda e: ("W", e.grads.flat[16:22].reshape(2, 3))), AliasingError, "'W'"),
    # -- hyperparameters out of range, at construction -----------------------------------------
    Case("sgd-lr-negative", lambda e: SGD(lr=-0.1), HyperparameterError, "lr"),
    Case("adam-lr-negative", lambda e: Adam(lr=-1e-3), HyperparameterError, "lr"),
    Case("adamw-lr-nan", lambda e: AdamW(lr=NAN), HyperparameterError, "lr"),
    Case("adam-lr-inf", lambda e: Adam(lr=INF), HyperparameterError, "lr"),
    Case("adam-beta1-one", lambda e: Adam(betas=(1.0, 0.999)), HyperparameterError, "betas[0]"),
    Case("adam-beta1-negative", lambda e: Adam(betas=(-0.1, 0.999)), HyperparameterError, "betas[0]"),
    Case("adam-beta2-one", lambda e: Adam(betas=(0.9, 1.0)), HyperparameterError, "betas[1]"),
    Case("adamw-beta2-above", lambda e: AdamW(betas=(0.9, 1.5)), HyperparameterError, "betas[1]"),
    Case("adam-betas-not-pair", lambda e: Adam(betas=(0.9,)), HyperparameterError, "betas"),
    Case("adam-eps-zero", lambda e: Adam(eps=0.0), HyperparameterError, "eps"),
    Case("adamw-eps-negative", lambda e: AdamW(eps=-1e-8), HyperparameterError, "eps"),
    Case("adam-weight-decay-negative", lambda e: Adam(weight_decay=-0.1), HyperparameterError, "weight_decay"),
    Case("adam-amsgrad-not-bool", lambda e: Adam(amsgrad=1), HyperparameterError, "amsgrad"),
    Case("sgd-momentum-negative", lambda e: SGD(momentum=-0.5), HyperparameterError, "momentum"),
    Case("sgd-dampening-above-one", lambda e: SGD(dampening=1.5), HyperparameterError, "dampening"),
    Case("sgd-nesterov-without-momentum", lambda e: SGD(nesterov=True), HyperparameterError, "nesterov"),
    Case("adagrad-lr-negative", lambda e: Adagrad(lr=-0.1), HyperparameterError, "lr"),
    Case("adagrad-lr-decay-negative", lambda e: Adagrad(lr_decay=-1e-3), HyperparameterError, "lr_decay"),
    Case("adagrad-weight-decay-negative", lambda e: Adagrad(weight_decay=-1.0), HyperparameterError, "weight_decay"),
    Case("adagrad-initial-accumulator-negative", lambda e: Adagrad(initial_accumulator_value=-0.1),
         HyperparameterError, "initial_accumulator_value"),
    Case("adagrad-eps-zero", lambda e: Adagrad(eps=0.0), HyperparameterError, "eps"),
    Case("rmsprop-lr-nan", lambda e: RMSprop(lr=NAN), HyperparameterError, "lr"),
    Case("rmsprop-alpha-one", lambda e: RMSprop(alpha=1.0), HyperparameterError, "alpha"),
    Case("rmsprop-alpha-negative", lambda e: RMSprop(alpha=-0.5), HyperparameterError, "alpha"),
    Case("rmsprop-eps-negative", lambda e: RMSprop(eps=-1e-8), HyperparameterError, "eps"),
    Case("rmsprop-momentum-negative", lambda e: RMSprop(momentum=-0.9), HyperparameterError, "momentum"),
    Case("rmsprop-weight-decay-inf", lambda e: RMSprop(weight_decay=INF), HyperparameterError, "weight_decay"),
    Case("rmsprop-centered-not-bool", lambda e: RMSprop(centered=1), HyperparameterError, "centered"),
    Case("lion-lr-negative", lambda e: Lion(lr=-1e-4), HyperparameterError, "lr"),
    Case("lion-beta1-one", lambda e: Lion(betas=(1.0, 0.99)), HyperparameterError, "betas[0]"),
    Case("lion-beta2-negative", lambda e: Lion(betas=(0.9, -0.1)), HyperparameterError, "betas[1]"),
    Case("lion-betas-not-pair", lambda e: Lion(betas=0.9), HyperparameterError, "betas"),
    Case("lion-weight-decay-negative", lambda e: Lion(weight_decay=-1e-3), HyperparameterError, "weight_decay"),
    Case("lamb-lr-inf", lambda e: LAMB(lr=INF), HyperparameterError, "lr"),
    Case("lamb-beta1-above", lambda e: LAMB(betas=(1.5, 0.999)), HyperparameterError, "betas[0]"),
    Case("lamb-beta2-one", lambda e: LAMB(betas=(0.9, 1.0)), HyperparameterError, "betas[1]"),
    Case("lamb-eps-zero", lambda e: LAMB(eps=0.0), HyperparameterError, "eps"),
    Case("lamb-eps-root-negative", lambda e: LAMB(eps_root=-1e-8), HyperparameterError, "eps_root"),
    Case("lamb-weight-decay-str", lambda e: LAMB(weight_decay="0.01"), HyperparameterError, "weight_decay"),
    Case("lamb-overrides-unknown-key", lambda e: LAMB(overrides={"*.bias": {"betas": 0.5}}), HyperparameterError,
         ("overrides", "'betas'")),
    Case("adafactor-lr-negative", lambda e: Adafactor(lr=-0.1), HyperparameterError, "lr"),
    Case("adafactor-beta2-decay-positive", lambda e: Adafactor(beta2_decay=0.5), HyperparameterError, "beta2_decay"),
    Case("adafactor-eps1-negative", lambda e: Adafactor(eps=(-1e-30, 1e-3)), HyperparameterError, "eps[0]"),
    Case("adafactor-eps-not-pair", lambda e: Adafactor(eps=1e-3), HyperparameterError, "eps"),
    Case("adafactor-d-below-one", lambda e: Adafactor(d=0.5), HyperparameterError, "d:"),
    Case("sophia-rho-zero", lambda e: Sophia(rho=0.0), HyperparameterError, "rho"),
    Case("sophia-beta2-one", lambda e: Sophia(betas=(0.9, 1.0)), HyperparameterError, "betas[1]"),
    Case("sophia-bs-negative", lambda e: Sophia(bs=-1.0), HyperparameterError, "bs"),
    Case("sam-rho-negative", lambda e: SAM(SGD(), rho=-0.05), HyperparameterError, "rho"),
    Case("nadam-lr-negative", lambda e: NAdam(lr=-1e-3), HyperparameterError, "lr"),
    Case("nadam-beta1-one", lambda e: NAdam(betas=(1.0, 0.999)), HyperparameterError, "betas[0]"),
    Case("nadam-eps-zero", lambda e: NAdam(eps=0.0), HyperparameterError, "eps"),
    Case("nadam-momentum-decay-negative", lambda e: NAdam(momentum_decay=-4e-3), HyperparameterError,
         "momentum_decay"),
    Case("nadam-decoupled-not-bool", lambda e: NAdam(decoupled_weight_decay=1), HyperparameterError,
         "decoupled_weight_decay"),
    Case("radam-beta2-one", lambda e: RAdam(betas=(0.9, 1.0)), HyperparameterError, "betas[1]"),
    Case("radam-weight-decay-negative", lambda e: RAdam(weight_decay=-0.1), HyperparameterError, "weight_decay"),
    Case("radam-decoupled-not-bool", lambda e: RAdam(decoupled_weight_decay="yes"), HyperparameterError,
         "decoupled_weight_decay"),
    Case("adamax-eps-zero", lambda e: Adamax(eps=0.0), HyperparameterError, "eps"),
    Case("adamax-lr-inf", lambda e: Adamax(lr=INF), HyperparameterError, "lr"),
    Case("adamax-state-dtype-float16", lambda e: Adamax(state_dtype="float16"), HyperparameterError, "state_dtype"),
    Case("adadelta-rho-above-one", lambda e: Adadelta(rho=1.5), HyperparameterError, "rho"),
    Case("adadelta-rho-negative", lambda e: Adadelta(rho=-0.1), HyperparameterError, "rho"),
    Case("adadelta-eps-zero", lambda e: Adadelta(eps=0.0), HyperparameterError, "eps"),
    Case("adadelta-lr-nan", lambda e: Adadelta(lr=NAN), HyperparameterError, "lr"),
    Case("adadelta-overrides-rho", lambda e: Adadelta(overrides={"*": {"rho": 0.5}}), HyperparameterError,
         ("overrides", "'rho'")),
    Case("sam-base-not-optimizer", lambda e: SAM("sgd"), HyperparameterError, "base"),
    Case("engine-accumulation-steps-0", _engine_with(accumulation_steps=0), HyperparameterError,
         "accumulation_steps"),
    Case("engine-accumulation-steps-float", _engine_with(accumulation_steps=2.0), HyperparameterError,
         "accumulation_steps"),
    Case("engine-max-grad-norm-0", _engine_with(max_grad_norm=0.0), HyperparameterError, "max_grad_norm"),
    Case("engine-max-grad-norm-negative", _engine_with(max_grad_norm=-1.0), HyperparameterError,
         "max_grad_norm"),
    Case("engine-max-grad-norm-inf", _engine_with(max_grad_norm=INF), HyperparameterError, "max_grad_norm"),
    Case("engine-reduction", _engine_with(reduction="avg"), HyperparameterError, ("reduction", "avg")),
    Case("engine-missing-policy", _engine_with(missing="drop"), HyperparameterError, ("missing", "drop")),
    Case("engine-optimizer-type", lambda e: Engine({"x": np.zeros(2)}, "adam"), TypeError, "optimizer"),
    Case("engine-params-type", lambda e: Engine([np.zeros(2)], SGD()), TypeError, "params"),
    Case("engine-params-int", lambda e: Engine({"x": np.zeros(2, np.int32)}, SGD()), DTypeError, "'x'"),
    Case("config-accumulation-steps-0", lambda e: AccumulationConfig(accumulation_steps=0),
         HyperparameterError, "accumulation_steps"),
    Case("config-max-grad-norm-0", lambda e: AccumulationConfig(max_grad_norm=0.0), HyperparameterError,
         "max_grad_norm"),
    # -- weight <= 0 (checked before anything is written) ---------------------------------------
    Case("weight-zero", lambda e: e.step(_good(), weight=0), HyperparameterError, "weight"),
    Case("weight-negative", lambda e: e.step(_good(), weight=-2.0), HyperparameterError, "weight"),
    Case("weight-nan", lambda e: e.step(_good(), weight=NAN), HyperparameterError, "weight"),
    Case("weight-zero-copy-path", lambda e: e.step(weight=0.0), HyperparameterError, "weight"),
    Case("accumulator-weight-zero", _accumulator_step({"w": np.ones(3)}, weight=0.0), HyperparameterError,
         "weight"),
    # -- non-mapping gradients -------------------------------------------------------------------
    Case("grads-list", lambda e: e.step([np.ones((2, 3)), np.ones(3)]), ArgumentTypeError, ("mapping", "list")),
    Case("grads-array", lambda e: e.step(np.ones(3)), ArgumentTypeError, ("mapping", "ndarray")),
    Case("grads-pairs", lambda e: e.step(tuple(_good().items())), ArgumentTypeError, "mapping"),
    Case("accumulator-grads-list", _accumulator_step([np.ones(3)]), ArgumentTypeError, "mapping"),
    # -- bad state dicts -----------------------------------------------------------------------------
    Case("state-step-negative", _bad_state("step", -1), StateDictError, "step"),
    Case("state-micro-out-of-range", _bad_state("micro_batches", 5), StateDictError, "micro_batches"),
    Case("state-weight-sum-inf", _bad_state("weight_sum", INF), StateDictError, "weight_sum"),
    Case("state-weight-sum-bool", _bad_state("weight_sum", True), StateDictError, "weight_sum"),
    Case("state-scalars-unexpected", _bad_scalars({"mu_product": 0.5}), StateDictError, ("scalars", "mu_product")),
    Case("state-scalars-not-mapping", _bad_scalars([0.5]), StateDictError, ("scalars", "list")),
    Case("state-mu-product-nan", _bad_mu_product(NAN), StateDictError, "mu_product"),
    Case("state-mu-product-str", _bad_mu_product("0.5"), StateDictError, "mu_product"),
    # -- layouts -------------------------------------------------------------------------------------
    Case("layout-float-dim", lambda e: Layout({"w": (2.5,)}), LayoutError, "'w'"),
    Case("layout-str-dim", lambda e: Layout({"w": ("3",)}), LayoutError, "'w'"),
    Case("layout-align-bool", lambda e: Layout({"w": (3,)}, align=True), LayoutError, "align"),
]

MIN_CASES = 60


def _make_engine() -> Engine:
    """A float32 engine mid-window with non-trivial optimizer state."""
    e = Engine({n: np.zeros(s, np.float32) for n, s in SHAPES.items()}, Adam(lr=0.1, amsgrad=True),
               accumulation_steps=2)
    rng = np.random.default_rng(0)
    for _ in range(3):
        e.step({n: rng.standard_normal(s) for n, s in SHAPES.items()}, weight=1.5)
    assert e.state.step == 1 and e.micro_batches == 1
    return e


def _snapshot(e: Engine) -> dict:
    return {**engine_snapshot(e), "buffers": (id(e.params.flat), id(e.grads.flat))}


def test_case_count():
    ids = [c.id for c in CASES]
    assert len(set(ids)) == len(ids), "duplicate case ids"
    assert len(CASES) >= MIN_CASES
    print(f"\nbad-input table: {len(CASES)} cases")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case):
    engine = _make_engine()
    before = _snapshot(engine)
    with pytest.raises(case.exc) as info:
        case.call(engine)
    message = str(info.value)
    for needle in (case.match,) if isinstance(case.match, str) else case.match:
        assert needle in message, f"{needle!r} not in {message!r}"
    assert _snapshot(engine) == before
    # the engine still works after the refusal
    report = engine.step(_good())
    assert report.applied and report.step == 2


# -- zero-size parameters are accepted anywhere -------------------------------------------------------


@pytest.mark.parametrize(
    "shapes",
    [
        {"z": (0,), "a": (3,)},
        {"a": (3,), "z": (0, 4), "b": (2, 2)},
        {"a": (3,), "z": (5, 0)},
        {"z0": (0,), "z1": (0, 0)},
    ],
    ids=["first", "middle", "last", "only-zero-size"],
)
@pytest.mark.parametrize("opt", [lambda: SGD(lr=1.0, momentum=0.5), lambda: AdamW(lr=0.1)], ids=["sgd", "adamw"])
def test_zero_size_parameters_accepted(shapes, opt):
    e = Engine({n: np.ones(s) for n, s in shapes.items()}, opt(), accumulation_steps=2, max_grad_norm=1.0)
    grads = {n: np.full(s, 0.5) for n, s in shapes.items()}
    assert e.step(grads).accumulated
    report = e.step(grads)
    assert report.applied and report.step == 1
    for n, s in shapes.items():
        assert e.params[n].shape == s
        if math.prod(s) == 0:
            assert report.grad_norms[n] == 0.0
        else:
            assert (e.params[n] < 1).all()
    sd = e.state_dict()
    e.load_state_dict(sd)
    assert e.state.step == 1
