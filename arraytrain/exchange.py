"""Deprecated: moved to :mod:`arraytrain.parallel.communicator` (one release: the old names warn)."""

from ._deprecation import moved_names

__all__: list[str] = []

__getattr__ = moved_names(__name__, {
    "Exchange": "arraytrain.parallel.communicator:Communicator",
    "LocalExchange": "arraytrain.parallel.communicator:LocalComm",
    "PerRank": "arraytrain.parallel.communicator:PerRank",
    "Pending": "arraytrain.parallel.communicator:Pending",
    "Done": "arraytrain.parallel.communicator:Done",
    "DONE": "arraytrain.parallel.communicator:DONE",
    "OPS": "arraytrain.parallel.communicator:OPS",
    "check_exchange": "arraytrain.parallel.communicator:check_comm",
    "agree_on_setup": "arraytrain.parallel.communicator:agree_on_setup",
    "block_length": "arraytrain.parallel.communicator:block_length",
    "check_buffer": "arraytrain.parallel.communicator:check_buffer",
})
