"""Optimizers: hyperparameters on the host, one fused kernel per step over the flat buffer."""

from ._adam import Adam, AdamW
from ._base import Optimizer, OptState
from ._sgd import SGD

__all__ = [
    "SGD",
    "Adam",
    "AdamW",
    "Optimizer",
    "OptState",
]
