"""Deprecated: moved to :mod:`arraytrain.parallel.shard` (one release: the old names warn)."""

from ._deprecation import moved_names

__all__: list[str] = []

__getattr__ = moved_names(__name__, {
    "Partition": "arraytrain.parallel.shard:Partition",
    "ShardBuffer": "arraytrain.parallel.shard:ShardBuffer",
    "ShardLayout": "arraytrain.parallel.shard:ShardLayout",
    "partition": "arraytrain.parallel.shard:partition",
    "aligned_to": "arraytrain.parallel.shard:aligned_to",
    "padded_buffer": "arraytrain.parallel.shard:padded_buffer",
    "gather": "arraytrain.parallel.shard:gather",
    "template": "arraytrain.parallel.shard:template",
    "check_arrays": "arraytrain.parallel.shard:check_arrays",
    "own_part": "arraytrain.parallel.shard:own_part",
})
