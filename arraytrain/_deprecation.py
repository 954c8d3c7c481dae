"""Old spellings of public names, accepted for one release with a :class:`DeprecationWarning`.

Each warning names the old spelling and the new one, and points at the caller's line.
A renamed class stays reachable under its old name through its module's ``__getattr__``
(:func:`renamed_names`), outside ``__all__`` and ``dir()``. Constructors keep their new
signature (what :func:`inspect.signature` shows and ``tests/test_public_api.py`` pins);
:func:`legacy_arguments` translates the old spellings before the constructor sees them.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from collections.abc import Callable

from .errors import HyperparameterError


def message(old: str, new: str) -> str:
    """The one wording of every deprecation (tests/conftest.py turns it into an error in the tests)."""
    return f"{old} is deprecated and will be removed in the next release; use {new}"


def warn(old: str, new: str, stacklevel: int = 2) -> None:
    """A DeprecationWarning ``old -> new``; ``stacklevel`` as for :func:`warnings.warn`, seen from the caller."""
    warnings.warn(message(old, new), DeprecationWarning, stacklevel=stacklevel + 1)


def legacy_arguments(*, renamed: dict | None = None, pairs: dict | None = None, old_positional: tuple = (),
                     old_call: Callable | None = None):
    """Decorate an ``__init__`` so that it also takes the spellings that shipped before.

    ``renamed``: ``{old: new}`` keyword renames, or ``{old: (new, convert)}`` where the
    old keyword's value is converted (``convert`` validates it too). ``pairs``: ``{new:
    (old_a, old_b)}``, two old keywords merged into one pair (``b1``/``b2`` -> ``betas``);
    a missing half takes the new parameter's default. ``old_positional``: the shipped
    order of the positional parameters; it applies when more positional arguments come
    than the new signature takes, or when ``old_call(args)`` says the call is in the old
    form (e.g. a number where the new signature has a pair). Each translation warns once,
    at the caller's line; giving an old and a new spelling of one argument is an error.
    """
    renamed = dict(renamed or {})
    pairs = dict(pairs or {})

    def decorate(init):
        params = list(inspect.signature(init).parameters.values())[1:]  # without self
        positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        defaults = {p.name: p.default for p in params}
        owner = init.__qualname__.split(".")[0]

        def translate(args: tuple, kwargs: dict) -> tuple[tuple, dict, list]:
            notes = []
            if old_positional and (len(args) > len(positional) or (old_call is not None and old_call(args))):
                moved = list(old_positional[:len(args)])
                if len(args) > len(old_positional):
                    raise TypeError(f"{owner}() takes at most {len(old_positional)} positional arguments, "
                                    f"got {len(args)}")
                kept = 0
                while kept < len(moved) and kept < len(positional) and moved[kept] == positional[kept]:
                    kept += 1
                for name, value in zip(moved[kept:], args[kept:]):
                    if name in kwargs:
                        raise TypeError(f"{owner}() got multiple values for argument {name!r}")
                    kwargs[name] = value
                notes.append((f"passing {', '.join(moved[kept:])} to {owner}() positionally",
                              "keyword arguments"))
                args = args[:kept]
            for old, new in renamed.items():
                if old in kwargs:
                    new, convert = new if isinstance(new, tuple) else (new, None)
                    _refuse_both(owner, old, new, kwargs)
                    value = kwargs.pop(old)
                    kwargs[new] = value if convert is None else convert(value)
                    notes.append((f"{owner}({old}=...)", f"{new}=..."))
            for new, (a, b) in pairs.items():
                if a in kwargs or b in kwargs:
                    _refuse_both(owner, a if a in kwargs else b, new, kwargs)
                    da, db = defaults[new]
                    kwargs[new] = (kwargs.pop(a, da), kwargs.pop(b, db))
                    notes.append((f"{owner}({a}=..., {b}=...)", f"{new}=({a}, {b})"))
            return args, kwargs, notes

        @functools.wraps(init)
        def wrapper(self, *args, **kwargs):
            args, kwargs, notes = translate(args, kwargs)
            for old, new in notes:
                warnings.warn(message(old, new), DeprecationWarning, stacklevel=2)
            return init(self, *args, **kwargs)

        return wrapper

    return decorate


def value_at(index: int, kind) -> Callable:
    """``old_call`` for :func:`legacy_arguments`: positional argument ``index`` is a ``kind``.

    E.g. a number where the new signature takes a pair (``Lion(1e-4, 0.9)``: the shipped
    ``b1``), or a bool where it takes a string.
    """
    return lambda args: len(args) > index and isinstance(args[index], kind)


def _refuse_both(owner: str, old: str, new: str, kwargs: dict) -> None:
    if new in kwargs:
        raise HyperparameterError(f"{owner}: {old}= is the deprecated spelling of {new}=; pass only {new}=")


def renamed_attribute(old: str, new: str, index: int | None = None) -> property:
    """A read-only property ``old`` that warns and returns ``self.<new>`` (or ``self.<new>[index]``)."""
    where = f".{new}" if index is None else f".{new}[{index}]"

    def get(self):
        warn(f"{type(self).__name__}.{old}", where)
        value = getattr(self, new)
        return value if index is None else value[index]

    get.__name__ = old
    return property(get, doc=f"Deprecated: {where[1:]}.")


def renamed_names(module: str, renamed: dict, namespace: dict) -> Callable[[str], object]:
    """A module ``__getattr__`` for names that ``module`` renamed: ``renamed`` maps each old
    name to the new one, looked up in ``namespace`` (the module's ``globals()``).

    ``module.<old>`` and ``from module import <old>`` warn and give the new object; any
    other missing name is an :class:`AttributeError`, as without the hook.
    """

    def __getattr__(name: str):
        new = renamed.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn(f"{module}.{name}", f"{module}.{new}")
        return namespace[new]

    return __getattr__


def moved_names(module: str, moved: dict) -> Callable[[str], object]:
    """A module ``__getattr__`` for a module whose names moved to other modules: ``moved`` maps each
    old name to ``"new.module:new_name"``, imported on first use. As :func:`renamed_names` otherwise."""

    def __getattr__(name: str):
        target = moved.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        where, new = target.split(":")
        warn(f"{module}.{name}", f"{where}.{new}")
        return getattr(importlib.import_module(where), new)

    return __getattr__
