"""A minimal multilayer perceptron with hand-written backward, losses, metrics and a training loop.

Parameters are views of an :class:`~arraytrain.Engine`'s flat parameter buffer
and backward writes straight into its flat gradient buffer::

    model = nn.MLP([64, 128, 10], activation="relu")
    engine = at.Engine(model.init(seed=0), at.optim.AdamW(lr=1e-3), zero_grad_on_step=False)
    model.bind(engine)
    loss, dlogits = nn.softmax_cross_entropy(model.forward(x), y)
    model.backward(dlogits)
    engine.step()
"""

from ._array import array_namespace, to_numpy
from .callbacks import (
    Callback,
    Checkpoint,
    EarlyStopping,
    GradientMonitor,
    LambdaCallback,
    MagnitudePruning,
    Profiler,
    ProgressBar,
    ReduceLROnPlateauCallback,
)
from .data import Batches, DataError, Dataset, MissingDependencyError, Standardizer, load_digits, load_npz
from .init import he_normal, xavier_uniform
from .layers import GELU, MLP, Activation, Dense, ReLU, Sigmoid, Tanh, activation
from .losses import (
    binary_cross_entropy,
    dice_loss,
    focal_loss,
    log_softmax,
    mse,
    poly1_cross_entropy,
    softmax,
    softmax_cross_entropy,
)
from .metrics import accuracy, classification_report, confusion_matrix, precision_recall_f1
from .phase import Phase, PhaseCheckpoint, PhaseSchedule, PhaseStats, PhaseTrainer
from .trainer import Trainer

__all__ = [
    "GELU",
    "MLP",
    "Activation",
    "Batches",
    "Callback",
    "Checkpoint",
    "DataError",
    "Dataset",
    "Dense",
    "EarlyStopping",
    "GradientMonitor",
    "LambdaCallback",
    "MagnitudePruning",
    "MissingDependencyError",
    "Phase",
    "PhaseCheckpoint",
    "PhaseSchedule",
    "PhaseStats",
    "PhaseTrainer",
    "Profiler",
    "ProgressBar",
    "ReLU",
    "ReduceLROnPlateauCallback",
    "Sigmoid",
    "Standardizer",
    "Tanh",
    "Trainer",
    "accuracy",
    "activation",
    "array_namespace",
    "binary_cross_entropy",
    "classification_report",
    "confusion_matrix",
    "dice_loss",
    "focal_loss",
    "he_normal",
    "load_digits",
    "load_npz",
    "log_softmax",
    "mse",
    "poly1_cross_entropy",
    "precision_recall_f1",
    "softmax",
    "softmax_cross_entropy",
    "to_numpy",
    "xavier_uniform",
]
