"""The package's shape, read from its source with ``ast`` (nothing is imported or run).

* No import cycle between the package's modules, counting every import statement,
  those inside functions too (a lazy import is still a dependency).
* The product (everything outside ``arraytrain.bench``) never imports the benchmarks.
* A module uses another module's public names only: no ``from arraytrain.x import _name``
  (unless ``_name`` is a module), no ``x._name`` on an imported arraytrain module, and no
  ``obj._name`` on another object unless ``_name`` is defined in the same module (its own
  classes' attributes). ``self._name`` and ``super()._name`` are a class's business, and a
  subclass may use its base class's underscore helpers where the base is of its own package
  (``optim._adam`` of ``optim._base``), never across packages (an interop class deriving from the
  Engine reaches it through its public names). Names reached through another library's modules
  or classes (numba's internals, ``os._exit``, torch.optim.Optimizer's hooks) are that library's
  business.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import arraytrain

PACKAGE = Path(arraytrain.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in MODULES.items()}


def _imported(module: str, node) -> list[tuple[str, str | None]]:
    """``(target module, imported name or None)`` for each arraytrain name an import statement binds."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names if a.name.split(".")[0] == "arraytrain"]
    if node.level:
        base = module.split(".")
        if MODULES[module].name != "__init__.py":
            base.pop()
        base = base[:len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    if prefix.split(".")[0] != "arraytrain":
        return []
    out = []
    for alias in node.names:
        sub = f"{prefix}.{alias.name}"
        out.append((sub, None) if sub in MODULES else (prefix, alias.name))
    return out


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, tree in TREES.items():
        deps = graph.setdefault(module, set())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target, _ in _imported(module, node):
                    parts = target.split(".")
                    # importing a.b.c runs a.b's __init__ too (but a module is inside its own packages)
                    for i in range(1, len(parts) + 1):
                        dep = ".".join(parts[:i])
                        if dep in MODULES and dep != module and not module.startswith(dep + "."):
                            deps.add(dep)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycle():
    graph = _graph()
    assert sum(len(d) for d in graph.values()) > 100  # the graph was read
    assert _cycles(graph) == []
    print(f"\nimport graph: {len(graph)} modules, {sum(len(d) for d in graph.values())} edges, no cycle")


def test_the_product_never_imports_its_benchmarks():
    graph = _graph()
    bad = sorted(f"{m} -> {d}" for m, deps in graph.items() if not m.startswith("arraytrain.bench")
                 for d in deps if d == "arraytrain.bench" or d.startswith("arraytrain.bench."))
    assert bad == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root_name(node):
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _defined(tree) -> set[str]:
    """The names a module defines: its functions and classes, what it assigns (attributes too)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
    return out


def _package(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


#: name -> the packages whose modules define it (where an inherited ``self._name`` comes from).
DEFINED_IN = {}
for _module, _tree in TREES.items():
    for _name in _defined(_tree):
        DEFINED_IN.setdefault(_name, set()).add(_package(_module))


def _violations(module: str, tree) -> list[str]:
    rel = MODULES[module].relative_to(PACKAGE.parent)
    defined, ours, foreign, found = _defined(tree), set(), set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                (ours if a.name.split(".")[0] == "arraytrain" else foreign).add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            targets = _imported(module, node)
            for alias in node.names:
                (ours if targets else foreign).add(alias.asname or alias.name)
            for target, name in targets:
                if name is not None and _private(name):
                    found.append(f"{rel}:{node.lineno}: from {target} import {name}")
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        value = node.value
        if (isinstance(value, ast.Name) and value.id in ("self", "cls")) or (
                isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"):
            home = DEFINED_IN.get(node.attr, set())
            if node.attr not in defined and home and _package(module) not in home:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)} (inherited from {', '.join(sorted(home))})")
            continue
        root = _root_name(value)
        if isinstance(value, ast.Name) and root in ours:
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)} (a private name of another module)")
        elif root not in foreign and node.attr not in defined:
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)} (not defined in this module)")
    return found


def test_modules_use_only_public_names_of_other_modules():
    found = [v for module, tree in TREES.items() for v in _violations(module, tree)]
    assert found == []
    print(f"\nprivate names: {len(TREES)} modules read, none reaches into another's")


@pytest.mark.parametrize("source, expected", [
    ("from arraytrain.engine import _x", 1),
    ("from .stages import Judge, _x", 1),
    ("from .. import _compile_notice", 0),  # a private module, its public names
    ("import arraytrain.engine as e\ne._x", 1),
    ("def f(engine):\n    return engine._state", 1),
    ("class A:\n    def f(self, other):\n        self._k = 1\n        return other._k", 0),
    ("import os\nos._exit(1)", 0),
    ("class A:\n    def f(self):\n        return self._guard", 0),  # the engine package's own (guard.py's)
    ("class A:\n    def f(self):\n        return self._optimizer_step_code", 0),  # a foreign base's (torch's)
])
def test_the_private_name_check_itself(source, expected):
    assert len(_violations("arraytrain.engine.core", ast.parse(source))) == expected


def test_an_inherited_private_name_is_refused_across_packages_only():
    source = ast.parse("from arraytrain.engine import Engine\nclass A(Engine):\n    def f(self):\n"
                       "        return self._placement")
    assert len(_violations("arraytrain.interop.torch", source)) == 1
    assert _violations("arraytrain.engine.guard", source) == []
