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
"""

from __future__ import annotations

import os
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


def main(steps: int = 40, batch: int = 64, seed: int = 0) -> float:
    start_group()
    comm = TorchComm()
    if batch % comm.size:
        raise SystemExit(f"batch {batch} does not divide over {comm.size} ranks")
    rng = np.random.default_rng(seed)  # the same data on every rank; each takes its share of a batch
    centres = rng.standard_normal((CLASSES, IN)).astype(np.float32)
    y = rng.integers(0, CLASSES, 4096)
    x = torch.from_numpy(centres[y] + 1.5 * rng.standard_normal((4096, IN)).astype(np.float32))
    y = torch.from_numpy(y)
    torch.manual_seed(seed + comm.rank)  # a different initialisation per rank: the engine broadcasts rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))
    engine = at_torch.bind(model, at.optim.AdamW(lr=3e-3, weight_decay=1e-2), max_grad_norm=5.0, comm=comm)
    share = batch // comm.size
    loss_sum = np.zeros(1)
    for step in range(1, steps + 1):
        idx = rng.integers(0, len(x), batch)[comm.rank * share : (comm.rank + 1) * share]
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        engine.step()  # the gradient is all-reduced (the mean over ranks), clipped and applied
        loss_sum[0] = loss.item() / comm.size
        comm.allreduce(loss_sum)  # the global batch's mean loss, for printing
        if step % 10 == 0 and comm.rank == 0:
            print(f"step {step}: loss {loss_sum[0]:.6f}", flush=True)
    if comm.rank == 0:
        print(f"{engine.state.step} AdamW steps on {comm.size} rank(s) over {comm.backend}; "
              f"final loss {loss_sum[0]:.6f}", flush=True)
    dist.destroy_process_group()
    return float(loss_sum[0])


if __name__ == "__main__":
    main()
