r"""Learning-rate schedules: closed-form functions of the optimizer step, plus reduce-on-plateau.

A schedule is called as ``lr = schedule(step, base_lr)`` once per applied
optimizer step. ``step`` is the number of optimizer steps already applied
(0 for the first update), which is torch's convention: the lr used by the
``(t+1)``-th ``optimizer.step()`` equals the torch scheduler's lr after ``t``
``scheduler.step()`` calls. ``base_lr`` is a float or a 1-D floating NumPy
array (per-parameter base lrs); the result is of the same kind (a float, or a
new float64 array of the same shape). Skipped steps do not advance ``step``;
that is the caller's business, since every schedule here is a pure function
of ``(step, base_lr)`` -- except :class:`ReduceLROnPlateau`, whose state moves
only through :meth:`Schedule.observe`.

Formulas, with :math:`b` the base lr and :math:`t` the step:

Names: a schedule that computes what a ``torch.optim.lr_scheduler`` class computes carries
that class's name and its argument names (without the optimizer: the base lr comes with each
call), so torch code ports by dropping the optimizer argument; the schedules torch has no
class for keep plain names (``Constant``, ``Warmup``, ``Sequential``, whose argument is a
list of ``(schedule, n_steps)`` pairs rather than torch's schedulers and milestones). A state
dict of format 1 (saved before torch's names were adopted: ``MultiStep``, ``Exponential``,
``Linear``, ``Cosine``, ``CosineWarmRestarts``, ``Polynomial``, ``OneCycle``,
``ReduceOnPlateau``; ``total_steps`` of LinearLR, CosineAnnealingLR and PolynomialLR,
``min_lr`` of CosineAnnealingLR, ``anneal`` of OneCycleLR) still loads: the loader reads
those names by the dict's format, and the API has one spelling of each.

- ``Constant()``: :math:`b`.
- ``StepLR(step_size, gamma)``: :math:`b\,\gamma^{\lfloor t / \text{step\_size} \rfloor}` (torch StepLR).
- ``MultiStepLR(milestones, gamma)``: :math:`b\,\gamma^{k}` with :math:`k = \#\{m \in
  \text{milestones} : m \le t\}`; a repeated milestone counts as often as it appears (torch MultiStepLR).
- ``ExponentialLR(gamma)``: :math:`b\,\gamma^{t}` (torch ExponentialLR).
- ``LinearLR(total_iters, start_factor, end_factor)``: :math:`b\,(s + (e - s)\,\min(t, T)/T)`
  (torch LinearLR; holds :math:`b\,e` from :math:`t = T` on).
- ``CosineAnnealingLR(T_max, eta_min)``: :math:`\eta_{min} + (b - \eta_{min})\,(1 + \cos(\pi t/T))/2`
  for :math:`t \le T`, and :math:`\eta_{min}` for :math:`t > T` (torch CosineAnnealingLR up to
  :math:`T`; SGDR, Loshchilov & Hutter 2017, without restarts). Past :math:`T` torch's formula
  climbs back up towards :math:`b` over the next :math:`T` steps; here the lr stays at
  :math:`\eta_{min}` (use :class:`CosineAnnealingWarmRestarts` for restarts).
- ``CosineAnnealingWarmRestarts(T_0, T_mult, eta_min)``: :math:`\eta_{min} + (b - \eta_{min})\,(1 +
  \cos(\pi T_{cur}/T_i))/2` where the cycles have lengths :math:`T_0, T_0 T_{mult}, T_0
  T_{mult}^2, \dots` and :math:`T_{cur}` is the position of :math:`t` inside cycle :math:`i`
  (torch CosineAnnealingWarmRestarts; found with integer arithmetic, so cycle ends are exact).
- ``PolynomialLR(total_iters, power)``: :math:`b\,(1 - \min(t, T)/T)^{p}` (torch PolynomialLR).
- ``OneCycleLR(total_steps, pct_start, anneal_strategy, div_factor, final_div_factor, three_phase)``
  (Smith & Topin 2017, torch OneCycleLR with ``max_lr = b``): with :math:`l_0 = b/\text{div}`,
  :math:`l_{min} = l_0/\text{final\_div}` and :math:`P = \text{pct\_start}\cdot T`, the phases
  end at steps :math:`P - 1` (:math:`l_0 \to b`) and :math:`T - 1` (:math:`b \to l_{min}`); with
  ``three_phase`` at :math:`P - 1` (:math:`l_0 \to b`), :math:`2P - 2` (:math:`b \to l_0`) and
  :math:`T - 1` (:math:`l_0 \to l_{min}`). Inside a phase running from step :math:`s_0` to
  :math:`s_1` from :math:`a` to :math:`z`, with :math:`q = (t - s_0)/(s_1 - s_0)`:
  ``anneal_strategy`` ``"cos"``: :math:`z + (a - z)(1 + \cos(\pi q))/2`; ``"linear"``: :math:`a + (z - a) q`.
  From :math:`t = T - 1` on the lr stays at :math:`l_{min}` (torch raises past :math:`T`).
- ``Warmup(steps, then, start_factor)``: :math:`b\,(s + (1 - s)\,t/W)` for :math:`t < W`, then
  ``then(t - W, b)``: torch ``SequentialLR([LinearLR(start_factor=s, total_iters=W), then],
  milestones=[W])``, where ``then`` starts from its own step 0.
- ``Sequential([(s_0, n_0), (s_1, n_1), ..., (s_k, None)])``: segment :math:`j` covers
  :math:`n_j` steps starting at :math:`N_j = n_0 + \dots + n_{j-1}` and is evaluated at its own
  local step :math:`t - N_j` (torch SequentialLR); the last segment runs for ever.
- ``ReduceLROnPlateau(inner, mode, factor, patience, threshold, threshold_mode, cooldown,
  min_lr, eps)``: torch ReduceLROnPlateau's rules. Each :meth:`~Schedule.observe` of a metric
  :math:`x` (once per epoch or evaluation) counts a bad epoch unless :math:`x` is better than
  the best so far -- ``min``/``rel``: :math:`x < best\,(1 - \theta)`; ``min``/``abs``:
  :math:`x < best - \theta`; ``max``/``rel``: :math:`x > best\,(1 + \theta)`; ``max``/``abs``:
  :math:`x > best + \theta` (a NaN is never better). During cooldown bad epochs are not
  counted; after more than ``patience`` bad epochs a reduction is recorded and cooldown
  starts. The lr at step :math:`t` replays the :math:`n` recorded reductions on the inner lr
  :math:`l = \text{inner}(t, b)`, element by element: :math:`n` times, :math:`l' = \max(l\cdot
  \text{factor}, \text{min\_lr})`, kept only if :math:`l - l' > \epsilon`. With a constant inner
  this is exactly torch's sequence of lrs, per parameter group, eps rule included; in general
  it is :math:`\max(\text{inner}\cdot \text{factor}^n, \text{min\_lr})` until a reduction would
  be smaller than ``eps``. ``min_lr`` only bounds the reductions: an inner lr already below it
  (e.g. during a warm-up) is left as it is.

Per-parameter base lrs (an array ``b``) go through the same formulas element by element.
The ``eta_min`` of ``CosineAnnealingLR`` and ``CosineAnnealingWarmRestarts`` is an absolute lr shared
by all elements, as torch's ``eta_min`` is shared by all parameter groups; ``OneCycleLR``'s lrs are all
proportional to ``b``. ``ReduceLROnPlateau`` reduces every element at the same observations (one
metric, as torch reduces every parameter group) with one absolute ``min_lr`` and the eps rule
applied per element.

Composition and metrics: :meth:`Schedule.observe` exists on every schedule, so a caller can
feed metrics without knowing the schedule. A composite (``Warmup``, ``Sequential``,
``ReduceLROnPlateau`` with a stateful inner) needs ``step``, the number of optimizer steps
applied so far, to route the metric to the segment that sets the next lr; the metrics seen
while another segment is active (e.g. during a warm-up) are not counted.

State: ``state_dict()`` is a JSON-serialisable dict (non-finite floats as the strings
``"inf"``, ``"-inf"``, ``"nan"``), holding the hyperparameters, nested schedules and
reduce-on-plateau's counters; :func:`from_state_dict` rebuilds any schedule from it, and
``load_state_dict`` restores it into a schedule of the same structure, validating all of it
before changing anything.
"""

from __future__ import annotations

from . import _base
from ._base import MAX_NESTING, Schedule, from_state_dict  # noqa: F401 (MAX_NESTING: how deep schedules nest)
from ._closed import (Constant, CosineAnnealingLR, CosineAnnealingWarmRestarts, ExponentialLR, LinearLR,
                      MultiStepLR, OneCycleLR, PolynomialLR, StepLR)
from ._composite import ReduceLROnPlateau, Sequential, Warmup

__all__ = ["Schedule", "Constant", "StepLR", "MultiStepLR", "ExponentialLR", "LinearLR", "CosineAnnealingLR",
           "CosineAnnealingWarmRestarts", "PolynomialLR", "OneCycleLR", "Warmup", "Sequential", "ReduceLROnPlateau",
           "from_state_dict", "SCHEDULE_FORMAT"]

#: The ``format`` of a schedule's :meth:`~Schedule.state_dict` (checked by :func:`from_state_dict`).
SCHEDULE_FORMAT = _base.SCHEDULE_FORMAT
