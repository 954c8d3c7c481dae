"""The README's and docs/*.md's Python examples run as written, their links resolve, and the
README's two commands match CI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


BLOCKS = [(page.relative_to(ROOT).as_posix(), index, code)
          for page in PAGES for index, code in enumerate(_blocks(page.read_text()))]

# [text](target) and ![alt](target); the target ends at whitespace or ")" (an optional "title" follows)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _outside_code(text: str) -> str:
    """``text`` without fenced blocks and inline code spans, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _relative_links(page: Path) -> list[str]:
    targets = LINK.findall(_outside_code(page.read_text()))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t, flags=re.I) and not t.startswith("#")]


def test_readme_has_examples():
    readme = _blocks(README)
    assert len(readme) >= 3  # the quickstarts: hand-written NumPy gradients, torch, JAX
    assert any("at.Engine(" in b and "engine.step({" in b for b in readme)
    assert any(re.search(r"^import torch", b, flags=re.M) and "interop import torch" in b for b in readme)
    assert any(re.search(r"^import jax", b, flags=re.M) and "interop import jax" in b for b in readme)
    assert {page for page, _, _ in BLOCKS} > {"README.md"}  # the docs pages have examples too


@pytest.mark.parametrize(("page", "index", "code"), BLOCKS, ids=[f"{p}-{i}" for p, i, _ in BLOCKS])
def test_block_runs(page, index, code):
    if re.search(r"^import torch", code, flags=re.M):
        pytest.importorskip("torch")
    if re.search(r"^import jax", code, flags=re.M):
        pytest.importorskip("jax")
    if "arraytrain.distributed" in code:
        pytest.importorskip("mpi4py")  # the extra mpi; run alone, the example is a group of one process
    if 'device="cuda"' in code:
        from cuda_family import require_cuda

        require_cuda()
    exec(compile(code, f"{page}[python block {index}]", "exec"), {"__name__": "__readme__"})


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_point_at_files(page):
    missing = []
    for target in _relative_links(page):
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)}: links to missing files: {missing}"


def test_link_check_sees_links_and_images(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[a](gone.md#part) ![b](pic.png) [c](https://example.org/x) [d](#here)\n"
                    "`[e](in-code.md)`\n```\n[f](in-fence.md)\n```\n")
    assert _relative_links(page) == ["gone.md#part", "pic.png"]


def test_ci_runs_the_readme_commands():
    commands = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(c for c in commands if "pytest" in c)
    main_job = next(c for c in commands if "arraytrain train" in c)
    assert test_command in ci and main_job in ci
    slow = "python -m pytest -q -n auto --tier slow"
    assert f"`{slow}`" in README  # the README names the slow tier's command, which CI runs last:
    # the README's test command (the default tier), the asv smoke run (the kernels the tests compiled
    # in numba's cache), the CUDA tests on the CPU executor (the command the README gives), the slow tier
    steps = [line for line in ci.splitlines() if line.strip() and not line.startswith(("#", "phase "))]
    assert steps[-4] == test_command and steps[-1] == slow, steps[-4:]
    assert steps[-3].startswith("ARRAYTRAIN_BENCH_QUICK=1 asv run --quick"), steps[-3]
    executor = 'ARRAYTRAIN_CUDA=cpu python -m pytest -q -n auto -k "cuda or cupy" --tier full'
    assert steps[-2].startswith(executor) and f"`{executor}`" in README, steps[-2]


def test_quickstart_example_trains():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    final = float(re.search(r"final test accuracy ([0-9.]+)", out).group(1))
    assert final > 0.8  # 10 Gaussian classes; chance is 0.1
