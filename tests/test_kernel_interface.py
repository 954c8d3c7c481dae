"""The kernel interface: every family provides every declared kernel, with the reference's argument names."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from arraytrain.backend import kernel_family, kernels_for
from arraytrain.errors import BackendUnavailableError, HyperparameterError
from arraytrain.kernels import cpu, cuda, reference
from arraytrain.kernels.interface import DOMAINS, FAMILIES, KERNELS, family

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
    expected = list(inspect.signature(getattr(reference, name)).parameters)
    assert list(inspect.signature(fn).parameters) == expected


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
