"""``python -m arraytrain.bench distributed --vs-ddp``: the torch binding against torch's DDP.

One ``mpiexec`` job of 2 processes runs every contestant on the same torch models, the same
initialisation and the same data per rank, taking turns two steps at a time (so the machine's
other work falls on all of them alike), the second one timed: what the first leaves in flight (the
weights' all-gather of ``gather_in_forward``) completes inside it, and what the second leaves is
completed before the next contestant's turn:

- ``torch DDP``: ``DistributedDataParallel`` over gloo (buckets of 25 MB, all-reduces
  launched by autograd hooks), ``clip_grad_norm_(1.0)``, ``torch.optim.AdamW``;
- ``torch DDP + PowerSGD``: the same with torch's PowerSGD communication hook (rank 4, error
  feedback, compressing from the second step: :data:`POWERSGD`), on a gloo group of its own and
  with one bucket for the whole model (over gloo with several buckets the hook's chained
  all-reduces were issued in a different order on each rank, a collective mismatch after a few
  steps); its losses depart from DDP's by design (a compressed gradient), so
  :func:`losses_agree` leaves it out;
- ``arraytrain, MPIComm`` and ``arraytrain, TorchComm`` (over the same gloo group), each
  blocking (``overlap=False``), overlapped, and sharded and overlapped (``shard_state=True``:
  each rank updates its share of AdamW's state; the buckets reduced to their owners while
  backward runs, the weights all-gathered after the update), and sharded and overlapped with the
  weights' all-gather left to the next forward pass (``gather_in_forward=True``): ``bind(model,
  AdamW, max_grad_norm=1.0, comm=...)``; and MPIComm's overlapped exchange once more without its
  progress thread (``MPIComm(progress_thread=False)``: the buckets move only inside the hooks'
  own MPI calls), to show what the thread does;
- ``torch, no exchange`` and ``arraytrain, no exchange``: each implementation's step alone,
  on the rank's own data: the reference of a step without any communication.

torch.distributed is initialised over TCP on 127.0.0.1 inside the MPI job (rank and size
from MPI). A step is forward, backward and the optimizer step. Its *exposed communication* is
what the exchange adds to the step: the step's time less the same implementation's step
without any exchange (the exchange hidden behind the backward pass adds nothing); the time
from the end of the backward pass to the end of the step is reported beside it. Each
figure is the best of ``--steps`` steps (after one warm-up), the slowest rank's; the losses
of every contestant are compared step by step with DDP's.
"""

from __future__ import annotations

import time

import numpy as np

from .common import slowest

#: torch's PowerSGD hook's settings for the ``torch DDP + PowerSGD`` contestant (torch's default starts
#: compressing at step 1000; here at the second step, so that the timed steps are compressed).
POWERSGD = {"matrix_approximation_rank": 4, "start_powerSGD_iter": 2, "use_error_feedback": True,
            "warm_start": True}
#: The contestants whose losses follow DDP's only approximately (compressed gradients).
APPROXIMATE = ("torch DDP + PowerSGD",)

#: The models: name -> (kind, settings).
MODELS = {
    "MLP 4x1024 (4.2M)": ("mlp", {"width": 1024, "layers": 4}),
    "MLP 4x2048 (16.8M)": ("mlp", {"width": 2048, "layers": 4}),
    "TransformerEncoder 2x256 (1.6M)": ("transformer", {"d_model": 256, "layers": 2, "seq": 32}),
}


def _model(torch, kind: str, cfg: dict):
    if kind == "mlp":
        w = cfg["width"]
        mods = []
        for i in range(cfg["layers"]):
            mods.append(torch.nn.Linear(w, w))
            if i < cfg["layers"] - 1:
                mods.append(torch.nn.ReLU())
        return torch.nn.Sequential(*mods)
    layer = torch.nn.TransformerEncoderLayer(cfg["d_model"], nhead=4, dim_feedforward=4 * cfg["d_model"],
                                             dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, cfg["layers"], enable_nested_tensor=False)


def _batch(torch, kind: str, cfg: dict, batch: int, gen):
    if kind == "mlp":
        return torch.randn(batch, cfg["width"], generator=gen), torch.randn(batch, cfg["width"], generator=gen)
    shape = (batch, cfg["seq"], cfg["d_model"])
    return torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)


def worker_ddp(comm, cfg) -> dict:
    """Every contestant on every model, taking turns step by step (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from .. import optim
    from ..interop import torch as att
    from ..parallel.mpi import MPIComm
    from ..parallel.torch_dist import TorchComm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{cfg.get('addr', '127.0.0.1')}:{cfg['port']}",
                            rank=comm.rank, world_size=comm.size)
    wire = cfg.get("wire")  # a file holding this rank's node's bytes sent (the simulated cluster's eth0)

    def sent() -> int:
        if wire is None:
            return 0
        with open(wire) as f:
            return int(f.read())
    tcomm = TorchComm()
    lazy = MPIComm(comm.comm, progress_thread=False)  # overlapped requests moved by the hooks' own MPI calls only
    # PowerSGD's hook over gloo with several DDP buckets issues its later all-reduces from gloo's threads, in
    # an order that differs between ranks (gloo: "Received data size doesn't match expected size" after a
    # few steps): one bucket for the whole model, on a gloo group of its own (the same links)
    psgd_group = dist.new_group(backend="gloo")
    out = {}
    for name in cfg["models"]:
        kind, mcfg = MODELS[name]
        torch.manual_seed(0)
        init = _model(torch, kind, mcfg).state_dict()

        def fresh():
            m = _model(torch, kind, mcfg)
            m.load_state_dict(init)
            return m

        def torch_step(ddp: bool, powersgd: bool = False):
            """torch's step: (DDP around) the model (with PowerSGD's hook), clip_grad_norm_, AdamW."""
            m = fresh()
            group = psgd_group if powersgd else None
            run = DistributedDataParallel(m, process_group=group, bucket_cap_mb=1024 if powersgd else None) \
                if ddp else m
            if powersgd:
                from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

                run.register_comm_hook(psgd.PowerSGDState(process_group=group, **POWERSGD), psgd.powerSGD_hook)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

            def step(x, y):
                loss = torch.nn.functional.mse_loss(run(x), y)
                loss.backward()
                t = time.perf_counter()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
                return float(loss), t

            return step

        settles = {}  # a contestant's call that completes what its step left in flight
        steps = {"torch DDP": torch_step(True), "torch DDP + PowerSGD": torch_step(True, powersgd=True),
                 "torch, no exchange": torch_step(False)}
        for label, c, overlap, shard in (("arraytrain, no exchange", None, False, False),
                                         ("arraytrain, MPIComm, blocking", comm, False, False),
                                         ("arraytrain, MPIComm, overlapped", comm, True, False),
                                         ("arraytrain, MPIComm, overlapped, no progress thread", lazy, True, False),
                                         ("arraytrain, MPIComm, sharded + overlapped", comm, True, True),
                                         ("arraytrain, MPIComm, sharded + overlapped, gathered in forward", comm,
                                          True, "forward"),
                                         ("arraytrain, TorchComm, blocking", tcomm, False, False),
                                         ("arraytrain, TorchComm, overlapped", tcomm, True, False),
                                         ("arraytrain, TorchComm, sharded + overlapped", tcomm, True, True),
                                         ("arraytrain, TorchComm, sharded + overlapped, gathered in forward", tcomm,
                                          True, "forward")):
            m = fresh()
            sizes = {} if cfg.get("bucket_mib") is None else {"bucket_bytes": int(cfg["bucket_mib"] * 2**20)}
            if shard == "forward":
                sizes["gather_in_forward"] = True
            eng = att.bind(m, optim.AdamW(lr=1e-3), max_grad_norm=1.0, comm=c, overlap=overlap,
                           shard_state=bool(shard), **sizes)
            settles[label] = eng.wait_weights

            def at_step(x, y, m=m, eng=eng):
                loss = torch.nn.functional.mse_loss(m(x), y)
                loss.backward()
                t = time.perf_counter()
                eng.step()
                return float(loss), t

            steps[label] = at_step
        gen = torch.Generator().manual_seed(1000 + comm.rank)
        data = [_batch(torch, kind, mcfg, cfg["batch"], gen) for _ in range(cfg["steps"] + 1)]
        times = {k: [] for k in steps}
        losses = {k: [] for k in steps}
        wire_bytes = {k: 0 for k in steps}
        for i, (x, y) in enumerate(data):
            for key, step in steps.items():
                comm.comm.Barrier()
                b0 = sent()
                step(x, y)  # the lead step, untimed: what it leaves in flight completes in the timed step
                t0 = time.perf_counter()
                loss, t1 = step(x, y)
                t2 = time.perf_counter()
                if key in settles:
                    settles[key]()  # untimed: nothing of this contestant moves during the next one's turn
                wire_bytes[key] += (sent() - b0) / 2
                losses[key].append(loss)
                if i:
                    times[key].append((slowest(comm, t2 - t0), slowest(comm, t2 - t1)))
        best = {k: min(v) for k, v in times.items()}
        out[name] = {"params": sum(p.numel() for p in fresh().parameters()), "step_s": {k: b[0] for k, b in best.items()},
                     "after_backward_s": {k: b[1] for k, b in best.items()}, "losses": losses}
        if wire is not None:  # rank 0's node, per step (the warm-up step included)
            out[name]["wire_bytes"] = {k: v / len(data) for k, v in wire_bytes.items()}
    dist.destroy_process_group()
    return out


def report(res: dict, args, where: str = "2 processes (gloo / MPI in shared memory)") -> None:
    """The table per model (step, exposed communication, speed against DDP, losses)."""
    print(f"\nThe torch binding against torch DDP, {where}, batch "
          f"{args.ddp_batch} per process, one torch and one numba thread per process; best of {args.steps} steps, "
          "the slowest rank's. Exposed communication: the step less the same implementation's step without "
          "any exchange:")
    for name, r in res.items():
        st, after = r["step_s"], r["after_backward_s"]
        ref = r["losses"]["torch DDP"]
        print(f"\n{name}: {r['params']:,} parameters")
        print("| contestant | step ms | after backward ms | exposed communication ms | % of step | "
              "speed vs DDP | max loss diff vs DDP |")
        print("|---|---|---|---|---|---|---|")
        for key in st:
            local = st["torch, no exchange" if key.startswith("torch") else "arraytrain, no exchange"]
            exposed = 0.0 if key.endswith("no exchange") else max(0.0, st[key] - local)
            diff = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(r["losses"][key], ref))
            if key.endswith("no exchange"):
                diff = float("nan")  # its own rank's data only: another trajectory
            r.setdefault("exposed_s", {})[key] = exposed
            print(f"| {key} | {1e3 * st[key]:.1f} | {1e3 * after[key]:.1f} | {1e3 * exposed:.1f} | "
                  f"{100 * exposed / st[key]:.0f}% | {st['torch DDP'] / st[key]:.2f}x | {diff:.1e} |")


def plot(path: str, res: dict) -> None:
    """Stacked bars per model: the step before the end of backward, and after it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(res), figsize=(5 * len(res), 4.8), squeeze=False)
    for ax, (name, r) in zip(axes[0], res.items()):
        keys = list(r["step_s"])
        before = [1e3 * (r["step_s"][k] - r["after_backward_s"][k]) for k in keys]
        after = [1e3 * r["after_backward_s"][k] for k in keys]
        ax.barh(range(len(keys)), before, label="forward + backward")
        ax.barh(range(len(keys)), after, left=before, label="after backward (exchange + update)")
        ax.set_yticks(range(len(keys)), [k.replace("arraytrain, ", "") for k in keys], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ms per step (best, slowest rank)")
        ax.set_title(name, fontsize=9)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=2)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for torch.distributed's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses_agree(res: dict, rtol: float = 1e-4) -> bool:
    """Every exact contestant's losses within ``rtol`` of DDP's, step by step (not the compressed ones,
    :data:`APPROXIMATE`)."""
    return all(np.allclose(r["losses"][k], r["losses"]["torch DDP"], rtol=rtol)
               for r in res.values() for k in r["losses"] if not k.endswith("no exchange") and k not in APPROXIMATE)
