"""The kernel interface: every family provides every declared kernel, with the reference's argument names."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from arraytrain.phase import predict
from arraytrain.backend import check_kernel_dtype
from arraytrain.errors import BackendUnavailableError, DTypeError, HyperparameterError
from arraytrain.kernels import cpu, cuda, interface, reference
from arraytrain.kernels.interface import ARGUMENTS, DEVICE_KERNELS, DOMAINS, FAMILIES, HOST_KERNELS, IMPLS, KERNELS

PACKAGES = {"reference": reference, "cpu": cpu, "cuda": cuda}


def test_the_table_names_every_public_kernel_of_the_reference_family():
    for domain in DOMAINS:
        mod = interface.family("numpy", "reference", domain)
        public = {n for n, f in vars(mod).items()
                  if inspect.isfunction(f) and f.__module__ == mod.__name__ and not n.startswith("_")}
        helpers = {"magnitude_keys", "ternary_scales", "signs", "positions"}  # reference-only building blocks
        assert public - helpers == {n for n, (d, _) in KERNELS.items() if d == domain}, domain
    assert all(d in DOMAINS for d, _ in KERNELS.values()) and FAMILIES == tuple(PACKAGES)
    for own, fam in ((DEVICE_KERNELS, cuda), (HOST_KERNELS, cpu)):  # one family's own kernels
        assert all(d in DOMAINS and not hasattr(reference, n) and getattr(interface.family(
            "cupy" if fam is cuda else "numpy", "numba", d), n) is getattr(fam, n) for n, (d, _) in own.items())


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("name", list(KERNELS))
def test_every_family_provides_the_kernel_with_the_same_arguments(fam, name):
    domain = KERNELS[name][0]
    fn = getattr(PACKAGES[fam], name)
    assert fn is getattr(interface.family("numpy" if fam != "cuda" else "cupy",
                                          "reference" if fam == "reference" else "numba", domain), name), \
        "the package re-exports its domain module's kernel"
    expected = [(q.name, q.kind, q.default) for q in inspect.signature(getattr(reference, name)).parameters.values()]
    assert [(q.name, q.kind, q.default) for q in inspect.signature(fn).parameters.values()] == expected


def _signature(name):
    """The reference's signature of a kernel; the CUDA family's for the device-only ones, the CPU's for its own."""
    return inspect.signature(getattr(cuda if name in DEVICE_KERNELS else cpu if name in HOST_KERNELS else reference,
                                     name))


ALL_KERNELS = list(KERNELS) + list(DEVICE_KERNELS) + list(HOST_KERNELS)
# Positional names that are also documented keywords of other kernels: cast_working's first array is
# the working copy ``w`` it writes (the optimizer kernels' keyword ``working``), not accumulate's weight.
POSITIONAL_ARRAYS = {("cast_working", "w")}


@pytest.mark.parametrize("name", ALL_KERNELS)
def test_kernels_take_scalars_by_keyword_only(name):
    """Arrays (and their tables) positional first, then every scalar keyword-only, each a documented name."""
    params = _signature(name).parameters.values()
    positional = [q.name for q in params if q.kind is q.POSITIONAL_OR_KEYWORD]
    keywords = [q.name for q in params if q.kind is q.KEYWORD_ONLY]
    assert [q.name for q in params] == positional + keywords, f"{name}: *args/**kwargs or keywords before arrays"
    assert all(q.default is q.empty for q in params if q.kind is q.POSITIONAL_OR_KEYWORD), \
        f"{name}: an optional positional argument"
    scalars = {p for p in positional if p in ARGUMENTS and (name, p) not in POSITIONAL_ARRAYS}
    assert not scalars, f"{name}: {sorted(scalars)} taken positionally"
    assert set(keywords) <= set(ARGUMENTS), f"{name}: undocumented {sorted(set(keywords) - set(ARGUMENTS))}"
    if {**KERNELS, **HOST_KERNELS}.get(name, ("",))[0] == "optimizers":
        assert positional[-1] in ("pieces", "batches")  # the arrays end with the layout's tables


def test_every_documented_argument_is_used():
    used = {q for n in ALL_KERNELS for q, p in _signature(n).parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert set(ARGUMENTS) == used


@pytest.mark.parametrize("fam", ["reference", "cpu"])
def test_a_positional_scalar_is_refused(fam):
    kernels = PACKAGES[fam]
    p = np.zeros(4)
    pieces = np.array([[0, 4, 0]], np.int64)
    with pytest.raises(TypeError):
        kernels.sgd_step(p, p.copy(), p[:0], pieces, 1.0, np.ones(1), np.zeros(1), 0.0, 0.0, False, True)
    with pytest.raises(TypeError):
        kernels.accumulate(p, p.copy(), 0.5, False)
    with pytest.raises(TypeError):
        kernels.scale(p, 2.0)
    with pytest.raises(TypeError):
        kernels.sumsq(p, pieces, 1)
    with pytest.raises(TypeError):
        kernels.fwht(p, 4)
    with pytest.raises(TypeError):
        kernels.topk(p, 2, np.zeros(2, np.int64), np.zeros(2))


def test_one_way_to_get_a_family():
    assert interface.family("numpy") is cpu and interface.family("numpy", "reference") is reference
    assert interface.family("cupy") is cuda
    assert interface.family("numpy", "numba", "compression") is cpu.compression
    assert interface.family("cupy", domain="trend") is cuda.trend
    with pytest.raises(BackendUnavailableError, match="reference"):
        interface.family("cupy", "reference", "trend")
    with pytest.raises(HyperparameterError, match="kernels"):
        interface.family("numpy", "cuda")
    with pytest.raises(KeyError, match="domain"):
        interface.family("numpy", "numba", "optim")
    import arraytrain.backend as backend

    assert not any(hasattr(backend, n) for n in ("kernels_for", "kernel_family", "KERNEL_IMPLS"))
    assert predict.KERNELS is IMPLS  # one spelling of the implementations


@pytest.mark.parametrize("dtype", [np.float16, np.int32, "bfloat16"])
def test_kernel_dtypes_are_float32_and_float64(dtype):
    import ml_dtypes

    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    check_kernel_dtype(np.float32)
    check_kernel_dtype(np.float64)
    with pytest.raises(DTypeError, match=f"buffer dtype {dtype}: the kernels run on float32 or float64"):
        check_kernel_dtype(dtype)
