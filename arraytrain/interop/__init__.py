"""Bindings to deep-learning frameworks: torch modules and JAX pytrees trained by an arraytrain Engine.

* :mod:`arraytrain.interop.torch`: ``bind(module, optimizer, **engine_kwargs)``
  makes the module's parameters and ``.grad`` tensors views of the engine's
  buffers and keeps them connected (``zero_grad``, frozen parameters, bf16/fp16
  models on float32 master weights, buffers in checkpoints, CUDA through DLPack).
* :mod:`arraytrain.interop.jax`: ``flatten``/``unflatten`` between pytrees and
  ``{name: array}``, and ``bind(params, optimizer, **engine_kwargs)``: an engine
  with a zero-copy pytree view of its parameters and a one-call gradient intake.

Neither torch nor JAX is imported until a function of these modules is called:
both stay optional (they are test and example dependencies of arraytrain only).
"""

from . import jax, torch

__all__ = [
    "jax",
    "torch",
]
