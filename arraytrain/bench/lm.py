"""A character-level language model trained to a validation loss by DDP and by ``bind``: time to target.

Run by ``python -m arraytrain.bench tta --task lm`` under ``mpiexec`` across the simulated cluster's
nodes (one rank each); every contestant in turn, in one job, from the same initial weights, each rank
drawing the same batches for every contestant:

- ``torch DDP``: ``DistributedDataParallel`` over gloo, ``clip_grad_norm_(1.0)``, ``torch.optim.AdamW``;
- ``torch DDP + PowerSGD``: the same with torch's ``powerSGD_hook`` (:data:`POWERSGD`: rank 4, error
  feedback, warm start; compressing from step 10 where torch's default waits 1,000 — longer than
  these runs), one bucket on a gloo group of its own (see :mod:`arraytrain.bench.ddp`);
- ``arraytrain <setting>``: ``bind(model, AdamW, max_grad_norm=1.0, comm=MPIComm(), compressor=...)``
  for each of ``--compress`` (as the CLI takes them: ``dense``, ``auto``, ``powersgd:rank=4``, ...).

The text ships with Python: the standard library's own ``*.py`` sources (its top folder, in name
order, the first 2 MB), bytes as tokens; the last 10% is the validation text. The model: a byte
embedding and a learned position embedding, a causal ``nn.TransformerEncoder`` (``--d-model``,
``--layers``, 4 heads, no dropout) and a linear head. A contestant trains until its validation loss
(mean cross-entropy in nats over fixed windows of the validation text, every ``eval_every`` steps)
is at most the target, or ``max_steps``; its clock counts the training steps only (forward,
backward, exchange, optimizer), not the evaluations.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

POWERSGD = {"matrix_approximation_rank": 4, "start_powerSGD_iter": 10, "use_error_feedback": True, "warm_start": True}


def corpus(megabytes: float = 2.0) -> np.ndarray:
    """The standard library's top-level ``*.py`` files, in name order, as bytes (uint8), ``megabytes`` of them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, n = [], int(megabytes * 2**20)
    for path in sorted(root.glob("*.py")):
        out.append(np.frombuffer(path.read_bytes(), np.uint8))
        if sum(a.size for a in out) >= n:
            break
    return np.concatenate(out)[:n]


def model(torch, d_model: int, layers: int, seq: int):
    """A causal TransformerEncoder over bytes: embedding + positions, encoder, head."""
    nn = torch.nn

    class CharLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(256, d_model)
            self.pos = nn.Parameter(torch.zeros(seq, d_model))
            layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.0,
                                               batch_first=True, norm_first=True)  # pre-norm: no lr warm-up needed
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d_model, 256)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

        def forward(self, x):
            h = self.embed(x) + self.pos[: x.shape[1]]
            return self.head(self.encoder(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True))

    return CharLM()


def worker(comm, cfg: dict) -> dict:
    """Every contestant to the target (see the module docstring); rank 0's figures."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from .. import optim
    from ..cli.arguments import compress_spec
    from ..cli.run import compressor_from
    from ..interop import torch as att

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{cfg['addr']}:{cfg['port']}", rank=comm.rank,
                            world_size=comm.size)
    psgd_group = dist.new_group(backend="gloo")
    text = torch.from_numpy(corpus(cfg["megabytes"]).astype(np.int64))
    cut = int(0.9 * text.numel())
    train, val = text[:cut], text[cut:]
    seq, batch = cfg["seq"], cfg["batch"]
    starts = torch.arange(0, val.numel() - seq - 1, (val.numel() - seq - 1) // cfg["val_windows"])[: cfg["val_windows"]]
    vx = torch.stack([val[s : s + seq] for s in starts])
    vy = torch.stack([val[s + 1 : s + seq + 1] for s in starts])
    torch.manual_seed(cfg["seed"])
    init = model(torch, cfg["d_model"], cfg["layers"], seq).state_dict()

    def sent() -> int:
        with open(cfg["wire"]) as f:
            return int(f.read())

    def fresh():
        m = model(torch, cfg["d_model"], cfg["layers"], seq)
        m.load_state_dict(init)
        return m

    def evaluate(m) -> float:
        with torch.no_grad():
            logits = m(vx)
            return float(torch.nn.functional.cross_entropy(logits.reshape(-1, 256), vy.reshape(-1)))

    def contestant(label: str):
        m = fresh()
        if label.startswith("torch"):
            psgd = "PowerSGD" in label
            group = psgd_group if psgd else None
            run = DistributedDataParallel(m, process_group=group, bucket_cap_mb=1024 if psgd else None)
            if psgd:
                from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook

                run.register_comm_hook(hook.PowerSGDState(process_group=group, **POWERSGD), hook.powerSGD_hook)
            opt = torch.optim.AdamW(m.parameters(), lr=cfg["lr"])

            def update():
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            return m, run, update, None
        spec = label.removeprefix("arraytrain ")
        args = argparse.Namespace(compress=None if spec == "dense" else compress_spec(spec), error_feedback=None)
        eng = att.bind(m, optim.AdamW(lr=cfg["lr"]), max_grad_norm=1.0, comm=comm,
                       compressor=compressor_from(args, cfg["steps_per_epoch"]))
        return m, m, eng.step, eng.compressor

    out = {}
    for label in cfg["contestants"]:
        m, run, update, compressor = contestant(label)
        gen = torch.Generator().manual_seed(1000 * cfg["seed"] + comm.rank)  # the same batches for every one
        clock, steps, curve, b0 = 0.0, 0, [], sent()
        loss = evaluate(m)
        while loss > cfg["target"] and steps < cfg["max_steps"]:
            for _ in range(cfg["eval_every"]):
                s = torch.randint(0, train.numel() - seq - 1, (batch,), generator=gen)
                x = torch.stack([train[i : i + seq] for i in s.tolist()])
                y = torch.stack([train[i + 1 : i + seq + 1] for i in s.tolist()])
                comm.comm.Barrier()
                t = time.perf_counter()
                torch.nn.functional.cross_entropy(run(x).reshape(-1, 256), y.reshape(-1)).backward()
                update()
                clock += time.perf_counter() - t
                steps += 1
            loss = evaluate(m)
            curve.append((steps, round(clock, 3), round(loss, 4)))
        out[label] = {"reached": loss <= cfg["target"], "steps": steps, "seconds": clock, "val_loss": loss,
                      "node_bytes": sent() - b0, "curve": curve,
                      "decisions": [{k: v for k, v in d.items() if k != "exchange_s"}
                                    for d in getattr(compressor, "decisions", [])]}
        if comm.rank == 0:
            print(f"    {label}: {'reached' if loss <= cfg['target'] else 'not reached'} val {loss:.3f} in {steps} steps, "
                  f"{clock:.1f} s, {out[label]['node_bytes'] / 1e6:,.0f} MB", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    return {"params": sum(p.numel() for p in fresh().parameters()), "results": out}


def main(argv=None) -> int:
    from ..distributed import MPIComm
    from .distributed import RESULT

    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = json.loads(argv[argv.index("--config") + 1])
    comm = MPIComm()
    res = worker(comm, cfg)
    if comm.rank == 0:
        print(RESULT + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
