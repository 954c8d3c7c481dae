"""Schedule state dicts of format 1, saved before torch's names were adopted: read with today's names."""

from __future__ import annotations

from collections.abc import Mapping

#: format 1's class names -> today's
FORMAT_1_TYPES = {
    "MultiStep": "MultiStepLR",
    "Exponential": "ExponentialLR",
    "Linear": "LinearLR",
    "Cosine": "CosineAnnealingLR",
    "CosineWarmRestarts": "CosineAnnealingWarmRestarts",
    "Polynomial": "PolynomialLR",
    "OneCycle": "OneCycleLR",
    "ReduceOnPlateau": "ReduceLROnPlateau",
}
#: format 1's field names -> today's, by today's class name
_FORMAT_1_FIELDS = {
    "LinearLR": {"total_steps": "total_iters"},
    "CosineAnnealingLR": {"total_steps": "T_max", "min_lr": "eta_min"},
    "PolynomialLR": {"total_steps": "total_iters"},
    "OneCycleLR": {"anneal": "anneal_strategy"},
}


def from_format_1(d: Mapping) -> dict:
    """A format-1 state dict with today's type and field names (its nested schedules stay format 1)."""
    typ = FORMAT_1_TYPES.get(d["type"], d["type"])
    renames = {old: new for old, new in _FORMAT_1_FIELDS.get(typ, {}).items() if old in d and new not in d}
    return {renames.get(k, k): v for k, v in d.items()} | {"type": typ}

