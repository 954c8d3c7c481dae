"""Data parallelism: the communicator, and the two strategies an engine picks once.

- :mod:`~arraytrain.parallel.communicator`: the interface to a group of processes
  (:class:`Communicator`, :class:`LocalComm` for one process); its transports are
  :mod:`~arraytrain.parallel.mpi` (MPI, NCCL) and :mod:`~arraytrain.parallel.torch_dist`
  (torch.distributed). :mod:`arraytrain.distributed` is their public face. MPI's waits
  are held to a deadline (:mod:`~arraytrain.parallel.deadline`), and its nonblocking
  collectives moved on by a thread while the process computes
  (:mod:`~arraytrain.parallel.progress`).
- :mod:`~arraytrain.parallel.placement`: which weights, gradients and state a rank holds
  (replicated or sharded), the reduce of a window's gradient, the norm's partial sums, the
  update of what the rank owns and the publish after it.
- :mod:`~arraytrain.parallel.sync`: when the gradient crosses the ranks (blocking at the
  boundary, bucketed while the backward pass runs, or through a compressor).
- :mod:`~arraytrain.parallel.shard`: partitions of a flat buffer, and moving name-keyed
  arrays (state dicts, checkpoints) in and out of them.

The Engine's parallel arguments
-------------------------------

``comm`` (a :class:`Communicator` or None)
    Data-parallel training over a group of processes (e.g.
    :class:`arraytrain.distributed.MPIComm`); None: this process alone. Every rank feeds its
    share of the batch; at each boundary the gradient is summed over ranks with the window's
    weight sum before the norm pass, so every rank skips, clips and steps identically. The
    ranks must agree on the layout, dtype, optimizer and settings (else the same error on
    every rank), and start from rank 0's parameters (broadcast).
``shard_state`` (bool, the :class:`~arraytrain.parallel.placement.Sharded` placement)
    With ``comm``: each rank keeps and updates one partition of the optimizer state (ZeRO
    stage 1-2), and under a working copy of the float32 master weights too (then
    ``engine.params`` is this rank's :class:`~arraytrain.parallel.shard.ShardBuffer`;
    ``engine.gather_params()`` assembles them). A boundary is one reduce-scatter, the norm
    from the partitions' sums, the own partition's update and one all-gather. Muon,
    Adafactor, Sophia, SAM and a compressor are refused on every rank; 8-bit state lays
    every offset on a 256-element quantization block. The placement lays the parameters out with the
    exchange's buckets dealt to the ranks in turn
    (:func:`~arraytrain.parallel.shard.interleaved`), so the engine's ``layout`` may order
    them otherwise than ``params``: read and write them by name. State dicts and
    checkpoints keep the name-keyed form, so they load on any number of ranks;
    ``engine.memory()`` reports the bytes per rank.
``overlap`` (bool, the :class:`~arraytrain.parallel.sync.BucketedSync` gradient sync)
    With ``comm``: exchange the gradient in buckets that start while the backward pass
    still runs: during a window's last micro-batch ``engine.mark_ready`` (the torch
    binding's hooks and the MLP's backward call it) says which gradients are final. The
    result equals the blocking exchange's (bitwise with 2 ranks). Off by default in the
    Engine; ``bind(..., comm=...)`` turns it on. Not with a compressor or SAM, whose
    exchanges need the whole window.
``bucket_bytes`` (int or None)
    The overlapped exchange's bucket size; None (the default): an eighth of the gradient, at
    least 1 MiB and at most 25 MiB, DDP's bucket size
    (:func:`~arraytrain.parallel.sync.default_bucket_bytes`).
``compressor`` (Compressor, ErrorFeedback, Auto, ``"auto"`` or None; the :class:`~arraytrain.parallel.sync.CompressedSync` gradient sync)
    A compressor from :mod:`arraytrain.compress` (optionally in
    :class:`~arraytrain.compress.ErrorFeedback`), or ``"auto"``: dense or a compressor,
    chosen from the measured link and compute and re-chosen when the link changes
    (:class:`~arraytrain.compress.Auto`). At every applied boundary the reduced, unscaled
    gradient is replaced by what the receivers decode (with ``comm``: the sum of every
    process's decoded share of the mean); the norm, clipping and the optimizer work on that,
    as DDP's communication hooks followed by ``clip_grad_norm_`` do. A non-finite boundary
    compresses nothing; SAM's ascent window uses the exact local gradient.

Glossary
--------

One word for each thing, in the code and its prose:

- **partition**: the contiguous range of the flat buffer that one rank owns under sharded
  state (:class:`~arraytrain.parallel.shard.Partition`: ``lo``, ``hi``, ``length``; a
  placement's ``partition``); *sharded* names the placement that gives each rank one. Not
  "part", "shard" or "window". At the communicator's level, the equal slices of an array
  that the block collectives (``reduce_scatter``, ``allgather_blocks``) move are **blocks**:
  under sharded state block ``r`` holds rank ``r``'s partition. One-byte optimizer state is
  quantized in 256-element **quantization blocks** (:data:`arraytrain.lowbit.BLOCK`).
- **window**: the accumulation window, the micro-batches of one optimizer step.
- **boundary**: the micro-batch that closes a window, where the gradient sync, the norm
  pass and the update run.
- **gradient sync**: how and when a window's gradient crosses the ranks (blocking,
  bucketed, compressed); in prose "gradient sync", the collective itself "the exchange".
- **bucket**: a contiguous slice of whole parameters that the bucketed sync exchanges as one.
- **piece**: a row of a layout's piece table (``layout.pieces``: a contiguous run of one
  parameter's elements, at most :data:`~arraytrain.layout.REDUCE_CHUNK` long), and nothing
  else. A deferred publish all-gathers a partition in **chunks**.
- **absent**: a parameter without a gradient in a micro-batch or window (``step(absent=...)``,
  ``missing="skip"``). Not "missing" (the policy's name), "held" or "none".
- **owns**: what a rank updates (its partition, or everything when replicated); "holds" is
  what it keeps in memory.
- **span**: ``(start, stop)`` flat element indices into the whole buffer (never relative to
  a parameter).
- **params / master**: ``params`` is what the model reads; ``master`` what the optimizer
  updates (the same buffer unless a working copy shards the float32 masters).

Walk of one boundary, ``Engine.step`` to the optimizer's kernel::

    Engine._boundary -> sync.reduce (BucketedSync: its buckets, or blocking | CompressedSync)
        -> placement.exchange (Replicated: all-reduce | Sharded: reduce-scatter), or the
           buckets' collectives -> placement.verdict (the norm pass | the partial sums) -> Verdict
    Engine._update_stage -> placement.update -> optimizer.update -> kernels.<optimizer>
        -> placement.publish (Sharded: all-gather)
"""

from .communicator import Communicator, LocalComm, Pending, PerRank, check_comm

__all__ = ["Communicator", "LocalComm", "Pending", "PerRank", "check_comm"]
