"""The kernel interface: every family provides every declared kernel, with the reference's argument names."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from arraytrain.backend import kernel_family, kernels_for
from arraytrain.errors import BackendUnavailableError, HyperparameterError
from arraytrain.kernels import cpu, cuda, reference
from arraytrain.kernels.interface import ARGUMENTS, DOMAINS, FAMILIES, KERNELS, family

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
    x = np.zeros(4, np.float32)
    assert kernels_for(x) is cpu and kernels_for(x, "reference") is reference
    assert kernels_for(x, domain="compression") is family("numpy", "numba", "compression")
    assert kernel_family("trend", "cupy") is family("cupy", "numba", "trend")
    with pytest.raises(BackendUnavailableError, match="reference"):
        kernel_family("trend", "cupy", "reference")
    with pytest.raises(HyperparameterError, match="kernels"):
        kernels_for(x, "cuda")
    with pytest.raises(KeyError, match="domain"):
        family("numpy", "numba", "optim")
