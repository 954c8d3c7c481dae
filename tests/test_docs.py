"""The API reference: every public name has a docstring, and the Sphinx build documents it.

The reference (``docs/api``, numpydoc docstrings) has one page per module of :data:`MODULES`.
A module's public names are its ``__all__``, or, without one, the classes, functions and
constants it defines whose names do not start with ``_``. For each of them:

* a docstring (a constant: a ``#:`` comment before its assignment, or a string after it, as
  Sphinx reads them); a class also for each public method and property it defines, or
  inherits from an arraytrain class (an override may inherit its base's docstring, as
  autodoc shows it). This part needs nothing but the package.
* where Sphinx and numpydoc are installed (the ``docs`` extra), the reference builds with
  warnings as errors and its objects inventory lists the name: the module's own page
  documents it, or, for a name the module re-exports, the page of the module that defines it;
  a member appears on its class or on the documented base class it inherits it (or, for an
  override without a docstring, its docstring) from.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import arraytrain

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "api"

# one page of the reference each (docs/api/<module>.rst)
MODULES = (
    "arraytrain",
    "arraytrain.accumulate",
    "arraytrain.amp",
    "arraytrain.checkpoint",
    "arraytrain.checkpoint.format",
    "arraytrain.compress",
    "arraytrain.distributed",
    "arraytrain.engine.protocol",
    "arraytrain.errors",
    "arraytrain.interop.jax",
    "arraytrain.interop.torch",
    "arraytrain.kernels.interface",
    "arraytrain.nn",
    "arraytrain.optim",
    "arraytrain.parallel",
    "arraytrain.parallel.communicator",
    "arraytrain.parallel.deadline",
    "arraytrain.parallel.mpi",
    "arraytrain.parallel.placement",
    "arraytrain.parallel.progress",
    "arraytrain.parallel.shard",
    "arraytrain.parallel.sync",
    "arraytrain.parallel.torch_dist",
    "arraytrain.phase",
    "arraytrain.phase.predict",
    "arraytrain.prune",
    "arraytrain.quantize",
    "arraytrain.schedules",
    "arraytrain.engine.stages",
    "arraytrain.threads",
)


def _assigned(node) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    names = []
    for t in targets:
        for e in t.elts if isinstance(t, ast.Tuple) else [t]:
            if isinstance(e, ast.Name):
                names.append(e.id)
    return names


def _top_level(module) -> dict[str, ast.stmt]:
    """Name -> the statement that defines it, for the module's top-level definitions."""
    tree = ast.parse(inspect.getsource(module))
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for name in _assigned(node):
                found[name] = node
    return found


def public_names(module) -> list[str]:
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [n for n in _top_level(module) if not n.startswith("_")]


def _is_constant(obj) -> bool:
    return not (inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj))


def _constant_documented(module, name: str) -> bool:
    """A ``#:`` comment right before the assignment, on its line, or a string right after it."""
    tree = ast.parse(inspect.getsource(module))
    lines = inspect.getsource(module).splitlines()
    for i, node in enumerate(tree.body):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and name in _assigned(node):
            before = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
            same = lines[node.lineno - 1]
            after = tree.body[i + 1] if i + 1 < len(tree.body) else None
            string_after = (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                            and isinstance(after.value.value, str) and after.value.value.strip())
            return (before.startswith("#:") and len(before) > 2) or "#: " in same or bool(string_after)
    return False


def _own_doc(obj) -> str:
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    doc = (doc or "").strip()
    if inspect.isclass(obj) and doc.startswith(f"{obj.__name__}("):
        return ""  # the signature a dataclass or namedtuple writes when a class has no docstring
    return doc


def _is_member(raw) -> bool:
    """A method, property or nested class (what autodoc's ``:members:`` documents from its docstring)."""
    return inspect.isfunction(raw) or isinstance(raw, (property, functools.cached_property)) or inspect.isclass(raw)


def _public_members(cls):
    """(name, defining class, raw attribute) of the public methods and properties of ``cls``.

    Members that only builtins define (``object``, ``Exception``, ``dict``, ...) are left out.
    """
    for name in dir(cls):
        if name.startswith("_"):
            continue
        owner = next((k for k in cls.__mro__ if name in k.__dict__), None)
        if owner is None or not owner.__module__.startswith("arraytrain"):
            continue
        raw = owner.__dict__[name]
        if isinstance(raw, (staticmethod, classmethod)):
            raw = raw.__func__
        if _is_member(raw):
            yield name, owner, raw


def _member_doc(cls, name: str) -> str:
    """The docstring autodoc shows for a member: its own, else that of the member it overrides."""
    for k in cls.__mro__:
        raw = k.__dict__.get(name)
        if isinstance(raw, (staticmethod, classmethod)):
            raw = raw.__func__
        if not _is_member(raw):
            continue  # absent here, or a plain value (whose __doc__ is its type's)
        doc = (raw.__doc__ or "").strip()
        if doc and not (inspect.isclass(raw) and doc.startswith(f"{raw.__name__}(")):
            return doc
    return ""


def _public_objects():
    """(module name, public name, object) for every page's public names."""
    for modname in MODULES:
        module = importlib.import_module(modname)
        for name in public_names(module):
            yield modname, name, getattr(module, name)


ALL = list(_public_objects())


def test_every_public_module_has_a_page():
    pages = {p.stem for p in DOCS.glob("*.rst")} - {"index"}
    assert pages == set(MODULES)
    subpackages = {f"arraytrain.{n}" for n in arraytrain.__all__ if inspect.ismodule(getattr(arraytrain, n))}
    assert subpackages <= set(MODULES)
    index = (DOCS / "index.rst").read_text()
    assert all(f"\n   {m}\n" in index for m in MODULES)


def test_the_pinned_surface_is_covered():
    from test_public_api import SURFACE

    for modname, names in SURFACE.items():
        assert set(names) <= {n for m, n, _ in ALL if m == modname}, modname
    assert len(ALL) > 200


@pytest.mark.parametrize("modname", MODULES)
def test_public_names_have_docstrings(modname):
    module = importlib.import_module(modname)
    missing = [] if (module.__doc__ or "").strip() else [modname]
    for m, name, obj in ALL:
        if m != modname:
            continue
        if _is_constant(obj):
            if not _constant_documented(module, name):
                missing.append(f"{modname}.{name} (a constant: a '#:' comment or a string after it)")
        elif not _own_doc(obj):
            missing.append(f"{modname}.{name}")
        if inspect.isclass(obj):
            for member, owner, raw in _public_members(obj):
                if not _member_doc(obj, member):
                    missing.append(f"{modname}.{name}.{member} (defined in {owner.__module__}.{owner.__qualname__})")
    assert not missing, "no docstring:\n" + "\n".join(missing)


# -- the Sphinx build ----------------------------------------------------------------------

def _inventory(path: Path) -> dict[str, str]:
    """``objects.inv`` (format 2) -> {name: role} for the Python domain."""
    data = path.read_bytes()
    header_end = 0
    for _ in range(4):  # "# Sphinx inventory version 2", project, version, "compressed using zlib"
        header_end = data.index(b"\n", header_end) + 1
    assert data.startswith(b"# Sphinx inventory version 2")
    found = {}
    for line in zlib.decompress(data[header_end:]).decode().splitlines():
        name, rest = line.split(" ", 1)
        role = rest.split(" ", 1)[0]
        if role.startswith("py:"):
            found[name] = role
    return found


def _resolve(name: str):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


@pytest.fixture(scope="module")
def inventory(tmp_path_factory):
    pytest.importorskip("sphinx")
    pytest.importorskip("numpydoc")
    out = tmp_path_factory.mktemp("docs")
    build = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                            "-d", str(out / "doctrees"), str(DOCS), str(out / "html")],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert build.returncode == 0, build.stdout + build.stderr
    return _inventory(out / "html" / "objects.inv")


@pytest.mark.slow  # the slow tier: a Sphinx build of the reference (about 25 s)
def test_reference_documents_every_public_name(inventory):
    by_object = {}
    for name, role in inventory.items():
        if role in ("py:module", "py:class", "py:exception", "py:function", "py:method", "py:property"):
            obj = _resolve(name)
            if obj is not None:
                by_object.setdefault(id(obj), []).append(name)
    missing = []
    for modname, name, obj in ALL:
        full = f"{modname}.{name}"
        if full in inventory or (not _is_constant(obj) and id(obj) in by_object):
            pass
        else:
            missing.append(full)
            continue
        if inspect.isclass(obj):
            for member, owner, raw in _public_members(obj):
                # on this class, or on a documented class it inherits the member (or its docstring) from, where
                # that class's page shows it (its own, or with :inherited-members:, as the Engine's base classes')
                homes = [h for k in obj.__mro__ if k is obj or hasattr(k, member) for h in by_object.get(id(k), [])]
                if not any(f"{home}.{member}" in inventory for home in homes):
                    missing.append(f"{full}.{member} (defined in {owner.__module__}.{owner.__qualname__})")
    assert not missing, "not in the reference:\n" + "\n".join(missing)


def _page_entries() -> list[tuple[str, str]]:
    """(page, full name) of every object an ``auto*`` directive of the reference documents."""
    entries = []
    for page in sorted(DOCS.glob("*.rst")):
        current = None
        for line in page.read_text().splitlines():
            m = re.match(r"\.\. (?:py:)?currentmodule:: (\S+)", line)
            if m:
                current = m.group(1)
            m = re.match(r"\.\. auto(?:class|exception|function|data):: (\S+)", line)
            if m:
                name = m.group(1)
                entries.append((page.stem, f"{current}.{name}" if current else name))
    return entries


def test_each_object_is_documented_once():
    """A re-exported name links to the page of the module that defines it instead of a second copy."""
    seen = {}
    for page, name in _page_entries():
        obj = _resolve(name)
        assert obj is not None, f"{page}.rst: {name} does not resolve"
        if not _is_constant(obj):
            seen.setdefault(id(obj), []).append(name)
    twice = [names for names in seen.values() if len(names) > 1]
    assert not twice, twice
