r"""``python -m arraytrain.bench distributed``: processes over MPI, measured.

It launches ``mpiexec`` itself (:func:`arraytrain.distributed.launch`, each job
bounded by ``--timeout``) and reads back rank 0's figures; run it as a plain
command, not under mpiexec. Four parts (``--parts``):

``allreduce``
    The dense all-reduce of a float32 flat buffer through
    :meth:`MPIComm.allreduce <arraytrain.distributed.MPIComm.allreduce>` beside
    mpi4py's own ``Allreduce(IN_PLACE, ...)`` of the same bytes, on ``--ranks``
    processes, at ``--sizes``: in each round the two take turns call by call,
    ``--reps`` calls each (the mean, the slowest rank's); the best of
    ``--rounds`` (the machine's other work only ever adds time). ``% of mpi4py`` is the
    throughput ratio (no extra copies: 100% up to the validation's microsecond).
``scaling``
    ``engine.step`` (AdamW, zero-copy gradients, ``--scaling-size`` float32
    parameters in 100 tensors per rank) at 1, 2 and 4 processes: the same work
    per process (weak scaling), so the growth is the exchange — and, beyond
    the machine's cores, time slicing (said in the output).
``projection``
    For each compressor (``arraytrain.bench compression``'s settings, with error
    feedback) and the dense exchange: the bytes each process sends per step,
    measured in a group of 2 (int8 codes travel as int16 sums in a group), and
    the step's compute time, measured in one process (``engine.step`` with the
    compressor, ``--compress-size`` parameters as 10 matrices and 10 vectors).
    The step time at ``--links`` Gb/s for ``--project-ranks`` processes is
    projected as compute + wire time, with the ring algorithms' bytes per
    process: :math:`2\,\frac{K-1}{K} B` for an all-reduce of ``B`` bytes (dense,
    and the methods whose payloads add up), :math:`(K-1) B` for an all-gather
    (top-k, sign, ternary). Bandwidth only: latency and overlap are ignored.
``accuracy``
    ``mpiexec -n --accuracy-ranks arraytrain train`` on the digits, for each
    compressor with and without error feedback and uncompressed, ``--epochs``
    epochs over ``--seeds`` seeds, SGD momentum 0.9, lr 0.01 (the settings of
    ``python -m arraytrain.bench compression``): test accuracy and the bytes
    each process sent per step.

``sharding``
    Sharded optimizer state (``Engine(shard_state=True)``): :meth:`engine.memory()
    <arraytrain.Engine.memory>` per process at 1 (replicated) and each of
    ``--shard-ranks`` processes for AdamW on ``--shard-size`` float32 parameters in 100
    tensors, in float32 and under a bfloat16 working copy (float32 masters sharded too);
    and at 2 processes the clipped step of the sharded engine beside the replicated
    one, the two engines taking turns step by step in one run (best of ``--steps``,
    the slowest rank's): ``sharded / replicated speed`` > 1 is a faster sharded step.

``overlap``
    The exchange overlapped with the backward pass against the blocking one, at 2
    processes: the built-in MLP (``--overlap-widths``, float32, batch ``--overlap-batch``
    per process) bound to the engine, one training step (forward, backward, exchange,
    update) timed whole, the two engines taking turns step by step (best of ``--steps``,
    the slowest rank's). MPI moves a nonblocking collective on only inside MPI calls:
    the backward pass's marks poll it; a second launch sets ``MPIR_CVAR_ASYNC_PROGRESS=1``
    (MPICH's progress thread) for comparison.

``--vs-ddp``
    The torch binding against torch's DDP on the same torch models (see
    :mod:`arraytrain.bench.ddp`); ``--ddp-plot FILE.png`` draws it.

``--json FILE`` keeps every figure; ``--plot FILE.png`` draws the all-reduce
throughput, the projected step times and accuracy against bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .common import slowest

PARTS = ("allreduce", "scaling", "projection", "accuracy", "sharding", "overlap")
RESULT = "RESULT "  # rank 0's line of JSON in a worker's output


# -- workers: run under mpiexec, rank 0 prints one RESULT line -------------------------------------


def _timed(comm, fn, reps: int) -> float:
    """Mean seconds per call of ``fn`` over ``reps`` calls started together, the slowest rank's."""
    comm.comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return slowest(comm, (time.perf_counter() - t0) / reps)


def worker_allreduce(comm, cfg) -> dict:
    from mpi4py import MPI

    rows = []
    for n in cfg["sizes"]:
        x = np.zeros(n, np.float32)  # zeros: the sums stay finite however many calls
        reps = max(3, min(cfg["reps"], int(2e8 // max(4 * n, 1))))
        fns = {"MPIComm": lambda x=x: comm.allreduce(x),
               "mpi4py": lambda x=x: comm.comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)}
        for fn in fns.values():
            for _ in range(5):  # first touch of the pages, MPICH's buffer set-up
                fn()
        samples = {k: [] for k in fns}
        for i in range(cfg["rounds"]):
            order = list(fns) if i % 2 == 0 else list(fns)[::-1]  # neither always goes first
            spent = dict.fromkeys(fns, 0.0)
            comm.comm.Barrier()
            for _ in range(reps):  # call by call in turn: both see the same load on a shared machine
                for k in order:
                    t0 = time.perf_counter()
                    fns[k]()
                    spent[k] += time.perf_counter() - t0
            for k in fns:
                samples[k].append(slowest(comm, spent[k] / reps))
        rows.append({"n": n, "bytes": 4 * n, "reps": reps, "samples_s": samples})
    return {"ranks": comm.size, "rows": rows}


def _params(n: int, parts: int, matrices: bool, seed: int = 0) -> dict:
    """``n`` float32 parameters: ``parts`` vectors, or ``parts // 2`` matrices (10:1) and as many vectors."""
    rng = np.random.default_rng(seed)
    if not matrices:
        per = n // parts
        return {f"p{i}": rng.standard_normal(per).astype(np.float32) for i in range(parts)}
    half = parts // 2
    per = n // half
    rows = max(1, int(math.sqrt(per / 10)))
    out = {}
    for i in range(half):
        out[f"w{i}"] = rng.standard_normal((rows, per // rows)).astype(np.float32)
        out[f"b{i}"] = rng.standard_normal(rows).astype(np.float32)
    return out


def _step_seconds(engine, steps: int, comm=None) -> float:
    """Best seconds of ``engine.step()`` over ``steps`` steps on gradients written in place (after a warm-up step).

    In a group, each step's time is the slowest rank's. The best, not the median: on a shared
    machine other work only ever adds time, and the step's own work is the same every time.
    """
    rng = np.random.default_rng(1 + (0 if comm is None else comm.rank))
    g = rng.standard_normal(engine.grads.flat.size).astype(engine.grads.flat.dtype) * 1e-3
    times = []
    for i in range(steps + 1):
        engine.grads.flat[...] = g
        if comm is not None:
            comm.comm.Barrier()
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        if i:
            times.append(dt if comm is None else slowest(comm, dt))
    return min(times)


def worker_scaling(comm, cfg) -> dict:
    from .. import Engine, optim

    engine = Engine(_params(cfg["n"], 100, False), optim.AdamW(lr=1e-3), comm=comm if comm.size > 1 else None)
    step = _step_seconds(engine, cfg["steps"], comm)
    x = np.zeros(engine.grads.flat.size, np.float32)
    exchange = 0.0
    if comm.size > 1:
        comm.allreduce(x)
        exchange = _timed(comm, lambda: comm.allreduce(x), cfg["steps"])
    return {"ranks": comm.size, "n": engine.layout.num_elements, "step_s": step, "allreduce_s": exchange}


def _compressor(key: str, seed: int, ef: bool):
    from ..compress import ErrorFeedback
    from .compression import METHODS

    comp = METHODS[key][1](seed, ef)
    return ErrorFeedback(comp) if ef else comp


def worker_projection(comm, cfg) -> dict:
    """Per method: the payload bytes of this group and (in a group of one) the step's compute time."""
    from .. import Engine, optim

    rows = []
    for key in [None, *cfg["methods"]]:
        comp = None if key is None else _compressor(key, 0, True)
        engine = Engine(_params(cfg["n"], 20, True), optim.SGD(lr=1e-3, momentum=0.9), compressor=comp,
                        comm=comm if comm.size > 1 else None)
        seconds = _step_seconds(engine, cfg["steps"], comm if comm.size > 1 else None)
        rep = engine.step()
        dense = engine.layout.num_elements * 4
        rows.append({"method": key or "dense", "step_s": seconds, "dense_bytes": dense,
                     "payload_bytes": dense if rep.payload_bytes is None else rep.payload_bytes,
                     "summed": key is None or not _gathered(comp)})
    return {"ranks": comm.size, "n": cfg["n"], "rows": rows}


def _gathered(comp) -> bool:
    """True for a method whose payloads are all-gathered, not all-reduced: one that keeps
    :meth:`Compressor.aggregate <arraytrain.compress.Compressor.aggregate>`'s default (methods
    whose payloads add up override it with an all-reduce)."""
    from ..compress import Compressor, ErrorFeedback

    inner = comp.compressor if isinstance(comp, ErrorFeedback) else comp
    return isinstance(inner, Compressor) and type(inner).aggregate is Compressor.aggregate


def worker_sharding(comm, cfg) -> dict:
    """engine.memory() of the replicated and sharded engines (float32, under a bfloat16 working copy, and
    with 8-bit state); with ``cfg["time"]`` the float32 and the 8-bit engines' clipped steps, taking turns."""
    from .. import Engine, optim

    group = comm if comm.size > 1 else None
    params = _params(cfg["n"], 100, False)
    out = {"ranks": comm.size, "n": sum(v.size for v in params.values()), "memory": {}}
    engines = {}
    for precision, extra, state in (("fp32", {}, None), ("bf16", {"working_dtype": "bfloat16"}, None),
                                    ("8bit", {}, "8bit")):
        for shard in (False, True) if group is not None else (False,):
            eng = Engine(params, optim.AdamW(lr=1e-3, state_dtype=state), comm=group, shard_state=shard,
                         max_grad_norm=1.0, **extra)
            key = f"{precision}/{'sharded' if shard else 'replicated'}"
            out["memory"][key] = eng.memory()
            if precision in ("fp32", "8bit") and cfg.get("time"):
                engines[key] = eng
            else:
                del eng
    if engines:
        rng = np.random.default_rng(1 + comm.rank)
        g = {name: rng.standard_normal(v.shape).astype(np.float32) * 1e-3 for name, v in params.items()}
        flat = {}
        for key, eng in engines.items():  # each engine's gradient buffer as it lays the names out
            eng.grads.load(g)
            flat[key] = eng.grads.flat.copy()
        times = {k: [] for k in engines}
        for i in range(cfg["steps"] + 1):
            for key, eng in engines.items():
                eng.grads.flat[...] = flat[key]
                comm.comm.Barrier()
                t0 = time.perf_counter()
                eng.step()
                dt = slowest(comm, time.perf_counter() - t0)
                if i:
                    times[key].append(dt)
        out["step_s"] = {k: min(v) for k, v in times.items()}
        out["same_weights"], out["max_rel_diff"] = {}, {}
        for precision in ("fp32", "8bit"):
            rep, sha = (engines[f"{precision}/{kind}"].params for kind in ("replicated", "sharded"))
            diff = max(float(np.max(np.abs(rep[n] - sha[n]) / (np.abs(rep[n]) + 1e-30))) for n in params)
            out["same_weights"][precision] = diff == 0.0
            out["max_rel_diff"][precision] = diff
    return out


def worker_overlap(comm, cfg) -> dict:
    """One MLP training step, blocking and overlapped exchange taking turns; seconds, the slowest rank's."""
    from .. import Engine, nn, optim
    from ..parallel.mpi import MPIComm
    from ..parallel.sync import buckets

    if not cfg.get("progress_thread", True):
        comm = MPIComm(comm.comm, progress_thread=False)
    models, engines = {}, {}
    for key in ("blocking", "overlapped"):
        model = nn.MLP(cfg["widths"], dtype=np.float32)
        eng = Engine(model.init(seed=0), optim.AdamW(lr=1e-3), comm=comm, max_grad_norm=1.0,
                     overlap=key == "overlapped", zero_grad_on_step=False, bucket_bytes=cfg["bucket_bytes"])
        model.bind(eng)
        models[key], engines[key] = model, eng
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((cfg["batch"], cfg["widths"][0])).astype(np.float32)
    y = rng.integers(0, cfg["widths"][-1], cfg["batch"])
    times = {k: [] for k in engines}
    parts = {k: [] for k in engines}
    for i in range(cfg["steps"] + 1):
        for key in engines:
            model, eng = models[key], engines[key]
            comm.comm.Barrier()
            t0 = time.perf_counter()
            _, d = nn.softmax_cross_entropy(model.forward(x), y)
            model.backward(d)
            t1 = time.perf_counter()
            eng.step()
            t2 = time.perf_counter()
            if i:
                times[key].append(slowest(comm, t2 - t0))
                parts[key].append((t1 - t0, t2 - t1))
    best = {k: int(np.argmin(v)) for k, v in times.items()}
    same = np.array_equal(engines["blocking"].params.flat, engines["overlapped"].params.flat)
    return {"ranks": comm.size, "n": engines["blocking"].layout.num_elements,
            "step_s": {k: times[k][best[k]] for k in times},
            "backward_s": {k: parts[k][best[k]][0] for k in parts}, "boundary_s": {k: parts[k][best[k]][1] for k in parts},
            "buckets": len(buckets(engines["overlapped"].layout, cfg["bucket_bytes"], 4)), "same_weights": bool(same)}


WORKERS = {"allreduce": worker_allreduce, "scaling": worker_scaling, "projection": worker_projection,
           "sharding": worker_sharding, "overlap": worker_overlap}


def run_worker(name: str, cfg: dict) -> int:
    from ..distributed import MPIComm, abort_on_error

    with abort_on_error():
        comm = MPIComm()
        if name == "ddp":
            from .ddp import worker_ddp

            out = worker_ddp(comm, cfg)
        else:
            out = WORKERS[name](comm, cfg)
        if comm.rank == 0:
            print(RESULT + json.dumps(out), flush=True)
    return 0


# -- the launcher ------------------------------------------------------------------------------------


def worker_env(threads: int) -> dict:
    """The environment of a benchmark's ranks: this source on the path, ``threads`` numba threads and one
    BLAS/OpenMP thread each."""
    import arraytrain

    source = str(Path(arraytrain.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "NUMBA_NUM_THREADS": str(threads), "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _launch(ranks: int, argv, args) -> str:
    from ..distributed import launch

    proc = launch(ranks, [sys.executable, *argv], timeout=args.timeout, env=worker_env(args.threads))
    if proc.returncode != 0:
        raise RuntimeError(f"mpiexec -n {ranks} {' '.join(map(str, argv[:6]))} ... failed "
                           f"({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def _worker(name: str, ranks: int, cfg: dict, args) -> dict:
    out = _launch(ranks, ["-m", "arraytrain.bench", "distributed", "--worker", name, "--config", json.dumps(cfg)],
                  args)
    line = next(ln for ln in out.splitlines() if ln.startswith(RESULT))
    return json.loads(line[len(RESULT):])


def part_allreduce(args) -> dict:
    res = _worker("allreduce", args.ranks, {"sizes": args.sizes, "rounds": args.rounds, "reps": args.reps}, args)
    print(f"\nDense all-reduce of a float32 buffer, {res['ranks']} processes (best of {args.rounds} rounds, "
          "slowest rank):")
    print("| elements | bytes | MPIComm.allreduce µs | mpi4py Allreduce µs | MPIComm GB/s | % of mpi4py |")
    print("|---|---|---|---|---|---|")
    for row in res["rows"]:
        ours, raw = (min(row["samples_s"][k]) for k in ("MPIComm", "mpi4py"))
        row.update(mpicomm_s=ours, mpi4py_s=raw, fraction=raw / ours)
        print(f"| {row['n']:,} | {row['bytes']:,} | {1e6 * ours:,.1f} | {1e6 * raw:,.1f} | "
              f"{row['bytes'] / ours / 1e9:.2f} | {100 * raw / ours:.0f}% |")
    return res


def part_scaling(args) -> dict:
    rows = [_worker("scaling", k, {"n": args.scaling_size, "steps": args.steps}, args) for k in args.scaling_ranks]
    cores = os.cpu_count() or 1
    print(f"\nengine.step (AdamW, {rows[0]['n']:,} float32 parameters per process, {args.threads} numba thread(s) "
          f"per process; this machine has {cores} cores):")
    print("| processes | step ms | of which the all-reduce alone ms | vs 1 process |")
    print("|---|---|---|---|")
    for r in rows:
        note = " (oversubscribed)" if r["ranks"] * args.threads > cores else ""
        print(f"| {r['ranks']}{note} | {1e3 * r['step_s']:.2f} | {1e3 * r['allreduce_s']:.2f} | "
              f"{r['step_s'] / rows[0]['step_s']:.2f}x |")
    return {"rows": rows, "cores": cores}


def wire_bytes(payload: float, ranks: int, summed: bool) -> float:
    """Bytes each process sends for one exchange with the ring algorithms (see the module docstring)."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * payload if summed else (ranks - 1) * payload


def part_projection(args) -> dict:
    from .compression import METHODS

    cfg = {"n": args.compress_size, "steps": args.steps, "methods": args.methods}
    one = _worker("projection", 1, cfg, args)
    group = _worker("projection", 2, cfg, args)
    k = args.project_ranks
    rows = []
    for a, b in zip(one["rows"], group["rows"]):
        row = {"method": a["method"], "compute_s": a["step_s"], "step_s_2_ranks_here": b["step_s"],
               "payload_bytes": b["payload_bytes"], "dense_bytes": b["dense_bytes"], "summed": b["summed"]}
        row["wire_bytes"] = wire_bytes(row["payload_bytes"], k, row["summed"])
        row["projected_s"] = {str(gbps): row["compute_s"] + 8 * row["wire_bytes"] / (gbps * 1e9)
                              for gbps in args.links}
        rows.append(row)
    label = {m: METHODS[m][0] + " + EF" for m in METHODS}
    print(f"\nCompressed exchange, {one['n']:,} float32 parameters (10 matrices, 10 vectors): bytes each process "
          f"sends per step and the step time projected for {k} processes (compute measured in one process + "
          "ring wire time; bandwidth only):")
    links = " | ".join(f"step ms @ {g:g} Gb/s" for g in args.links)
    print(f"| method | exchange | payload bytes | x smaller | sent per step, {k} processes | compute ms | {links} |")
    print("|---|---|---|---|---|---|" + "---|" * len(args.links))
    for r in rows:
        cells = " | ".join(f"{1e3 * r['projected_s'][str(g)]:.2f}" for g in args.links)
        print(f"| {label.get(r['method'], 'dense')} | {'all-reduce' if r['summed'] else 'all-gather'} | "
              f"{r['payload_bytes']:,} | {r['dense_bytes'] / r['payload_bytes']:.1f} | {r['wire_bytes']:,.0f} | "
              f"{1e3 * r['compute_s']:.2f} | {cells} |")
    return {"ranks": k, "links_gbps": args.links, "rows": rows}


def cli_spec(comp) -> str:
    """``--compress`` for ``arraytrain train``: the compressor's class and hyperparameters."""
    from ..cli import COMPRESSORS

    method = {v: k for k, v in COMPRESSORS.items()}[type(comp).__name__]
    return method + ":" + ",".join(f"{k}={v}" for k, v in comp.hyperparameters().items() if v is not None)


def part_accuracy(args) -> dict:
    from .compression import METHODS

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for key in [None, *args.methods]:
                for ef in ((False,) if key is None else (False, True)):
                    js = os.path.join(tmp, "run.json")
                    argv = ["-m", "arraytrain", "train", "--no-progress", "--json", js, "--epochs", str(args.epochs),
                            "--seed", str(seed), "--optimizer", "sgd", "--lr", "0.01", "--momentum", "0.9"]
                    if key is not None:
                        argv += ["--compress", cli_spec(METHODS[key][1](seed, ef)),
                                 "--error-feedback" if ef else "--no-error-feedback"]
                    t0 = time.perf_counter()
                    try:
                        _launch(args.accuracy_ranks, argv, args)
                    except RuntimeError as exc:  # the engine gave up on non-finite steps: diverged
                        if "NonFiniteError" not in str(exc):
                            raise
                        runs.append({"method": key or "none", "ef": ef, "seed": seed, "accuracy": math.nan,
                                     "diverged": True, "bytes_per_step": math.nan, "dense_bytes": math.nan,
                                     "seconds": time.perf_counter() - t0})
                        continue
                    with open(js) as f:
                        res = json.load(f)
                    dense = 4 * res["parameters"]
                    runs.append({"method": key or "none", "ef": ef, "seed": seed, "accuracy": res["test_accuracy"],
                                 "diverged": False, "bytes_per_step": res["payload_bytes_per_step"] or dense,
                                 "dense_bytes": dense, "processes": res["processes"],
                                 "seconds": time.perf_counter() - t0})
                    r = runs[-1]
                    print(f"seed {seed} {r['method']:9s} ef={ef!s:5s} acc {r['accuracy']:.4f} "
                          f"{r['bytes_per_step']:,.0f} B/step ({r['seconds']:.1f} s)", file=sys.stderr, flush=True)
    from .compression import summarise, table

    summary = summarise(runs)
    print(f"\nDigits MLP, {args.accuracy_ranks} processes (mpiexec -n {args.accuracy_ranks} arraytrain train), "
          f"SGD momentum 0.9, lr 0.01, {args.epochs} epochs, batch 32 (global), {args.seeds} seed(s); bytes/step: "
          "what each process sent:")
    print(table(summary))
    return {"ranks": args.accuracy_ranks, "runs": runs, "summary": summary}


def plot(path: str, results: dict) -> None:
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    panels = [p for p in ("allreduce", "projection", "accuracy") if p in results]
    fig = Figure(figsize=(5.2 * len(panels), 4.2))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, part in zip(axes, panels):
        res = results[part]
        if part == "allreduce":
            n = [r["bytes"] for r in res["rows"]]
            for key, style in (("mpicomm_s", "o-"), ("mpi4py_s", "s--")):
                ax.plot(n, [b / r[key] / 1e9 for b, r in zip(n, res["rows"])], style,
                        label="MPIComm.allreduce" if key == "mpicomm_s" else "mpi4py Allreduce")
            ax.set(xscale="log", xlabel="buffer bytes (float32)", ylabel="GB/s (bytes / time)",
                   title=f"dense all-reduce, {res['ranks']} processes")
            ax.legend(fontsize=8)
        elif part == "projection":
            rows = res["rows"]
            y = np.arange(len(rows))[::-1]
            h = 0.8 / len(res["links_gbps"])
            for i, g in enumerate(res["links_gbps"]):
                ax.barh(y + (i - (len(res["links_gbps"]) - 1) / 2) * h,
                        [1e3 * r["projected_s"][str(g)] for r in rows], height=h, label=f"{g:g} Gb/s")
            ax.set(yticks=y, yticklabels=[r["method"] for r in rows], xscale="log", xlabel="projected step ms",
                   title=f"step time, {res['ranks']} processes (projected)")
            ax.legend(fontsize=8)
        else:
            for s in res["summary"]:
                marker = "s" if s["ef"] else "o"
                color = "gray" if s["method"] == "none" else ("tab:blue" if s["ef"] else "tab:red")
                ax.scatter(s["bytes_per_step"], 100 * s["accuracy"], marker=marker, color=color)
                ax.annotate(s["method"], (s["bytes_per_step"], 100 * s["accuracy"]), fontsize=7, color=color,
                            xytext=(4, 3 if s["ef"] else -8), textcoords="offset points")
            ax.set(xscale="log", xlabel="bytes sent per process per step", ylabel="test accuracy (%)",
                   title=f"digits, {res['ranks']} processes (blue squares: error feedback)")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def part_sharding(args) -> dict:
    rows = []
    for k in [1, *args.shard_ranks]:
        rows.append(_worker("sharding", k, {"n": args.shard_size, "steps": args.steps, "time": k == 2}, args))
    mib = 2.0**20
    n = rows[0]["n"]
    print(f"\nSharded optimizer state: engine.memory() per process, AdamW on {n:,} float32 parameters "
          "(100 tensors), MiB:")
    print("| processes | precision | engine | params | grads | state | master | working | state vs replicated |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for key, mem in r["memory"].items():
            precision, kind = key.split("/")
            full = rows[0]["memory"][f"{precision}/replicated"]["state"]
            print(f"| {r['ranks']} | {precision} | {kind} | " + " | ".join(
                f"{mem[k] / mib:.1f}" for k in ("params", "grads", "state", "master", "working"))
                  + f" | {mem['state'] / full:.3f} (1/K = {1 / r['ranks']:.3f}) |")
    timed = next((r for r in rows if "step_s" in r), None)
    if timed is not None:
        st = timed["step_s"]
        print(f"\nThe clipped AdamW step at {timed['ranks']} processes ({n:,} parameters, {args.threads} numba "
              f"thread(s) per process; best of {args.steps}, the slowest rank's):")
        print("| state | replicated ms | sharded ms | sharded / replicated speed | weights |")
        print("|---|---|---|---|---|")
        for precision in ("fp32", "8bit"):
            rep, sha = st[f"{precision}/replicated"], st[f"{precision}/sharded"]
            same = ("equal bit for bit" if timed["same_weights"][precision]
                    else f"max rel. diff {timed['max_rel_diff'][precision]:.1e}")
            print(f"| {precision} | {1e3 * rep:.2f} | {1e3 * sha:.2f} | {rep / sha:.2f}x | {same} |")
    return {"rows": rows}


def part_overlap(args) -> dict:
    cfg = {"widths": args.overlap_widths, "batch": args.overlap_batch, "steps": args.steps,
           "bucket_bytes": int(args.overlap_bucket_mib * 2**20)}
    runs = {}
    for label, env, thread in (("MPIComm's progress thread and the marks' tests", {}, True),
                               ("the marks' tests only (progress_thread=False)", {}, False),
                               ("MPICH's progress thread (progress_thread=False)", {"MPIR_CVAR_ASYNC_PROGRESS": "1"}, False)):
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            runs[label] = _worker("overlap", 2, {**cfg, "progress_thread": thread}, args)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    first = next(iter(runs.values()))
    print(f"\nThe exchange overlapped with the backward pass, 2 processes: the MLP {args.overlap_widths} "
          f"({first['n']:,} float32 parameters, {first['buckets']} buckets of {args.overlap_bucket_mib:g} MiB), batch {args.overlap_batch} "
          f"per process, {args.threads} numba thread(s) and one BLAS thread per process; one training step "
          f"(forward, backward, exchange, update), best of {args.steps}, the slowest rank's:")
    print("| MPI progress | blocking ms | overlapped ms | overlapped / blocking speed | of which forward+backward "
          "ms (blocking, overlapped) | weights |")
    print("|---|---|---|---|---|---|")
    for label, r in runs.items():
        st, bw = r["step_s"], r["backward_s"]
        same = "equal bit for bit" if r["same_weights"] else "differ"
        print(f"| {label} | {1e3 * st['blocking']:.2f} | {1e3 * st['overlapped']:.2f} | "
              f"{st['blocking'] / st['overlapped']:.2f}x | {1e3 * bw['blocking']:.2f}, {1e3 * bw['overlapped']:.2f} "
              f"| {same} |")
    return {"runs": runs}


def _floats(text: str) -> list:
    return [float(s) for s in text.split(",") if s]


def build_parser() -> argparse.ArgumentParser:
    from .compression import METHODS

    p = argparse.ArgumentParser(prog="python -m arraytrain.bench distributed",
                                description="processes over MPI: all-reduce, scaling, compressed exchange, accuracy")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--ranks", type=int, default=2, help="processes for the all-reduce comparison")
    p.add_argument("--sizes", default="1e3,1e5,1e6,1e7", help="all-reduce elements (float32)")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--scaling-ranks", default="1,2,4")
    p.add_argument("--scaling-size", type=float, default=1e6)
    p.add_argument("--compress-size", type=float, default=1e6)
    p.add_argument("--methods", default=",".join(METHODS), help=f"compressors, a subset of {','.join(METHODS)}")
    p.add_argument("--links", default="1,10,100", help="link speeds in Gb/s for the projection")
    p.add_argument("--project-ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=40, help="timed engine steps")
    p.add_argument("--accuracy-ranks", type=int, default=4)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--shard-ranks", default="2,4", help="sharding: group sizes besides 1")
    p.add_argument("--shard-size", type=float, default=1e7, help="sharding: float32 parameters")
    p.add_argument("--overlap-widths", default="1024,2048,2048,1024,10", help="overlap: the MLP's layer widths")
    p.add_argument("--overlap-batch", type=int, default=256, help="overlap: samples per process")
    p.add_argument("--overlap-bucket-mib", type=float, default=4.0, help="overlap: bucket size in MiB")
    p.add_argument("--threads", type=int, default=1, help="numba threads per process")
    p.add_argument("--timeout", type=float, default=900, help="seconds per mpiexec job")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png")
    p.add_argument("--vs-ddp", action="store_true", help="the torch binding against torch DDP (only this part)")
    p.add_argument("--ddp-models", default="all", help="--vs-ddp: models, comma-separated names or 'all'")
    p.add_argument("--ddp-batch", type=int, default=64, help="--vs-ddp: samples per process")
    p.add_argument("--ddp-plot", metavar="FILE.png", help="--vs-ddp: draw the steps")
    p.add_argument("--worker", choices=sorted(WORKERS) + ["ddp"], help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    from .compression import METHODS

    args = build_parser().parse_args(argv)
    if args.worker:
        return run_worker(args.worker, json.loads(args.config))
    from ..distributed import find_mpiexec

    parts = [s for s in args.parts.split(",") if s]
    args.methods = [m for m in args.methods.split(",") if m]
    bad = [s for s in parts if s not in PARTS] + [m for m in args.methods if m not in METHODS]
    if bad:
        print(f"--parts/--methods: unknown {bad}; parts {list(PARTS)}, methods {list(METHODS)}", file=sys.stderr)
        return 2
    if find_mpiexec() is None:
        print('no mpiexec: pip install "arraytrain[mpi]"', file=sys.stderr)
        return 2
    args.sizes = [int(s) for s in _floats(args.sizes)]
    args.scaling_ranks = [int(s) for s in _floats(args.scaling_ranks)]
    args.shard_ranks = [int(s) for s in _floats(args.shard_ranks)]
    args.shard_size = int(args.shard_size)
    args.overlap_widths = [int(s) for s in _floats(args.overlap_widths)]
    args.scaling_size, args.compress_size = int(args.scaling_size), int(args.compress_size)
    args.links = _floats(args.links)
    if args.vs_ddp:
        from . import ddp

        names = list(ddp.MODELS) if args.ddp_models == "all" else [s for s in args.ddp_models.split(",") if s]
        unknown = [n for n in names if n not in ddp.MODELS]
        if unknown:
            print(f"--ddp-models: unknown {unknown}; models {list(ddp.MODELS)}", file=sys.stderr)
            return 2
        res = _worker("ddp", 2, {"models": names, "batch": args.ddp_batch, "steps": args.steps,
                                 "port": ddp.free_port()}, args)
        ddp.report(res, args)
        print(f"\nlosses agree with DDP's to 1e-4: {ddp.losses_agree(res)}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"vs_ddp": res}, f, indent=2)
        if args.ddp_plot:
            ddp.plot(args.ddp_plot, res)
        return 0
    runners = {"allreduce": part_allreduce, "scaling": part_scaling, "projection": part_projection,
               "accuracy": part_accuracy, "sharding": part_sharding, "overlap": part_overlap}
    results = {part: runners[part](args) for part in parts}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k not in ("worker", "config")},
                       **results}, f, indent=2)
    if args.plot:
        plot(args.plot, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
