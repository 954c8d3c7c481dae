"""The public surface: exported names, the error hierarchy, and a cheap import."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import arraytrain
import arraytrain.optim
from arraytrain import errors

ARRAYTRAIN_ALL = [
    "AccumulationConfig",
    "AccumulationError",
    "AccumulationStats",
    "AccumulatorFullError",
    "AliasingError",
    "ArgumentTypeError",
    "ArrayTrainError",
    "BackendError",
    "BackendUnavailableError",
    "CheckpointError",
    "ConcurrentUseError",
    "DTypeError",
    "DataError",
    "Engine",
    "FlatBuffer",
    "GradientAccumulator",
    "GradientPredictor",
    "HyperparameterError",
    "Layout",
    "LayoutError",
    "LossScaler",
    "MissingDependencyError",
    "MissingGradientError",
    "NoGradientsError",
    "NonFiniteError",
    "QuantizedTensor",
    "ReadOnlyError",
    "ShapeMismatchError",
    "StateDictError",
    "StepReport",
    "UnknownParameterError",
    "compress",
    "dequantize_params",
    "load",
    "magnitude_mask",
    "nn",
    "optim",
    "prune",
    "quantize",
    "quantize_params",
    "save",
    "schedules",
    "sparsity",
    "threads",
]

OPTIM_ALL = ["Adafactor", "Adagrad", "Adam", "AdamW", "LAMB", "Lion", "OptState", "Optimizer", "RMSprop", "SAM", "SGD", "Sophia"]

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


def test_all_is_pinned():
    assert sorted(arraytrain.__all__) == ARRAYTRAIN_ALL
    assert len(set(arraytrain.__all__)) == len(arraytrain.__all__)
    for name in arraytrain.__all__:
        assert hasattr(arraytrain, name), name


COMPRESS_ALL = ["Compressor", "Domain", "ErrorFeedback", "Int8Block", "Payload", "PowerSGD", "RandomK", "Segment",
                "Sign", "Ternary", "TopK", "VSA"]


def test_compress_all_is_pinned():
    assert sorted(arraytrain.compress.__all__) == COMPRESS_ALL
    for name in arraytrain.compress.__all__:
        assert hasattr(arraytrain.compress, name), name


def test_optim_all_is_pinned():
    assert sorted(arraytrain.optim.__all__) == OPTIM_ALL
    for name in arraytrain.optim.__all__:
        assert hasattr(arraytrain.optim, name), name


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
