"""Every CUDA source compiles with nvcc for sm_80 and sm_90, each template instance, without spills;
the CUDA kernel modules mirror their CPU families (no GPU needed for either).

Runs wherever ``nvcc`` is on the PATH (no GPU or CuPy needed): the sources are module
constants and every name expression a launcher can ask for is declared with its source.
"""

from __future__ import annotations

import re
import shutil

import pytest

from arraytrain.kernels.cuda import build

# the slow tier: nvcc builds every CUDA source for two architectures
pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")]


@pytest.mark.parametrize("arch", build.ARCHS)
@pytest.mark.parametrize("name", list(build.sources()))
def test_source_compiles_for_every_instance(name, arch, tmp_path):
    result = build.compile_source(name, arch, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    compiled = set(re.findall(r"Compiling entry function '(\w+)'", result.stderr))
    assert len(compiled) == len(build.sources()[name].instances), "every declared instance is compiled"
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", result.stderr)]
    assert spills and max(spills) == 0, "a kernel spills registers to local memory"
