"""The closed-form schedules: each a pure function of ``(step, base_lr)`` (see the package docstring)."""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping, Sequence

from .._checks import check_bool, check_choice, check_count, check_number, check_positive
from ..errors import HyperparameterError
from ._base import Schedule, register

ANNEAL = ("cos", "linear")


@register
class Constant(Schedule):
    """The base lr at every step."""

    def _lr(self, step, base):
        return base


@register
class StepLR(Schedule):
    r""":math:`b\,\gamma^{\lfloor t/\text{step\_size}\rfloor}` (torch.optim.lr_scheduler.StepLR)."""

    _fields = ("step_size", "gamma")

    def __init__(self, step_size: int, gamma: float = 0.1):
        self.step_size = check_count("step_size", step_size, 1)
        self.gamma = check_positive("gamma", gamma)

    def _lr(self, step, base):
        return base * self.gamma ** (step // self.step_size)


@register
class MultiStepLR(Schedule):
    r""":math:`b\,\gamma^{k}`, :math:`k` the number of milestones :math:`\le t` (torch MultiStepLR).

    ``milestones`` must be non-decreasing ints >= 0; a repeated milestone
    multiplies by ``gamma`` once per occurrence, as in torch.
    """

    _fields = ("milestones", "gamma")

    def __init__(self, milestones: Sequence[int], gamma: float = 0.1):
        if isinstance(milestones, (str, bytes, Mapping)) or not isinstance(milestones, Sequence):
            raise HyperparameterError(f"milestones: expected a sequence of ints, got {milestones!r}")
        ms = tuple(check_count(f"milestones[{i}]", m, 0) for i, m in enumerate(milestones))
        for i in range(1, len(ms)):
            if ms[i] < ms[i - 1]:
                raise HyperparameterError(f"milestones: expected a non-decreasing sequence, got {list(ms)}")
        self.milestones = ms
        self.gamma = check_positive("gamma", gamma)

    def _lr(self, step, base):
        return base * self.gamma ** bisect_right(self.milestones, step)


@register
class ExponentialLR(Schedule):
    r""":math:`b\,\gamma^{t}` (torch ExponentialLR)."""

    _fields = ("gamma",)

    def __init__(self, gamma: float):
        self.gamma = check_positive("gamma", gamma)

    def _lr(self, step, base):
        return base * self.gamma ** step


@register
class LinearLR(Schedule):
    r""":math:`b\,(s + (e - s)\min(t, T)/T)`, :math:`T` = ``total_iters`` (torch LinearLR;
    ``start_factor`` 0 is allowed here)."""

    _fields = ("total_iters", "start_factor", "end_factor")

    def __init__(self, total_iters: int, start_factor: float = 1.0 / 3, end_factor: float = 1.0):
        self.total_iters = check_count("total_iters", total_iters, 1)
        self.start_factor = check_number("start_factor", start_factor, 0.0, 1.0)
        self.end_factor = check_number("end_factor", end_factor, 0.0, 1.0)

    def _lr(self, step, base):
        s, e = self.start_factor, self.end_factor
        return base * (s + (e - s) * min(step, self.total_iters) / self.total_iters)


@register
class CosineAnnealingLR(Schedule):
    r"""Cosine annealing from :math:`b` to ``eta_min`` over ``T_max`` steps, then ``eta_min``.

    :math:`\eta_{min} + (b - \eta_{min})(1 + \cos(\pi t/T))/2` for :math:`t \le T`
    (torch CosineAnnealingLR; Loshchilov & Hutter 2017). For :math:`t > T` the lr stays
    at ``eta_min``, where torch's formula would rise again.
    """

    _fields = ("T_max", "eta_min")

    def __init__(self, T_max: int, eta_min: float = 0.0):  # noqa: N803 (torch's names)
        self.T_max = check_count("T_max", T_max, 1)
        self.eta_min = check_number("eta_min", eta_min, 0.0)

    def _lr(self, step, base):
        if step >= self.T_max:
            return base * 0.0 + self.eta_min
        c = 1.0 + math.cos(math.pi * step / self.T_max)
        return self.eta_min + (base - self.eta_min) * c / 2


@register
class CosineAnnealingWarmRestarts(Schedule):
    r"""SGDR (Loshchilov & Hutter 2017): cosine cycles of lengths :math:`T_0 T_{mult}^i`.

    :math:`\eta_{min} + (b - \eta_{min})(1 + \cos(\pi T_{cur}/T_i))/2`, torch
    CosineAnnealingWarmRestarts stepped without an epoch argument.
    """

    _fields = ("T_0", "T_mult", "eta_min")

    def __init__(self, T_0: int, T_mult: int = 1, eta_min: float = 0.0):
        self.T_0 = check_count("T_0", T_0, 1)
        self.T_mult = check_count("T_mult", T_mult, 1)
        self.eta_min = check_number("eta_min", eta_min, 0.0)

    def _position(self, step: int) -> tuple[int, int]:
        if self.T_mult == 1:
            return step % self.T_0, self.T_0
        t_cur, t_i = step, self.T_0
        while t_cur >= t_i:  # cycles grow geometrically: O(log step) iterations
            t_cur -= t_i
            t_i *= self.T_mult
        return t_cur, t_i

    def _lr(self, step, base):
        t_cur, t_i = self._position(step)
        return self.eta_min + (base - self.eta_min) * (1 + math.cos(math.pi * t_cur / t_i)) / 2


@register
class PolynomialLR(Schedule):
    r""":math:`b\,(1 - \min(t, T)/T)^{p}`, :math:`T` = ``total_iters`` (torch PolynomialLR)."""

    _fields = ("total_iters", "power")

    def __init__(self, total_iters: int, power: float = 1.0):
        self.total_iters = check_count("total_iters", total_iters, 1)
        self.power = check_positive("power", power)

    def _lr(self, step, base):
        return base * (1.0 - min(step, self.total_iters) / self.total_iters) ** self.power


@register
class OneCycleLR(Schedule):
    r"""The 1cycle policy (Smith & Topin 2017), torch OneCycleLR with ``max_lr = base_lr``.

    Starts at ``base_lr / div_factor``, rises to ``base_lr`` over the first
    ``pct_start * total_steps - 1`` steps, then anneals to
    ``base_lr / div_factor / final_div_factor`` at step ``total_steps - 1``
    (``three_phase``: back to the start lr first, then to the minimum). The lr
    stays at the minimum from ``total_steps - 1`` on. ``anneal_strategy``: ``"cos"`` or
    ``"linear"``. Momentum cycling is not part of a learning-rate schedule and is not done.
    """

    _fields = ("total_steps", "pct_start", "anneal_strategy", "div_factor", "final_div_factor", "three_phase")

    def __init__(self, total_steps: int, pct_start: float = 0.3, anneal_strategy: str = "cos",
                 div_factor: float = 25.0, final_div_factor: float = 1e4, three_phase: bool = False):
        self.total_steps = check_count("total_steps", total_steps, 2)
        self.pct_start = check_number("pct_start", pct_start, 0.0, 1.0, lo_open=True, hi_open=True)
        self.anneal_strategy = check_choice("anneal_strategy", anneal_strategy, ANNEAL)
        self.div_factor = check_positive("div_factor", div_factor)
        self.final_div_factor = check_positive("final_div_factor", final_div_factor)
        self.three_phase = check_bool("three_phase", three_phase)
        # torch's phase ends, in its float arithmetic
        p = float(self.pct_start * self.total_steps)
        if p - 1 <= 0:
            raise HyperparameterError(f"pct_start: pct_start * total_steps = {p!r} must exceed 1 so that the "
                                      "warm-up phase has a length")
        if self.three_phase:
            ends = (p - 1, float(2 * self.pct_start * self.total_steps) - 2, self.total_steps - 1)
            if ends[1] >= ends[2]:
                raise HyperparameterError(f"pct_start: with three_phase, 2 * pct_start * total_steps - 2 = {ends[1]!r} "
                                          f"must be below total_steps - 1 = {ends[2]}")
            self._phases = ((ends[0], "initial", "max"), (ends[1], "max", "initial"), (ends[2], "initial", "min"))
        else:
            self._phases = ((p - 1, "initial", "max"), (self.total_steps - 1, "max", "min"))

    def _lr(self, step, base):
        initial = base / self.div_factor
        lrs = {"initial": initial, "max": base, "min": initial / self.final_div_factor}
        step = min(step, self.total_steps - 1)
        start = 0.0
        for i, (end, a, z) in enumerate(self._phases):
            if step <= end or i == len(self._phases) - 1:
                pct = (step - start) / (end - start)
                a, z = lrs[a], lrs[z]
                if self.anneal_strategy == "cos":
                    return z + (a - z) / 2.0 * (math.cos(math.pi * pct) + 1)
                return (z - a) * pct + a
            start = end
        raise AssertionError("unreachable: the last phase always matches")
