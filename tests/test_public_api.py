"""The public surface: exported names and their signatures, the error hierarchy, and a cheap import.

:data:`SURFACE` pins, for ``arraytrain``, ``arraytrain.optim``, ``arraytrain.schedules``,
``arraytrain.compress`` and ``arraytrain.nn``, every public name and the signature of each
public class's constructor and each function (parameter names, kinds and defaults), so that
any change to the surface is a conscious edit of this table.
"""

from __future__ import annotations

import enum
import inspect
import json
import subprocess
import sys
import textwrap
import types

import pytest

import arraytrain
import arraytrain.compress
import arraytrain.nn
import arraytrain.optim
import arraytrain.schedules
from arraytrain import errors

# module -> {public name: its signature without annotations ("error": an exception class, whose
# constructor is the builtin's; "module"; "= value": a constant)}
SURFACE = {
    "arraytrain": {
        "AccumulationConfig": "(accumulation_steps=4, reduction='mean', max_grad_norm=None, clip_eps=1e-06)",
        "AccumulationError": "error",
        "AccumulationStats": "(total_micro_batches, total_updates, accumulation_steps, registered_params, "
                             "total_param_elements)",
        "AccumulatorFullError": "error",
        "AliasingError": "error",
        "ArgumentTypeError": "error",
        "ArrayTrainError": "error",
        "BackendError": "error",
        "BackendUnavailableError": "error",
        "CheckpointError": "error",
        "CommTimeoutError": "error",
        "ConcurrentUseError": "error",
        "DTypeError": "error",
        "DataError": "error",
        "Engine": "(params, optimizer, *, accumulation_steps=1, max_grad_norm=None, reduction='mean', "
                  "missing='error', zero_grad_on_step=True, dtype=None, kernels='numba', schedule=None, "
                  "loss_scaler=None, working_dtype=None, max_consecutive_skips=50, compressor=None, device=None, "
                  "clip_eps=1e-06, comm=None, shard_state=False, overlap=False, "
                  "bucket_bytes=None, nonfinite='skip')",
        "FlatBuffer": "(layout, flat)",
        "GradientAccumulator": "(config=None, dtype=<class 'numpy.float64'>)",
        "GradientPredictor": "(layout_or_params, history=4, correction_beta=0.9, *, dtype=None, kernels='numba', "
                             "device=None)",
        "HyperparameterError": "error",
        "Layout": "(shapes, align=16)",
        "LayoutError": "error",
        "LossScaler": "(init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, "
                      "max_scale=None)",
        "MissingDependencyError": "error",
        "MissingGradientError": "error",
        "NoGradientsError": "error",
        "NonFiniteError": "error",
        "PhaseOrderError": "error",
        "QuantizedTensor": "(codes, scale, zero_point, shape, scheme, granularity, axis, dtype)",
        "ReadOnlyError": "error",
        "ShapeMismatchError": "(name, expected, got, what='grad')",
        "StateDictError": "error",
        "StepReport": "(*, applied, skipped, step, micro_batches, lr, grad_norm=None, clip_coef=None, loss_scale=1.0, "
                      "perturbed=False, _segment_norms=None, _names=(), payload_bytes=None, dense_bytes=None, "
                      "compression=None)",
        "UnknownParameterError": "error",
        "compress": "module",
        "dequantize_params": "(q, *, into)",
        "load": "(path, engine)",
        "magnitude_mask": "(params, *, ratio=None, threshold=None, scope='global', structure='unstructured', "
                          "names=None)",
        "nn": "module",
        "optim": "module",
        "phase": "module",
        "prune": "module",
        "quantize": "module",
        "quantize_params": "(params, *, names=None, **kw)",
        "save": "(path, engine, *, extra=None)",
        "schedules": "module",
        "sparsity": "(buf)",
        "threads": "module",
    },
    # torch's names and positional order where torch has the optimizer (optax's hyperparameters for
    # Lion and LAMB, the reference code's for Sophia, under the same names); flags and arraytrain's
    # own options keyword-only
    "arraytrain.optim": {
        "by_name": "()",
        "Adafactor": "(lr=0.01, beta2_decay=-0.8, eps=(None, 0.001), d=1.0, weight_decay=0.0, *, maximize=False, "
                     "overrides=None)",
        "Adagrad": "(lr=0.01, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10, *, "
                   "maximize=False, state_dtype=None, overrides=None)",
        "Adam": "(lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.0, amsgrad=False, *, maximize=False, "
                "state_dtype=None, overrides=None)",
        "AdamW": "(lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01, amsgrad=False, *, maximize=False, "
                 "state_dtype=None, overrides=None)",
        "LAMB": "(lr=0.001, betas=(0.9, 0.999), eps=1e-06, weight_decay=0.0, *, eps_root=0.0, maximize=False, "
                "state_dtype=None, overrides=None)",
        "Lion": "(lr=0.0001, betas=(0.9, 0.99), weight_decay=0.001, *, maximize=False, state_dtype=None, "
                "overrides=None)",
        "OptState": "(step=0, slots=<factory>, hp=<factory>, scalars=<factory>, counts=None, "
                    "param_scalars=<factory>, present=None)",
        "Optimizer": "()",
        "RMSprop": "(lr=0.01, alpha=0.99, eps=1e-08, weight_decay=0.0, momentum=0.0, centered=False, *, "
                   "maximize=False, state_dtype=None, overrides=None)",
        "SAM": "(base, rho=0.05, adaptive=False)",
        "SGD": "(lr=0.001, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *, maximize=False, "
               "state_dtype=None, overrides=None)",
        "Sophia": "(lr=0.0001, betas=(0.965, 0.99), rho=0.04, weight_decay=0.1, *, eps=1e-15, bs=5120, "
                  "maximize=False, overrides=None)",
        "NAdam": "(lr=0.002, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.0, momentum_decay=0.004, "
                 "decoupled_weight_decay=False, *, maximize=False, state_dtype=None, overrides=None)",
        "RAdam": "(lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.0, decoupled_weight_decay=False, *, "
                 "maximize=False, state_dtype=None, overrides=None)",
        "Adamax": "(lr=0.002, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.0, *, maximize=False, state_dtype=None, "
                  "overrides=None)",
        "Adadelta": "(lr=1.0, rho=0.9, eps=1e-06, weight_decay=0.0, *, maximize=False, state_dtype=None, "
                    "overrides=None)",
        # torch.optim.Muon's names and order; the routing to a fallback optimizer keyword-only
        "Muon": "(lr=0.001, weight_decay=0.1, momentum=0.95, nesterov=True, ns_coefficients=(3.4445, -4.775, 2.0315), "
                "eps=1e-07, ns_steps=5, adjust_lr_fn=None, *, fallback=None, fallback_for=(), maximize=False, "
                "state_dtype=None, overrides=None)",
        # optax's defaults under the shared names (betas = (b1, b2)), the reference code's order
        "ScheduleFreeAdamW": "(lr=0.0025, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.0, warmup_steps=0, "
                             "weight_lr_power=2.0, *, maximize=False, state_dtype=None, overrides=None)",
    },
    # torch's class and argument names where torch has the schedule (see the module docstring)
    "arraytrain.schedules": {
        "Constant": "()",
        "CosineAnnealingLR": "(T_max, eta_min=0.0)",
        "CosineAnnealingWarmRestarts": "(T_0, T_mult=1, eta_min=0.0)",
        "ExponentialLR": "(gamma)",
        "LinearLR": "(total_iters, start_factor=0.3333333333333333, end_factor=1.0)",
        "MultiStepLR": "(milestones, gamma=0.1)",
        "OneCycleLR": "(total_steps, pct_start=0.3, anneal_strategy='cos', div_factor=25.0, final_div_factor=10000.0, "
                      "three_phase=False)",
        "PolynomialLR": "(total_iters, power=1.0)",
        "ReduceLROnPlateau": "(inner=None, mode='min', factor=0.1, patience=10, threshold=0.0001, threshold_mode='rel', "
                             "cooldown=0, min_lr=0.0, eps=1e-08)",
        "SCHEDULE_FORMAT": "= 2",
        "Schedule": "()",
        "Sequential": "(segments)",
        "StepLR": "(step_size, gamma=0.1)",
        "Warmup": "(steps, then=None, start_factor=0.0)",
        "from_state_dict": "(state)",
    },
    "arraytrain.compress": {
        "Auto": "(candidates=None, *, probe=4, gain=1.25, reprobe=200, drift=2.0, clock=None)",
        "Compressor": "(*, min_size=0, warmup=None, seed=0, kernels='numba')",
        "Domain": "(size, dtype, segments)",
        "ErrorFeedback": "(compressor)",
        "Int8Block": "(block=256, stochastic_rounding=False, *, min_size=0, warmup=None, seed=0, kernels='numba')",
        "Payload": "(method, arrays=<factory>, raw=None, meta=<factory>, dense_nbytes=0, sent_nbytes=None)",
        "PowerSGD": "(rank=2, *, warm_start=True, min_size=0, warmup=None, seed=0, kernels='numba')",
        "RandomK": "(ratio=None, k=None, *, rescale=True, ramp=None, min_size=0, warmup=None, seed=0, kernels='numba')",
        "Segment": "(name, shape, start)",
        "Sign": "(block=None, *, min_size=0, warmup=None, seed=0, kernels='numba')",
        "Ternary": "(block=None, *, min_size=0, warmup=None, seed=0, kernels='numba')",
        "TopK": "(ratio=None, k=None, *, ramp=None, min_size=0, warmup=None, seed=0, kernels='numba')",
        "VSA": "(ratio=None, *, dim=None, block=4096, unbiased=True, min_size=0, warmup=None, seed=0, kernels='numba')",
        "default_candidates": "()",
    },    # the layers, losses, metrics, data and training loop; a callback's name says it is one where a
    # schedule has the same meaning (ReduceLROnPlateauCallback feeds arraytrain.schedules.ReduceLROnPlateau)
    "arraytrain.nn": {
        "Activation": "()",
        "Batches": "(x, y=None, batch_size=32, *, shuffle=True, seed=0, drop_last=False)",
        "Callback": "()",
        "Checkpoint": "(path, every=1, extra=None)",
        "DataError": "error",
        "Dataset": "(name, x_train, y_train, x_val, y_val, x_test, y_test, num_classes, classes)",
        "Dense": "(in_features, out_features, name='fc')",
        "EarlyStopping": "(monitor='val_loss', patience=5, min_delta=0.0, mode='auto', restore_best=False)",
        "GELU": "()",
        "GradientMonitor": "()",
        "LambdaCallback": "(**hooks)",
        "MLP": "(sizes, activation='relu', dtype=<class 'numpy.float32'>, init=None)",
        "MagnitudePruning": "(ratio, start=1, end=None)",
        "MissingDependencyError": "error",
        "Phase": "enum",
        "PhaseCheckpoint": "(path, every=1, extra=None)",
        "PhaseSchedule": "(full_steps=10, predict_steps=40, correct_every=10, *, adaptive=False, loss_threshold=0.1, "
                         "full_bounds=(5, 50), predict_bounds=(10, 100))",
        "PhaseStats": "(full_steps=0, predict_steps=0, correct_steps=0, cycles=0, unrecorded=0, seconds=<factory>, "
                      "timed=<factory>, loss_sum=<factory>, loss_count=<factory>)",
        "PhaseTrainer": "(model, engine, *, full_steps=10, predict_steps=40, correct_every=10, adaptive=False, "
                        "loss_threshold=0.1, full_bounds=(5, 50), predict_bounds=(10, 100), history=4, "
                        "correction_beta=0.9, kernels='numba', **trainer_kwargs)",
        "Profiler": "()",
        "ProgressBar": "(file=None, leave=True, every=10, disable=None)",
        "ReLU": "()",
        "ReduceLROnPlateauCallback": "(monitor='val_loss')",
        "Sigmoid": "()",
        "Standardizer": "(floor=0.25)",
        "Tanh": "()",
        "Trainer": "(model, engine, *, loss='cross_entropy', batch_size=32, shuffle=True, seed=0, drop_last=False, "
                   "callbacks=(), num_classes=None, eval_batch_size=1024)",
        "accuracy": "(y_true, y_pred)",
        "activation": "(name)",
        "array_namespace": "(*arrays)",
        "binary_cross_entropy": "(logits, target)",
        "classification_report": "(y_true, y_pred, num_classes)",
        "confusion_matrix": "(y_true, y_pred, num_classes)",
        "dice_loss": "(logits, labels, smooth=1.0)",
        "focal_loss": "(logits, labels, gamma=2.0, alpha=1.0)",
        "he_normal": "(rng, fan_in, fan_out, dtype=<class 'numpy.float32'>)",
        "load_digits": "(seed=0, val_fraction=0.15, test_fraction=0.2, dtype=<class 'numpy.float32'>)",
        "load_npz": "(path, seed=0, val_fraction=0.15, test_fraction=0.2, dtype=<class 'numpy.float32'>)",
        "log_softmax": "(logits)",
        "mse": "(pred, target)",
        "poly1_cross_entropy": "(logits, labels, epsilon=1.0)",
        "precision_recall_f1": "(cm)",
        "softmax": "(logits)",
        "softmax_cross_entropy": "(logits, labels, label_smoothing=0.0)",
        "to_numpy": "(a)",
        "xavier_uniform": "(rng, fan_in, fan_out, dtype=<class 'numpy.float32'>)",
    },
}
MODULES = {"arraytrain": arraytrain, "arraytrain.optim": arraytrain.optim, "arraytrain.schedules": arraytrain.schedules,
           "arraytrain.compress": arraytrain.compress, "arraytrain.nn": arraytrain.nn}


def spelled(obj) -> str:
    """How :data:`SURFACE` writes a public object: its signature without annotations, or its kind."""
    if isinstance(obj, types.ModuleType):
        return "module"
    if isinstance(obj, type) and issubclass(obj, enum.Enum):  # its members are its surface, not a signature
        return "enum"
    if isinstance(obj, type) and issubclass(obj, BaseException) and "__init__" not in vars(obj):
        return "error"
    if not callable(obj):
        return f"= {obj!r}"
    sig = inspect.signature(obj)
    return str(sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                           return_annotation=sig.empty))


@pytest.mark.parametrize("module", list(SURFACE))
def test_public_names_are_pinned(module):
    mod = MODULES[module]
    assert sorted(mod.__all__) == sorted(SURFACE[module])
    assert len(set(mod.__all__)) == len(mod.__all__)
    for name in mod.__all__:
        assert hasattr(mod, name), name


@pytest.mark.parametrize("module, name", [(m, n) for m, names in SURFACE.items() for n in names])
def test_public_signature_is_pinned(module, name):
    assert spelled(getattr(MODULES[module], name)) == SURFACE[module][name]

# every error class and the builtin a caller would naturally catch it as
ERRORS = {
    "HyperparameterError": ValueError,
    "ArgumentTypeError": TypeError,
    "DTypeError": TypeError,
    "BackendError": TypeError,
    "BackendUnavailableError": ImportError,
    "ReadOnlyError": ValueError,
    "AliasingError": ValueError,
    "LayoutError": ValueError,
    "StateDictError": ValueError,
    "CheckpointError": ValueError,
    "NonFiniteError": FloatingPointError,
    "PhaseOrderError": RuntimeError,
    "CommTimeoutError": TimeoutError,
    "ConcurrentUseError": RuntimeError,
    "DataError": ValueError,
    "MissingDependencyError": ImportError,
    "ShapeMismatchError": ValueError,
    "UnknownParameterError": KeyError,
    "MissingGradientError": KeyError,
    "NoGradientsError": ValueError,
    "AccumulatorFullError": RuntimeError,
    "AccumulationError": None,  # an abstract base: only ArrayTrainError
}


OPTIMIZERS = [n for n in SURFACE["arraytrain.optim"] if n not in ("by_name", "Optimizer", "OptState", "SAM")]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizers_share_one_vocabulary(name):
    """lr, betas, eps, weight_decay and maximize mean one thing each; hyperparameters() rebuilds the optimizer."""
    cls = getattr(arraytrain.optim, name)
    params = inspect.signature(cls).parameters
    assert {"lr", "weight_decay", "maximize", "overrides"} <= set(params)
    assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in ("maximize", "overrides", "state_dtype")
               if k in params)
    assert not {"b1", "b2", "beta1", "beta2", "normalize", "min_lr"} & set(params)
    opt = cls()
    assert set(opt.hyperparameters()) == set(params)
    assert cls(**opt.hyperparameters()).hyperparameters() == opt.hyperparameters()
    if "betas" in params:
        assert isinstance(opt.betas, tuple) and len(opt.betas) == 2


def test_version():
    assert isinstance(arraytrain.__version__, str) and arraytrain.__version__.count(".") == 2


def test_every_exported_error_is_listed():
    exported = {n for n in arraytrain.__all__ if isinstance(getattr(arraytrain, n), type)
                and issubclass(getattr(arraytrain, n), BaseException)}
    assert exported == set(ERRORS) | {"ArrayTrainError"}
    defined = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, BaseException)
               and v.__module__ == errors.__name__ and not n.startswith("_")}
    assert defined == exported


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_error_hierarchy(name):
    cls = getattr(arraytrain, name)
    assert issubclass(cls, arraytrain.ArrayTrainError)
    builtin = ERRORS[name]
    if builtin is not None:
        assert issubclass(cls, builtin)
        try:
            raise cls(*(("p", (1,), (2,)) if cls is arraytrain.ShapeMismatchError else ("boom",)))
        except builtin as exc:  # catchable as the builtin
            assert isinstance(exc, arraytrain.ArrayTrainError)


@pytest.mark.parametrize("name", ["ShapeMismatchError", "UnknownParameterError", "MissingGradientError",
                                  "NoGradientsError", "AccumulatorFullError"])
def test_accumulation_errors(name):
    assert issubclass(getattr(arraytrain, name), arraytrain.AccumulationError)


@pytest.mark.parametrize("cls", [arraytrain.UnknownParameterError, arraytrain.MissingGradientError])
def test_key_errors_print_as_sentences(cls):
    assert str(cls("'w': no such parameter")) == "'w': no such parameter"
    assert str(cls()) == ""


def test_shape_mismatch_attributes():
    exc = arraytrain.ShapeMismatchError("w", [2, 3], (3, 2))
    assert (exc.name, exc.expected, exc.got) == ("w", (2, 3), (3, 2))
    assert "'w'" in str(exc) and "(3, 2)" in str(exc) and "(2, 3)" in str(exc)


IMPORT_PROBE = textwrap.dedent(
    """
    import json, sys
    import arraytrain
    loaded_at_import = sorted(m for m in ("arraytrain.kernels.cpu", "arraytrain.kernels.cuda", "cupy")
                              if m in sys.modules)
    import importlib
    from numba.core.registry import CPUDispatcher

    dispatchers = {}
    for domain in ("codecs", "reductions", "optimizers", "compression", "projection", "trend"):
        mod = importlib.import_module("arraytrain.kernels.cpu." + domain)
        for name, value in vars(mod).items():
            for i, d in enumerate(value if isinstance(value, tuple) else (value,)):
                if isinstance(d, CPUDispatcher):
                    dispatchers[f"{name}[{i}]"] = [str(s) for s in d.signatures]
    print(json.dumps({
        "loaded_at_import": loaded_at_import,
        "dispatchers": dispatchers,
        "cupy": "cupy" in sys.modules,
        "cuda_kernels": "arraytrain.kernels.cuda" in sys.modules,
    }))
    """
)


def test_import_compiles_nothing():
    out = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    # neither CuPy nor the CUDA kernel module is imported by ``import arraytrain``
    assert "cupy" not in found["loaded_at_import"]
    assert "arraytrain.kernels.cuda" not in found["loaded_at_import"]
    # the kernels exist (parallel and serial twins) ...
    assert len(found["dispatchers"]) >= 10
    assert any(k.startswith("_ADAM") for k in found["dispatchers"])
    # ... and none was compiled (or loaded from the on-disk cache) by the import
    compiled = {k: v for k, v in found["dispatchers"].items() if v}
    assert compiled == {}
    assert not found["cupy"] and not found["cuda_kernels"]


LIGHT_IMPORT_PROBE = textwrap.dedent(
    """
    import json, sys
    import arraytrain
    heavy = ("numba", "llvmlite", "scipy", "safetensors", "ml_dtypes", "cupy")
    at_import = sorted(m for m in heavy if m in sys.modules)
    arraytrain.Engine, arraytrain.optim.AdamW, arraytrain.compress.TopK, arraytrain.nn.MLP
    from arraytrain import load, save, schedules
    at_engine = sorted(m for m in heavy if m in sys.modules)
    print(json.dumps({"at_import": at_import, "at_engine": at_engine, "names": sorted(dir(arraytrain))}))
    """
)


def test_import_loads_no_heavy_dependency():
    """``import arraytrain`` imports none of numba, scipy, safetensors, ml_dtypes (and no kernel);
    reaching the engine, the optimizers, the compressors and nn imports no numba, scipy or safetensors
    either: numba loads with the first CPU kernel, safetensors with the first save or load."""
    out = subprocess.run([sys.executable, "-c", LIGHT_IMPORT_PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["at_import"] == []
    assert not {"numba", "llvmlite", "scipy", "safetensors", "cupy"} & set(found["at_engine"])
    assert set(arraytrain.__all__) <= set(found["names"])  # dir() lists the lazily imported names


def test_lazy_names_are_the_modules_objects():
    from arraytrain import checkpoint, engine, optim, prune

    assert arraytrain.Engine is engine.Engine and arraytrain.save is checkpoint.save
    assert arraytrain.optim is optim and arraytrain.magnitude_mask is prune.magnitude_mask
    assert arraytrain.kernels.interface.DOMAINS  # submodules are reachable as attributes, as before
    with pytest.raises(AttributeError):
        arraytrain.no_such_name  # noqa: B018
