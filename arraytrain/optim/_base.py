"""The optimizer protocol: hyperparameters on the host, state in flat buffers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from ..buffer import FlatBuffer


@dataclass
class OptState:
    """Optimizer state: a step count and named flat buffers of the parameters' layout."""

    step: int = 0
    slots: dict[str, FlatBuffer] = field(default_factory=dict)


class Optimizer(ABC):
    """Base class. Subclasses set ``slot_names`` and implement :meth:`update`.

    ``update`` runs one fused kernel over the whole flat buffer. ``gscale``
    multiplies the gradient inside that kernel (clip factor, accumulation mean,
    loss-scale unscale), so no pass is spent rescaling the gradient buffer.
    """

    lr: float

    @property
    @abstractmethod
    def slot_names(self) -> tuple[str, ...]:
        """Names of the state buffers this configuration keeps."""

    @abstractmethod
    def hyperparameters(self) -> dict:
        """The constructor arguments, for repr and checkpoints."""

    def init(self, params: FlatBuffer) -> OptState:
        return OptState(0, {name: params.zeros_like() for name in self.slot_names})

    @abstractmethod
    def update(self, kernels, params: FlatBuffer, grads: FlatBuffer, state: OptState, *,
               gscale: float = 1.0, lr: float | None = None, zero_grad: bool = False) -> None:
        """One step in place: params and every slot, then ``state.step += 1``.

        ``zero_grad`` also zeroes the gradient buffer inside the same kernel.
        """

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}({args})"
