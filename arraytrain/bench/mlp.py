r"""``python -m arraytrain.bench mlp``: MLP training throughput, arraytrain beside torch on the CPU.

The same MLP (dense layers with ReLU between them, softmax cross-entropy on
the logits), the same initial weights and the same batches, trained by:

* ``arraytrain``: :class:`arraytrain.nn.MLP` bound to an :class:`arraytrain.Engine`
  (weights are views of the flat parameter buffer, ``model.backward`` writes
  ``matmul(..., out=view)`` straight into ``engine.grads``), then
  ``engine.step()``: one norm/finite pass and one fused optimizer kernel;
* ``torch-foreach`` / ``torch-fused``: ``nn.Linear`` + ``nn.ReLU``,
  ``F.cross_entropy``, ``loss.backward()``, then ``torch.optim`` with
  ``foreach=True`` / ``fused=True`` and ``zero_grad()`` (torch's defaults:
  gradients set to None).

Per shape, batch size and optimizer (SGD with momentum, Adam, AdamW) the
contestants run in alternating blocks of ``--steps`` timed steps, each block
after one untimed step (torch's OpenMP workers keep spinning for a while after
a step and would otherwise slow whoever comes next), ``--rounds`` times, under
the project's threading policy (:mod:`arraytrain.threads`: numba on its TBB
layer, BLAS and torch keep their own thread counts). samples/s is
``batch * steps / block time``; the median and the best block are reported.

The BLAS roof is measured in the same rotation: the float32 matmuls of one
training step of this shape and batch, ``np.matmul`` with ``out=`` on
matrices of the model's sizes (forward ``x W``, weight gradient
:math:`x^\top \delta`, input gradient :math:`\delta W^\top` for every layer
but the first), timed as one more contestant in every rotation; the best
block over all optimizers of a shape and batch gives its GFLOP/s.
"% roof" is, as usual for training, :math:`6 \cdot P \cdot \text{samples/s}`
over that GFLOP/s (2P FLOPs per sample forward, 4P backward, P = parameters).
6P counts the first layer's input gradient, which no contestant computes (the
input needs none), so the column tops out above 100%: at ``1 / share`` where
``share`` (printed per shape) is the step's matmul FLOPs over 6P.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import numpy as np

SHAPES = ("784-1024-256-10", "784-3584-2048-10")  # ~1.07M and ~10.2M parameters
BATCHES = (32, 128)
OPTIMIZERS = ("sgd", "adam", "adamw")
LR = {"sgd": 1e-2, "adam": 1e-3, "adamw": 1e-3}
MOMENTUM, BETAS, EPS, WD = 0.9, (0.9, 0.999), 1e-8, 1e-2
N_BATCHES = 4  # distinct batches cycled through (the same for every contestant)


def parse_shape(text: str) -> list[int]:
    """``"784-1024-256-10"`` -> ``[784, 1024, 256, 10]``."""
    try:
        sizes = [int(s) for s in str(text).split("-")]
    except ValueError:
        raise ValueError(f"shape: expected widths joined by '-', e.g. 784-1024-256-10, got {text!r}") from None
    if len(sizes) < 2 or min(sizes) < 1:
        raise ValueError(f"shape: expected at least two positive widths, got {text!r}")
    return sizes


def num_params(sizes) -> int:
    return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))


def matmul_flops(sizes, batch: int) -> int:
    """FLOPs of one training step's matmuls: forward and weight gradient of every layer,
    input gradient of every layer but the first."""
    pairs = list(zip(sizes[:-1], sizes[1:]))
    return sum(2 * batch * a * b * (2 + (i > 0)) for i, (a, b) in enumerate(pairs))


def matmul_share(sizes) -> float:
    """The step's matmul FLOPs per sample over 6 x parameters."""
    return matmul_flops(sizes, 1) / (6 * num_params(sizes))


def make_data(sizes, batch: int, seed: int = 0):
    """``N_BATCHES`` batches of standard-normal float32 inputs and int64 class labels."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, sizes[0]), dtype=np.float32),
             rng.integers(0, sizes[-1], batch)) for _ in range(N_BATCHES)]


def init_params(sizes, seed: int = 0) -> dict:
    """arraytrain's initialisation (He normal, zero biases), layout ``(in, out)``."""
    from arraytrain import nn

    return nn.MLP(sizes, activation="relu", dtype=np.float32).init(seed=seed)


# -- contestants: each returns a zero-argument step function, warm (one step taken), with ----
# -- ``.params()`` (name -> array in arraytrain's (in, out) layout) and ``.loss()`` -----------


def make_arraytrain(sizes, batch: int, opt: str, params: dict, data):
    import arraytrain as at
    from arraytrain import nn

    optimizer = {"sgd": lambda: at.optim.SGD(LR["sgd"], momentum=MOMENTUM),
                 "adam": lambda: at.optim.Adam(LR["adam"], BETAS, EPS),
                 "adamw": lambda: at.optim.AdamW(LR["adamw"], BETAS, EPS, WD)}[opt]()
    model = nn.MLP(sizes, activation="relu", dtype=np.float32)
    # backward() overwrites every gradient each step: no zeroing pass needed
    engine = at.Engine(params, optimizer, zero_grad_on_step=False)
    model.bind(engine)
    box = {"i": 0, "loss": math.nan}

    def step():
        x, y = data[box["i"] % len(data)]
        box["i"] += 1
        loss, dlogits = nn.softmax_cross_entropy(model.forward(x), y)
        model.backward(dlogits)
        engine.step()
        box["loss"] = loss

    step.params = lambda: {n: engine.params[n] for n in engine.layout.names}
    step.loss = lambda: box["loss"]
    step()
    return step


def _make_torch(sizes, batch: int, opt: str, params: dict, data, mode: str):
    import torch

    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]), 1):
        lin = torch.nn.Linear(a, b)
        with torch.no_grad():  # torch's Linear holds (out, in)
            lin.weight.copy_(torch.from_numpy(params[f"fc{i}.weight"].T))
            lin.bias.copy_(torch.from_numpy(params[f"fc{i}.bias"]))
        layers += [lin, torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    flag = {mode: True}
    ps = list(model.parameters())
    optimizer = {"sgd": lambda: torch.optim.SGD(ps, LR["sgd"], momentum=MOMENTUM, **flag),
                 "adam": lambda: torch.optim.Adam(ps, LR["adam"], BETAS, EPS, **flag),
                 "adamw": lambda: torch.optim.AdamW(ps, LR["adamw"], BETAS, EPS, WD, **flag)}[opt]()
    tdata = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in data]
    box = {"i": 0, "loss": None}

    def step():
        x, y = tdata[box["i"] % len(tdata)]
        box["i"] += 1
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        box["loss"] = loss

    def named():
        out = {}
        for i, lin in enumerate(model[::2], 1):
            out[f"fc{i}.weight"] = lin.weight.detach().numpy().T
            out[f"fc{i}.bias"] = lin.bias.detach().numpy()
        return out

    step.params = named
    step.loss = lambda: float(box["loss"].item())
    step()
    return step


def make_torch_foreach(sizes, batch, opt, params, data):
    return _make_torch(sizes, batch, opt, params, data, "foreach")


def make_torch_fused(sizes, batch, opt, params, data):
    return _make_torch(sizes, batch, opt, params, data, "fused")


CONTESTANTS = {
    "arraytrain": make_arraytrain,
    "torch-foreach": make_torch_foreach,
    "torch-fused": make_torch_fused,
}


def make_gemm(sizes, batch: int, seed: int = 1):
    """The float32 matmuls of one training step (see :func:`matmul_flops`), with ``out=`` buffers.

    Returns ``(call, flops)``; ``call`` has run once.
    """
    rng = np.random.default_rng(seed)
    work = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        x = rng.standard_normal((batch, a), dtype=np.float32)
        w = rng.standard_normal((a, b), dtype=np.float32)
        d = rng.standard_normal((batch, b), dtype=np.float32)
        work.append((x, w, np.empty((batch, b), np.float32)))          # forward  x W
        work.append((x.T, d, np.empty((a, b), np.float32)))            # weight gradient  x^T delta
        if i > 0:
            work.append((d, w.T, np.empty((batch, a), np.float32)))    # input gradient  delta W^T

    def call():
        for a, b, out in work:
            np.matmul(a, b, out=out)

    call()
    return call, matmul_flops(sizes, batch)


# -- running and reporting -------------------------------------------------------------------------


def run(shapes, batches, optimizers, steps: int, rounds: int, names=tuple(CONTESTANTS), log=print):
    """Time every contestant and the GEMM roof per (shape, batch, optimizer); returns (rows, missing)."""
    rows, missing = [], {}
    for shape in shapes:
        sizes = parse_shape(shape)
        params = init_params(sizes)  # every contestant copies these in
        for batch in batches:
            data = make_data(sizes, batch)
            gemm, flops = make_gemm(sizes, batch)
            gemm_rates, first = [], len(rows)
            for opt in optimizers:
                contestants = {}
                for name in names:
                    try:
                        contestants[name] = CONTESTANTS[name](sizes, batch, opt, params, data)
                    except ImportError as exc:
                        missing[name] = str(exc)
                contestants["gemm"] = gemm
                rates = {k: [] for k in contestants}
                for _ in range(rounds):
                    for name, fn in contestants.items():
                        fn()  # untimed: absorbs the previous contestant's threads winding down
                        t0 = time.perf_counter()
                        for _ in range(steps):
                            fn()
                        rates[name].append(batch * steps / (time.perf_counter() - t0))
                gemm_rates += rates.pop("gemm")
                rows.append({"shape": shape, "params": num_params(sizes), "batch": batch, "optimizer": opt,
                             "samples_per_second": rates})
                log(f"  timed {shape} batch {batch} {opt}: "
                    + ", ".join(f"{k} {statistics.median(v):.0f}/s" for k, v in rates.items())
                    + f", GEMM {max(gemm_rates) * flops / batch / 1e9:.1f} GFLOP/s so far")
                contestants.clear()
            # the roof: the best GEMM block over every optimizer's rotation of this shape and batch
            for row in rows[first:]:
                row["gemm_gflops"] = max(gemm_rates) * flops / batch / 1e9
    return rows, missing


def summarize(rows) -> list[dict]:
    """One record per (row, contestant): median/best samples/s, ratio to torch, fraction of the roof."""
    out = []
    for row in rows:
        rates = row["samples_per_second"]
        torch_meds = [statistics.median(v) for k, v in rates.items() if k.startswith("torch")]
        best_torch = max(torch_meds) if torch_meds else None
        for name, v in rates.items():
            med = statistics.median(v)
            out.append({
                "shape": row["shape"], "params": row["params"], "batch": row["batch"],
                "optimizer": row["optimizer"], "contestant": name,
                "samples_per_second": med, "best_samples_per_second": max(v),
                "vs_torch": med / best_torch if best_torch else None,
                "fraction_of_gemm_roof": 6 * row["params"] * med / (row["gemm_gflops"] * 1e9),
                "gemm_gflops": row["gemm_gflops"],
            })
    return out


def table(records) -> str:
    lines = ["| shape | params | batch | optimizer | contestant | samples/s (median) | best | vs best torch "
             "| GEMM GFLOP/s | % roof (6P) |",
             "|---|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in records:
        ratio = f"{r['vs_torch']:.2f}" if r["vs_torch"] is not None else "-"
        lines.append(f"| {r['shape']} | {r['params'] / 1e6:.2f}M | {r['batch']} | {r['optimizer']} | "
                     f"{r['contestant']} | {r['samples_per_second']:.0f} | {r['best_samples_per_second']:.0f} | "
                     f"{ratio} | {r['gemm_gflops']:.1f} | {r['fraction_of_gemm_roof']:.0%} |")
    return "\n".join(lines)


def _csv(text: str, what: str, allowed=None) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise ValueError(f"--{what}: empty")
    for s in items:
        if allowed is not None and s not in allowed:
            raise ValueError(f"--{what}: unknown {s!r}; choose from {list(allowed)}")
    return items


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m arraytrain.bench mlp", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated layer widths, e.g. 784-1024-256-10")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated: sgd, adam, adamw")
    ap.add_argument("--contestants", default=",".join(CONTESTANTS))
    ap.add_argument("--steps", type=int, default=10, help="timed steps per block")
    ap.add_argument("--rounds", type=int, default=5, help="blocks per contestant (alternated)")
    ap.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    args = ap.parse_args(argv)
    try:
        shapes = _csv(args.shapes, "shapes")
        for s in shapes:
            parse_shape(s)
        batches = [int(b) for b in _csv(args.batches, "batches")]
        if min(batches) < 1:
            raise ValueError(f"--batches: expected positive sizes, got {args.batches!r}")
        optimizers = _csv(args.optimizers, "optimizers", OPTIMIZERS)
        names = _csv(args.contestants, "contestants", CONTESTANTS)
        if args.steps < 1 or args.rounds < 1:
            raise ValueError(f"--steps/--rounds: expected >= 1, got {args.steps}/{args.rounds}")
    except ValueError as exc:
        ap.error(str(exc))

    from arraytrain import threads

    policy = threads.describe()  # starts numba's pool under the policy before anything runs
    rows, missing = run(shapes, batches, optimizers, args.steps, args.rounds, names,
                        log=lambda s: print(s, file=sys.stderr))
    for name, why in missing.items():
        print(f"skipped {name}: {why}", file=sys.stderr)
    records = summarize(rows)
    torch_info = None
    if any(n.startswith("torch") for n in names) and not all(n in missing for n in names if n.startswith("torch")):
        import torch

        torch_info = {"version": torch.__version__, "threads": torch.get_num_threads()}
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; python {platform.python_version()}, "
          f"numpy {np.__version__}; {policy}"
          + (f"; torch {torch_info['version']}, {torch_info['threads']} threads" if torch_info else ""))
    print("matmul share (a step's matmul FLOPs / 6P; '% roof' tops out at 1/share): "
          + ", ".join(f"{s} {matmul_share(parse_shape(s)):.2f}" for s in shapes) + "\n")
    print(table(records))
    if args.json:
        doc = {"threads": policy, "torch": torch_info, "machine": platform.machine(), "cpus": os.cpu_count(),
               "steps": args.steps, "rounds": args.rounds, "rows": rows, "records": records,
               "matmul_share": {s: matmul_share(parse_shape(s)) for s in shapes}, "missing": missing}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0
