"""The kernel interface: every family provides every declared kernel, with the reference's argument names."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from arraytrain import predict
from arraytrain.backend import check_kernel_dtype
from arraytrain.errors import BackendUnavailableError, DTypeError, HyperparameterError
from arraytrain.kernels import cpu, cuda, reference
from arraytrain.kernels.interface import ARGUMENTS, DOMAINS, FAMILIES, IMPLS, KERNELS, family

PACKAGES = {"reference": reference, "cpu": cpu, "cuda": cuda}


def test_the_table_names_every_public_kernel_of_the_reference_family():
    declared = set(KERNELS)
    for domain in DOMAINS:
        mod = family("numpy", "reference", domain)
        public = {n for n, f in vars(mod).items()
                  if inspect.isfunction(f) and f.__module__ == mod.__name__ and not n.startswith("_")}
        helpers = {"magnitude_keys", "ternary_scales", "signs", "positions"}  # reference-only building blocks
        assert public - helpers == {n for n, (d, _) in KERNELS.items() if d == domain}, domain
    assert all(d in DOMAINS for d, _ in KERNELS.values()) and FAMILIES == tuple(PACKAGES)


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("name", list(KERNELS))
def test_every_family_provides_the_kernel_with_the_same_arguments(fam, name):
    domain = KERNELS[name][0]
    fn = getattr(PACKAGES[fam], name)
    assert fn is getattr(family("numpy" if fam != "cuda" else "cupy", "reference" if fam == "reference" else "numba",
                                domain), name), "the package re-exports its domain module's kernel"
    expected = [(q.name, q.kind, q.default) for q in inspect.signature(getattr(reference, name)).parameters.values()]
    assert [(q.name, q.kind, q.default) for q in inspect.signature(fn).parameters.values()] == expected


OPTIMIZER_KERNELS = [n for n, (d, _) in KERNELS.items() if d == "optimizers"]


@pytest.mark.parametrize("name", OPTIMIZER_KERNELS)
def test_optimizer_kernels_take_scalars_by_keyword_only(name):
    """Arrays first, then every scalar keyword-only, each one a documented name (ARGUMENTS)."""
    params = inspect.signature(getattr(reference, name)).parameters.values()
    positional = [q.name for q in params if q.kind is q.POSITIONAL_OR_KEYWORD]
    keywords = [q.name for q in params if q.kind is q.KEYWORD_ONLY]
    assert [q.name for q in params] == positional + keywords
    assert not set(positional) & set(ARGUMENTS), f"{name}: a scalar taken positionally"
    assert set(keywords) <= set(ARGUMENTS), f"{name}: undocumented {sorted(set(keywords) - set(ARGUMENTS))}"
    assert positional[-1] in ("pieces", "batches")  # the arrays end with the layout's tables


def test_every_documented_argument_is_used():
    used = {q for n in OPTIMIZER_KERNELS for q in inspect.signature(getattr(reference, n)).parameters}
    assert set(ARGUMENTS) <= used


@pytest.mark.parametrize("fam", ["reference", "cpu"])
def test_a_positional_scalar_is_refused(fam):
    kernels = PACKAGES[fam]
    p = np.zeros(4)
    pieces = np.array([[0, 4, 0]], np.int64)
    with pytest.raises(TypeError):
        kernels.sgd_step(p, p.copy(), p[:0], pieces, 1.0, np.ones(1), np.zeros(1), 0.0, 0.0, False, True)


def test_one_way_to_get_a_family():
    assert family("numpy") is cpu and family("numpy", "reference") is reference
    assert family("cupy") is cuda
    assert family("numpy", "numba", "compression") is cpu.compression
    assert family("cupy", domain="trend") is cuda.trend
    with pytest.raises(BackendUnavailableError, match="reference"):
        family("cupy", "reference", "trend")
    with pytest.raises(HyperparameterError, match="kernels"):
        family("numpy", "cuda")
    with pytest.raises(KeyError, match="domain"):
        family("numpy", "numba", "optim")
    import arraytrain.backend as backend

    assert not hasattr(backend, "kernel_family") and not hasattr(backend, "KERNEL_IMPLS")
    assert predict.KERNELS is IMPLS  # one spelling of the implementations


@pytest.mark.parametrize("dtype", [np.float16, np.int32, "bfloat16"])
def test_kernel_dtypes_are_float32_and_float64(dtype):
    import ml_dtypes

    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    check_kernel_dtype(np.float32)
    check_kernel_dtype(np.float64)
    with pytest.raises(DTypeError, match=f"buffer dtype {dtype}: the kernels run on float32 or float64"):
        check_kernel_dtype(dtype)
