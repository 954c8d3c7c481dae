"""Parameters without a gradient: torch's rule, and the step count each parameter keeps.

torch's optimizers skip a parameter whose ``.grad`` is None: that step leaves its weights and its
state alone and does not advance its own step count, so its bias corrections later come from the
steps it took. An engine built with ``missing="skip"`` does the same (the drop-in optimizers and
``bind`` build theirs so):

* a window's *absent* parameters are those that had no gradient in any of its micro-batches
  (a name left out of ``step(grads)``, or named in ``step(absent=...)``); with a group of
  processes a parameter is present when any rank had a gradient for it (DDP's
  ``find_unused_parameters``), agreed by one small all-reduce at every boundary;
* at the boundary the optimizer's kernels walk the present parameters' pieces only
  (:class:`~arraytrain.buffer.Subset`), once per distinct step count among them, each with the
  bias corrections of its own count; absent parameters are not read or written;
* ``OptState.counts`` holds the per-parameter counts where they differ from ``OptState.step``
  (None while every parameter took every applied step: then a step is one launch, as before).
  ``OptState.step`` still counts the engine's applied steps (the schedule's clock).

* a scalar state (NAdam's ``mu_product``) that comes to differ between parameters is kept per
  parameter in ``OptState.param_scalars`` (float64 by segment; the one scalar again once they agree).

Only optimizers whose update depends on nothing but their element-wise slots, scalar states and the
step count (``Optimizer.per_param_steps``) can run on a subset this way; the others (schedule-free's
averaging weights, Adafactor's and Muon's per-matrix work, SAM's two windows) are refused
``missing="skip"``.
"""

from __future__ import annotations

import numpy as np

from .errors import HyperparameterError


def check_skip_capable(optimizer) -> None:
    """``missing="skip"`` needs an optimizer that can step some parameters alone."""
    if not optimizer.per_param_steps:
        raise HyperparameterError(
            f"missing: 'skip' steps only the parameters that have a gradient, each at its own step count; "
            f"{type(optimizer).__name__} cannot ({optimizer.per_param_steps_refusal}): use missing='zero'")


def mark(absent, layout, names, first: bool):
    """The window's absent parameters after a micro-batch without gradients for ``names``: a bool
    array by segment (True: no gradient yet in this window), or None when every parameter had one."""
    if not names:
        return None
    now = np.zeros(len(layout), dtype=bool)
    now[[layout.index(n) for n in names]] = True
    if first:
        return now
    return None if absent is None else (absent & now if (absent & now).any() else None)


def agree(comm, absent, nseg: int):
    """Absent on every rank: a parameter counts as having a gradient when any rank had one. With a
    group of processes a collective (one all-reduce of ``nseg`` counts) that every rank calls at every
    boundary, whatever its own window held."""
    if comm.is_local:
        return absent
    here = np.zeros(nseg) if absent is None else absent.astype(np.float64)
    comm.allreduce(here, "sum")
    everywhere = here == comm.size
    return everywhere if everywhere.any() else None


def groups(absent, counts, step: int):
    """The present parameters by step count: ``[(count, keep)]``, ``keep`` a bool array by segment
    (None: every parameter, all at ``step``), in increasing count."""
    if counts is None:
        return [(step, None if absent is None else ~absent)]
    present = np.ones(counts.size, dtype=bool) if absent is None else ~absent
    return [(int(c), present & (counts == c)) for c in np.unique(counts[present])]


def advanced(absent, counts, step: int, nseg: int):
    """The per-parameter counts after an applied step at ``step`` (the count before it): None while
    they all equal the engine's step count."""
    if counts is None:
        if absent is None:
            return None
        counts = np.full(nseg, step, dtype=np.int64)
    else:
        counts = counts.copy()
    counts[slice(None) if absent is None else ~absent] += 1
    return None if (counts == step + 1).all() else counts


def pieces_of(pieces, keep):
    """The rows of a pieces table whose parameter ``keep`` holds (read-only, as the kernels take tables)."""
    if keep is None:
        return pieces
    out = np.ascontiguousarray(pieces[keep[pieces[:, 2]]])
    out.flags.writeable = False
    return out


def value_of(state, key: str, seg: int) -> float:
    """Parameter ``seg``'s value of the scalar state ``key``."""
    each = state.param_scalars.get(key)
    return state.scalars[key] if each is None else float(each[seg])


def set_values(state, key: str, values: np.ndarray) -> None:
    """Every parameter's value of the scalar state ``key`` (float64 by segment) into ``state``: the one
    scalar where they all agree, else ``state.param_scalars[key]`` (``values`` itself, kept)."""
    if (values == values[0]).all():
        state.scalars[key] = float(values[0])
        state.param_scalars.pop(key, None)
    else:
        state.param_scalars[key] = values
