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

Walk of one boundary, ``Engine.step`` to the optimizer's kernel::

    Engine._boundary -> sync.reduce (BlockingSync | BucketedSync | CompressedSync)
        -> placement.reduce (Replicated: all-reduce + norm pass | Sharded: reduce-scatter
           + partial sums) -> Verdict
    Engine._update_stage -> placement.update -> optimizer.update -> kernels.<optimizer>
        -> placement.publish (Sharded: all-gather)
"""

from .communicator import Communicator, LocalComm, Pending, PerRank, check_comm

__all__ = ["Communicator", "LocalComm", "Pending", "PerRank", "check_comm"]
