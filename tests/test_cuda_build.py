"""Every CUDA source compiles with nvcc for sm_80 and sm_90, each template instance, without spills;
the CUDA kernel modules mirror their CPU families (no GPU needed for either).

Runs wherever ``nvcc`` is on the PATH (no GPU or CuPy needed): the sources are module
constants and every name expression a launcher can ask for is declared with its source.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from arraytrain.kernels.cuda import build

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


@pytest.mark.parametrize("arch", build.ARCHS)
@pytest.mark.parametrize("name", list(build.sources()))
def test_source_compiles_for_every_instance(name, arch, tmp_path):
    result = build.compile_source(name, arch, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    compiled = set(re.findall(r"Compiling entry function '(\w+)'", result.stderr))
    assert len(compiled) == len(build.sources()[name].instances), "every declared instance is compiled"
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", result.stderr)]
    assert spills and max(spills) == 0, "a kernel spills registers to local memory"


def test_cuda_kernel_modules_mirror_the_cpu_families():
    """Without a GPU or CuPy: the compression, projection and trend CUDA modules import and have
    every kernel of their CPU family; ``kernel_family`` picks the module by backend."""
    import inspect

    from arraytrain.backend import kernel_family
    from arraytrain.errors import BackendUnavailableError
    from arraytrain.kernels import compress, compress_reference, project, project_reference, trend, trend_reference
    from arraytrain.kernels.cuda import compression, projection
    from arraytrain.kernels.cuda import trend as cuda_trend

    for cpu_mod, cuda_mod, ref_mod in [(compress, compression, compress_reference),
                                       (project, projection, project_reference),
                                       (trend, cuda_trend, trend_reference)]:
        names = [n for n, f in vars(ref_mod).items() if inspect.isfunction(f) and f.__module__ == ref_mod.__name__
                 and not n.startswith("_") and callable(getattr(cpu_mod, n, None))]
        assert names, ref_mod.__name__
        missing = [n for n in names if not callable(getattr(cuda_mod, n, None))]
        assert not missing, f"{cuda_mod.__name__} lacks {missing}"
    assert kernel_family("compress", "numpy") is compress
    assert kernel_family("compress", "cupy") is compression
    assert kernel_family("project", "numpy", "reference") is project_reference
    assert kernel_family("trend", "cupy") is cuda_trend
    with pytest.raises(BackendUnavailableError, match="reference"):
        kernel_family("trend", "cupy", "reference")
