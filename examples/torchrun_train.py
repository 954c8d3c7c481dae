"""A torch model trained data-parallel by arraytrain under ``torchrun``, exchanging over torch.distributed.

Every process (rank) binds the same model to an engine whose exchange is
:class:`arraytrain.distributed.TorchComm` (gloo: the gradients are NumPy
buffers); at each step a rank runs the forward and backward pass on its share
of the global batch, and ``engine.step()`` all-reduces the flat gradient
buffer in place through gloo before clipping and AdamW, so every rank applies
the same update and the model stays identical everywhere. Rank 0's weights are
broadcast when the engine is built.

Runs in a few seconds::

    torchrun --standalone --nproc-per-node 2 examples/torchrun_train.py
    python examples/torchrun_train.py        # alone: a group of one process

Rank 0 prints the global batch's mean loss every 10 steps. With a batch that
divides evenly over the ranks, the printed losses are those of one process
training on the whole batch (to float32 rounding).

Elastic: with ``--checkpoint-dir DIR`` the engine is saved every ``--every``
steps (rank 0 writes, atomically) and a start resumes from the newest file
there, on however many ranks it now has. Under ``torchrun --nnodes 1:2
--max-restarts 3`` a node that dies ends the survivors' waits at their
deadline (``ARRAYTRAIN_COMM_TIMEOUT``), torchrun restarts them on the nodes
left, and they go on from the last checkpoint (``docs/cluster.md``)::

    torchrun --nnodes 1:2 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        examples/torchrun_train.py --steps 400 --checkpoint-dir /shared/run --every 20
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile

import numpy as np
import torch
import torch.distributed as dist

import arraytrain as at
from arraytrain.interop import torch as at_torch
from arraytrain.distributed import TorchComm

IN, HIDDEN, CLASSES = 20, 64, 4


def start_group() -> None:
    """``init_process_group`` from torchrun's environment; alone, a group of one process."""
    if "RANK" in os.environ:  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
        dist.init_process_group("gloo")
    else:
        store = os.path.join(tempfile.mkdtemp(prefix="arraytrain-"), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def newest_checkpoint(folder: str | None) -> tuple[str | None, int]:
    """The newest ``step-N.safetensors`` in ``folder`` and its N; (None, 0) without one."""
    found = [(int(m.group(1)), m.group(0)) for f in (os.listdir(folder) if folder and os.path.isdir(folder) else ())
             if (m := re.fullmatch(r"step-(\d+)\.safetensors", f))]
    if not found:
        return None, 0
    step, name = max(found)
    return os.path.join(folder, name), step


def main(steps: int = 40, batch: int = 64, seed: int = 0, checkpoint_dir: str | None = None, every: int = 20,
         print_every: int = 10) -> float:
    start_group()
    comm = TorchComm()
    if batch % comm.size:
        raise SystemExit(f"batch {batch} does not divide over {comm.size} ranks")
    rng = np.random.default_rng(seed)  # the same data on every rank
    centres = rng.standard_normal((CLASSES, IN)).astype(np.float32)
    y = rng.integers(0, CLASSES, 4096)
    x = torch.from_numpy(centres[y] + 1.5 * rng.standard_normal((4096, IN)).astype(np.float32))
    y = torch.from_numpy(y)
    torch.manual_seed(seed + comm.rank)  # a different initialisation per rank: the engine broadcasts rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))
    engine = at_torch.bind(model, at.optim.AdamW(lr=3e-3, weight_decay=1e-2), max_grad_norm=5.0, comm=comm)
    share = batch // comm.size
    path, done = newest_checkpoint(checkpoint_dir)
    if path is not None:  # every rank reads it (a file system they share), on any number of ranks
        at.load(path, engine)
        if comm.rank == 0:
            print(f"resumed from {path} at step {done} on {comm.size} rank(s)", flush=True)
    loss_sum = np.zeros(1)
    for step in range(done + 1, steps + 1):
        batch_rng = np.random.default_rng([seed, step])  # step's global batch, whatever the ranks: each its share
        idx = batch_rng.integers(0, len(x), batch)[comm.rank * share : (comm.rank + 1) * share]
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        engine.step()  # the gradient is all-reduced (the mean over ranks), clipped and applied
        loss_sum[0] = loss.item() / comm.size
        comm.allreduce(loss_sum)  # the global batch's mean loss, for printing
        if step % print_every == 0 and comm.rank == 0:
            print(f"step {step}: loss {loss_sum[0]:.6f}", flush=True)
        if checkpoint_dir and step % every == 0:
            at.save(os.path.join(checkpoint_dir, f"step-{step}.safetensors"), engine)  # rank 0 writes
    if comm.rank == 0:
        print(f"{engine.state.step} AdamW steps on {comm.size} rank(s) over {comm.backend}; "
              f"final loss {loss_sum[0]:.6f}", flush=True)
    dist.destroy_process_group()
    return float(loss_sum[0])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint-dir", help="save every --every steps here; resume from the newest")
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--print-every", type=int, default=10)
    args = parser.parse_args()
    main(args.steps, checkpoint_dir=args.checkpoint_dir, every=args.every, print_every=args.print_every)
