"""Gradient compression with error feedback.

Every compressor turns the flat gradient into a :class:`Payload` of real
arrays (``payload.nbytes`` is measured, never nominal) and decodes it back;
:class:`ErrorFeedback` wraps any of them and keeps what was not sent as named
state. Pass one to ``Engine(..., compressor=...)``, or ``compressor="auto"``
(:class:`Auto`): dense or a compressor, chosen from the measured link and compute.
"""

from ._base import Compressor, Domain, ErrorFeedback, Payload, Segment
from ._auto import Auto, check_compressor, default_candidates  # noqa: F401 (the engine checks with check_compressor)
from ._powersgd import PowerSGD
from ._quant import Int8Block, Sign, Ternary
from ._sparse import RandomK, TopK
from ._vsa import VSA

__all__ = ["Auto", "Compressor", "Domain", "ErrorFeedback", "Int8Block", "Payload", "PowerSGD", "RandomK", "Segment",
           "Sign", "Ternary", "TopK", "VSA", "default_candidates"]
