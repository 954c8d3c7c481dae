"""Deprecated: moved to :mod:`arraytrain.parallel.sync` (one release: the old names warn)."""

from ._deprecation import moved_names

__all__: list[str] = []

__getattr__ = moved_names(__name__, {
    "BUCKET_BYTES": "arraytrain.parallel.sync:BUCKET_BYTES",
    "Bucket": "arraytrain.parallel.sync:Bucket",
    "buckets": "arraytrain.parallel.sync:buckets",
})
