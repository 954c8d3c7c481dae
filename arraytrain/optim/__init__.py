"""Optimizers: hyperparameters on the host, one fused kernel per step over the flat buffer."""

import inspect

from ._adagrad import Adagrad
from ._adafactor import Adafactor
from ._adam import Adam, AdamW
from ._base import Optimizer, OptState, check_optimizer  # noqa: F401 (the engine checks with it)
from ._lamb import LAMB
from ._lion import Lion
from ._rmsprop import RMSprop
from ._sam import SAM
from ._sgd import SGD
from ._sophia import Sophia
from ._adam_variants import Adamax, NAdam, RAdam
from ._adadelta import Adadelta
from ._muon import Muon
from ._schedule_free import ScheduleFreeAdamW

__all__ = [
    "by_name",
    "SGD",
    "Adam",
    "AdamW",
    "Adagrad",
    "RMSprop",
    "Lion",
    "LAMB",
    "Adafactor",
    "Sophia",
    "SAM",
    "NAdam",
    "RAdam",
    "Adamax",
    "Adadelta",
    "Optimizer",
    "OptState",
    "Muon",
    "ScheduleFreeAdamW",
]


def by_name() -> dict:
    """``{name: class}`` of the optimizers that need nothing but an lr, by their lower-case class name
    (``"adamw"``, ``"schedulefreeadamw"``, ...): the names ``arraytrain train --optimizer`` and
    ``arraytrain compile --optimizers`` take. SAM, which wraps another optimizer, is not one."""
    out = {}
    for name in __all__:
        cls = globals()[name]
        if not (isinstance(cls, type) and issubclass(cls, Optimizer)) or inspect.isabstract(cls):
            continue
        params = inspect.signature(cls).parameters
        if "lr" in params and all(p.default is not p.empty or n == "lr" for n, p in params.items()
                                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)):
            out[name.lower()] = cls
    return out
