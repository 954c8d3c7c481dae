"""Sphinx configuration of arraytrain's API reference (numpydoc docstrings).

Build with warnings as errors, from the repository root::

    python -m sphinx -W --keep-going -b html docs/api docs/_build/html
"""

import os
import sys

# The package from this checkout, whether or not it is installed.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import arraytrain  # noqa: E402

project = "arraytrain"
author = "arraytrain contributors"
copyright = "arraytrain contributors"
release = version = arraytrain.__version__

# No intersphinx: the build reads nothing from the network.
extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
]

root_doc = "index"
exclude_patterns = ["_build"]
templates_path = []
html_theme = "alabaster"
html_static_path = []

# autodoc: members in source order, signatures without the type hints (the docstrings say
# what an argument is); importing the package never imports torch, JAX, CuPy or mpi4py, so
# nothing needs mocking.
autodoc_member_order = "bysource"
autodoc_typehints = "none"
autosummary_generate = False
# An override without a docstring of its own (every optimizer's ``update``) is documented once,
# on the base class that defines its meaning, rather than repeated on every subclass.
autodoc_inherit_docstrings = False

# numpydoc: the members are listed by autodoc's :members:, not by numpydoc's own tables.
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

# numpydoc's checks that a docstring parses as meant: known sections in the right order
# (GL06, GL07), directives with their two colons (GL10), Parameters entries that are
# parameters of the signature (PR02: prose run on after the parameter list reads as
# parameters) and ``name : type`` spelt with the spaces (PR10). Each failure is a Sphinx
# warning, so an error under -W.
numpydoc_validation_checks = {"GL06", "GL07", "GL10", "PR02", "PR10"}


# The kernel interface's two tables (name -> what it is) as tables rather than one long repr
# (their autodata entries take :no-value:).
TABLES = {
    "arraytrain.kernels.interface.KERNELS": ("Kernel", "Domain", "What it computes"),
    "arraytrain.kernels.interface.ARGUMENTS": ("Keyword", "What it means"),
}


def _escape(text: str) -> str:
    for c in "\\*`|_":
        text = text.replace(c, "\\" + c)
    return text


def _table(app, what, name, obj, options, lines):
    if what != "data" or name not in TABLES:
        return
    header = TABLES[name]
    rows = [(key, *(value if isinstance(value, tuple) else (value,))) for key, value in obj.items()]
    lines += ["", ".. list-table::", "   :header-rows: 1", ""]
    for row in [header, *(("``" + r[0] + "``", *map(_escape, r[1:])) for r in rows)]:
        lines += [f"   * - {row[0]}"] + [f"     - {cell}" for cell in row[1:]]
    lines.append("")


def setup(app):
    app.connect("autodoc-process-docstring", _table)
