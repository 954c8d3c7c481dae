"""Optimizers: hyperparameters on the host, one fused kernel per step over the flat buffer."""

from ._adagrad import Adagrad
from ._adafactor import Adafactor
from ._adam import Adam, AdamW
from ._base import Optimizer, OptState
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
