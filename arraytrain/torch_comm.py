"""Deprecated: moved to :mod:`arraytrain.parallel.torch_dist` (one release: the old names warn)."""

from ._deprecation import moved_names

__all__: list[str] = []

__getattr__ = moved_names(__name__, {
    "TorchComm": "arraytrain.parallel.torch_dist:TorchComm",
    "TorchWork": "arraytrain.parallel.torch_dist:TorchWork",
    "INIT_HINT": "arraytrain.parallel.torch_dist:INIT_HINT",
})
