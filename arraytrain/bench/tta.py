"""``python -m arraytrain.bench tta``: compression measured end to end on the simulated cluster.

``arraytrain train`` runs under ``mpiexec`` with one rank per node of a :class:`~arraytrain.bench.cluster.Cluster`
(links shaped with ``tc``), once per ``--compress`` setting, seed and link rate, every setting of a
seed and link in turn. Each run's figures come from its ``--json`` summary and the nodes' own
``eth0`` counters:

- **training time**: the run's micro-batches (forward, backward, exchange, optimizer; the
  ``time_split_seconds`` of the summary less its evaluation and metrics), and **samples/s** over
  it — the whole run, its warm-up, probes and ramp included, not the fastest epoch;
- **bytes**: what each node sent, the job's start-up included;
- **test accuracy** (mean over the seeds), and against the dense run of the same seed and link.

The default is the issue's task: the digits MLP widened to 2048,2048 (4.3M parameters, a 17 MB
gradient a step), batch 64 per step, 8 epochs, AdamW.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .cluster import MPI_ENV, Cluster, available, on_cluster

TRAIN = ["--hidden", "2048,2048", "--batch-size", "64", "--epochs", "8"]
#: ``--task lm``: the character language model of :mod:`arraytrain.bench.lm`, its contestants and settings.
LM_CONTESTANTS = ["torch DDP", "torch DDP + PowerSGD", "arraytrain dense", "arraytrain powersgd:rank=4",
                  "arraytrain auto"]
LM = {"d_model": 256, "layers": 2, "seq": 32, "batch": 16, "lr": 1e-3, "target": 2.2, "eval_every": 25,
      "max_steps": 800, "val_windows": 64, "megabytes": 2.0, "seed": 0, "steps_per_epoch": 25}
SETTINGS = ["dense", "auto", "powersgd:rank=4", "topk:ratio=0.01", "sign", "ternary", "int8"]


def run_one(cluster: Cluster, spec: str, seed: int, train: list, timeout: float, workdir: Path) -> dict:
    """One ``arraytrain train`` across the nodes; its figures (raises with the job's stderr if it failed)."""
    out = workdir / f"run-{time.monotonic_ns()}.json"
    argv = [sys.executable, "-m", "arraytrain", "train", *train, "--seed", str(seed), "--no-progress",
            "--json", str(out), *([] if spec == "dense" else ["--compress", spec])]
    before = cluster.tx_bytes()
    t = time.perf_counter()
    proc = cluster.run(0, cluster.mpiexec(argv), env=MPI_ENV, timeout=timeout)
    wall = time.perf_counter() - t
    sent = [b - a for a, b in zip(before, cluster.tx_bytes())]
    if proc.returncode != 0:
        raise RuntimeError(f"{spec} seed {seed}: the job failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    r = json.loads(out.read_text())
    split = r["time_split_seconds"]
    train_s = sum(v for k, v in split.items() if k not in ("evaluation", "metrics"))
    samples = r["micro_batches_this_run"] * int(r["config"]["batch_size"])
    return {"spec": spec, "seed": seed, "accuracy": r["test_accuracy"], "train_s": train_s,
            "samples_per_s": samples / train_s, "best_epoch_samples_per_s": r["samples_per_second"],
            "wall_s": wall, "node_bytes": max(sent), "payload_bytes_per_step": r["payload_bytes_per_step"],
            "decisions": [{k: v for k, v in d.items() if k != "exchange_s"} for d in r.get("compression_decisions") or []],
            "schedule": r.get("compression_schedule")}


def run_lm(cluster: Cluster, cfg: dict, timeout: float) -> dict:
    """:mod:`arraytrain.bench.lm`'s contestants across the nodes (one job); rank 0's figures."""
    from .cluster import PORT, TX_BYTES
    from .distributed import RESULT

    cfg = {**cfg, "addr": cluster.addresses[0], "port": PORT + 2, "wire": TX_BYTES}
    argv = cluster.mpiexec([sys.executable, "-m", "arraytrain.bench.lm", "--config", json.dumps(cfg)])
    proc = cluster.run(0, argv, env=MPI_ENV, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the language model's job failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT))
    return json.loads(line[len(RESULT):])


def lm_table(res: dict, link: float, cfg: dict) -> str:
    """Time to the target validation loss, each contestant against torch DDP + PowerSGD."""
    rows = res["results"]
    ref = rows.get("torch DDP + PowerSGD")
    lines = [f"link {link:g} Gbit/s a node; {res['params']:,} parameters; target validation loss {cfg['target']}",
             "| contestant | reached | steps | seconds to target | vs DDP + PowerSGD | MB sent per node | chose |",
             "|---|---|---:|---:|---:|---:|---|"]
    for label, r in rows.items():
        vs = f"{ref['seconds'] / r['seconds']:.2f}x" if ref and ref["reached"] and r["reached"] else ""
        chose = ", ".join(d["choice"] for d in r["decisions"])
        lines.append(f"| {label} | {'yes' if r['reached'] else 'no (%.3f)' % r['val_loss']} | {r['steps']} | "
                     f"{r['seconds']:.1f} | {vs} | {r['node_bytes'] / 1e6:,.0f} | {chose} |")
    return "\n".join(lines)


def table(runs: list, link: float) -> str:
    """The settings' means over the seeds at one link, against dense."""
    by = {}
    for r in runs:
        by.setdefault(r["spec"], []).append(r)
    dense = by.get("dense")
    dense_sps = statistics.mean(r["samples_per_s"] for r in dense) if dense else None
    dense_acc = statistics.mean(r["accuracy"] for r in dense) if dense else None
    lines = [f"link {link:g} Gbit/s a node; {len(next(iter(by.values())))} seeds; means",
             "| --compress | samples/s (whole run) | vs dense | test accuracy | vs dense | MB sent per node | chose |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for spec, rs in by.items():
        sps = statistics.mean(r["samples_per_s"] for r in rs)
        acc = statistics.mean(r["accuracy"] for r in rs)
        chose = ", ".join(sorted({d["choice"] for r in rs for d in r["decisions"]})) or ""
        each = ", ".join(f"{100 * r['accuracy']:.2f}" for r in rs)
        lines.append(f"| {spec} | {sps:,.0f} | {sps / dense_sps:.2f}x | {100 * acc:.2f}% "
                     f"({each}) | {100 * (acc - dense_acc):+.2f} pt | "
                     f"{statistics.mean(r['node_bytes'] for r in rs) / 1e6:,.0f} | {chose} |"
                     if dense else f"| {spec} | {sps:,.0f} | | {100 * acc:.2f}% | | | {chose} |")
    return "\n".join(lines)


def plot(path: str, results: list, task: str) -> None:
    """lm: validation loss against training seconds, a line per contestant, a panel per link; digits:
    samples/s over the whole run per setting (mean of the seeds), a panel per link."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
    for ax, res in zip(axes[0], results):
        if task == "lm":
            for label, r in res["results"].items():
                ax.plot([0] + [c[1] for c in r["curve"]], [None] + [c[2] for c in r["curve"]], marker=".",
                        linestyle="--" if label.startswith("torch") else "-", label=label)
            ax.axhline(res["lm"]["target"], color="grey", linewidth=0.8)
            ax.set_xlabel("training seconds")
            ax.set_ylabel("validation loss (nats per byte)")
            ax.legend(fontsize=7)
        else:
            by = {}
            for r in res["runs"]:
                by.setdefault(r["spec"], []).append(r["samples_per_s"])
            ax.bar(range(len(by)), [statistics.mean(v) for v in by.values()])
            ax.set_xticks(range(len(by)), list(by), rotation=30, ha="right", fontsize=8)
            ax.set_ylabel("samples/s over the whole run (mean of seeds)")
        ax.set_title(f"{res['link_gbit']:g} Gbit/s a node", fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m arraytrain.bench tta", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--link", default="1", help="Gbit/s a node, comma-separated (default 1)")
    p.add_argument("--compress", default=";".join(SETTINGS),
                   help=f"';'-separated --compress settings, 'dense' for none (default {';'.join(SETTINGS)})")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--train", default=" ".join(TRAIN), help=f"arraytrain train's other flags (default {' '.join(TRAIN)})")
    p.add_argument("--task", choices=("digits", "lm"), default="digits",
                   help="digits: arraytrain train's widened MLP (default); lm: a character TransformerEncoder "
                        "language model on the standard library's sources, DDP (+ PowerSGD's hook) against bind, "
                        "to a validation loss (--compress and --seeds do not apply)")
    p.add_argument("--lm", default="{}", help="JSON: settings of --task lm over the defaults "
                                              "(d_model, layers, seq, batch, lr, target, eval_every, max_steps, ...)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png", help="lm: validation loss against seconds; digits: samples/s")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        links = [float(x) for x in args.link.split(",") if x]
        seeds = [int(x) for x in args.seeds.split(",") if x]
    except ValueError:
        links, seeds = [], []
    if not links or min(links) <= 0 or not seeds:
        print(f"--link, --seeds: expected rates > 0 in Gbit/s and integer seeds, comma-separated, got "
              f"{args.link!r} and {args.seeds!r}", file=sys.stderr)
        return 2
    specs = [s.strip() for s in args.compress.split(";") if s.strip()]
    try:
        extra = json.loads(args.lm)
    except ValueError:
        extra = None
    if not isinstance(extra, dict) or set(extra) - {*LM, "contestants"}:
        print(f"--lm: expected a JSON object with keys among {sorted({*LM, 'contestants'})}, got {args.lm!r}",
              file=sys.stderr)
        return 2
    why = available()
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    results = []
    lm = {**LM, "contestants": LM_CONTESTANTS, **extra}

    def body(cluster):
        with tempfile.TemporaryDirectory() as tmp:
            for link in links:
                cluster.shape(link)
                print(f"{args.nodes} nodes, link probed at {cluster.probe():.2f} Gbit/s (shaped to {link:g})", flush=True)
                if args.task == "lm":
                    res = run_lm(cluster, lm, args.timeout)
                    print(lm_table(res, link, lm), flush=True)
                    results.append({"link_gbit": link, "lm": lm, **res})
                    continue
                runs = []
                for seed in seeds:
                    for spec in specs:
                        r = run_one(cluster, spec, seed, args.train.split(), args.timeout, Path(tmp))
                        runs.append(r)
                        print(f"  {spec:24s} seed {seed}: {100 * r['accuracy']:.2f}%  {r['samples_per_s']:,.0f} samples/s "
                              f"(best epoch {r['best_epoch_samples_per_s']:,.0f})  {r['node_bytes'] / 1e6:,.0f} MB  "
                              + "; ".join(f"step {d['step']}: {d['choice']}" for d in r["decisions"]), flush=True)
                print(table(runs, link), flush=True)
                results.append({"link_gbit": link, "runs": runs})

    status = on_cluster(args.nodes, links[0], body)
    if status is not None:
        return status
    if args.json:
        Path(args.json).write_text(json.dumps({"nodes": args.nodes, "train": args.train, "results": results}, indent=2))
    if args.plot:
        plot(args.plot, results, args.task)
    return 0


if __name__ == "__main__":
    sys.exit(main())
