"""The drop-in optimizers: torch's constructors as tables, each with the arraytrain optimizer it steps with.

A class declares ``HYPERPARAMETERS`` (torch's positional and keyword-only hyperparameters, in
torch's order, with torch's defaults), from which :class:`~._torch_optim.TorchOptimizer` builds
its signature and constructor, and :meth:`arraytrain_optimizer`, the :mod:`arraytrain.optim`
optimizer of one group's values. :data:`~._torch_views.DROP_INS` names them.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping

import torch

from .. import optim
from ..errors import ConcurrentUseError, HyperparameterError, LayoutError
from ._torch_groups import flag
from ._torch_optim import TorchOptimizer
from ._torch_options import OPTIONS
from ._torch_views import DROP_INS

__all__ = list(DROP_INS)

PUBLIC_MODULE = "arraytrain.interop.torch"
ADAM_BETAS = (0.9, 0.999)


class Adam(TorchOptimizer):
    """torch.optim.Adam's constructor, :class:`arraytrain.optim.Adam`'s step (AdamW's with ``decoupled_weight_decay``)."""

    TUNABLE = ("betas",)
    HYPERPARAMETERS = ((("lr", 1e-3), ("betas", ADAM_BETAS), ("eps", 1e-8), ("weight_decay", 0), ("amsgrad", False)),
                       (("foreach", None), ("maximize", False), ("capturable", False), ("differentiable", False),
                        ("fused", None), ("decoupled_weight_decay", False)))

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.Adam`, or :class:`~arraytrain.optim.AdamW` with ``decoupled_weight_decay``."""
        cls = optim.AdamW if flag(values, "decoupled_weight_decay") else optim.Adam
        return cls(values["lr"], values["betas"], values["eps"], values["weight_decay"], values["amsgrad"],
                   maximize=values["maximize"], state_dtype=self.state_dtype)


class AdamW(Adam):
    """torch.optim.AdamW's constructor, :class:`arraytrain.optim.AdamW`'s step (decoupled weight decay)."""

    HYPERPARAMETERS = ((("lr", 1e-3), ("betas", ADAM_BETAS), ("eps", 1e-8), ("weight_decay", 1e-2), ("amsgrad", False)),
                       (("maximize", False), ("foreach", None), ("capturable", False), ("differentiable", False),
                        ("fused", None)))
    FIXED = {"decoupled_weight_decay": True}


class SGD(TorchOptimizer):
    """torch.optim.SGD's constructor, :class:`arraytrain.optim.SGD`'s step (momentum, dampening, Nesterov)."""

    TUNABLE = ("momentum",)
    HYPERPARAMETERS = ((("lr", 1e-3), ("momentum", 0), ("dampening", 0), ("weight_decay", 0), ("nesterov", False)),
                       (("maximize", False), ("foreach", None), ("differentiable", False), ("fused", None)))

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.SGD` of one group's values."""
        return optim.SGD(values["lr"], values["momentum"], values["dampening"], values["weight_decay"],
                         values["nesterov"], maximize=values["maximize"], state_dtype=self.state_dtype)


class Adagrad(TorchOptimizer):
    """torch.optim.Adagrad's constructor, :class:`arraytrain.optim.Adagrad`'s step."""

    HYPERPARAMETERS = ((("lr", 1e-2), ("lr_decay", 0), ("weight_decay", 0), ("initial_accumulator_value", 0),
                        ("eps", 1e-10), ("foreach", None)),
                       (("maximize", False), ("differentiable", False), ("fused", None)))

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.Adagrad` of one group's values."""
        return optim.Adagrad(values["lr"], values["lr_decay"], values["weight_decay"],
                             values["initial_accumulator_value"], values["eps"], maximize=values["maximize"],
                             state_dtype=self.state_dtype)


class RMSprop(TorchOptimizer):
    """torch.optim.RMSprop's constructor, :class:`arraytrain.optim.RMSprop`'s step (momentum, centered)."""

    TUNABLE = ("momentum",)
    HYPERPARAMETERS = ((("lr", 1e-2), ("alpha", 0.99), ("eps", 1e-8), ("weight_decay", 0), ("momentum", 0),
                        ("centered", False), ("capturable", False), ("foreach", None), ("maximize", False),
                        ("differentiable", False)),
                       ())

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.RMSprop` of one group's values."""
        return optim.RMSprop(values["lr"], values["alpha"], values["eps"], values["weight_decay"], values["momentum"],
                             values["centered"], maximize=values["maximize"], state_dtype=self.state_dtype)


class NAdam(TorchOptimizer):
    """torch.optim.NAdam's constructor, :class:`arraytrain.optim.NAdam`'s step (``mu_product`` in each
    parameter's state, its own where parameters skipped steps for want of a gradient, as torch's)."""

    TUNABLE = ("betas",)
    HYPERPARAMETERS = ((("lr", 2e-3), ("betas", ADAM_BETAS), ("eps", 1e-8), ("weight_decay", 0),
                        ("momentum_decay", 4e-3), ("decoupled_weight_decay", False)),
                       (("foreach", None), ("maximize", False), ("capturable", False), ("differentiable", False)))

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.NAdam` of one group's values."""
        return optim.NAdam(values["lr"], values["betas"], values["eps"], values["weight_decay"],
                           values["momentum_decay"], values["decoupled_weight_decay"], maximize=values["maximize"],
                           state_dtype=self.state_dtype)


class RAdam(TorchOptimizer):
    """torch.optim.RAdam's constructor, :class:`arraytrain.optim.RAdam`'s step."""

    TUNABLE = ("betas",)
    HYPERPARAMETERS = ((("lr", 1e-3), ("betas", ADAM_BETAS), ("eps", 1e-8), ("weight_decay", 0),
                        ("decoupled_weight_decay", False)),
                       (("foreach", None), ("maximize", False), ("capturable", False), ("differentiable", False)))

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.RAdam` of one group's values."""
        return optim.RAdam(values["lr"], values["betas"], values["eps"], values["weight_decay"],
                           values["decoupled_weight_decay"], maximize=values["maximize"], state_dtype=self.state_dtype)


class Adamax(TorchOptimizer):
    """torch.optim.Adamax's constructor, :class:`arraytrain.optim.Adamax`'s step."""

    TUNABLE = ("betas",)
    HYPERPARAMETERS = ((("lr", 2e-3), ("betas", ADAM_BETAS), ("eps", 1e-8), ("weight_decay", 0), ("foreach", None)),
                       (("maximize", False), ("differentiable", False), ("capturable", False)))

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.Adamax` of one group's values."""
        return optim.Adamax(values["lr"], values["betas"], values["eps"], values["weight_decay"],
                            maximize=values["maximize"], state_dtype=self.state_dtype)


class Adadelta(TorchOptimizer):
    """torch.optim.Adadelta's constructor, :class:`arraytrain.optim.Adadelta`'s step."""

    HYPERPARAMETERS = ((("lr", 1.0), ("rho", 0.9), ("eps", 1e-6), ("weight_decay", 0), ("foreach", None)),
                       (("capturable", False), ("maximize", False), ("differentiable", False)))

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.Adadelta` of one group's values."""
        return optim.Adadelta(values["lr"], values["rho"], values["eps"], values["weight_decay"],
                              maximize=values["maximize"], state_dtype=self.state_dtype)


class Adafactor(TorchOptimizer):
    """torch.optim.Adafactor's constructor, :class:`arraytrain.optim.Adafactor`'s step (factored second moments).

    ``state_dtype`` and ``min_8bit_size`` are refused with a typed error: arraytrain's Adafactor keeps
    its factored state in the parameters' dtype.
    """

    takes_state_dtype = False
    HYPERPARAMETERS = ((("lr", 1e-2), ("beta2_decay", -0.8), ("eps", (None, 1e-3)), ("d", 1.0), ("weight_decay", 0.0)),
                       (("foreach", None), ("maximize", False)))

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.Adafactor` of one group's values."""
        return optim.Adafactor(values["lr"], values["beta2_decay"], values["eps"], values["d"], values["weight_decay"],
                               maximize=values["maximize"])


class Muon(TorchOptimizer):
    """torch.optim.Muon's constructor, :class:`arraytrain.optim.Muon`'s step: matrices only, as torch's.

    Parameters with two or more dimensions (a >2-D one as its first dimension by the rest);
    give biases, norms and embeddings to another optimizer (e.g. this module's ``AdamW``), as
    with torch's Muon.
    """

    HYPERPARAMETERS = ((("lr", 1e-3), ("weight_decay", 0.1), ("momentum", 0.95), ("nesterov", True),
                        ("ns_coefficients", (3.4445, -4.775, 2.0315)), ("eps", 1e-7), ("ns_steps", 5),
                        ("adjust_lr_fn", None)),
                       ())

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``; every parameter must have two or more dimensions."""
        if isinstance(param_group, dict) and "params" in param_group:
            params = param_group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            for j, item in enumerate(params):
                name, p = item if isinstance(item, tuple) and len(item) == 2 else (f"params[{j}]", item)
                if isinstance(p, torch.Tensor) and p.dim() < 2:
                    raise LayoutError(f"{name!r}: Muon updates matrices (2 or more dims), got shape "
                                      f"{tuple(p.shape)}; give biases and norms to another optimizer, e.g. AdamW")
            param_group = {**param_group, "params": params}
        super().add_param_group(param_group)

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.Muon` of one group's values (no fallback: matrices only)."""
        return optim.Muon(values["lr"], values["weight_decay"], values["momentum"], values["nesterov"],
                          values["ns_coefficients"], values["eps"], values["ns_steps"], values["adjust_lr_fn"],
                          state_dtype=self.state_dtype)


class Lion(TorchOptimizer):
    """:class:`arraytrain.optim.Lion` (Chen et al., 2023) as a torch optimizer; arraytrain's names and defaults."""

    TUNABLE = ("betas",)
    HYPERPARAMETERS = ((("lr", 1e-4), ("betas", (0.9, 0.99)), ("weight_decay", 1e-3)), (("maximize", False),))

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.Lion` of one group's values."""
        return optim.Lion(values["lr"], values["betas"], values["weight_decay"], maximize=values["maximize"],
                          state_dtype=self.state_dtype)


class LAMB(TorchOptimizer):
    """:class:`arraytrain.optim.LAMB` (You et al., 2020) as a torch optimizer; arraytrain's names and defaults."""

    TUNABLE = ("betas",)
    HYPERPARAMETERS = ((("lr", 1e-3), ("betas", ADAM_BETAS), ("eps", 1e-6), ("weight_decay", 0.0)),
                       (("eps_root", 0.0), ("maximize", False)))

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.LAMB` of one group's values."""
        return optim.LAMB(values["lr"], values["betas"], values["eps"], values["weight_decay"],
                          eps_root=values["eps_root"], maximize=values["maximize"], state_dtype=self.state_dtype)


class Sophia(TorchOptimizer):
    """:class:`arraytrain.optim.Sophia` (Liu et al., 2023) as a torch optimizer, with SophiaG's ``update_hessian``.

    Every k steps, take the gradient of the loss on labels sampled from the model's own
    output distribution (the Gauss-Newton-Bartlett estimator), call :meth:`update_hessian`,
    then zero the gradients and take the ordinary step's gradient. ``state_dtype`` and
    ``min_8bit_size`` are refused with a typed error (arraytrain's Sophia takes none).
    """

    takes_state_dtype = False
    TUNABLE = ("betas",)
    HYPERPARAMETERS = ((("lr", 1e-4), ("betas", (0.965, 0.99)), ("rho", 0.04), ("weight_decay", 0.1)),
                       (("eps", 1e-15), ("bs", 5120), ("maximize", False)))

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.Sophia` of one group's values."""
        return optim.Sophia(values["lr"], values["betas"], values["rho"], values["weight_decay"], eps=values["eps"],
                            bs=values["bs"], maximize=values["maximize"])

    @torch.no_grad()
    def update_hessian(self) -> None:
        """SophiaG's ``update_hessian``: ``h <- beta2 h + (1 - beta2) g*g`` from each parameter's ``.grad``.

        A parameter whose ``.grad`` is None counts as a zero estimate. The gradients are read, not changed.
        """
        if self._evaluating is not None:
            raise ConcurrentUseError("update_hessian: the optimizer is in eval() mode; call train() first")
        self.read_param_groups()
        for c in self._cohorts:
            estimates = {}
            for name, p, *_ in c.engine.bound:
                g = p.grad
                est = torch.zeros(p.shape, dtype=torch.float32, device=p.device) if g is None else g.float().square()
                estimates[name] = est.numpy() if est.device.type == "cpu" else est
            c.engine.update_hessian(estimates)


class ScheduleFreeAdamW(TorchOptimizer):
    """:class:`arraytrain.optim.ScheduleFreeAdamW` (Defazio et al., 2024) as a torch optimizer.

    As the ``schedulefree`` package's optimizers: call :meth:`train` before training steps
    and :meth:`eval` before evaluating or saving the model, whose parameters then hold the
    averaged weights x (while training they hold y, where gradients are taken).
    """

    TUNABLE = ("betas",)
    HYPERPARAMETERS = ((("lr", 0.0025), ("betas", ADAM_BETAS), ("eps", 1e-8), ("weight_decay", 0.0),
                        ("warmup_steps", 0), ("weight_lr_power", 2.0)),
                       (("maximize", False),))

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.ScheduleFreeAdamW` of one group's values."""
        return optim.ScheduleFreeAdamW(values["lr"], values["betas"], values["eps"], values["weight_decay"],
                                       values["warmup_steps"], values["weight_lr_power"], maximize=values["maximize"],
                                       state_dtype=self.state_dtype)

    def eval(self) -> None:
        """The parameters hold the evaluation weights x until :meth:`train` (no-op when already there)."""
        if self._evaluating is not None:
            return
        stack = contextlib.ExitStack()
        try:
            for c in self._cohorts:
                stack.enter_context(c.engine.evaluation())
        except BaseException:
            stack.close()
            raise
        self._evaluating = stack

    def train(self) -> None:
        """The parameters hold y again, bit for bit (no-op when already there)."""
        if self._evaluating is None:
            return
        stack, self._evaluating = self._evaluating, None
        stack.close()


class SAM(TorchOptimizer):
    """SAM / ASAM (Foret et al., 2021; Kwon et al., 2021) over a base optimizer, davda54/sam's constructor.

    ``SAM(params, AdamW, rho=0.05, adaptive=False, lr=..., weight_decay=...)``: the base is one
    of this module's classes (or the torch.optim class of the same name), its hyperparameters
    given as keywords; the groups hold them with ``rho`` and ``adaptive``.
    :meth:`~TorchOptimizer.step` needs a closure (zero the gradients if you like, compute the
    loss, ``backward()``, return the loss): it is called at the weights, then at the ascent
    point; the base step is then taken from the weights with the second gradient.
    """

    two_windows = True

    def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, **kwargs):
        options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
        self.base_optimizer = base_class(base_optimizer)
        self.takes_state_dtype = self.base_optimizer.takes_state_dtype
        try:
            defaults = self.base_optimizer.group_defaults(**kwargs)
        except TypeError as exc:
            raise HyperparameterError(f"base_hyperparameters: {exc}") from None
        defaults.update(rho=rho, adaptive=adaptive)
        self.setup(params, defaults, options)

    def arraytrain_optimizer(self, values: Mapping):
        """:class:`arraytrain.optim.SAM` over the base's arraytrain optimizer (which makes the state)."""
        base = self.base_optimizer.arraytrain_optimizer(self, values)
        base.min_8bit_size = self.min_8bit_size
        return optim.SAM(base, values["rho"], values["adaptive"])

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``, before the first step only: SAM's ascent is along the whole gradient."""
        if self._built and any(c.engine.state.step for c in self._cohorts):
            raise LayoutError("add_param_group: SAM perturbs all parameters along one gradient norm; a group "
                              "added after the first step (with a step count of its own) is not supported")
        super().add_param_group(param_group)


def _sam_signature():
    """SAM's constructor as its signature shows it (the options by name; the base's hyperparameters)."""
    P = inspect.Parameter
    return inspect.Signature(
        [P("params", P.POSITIONAL_OR_KEYWORD), P("base_optimizer", P.POSITIONAL_OR_KEYWORD),
         P("rho", P.POSITIONAL_OR_KEYWORD, default=0.05), P("adaptive", P.POSITIONAL_OR_KEYWORD, default=False)]
        + [P(n, P.KEYWORD_ONLY, default=d) for n, d in OPTIONS.items()]
        + [P("base_hyperparameters", P.VAR_KEYWORD)])


SAM.__signature__ = _sam_signature()


def base_class(base):
    """SAM's base: one of the drop-in classes but SAM, by class, by name or by the torch.optim class of that name."""
    mine = {n: globals()[n] for n in DROP_INS if n not in ("SAM", "TorchOptimizer")}
    if isinstance(base, str) and base in mine:
        return mine[base]
    if isinstance(base, type) and issubclass(base, TorchOptimizer) and base is not SAM and base is not TorchOptimizer:
        return base
    if isinstance(base, type) and issubclass(base, torch.optim.Optimizer) and base.__name__ in mine:
        return mine[base.__name__]
    raise HyperparameterError(f"base_optimizer: expected one of {sorted(mine)} (a class of "
                              f"arraytrain.interop.torch, the torch.optim class of that name, or the name), got {base!r}")


for _name in DROP_INS:
    globals()[_name].__module__ = PUBLIC_MODULE
