"""The README's Python examples run as written, and its two commands match CI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index):
    code = BLOCKS[index]
    if re.search(r"^import torch", code, flags=re.M):
        pytest.importorskip("torch")
    if "arraytrain.distributed" in code:
        pytest.importorskip("mpi4py")  # the extra mpi; run alone, the example is a group of one process
    if 'device="cuda"' in code:
        from cuda_family import require_cuda

        require_cuda()
    exec(compile(code, f"README.md[python block {index}]", "exec"), {"__name__": "__readme__"})


def test_ci_runs_the_readme_commands():
    commands = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(c for c in commands if "pytest" in c)
    main_job = next(c for c in commands if "arraytrain train" in c)
    assert test_command in ci and main_job in ci
    assert ci.rstrip().endswith(test_command)


def test_quickstart_example_trains():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    final = float(re.search(r"final test accuracy ([0-9.]+)", out).group(1))
    assert final > 0.8  # 10 Gaussian classes; chance is 0.1
