"""The benchmarks sit on top of the product: the product never imports them, they use its public
names only, and no two of them import each other in a circle (what they share is in bench.common).

Read from the source with ``ast`` (every import, including those inside functions), so a
benchmark's optional dependencies need not be installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "arraytrain"

# (benchmark file, private module or name) pairs still used, and why; each is a change the owner
# of the other side has to make first
KNOWN_PRIVATE: set = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str) -> list[tuple[str, str | None, int]]:
    """``(module, imported name or None, line)`` for every arraytrain import in module ``name``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "arraytrain"]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target.split(".")[0] == "arraytrain":
                out += [(target, a.name, node.lineno) for a in node.names]
    return out


def _targets(name: str) -> set[str]:
    """The arraytrain modules that module ``name`` imports (a ``from package import module`` counts)."""
    found = set()
    for target, item, _ in _imports(name):
        sub = f"{target}.{item}" if item else None
        found.add(sub if sub in MODULES else target)
    return found


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def test_the_product_never_imports_the_benchmarks():
    offenders = {name: sorted(t for t in _targets(name) if t == "arraytrain.bench" or t.startswith("arraytrain.bench."))
                 for name in MODULES if not name.startswith("arraytrain.bench")}
    assert {k: v for k, v in offenders.items() if v} == {}


BENCH = sorted(name for name in MODULES if name.startswith("arraytrain.bench."))


@pytest.mark.parametrize("name", BENCH)
def test_a_benchmark_uses_public_names_only(name):
    """No private module of the product, no private name of another module."""
    rel = MODULES[name].relative_to(PACKAGE).as_posix()
    private = {f"{t}.{i}" if i else t for t, i, _ in _imports(name)}
    assert {d for d in private if _private(d) and (rel, d) not in KNOWN_PRIVATE} == set()


def test_the_known_exceptions_are_still_needed():
    """An entry of KNOWN_PRIVATE that no benchmark needs any more is removed from the list."""
    for rel, dotted in KNOWN_PRIVATE:
        name = _module_name(PACKAGE / rel)
        used = {f"{t}.{i}" if i else t for t, i, _ in _imports(name)}
        assert dotted in used, (rel, dotted)


def test_no_two_benchmarks_import_each_other_in_a_circle():
    graph = {name: {t for t in _targets(name) if t in BENCH} for name in BENCH}
    done: set[str] = set()

    def visit(node, path):
        if node in path:
            raise AssertionError(" -> ".join([*path[path.index(node):], node]))
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, [*path, node])
        done.add(node)

    for name in BENCH:
        visit(name, [])


def test_the_scan_sees_relative_and_nested_imports():
    """``from ..x import y`` inside a function is read as an import of arraytrain.x; a private name is seen."""
    assert any(t == "arraytrain.distributed" and i == "launch" for t, i, _ in _imports("arraytrain.bench.distributed"))
    assert "arraytrain.bench.compression" in _targets("arraytrain.bench.distributed")
    assert "arraytrain.cli" in _targets("arraytrain.bench.predict")
    assert _private("arraytrain.kernels.cuda._core") and _private("arraytrain.bench.compare._timeit")
    assert not _private("arraytrain.kernels.cuda.core")
    assert not _private("arraytrain.compress.ErrorFeedback") and not _private("arraytrain.nn.__init__")
