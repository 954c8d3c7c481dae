"""The engine core: :class:`Engine` (:mod:`~arraytrain.engine.core`), the boundary's stages and what passes
between them (:mod:`~arraytrain.engine.stages`: the judge, its verdict, the step report), the state protocol
and the counters a state dict carries (:mod:`~arraytrain.engine.protocol`), the dict path's intake
(:mod:`~arraytrain.engine.intake`) and the call guard (:mod:`~arraytrain.engine.guard`).
"""

from __future__ import annotations

import importlib

__all__ = ["Engine", "STATE_FORMAT", "StepReport"]
_WHERE = {"Engine": "core", "STATE_FORMAT": "core", "StepReport": "stages"}


def __getattr__(name: str):
    """``Engine`` and the rest on first access: the intake and the guard, which the compressors and the
    bindings import, then do not import the engine (and the compressors it imports) with them."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
