r"""The compression benchmarks: what each compressor costs in accuracy, and how fast it runs.

``python -m arraytrain.bench compression``: the digits MLP trained with every compressor.

The model, data, split and batches of ``arraytrain train`` (scikit-learn's
digits, MLP 64-128-64-10), trained for ``--epochs`` with each gradient
compressor of :mod:`arraytrain.compress`, with and without error feedback,
over ``--seeds`` seeds, beside the same runs without compression. Reported per
configuration: the final test accuracy (mean, min and max over seeds), its
difference from uncompressed training, and the payload bytes per optimizer
step as the engine measured them (``StepReport.payload_bytes``: the real
arrays, indices and scales included) against the uncompressed gradient's
bytes. ``--plot FILE.png`` draws accuracy against bytes per step.

The optimizer is SGD with momentum (``--optimizer``, ``--lr``), the setting of
the error-feedback papers (Seide et al. 2014; Karimireddy et al. 2019;
Vogels et al. 2019); every compressor sees the same gradients, seeds and lr.

``python -m arraytrain.bench compress``: compressor throughput beside the machine's bandwidth.

For every compressor of :mod:`arraytrain.compress` and gradient size: the
time of ``compress``, of ``decompress`` and of the error-feedback round trip
(``ErrorFeedback(c).roundtrip``: residual add, compress, decode, residual
update), as GB/s of float32 gradient handled (4 bytes per element) and as a
fraction of a numba triad measured in the same rounds; and the payload's
measured size. Methods are timed in alternating rounds (``--rounds``), the
best of ``--reps`` calls per round; the median over rounds is reported.
``np.argpartition`` on ``|g|`` (the usual NumPy top-k) is timed beside top-k.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import numpy as np

from .common import make_triad, timeit

# name -> (label, factory(seed, ef)); the settings docs/guide.md's table shows, each method at its
# setting from the first call (the sparsifiers without their ramp: ramp=0). Random-k and
# VSA are unbiased (scaled by n/k) without error feedback and plain contractions (no
# scaling) with it: error feedback needs a contraction (Stich et al. 2018), and the
# unbiased forms' variance makes its residual grow.
METHODS = {
    "topk": ("top-k 1%", lambda s, ef: _c().TopK(ratio=0.01, ramp=0)),
    "randomk": ("random-k 10%", lambda s, ef: _c().RandomK(ratio=0.10, rescale=not ef, seed=s, ramp=0)),
    "int8": ("int8 block 256", lambda s, ef: _c().Int8Block(block=256)),
    "int8sr": ("int8 block 256, stochastic rounding",
               lambda s, ef: _c().Int8Block(block=256, stochastic_rounding=True, seed=s)),
    "sign": ("sign (1 bit)", lambda s, ef: _c().Sign()),
    "ternary": ("ternary (TernGrad) block 256", lambda s, ef: _c().Ternary(block=256, seed=s)),
    "powersgd": ("PowerSGD rank 2", lambda s, ef: _c().PowerSGD(rank=2, seed=s)),
    "vsa": ("VSA / SRHT 10%", lambda s, ef: _c().VSA(ratio=0.10, unbiased=not ef, seed=s)),
}


def _c():
    from .. import compress

    return compress


def run_one(data, method: str | None, ef: bool, seed: int, args) -> dict:
    """Train once; return test accuracy, mean payload bytes per step, dense bytes, seconds."""
    from .. import Engine, compress, nn, optim
    from ..errors import NonFiniteError

    model = nn.MLP([data.num_features, *args.hidden, data.num_classes], dtype=np.float32)
    params = model.init(seed=seed)
    comp = None
    if method is not None:
        comp = METHODS[method][1](seed, ef)
        if ef:
            comp = compress.ErrorFeedback(comp)
    opt = (optim.SGD(lr=args.lr, momentum=0.9) if args.optimizer == "sgd"
           else optim.AdamW(lr=args.lr))
    engine = Engine(params, opt, zero_grad_on_step=False, compressor=comp)
    model.bind(engine)
    sizes: list[int] = []

    def count(trainer, step, logs):
        rep = logs["report"]
        if rep is not None and rep.applied:
            sizes.append(rep.payload_bytes if rep.payload_bytes is not None else dense)

    dense = engine.layout.num_elements * engine.params.dtype.itemsize
    trainer = nn.Trainer(model, engine, batch_size=args.batch_size, seed=seed,
                         callbacks=[nn.LambdaCallback(on_batch_end=count)])
    t0 = time.perf_counter()
    try:
        with np.errstate(all="ignore"):  # a diverging run overflows on its way to NonFiniteError
            trainer.fit(data.x_train, data.y_train, epochs=args.epochs)
        accuracy = float(trainer.evaluate(data.x_test, data.y_test)["accuracy"])
    except NonFiniteError:  # the engine gave up after max_consecutive_skips non-finite steps
        accuracy = math.nan
    seconds = time.perf_counter() - t0
    return {"method": method or "none", "ef": ef, "seed": seed, "accuracy": accuracy,
            "diverged": math.isnan(accuracy), "bytes_per_step": float(np.mean(sizes)), "dense_bytes": dense,
            "steps": len(sizes), "seconds": seconds}


def summarise(rows: list[dict]) -> list[dict]:
    """Per (method, ef): accuracy mean/min/max over seeds, bytes per step, difference from 'none'."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["method"], r["ef"]), []).append(r)
    base = statistics.fmean(r["accuracy"] for r in groups[("none", False)])
    out = []
    for (method, ef), rs in groups.items():
        acc = [r["accuracy"] for r in rs if not r["diverged"]]
        mean = statistics.fmean(acc) if acc else math.nan
        out.append({"method": method, "ef": ef, "label": "uncompressed" if method == "none" else METHODS[method][0],
                    "accuracy": mean, "min": min(acc, default=math.nan), "max": max(acc, default=math.nan),
                    "diverged": len(rs) - len(acc), "delta_points": 100 * (mean - base),
                    "bytes_per_step": statistics.fmean(r["bytes_per_step"] for r in rs),
                    "dense_bytes": rs[0]["dense_bytes"], "seeds": len(rs),
                    "seconds": statistics.fmean(r["seconds"] for r in rs)})
    return out


def table(summary: list[dict]) -> str:
    lines = ["| compressor | error feedback | test accuracy (min–max) | vs uncompressed | bytes/step | "
             "x smaller | s/run |",
             "|---|---|---|---|---|---|---|"]
    for s in summary:
        ef = "—" if s["method"] == "none" else ("yes" if s["ef"] else "no")
        if s["diverged"] == s["seeds"]:
            acc, delta = f"diverged ({s['seeds']}/{s['seeds']} seeds)", "—"
        else:
            acc = f"{100 * s['accuracy']:.2f}% ({100 * s['min']:.1f}–{100 * s['max']:.1f})"
            acc += f", {s['diverged']} seed(s) diverged" if s["diverged"] else ""
            delta = f"{s['delta_points']:+.2f} pt"
        lines.append(f"| {s['label']} | {ef} | {acc} "
                     f"| {delta} | {s['bytes_per_step']:,.0f} | "
                     f"{s['dense_bytes'] / s['bytes_per_step']:.1f} | {s['seconds']:.1f} |")
    return "\n".join(lines)


def plot(path: str, summary: list[dict]) -> None:
    """Two panels sharing the methods' axis: accuracy (mean, min–max) with and without EF; bytes per step."""
    from matplotlib.figure import Figure

    base = next(s for s in summary if s["method"] == "none")
    labels = [base["label"]] + [m[0] for k, m in METHODS.items() if any(s["method"] == k for s in summary)]
    keys = ["none"] + [k for k in METHODS if any(s["method"] == k for s in summary)]
    y = np.arange(len(keys))[::-1]
    fig = Figure(figsize=(10, 0.45 * len(keys) + 1.6))
    ax_acc, ax_bytes = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [3, 2]})
    ax_acc.axvline(100 * base["accuracy"], color="gray", linestyle="--", linewidth=1)
    for ef, dy, marker, color, label in ((False, 0.15, "o", "tab:red", "without error feedback"),
                                         (True, -0.15, "s", "tab:blue", "with error feedback")):
        xs, ys, lo, hi = [], [], [], []
        for yi, k in zip(y, keys):
            s = next((s for s in summary if s["method"] == k and (s["ef"] == ef or k == "none")), None)
            if s is None or s["diverged"] == s["seeds"] or (k == "none" and ef):
                continue
            xs.append(100 * s["accuracy"])
            ys.append(yi + (0 if k == "none" else dy))
            lo.append(100 * (s["accuracy"] - s["min"]))
            hi.append(100 * (s["max"] - s["accuracy"]))
        ax_acc.errorbar(xs, ys, xerr=[lo, hi], fmt=marker, color=color, capsize=3, label=label)
    ax_acc.set(xlabel="test accuracy (%): mean, min–max over seeds", yticks=y, yticklabels=labels)
    ax_acc.legend(loc="lower left", fontsize=8)
    nbytes = [next(s["bytes_per_step"] for s in summary if s["method"] == k) for k in keys]
    ax_bytes.barh(y, nbytes, color=["gray"] + ["tab:green"] * (len(keys) - 1))
    for yi, nb in zip(y, nbytes):
        ax_bytes.annotate(f"{nb:,.0f} B  ({base['dense_bytes'] / nb:.0f}x)", (nb, yi), xytext=(3, -3),
                          textcoords="offset points", fontsize=8)
    ax_bytes.set_xscale("log")
    ax_bytes.set_xlim(right=max(nbytes) * 20)
    ax_bytes.set(xlabel="payload bytes per step (measured)")
    for ax in (ax_acc, ax_bytes):
        ax.grid(alpha=0.3, axis="x", which="both")
    fig.suptitle(f"digits MLP, {base['seeds']} seeds: accuracy and bytes sent per step, by compressor")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m arraytrain.bench compression",
                                description="the digits MLP trained with every compressor, with and without EF")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", default="128,64")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--json", metavar="FILE", help="write every run and the summary")
    p.add_argument("--plot", metavar="FILE.png", help="accuracy against bytes per step (matplotlib)")
    return p


def main(argv=None) -> int:
    from ..nn import load_digits

    args = build_parser().parse_args(argv)
    args.hidden = [int(h) for h in args.hidden.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        print(f"--methods: unknown {unknown}; choose from {list(METHODS)}", file=sys.stderr)
        return 2
    rows = []
    for seed in range(args.seeds):
        data = load_digits(seed=seed)
        rows.append(run_one(data, None, False, seed, args))
        for m in methods:
            for ef in (False, True):
                rows.append(run_one(data, m, ef, seed, args))
                r = rows[-1]
                print(f"seed {seed} {m:9s} ef={ef!s:5s} acc {r['accuracy']:.4f} "
                      f"{r['bytes_per_step']:,.0f} B/step ({r['seconds']:.1f} s)", file=sys.stderr, flush=True)
    summary = summarise(rows)
    print(f"digits MLP {args.hidden}, {args.optimizer} lr {args.lr}, {args.epochs} epochs, batch {args.batch_size}, "
          f"{args.seeds} seeds")
    print(table(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": rows, "summary": summary, "config": {k: v for k, v in vars(args).items()}}, f, indent=2)
    if args.plot:
        plot(args.plot, summary)
    return 0


# -- throughput: compress, decompress, the error-feedback round trip ---------------------------------

# the settings docs/guide.md's throughput table shows
THROUGHPUT_METHODS = ("topk-1%", "randomk-1%", "int8-256", "int8-256-sr", "sign", "ternary", "powersgd-r4", "vsa-1%")


def throughput_compressor(method: str, error_feedback: bool = False):
    """A :data:`THROUGHPUT_METHODS` method's compressor; with ``error_feedback``, wrapped in
    :class:`~arraytrain.compress.ErrorFeedback`, random-k and VSA in their contraction form
    (their unbiased decode scales up: ErrorFeedback refuses it)."""
    from .. import compress as C

    ef = error_feedback
    table = {
        "topk-1%": lambda: C.TopK(ratio=0.01, ramp=0),  # at its ratio (the throughput of the method)
        "randomk-1%": lambda: C.RandomK(ratio=0.01, rescale=not ef, ramp=0),
        "int8-256": lambda: C.Int8Block(block=256),
        "int8-256-sr": lambda: C.Int8Block(block=256, stochastic_rounding=True),
        "sign": lambda: C.Sign(),
        "ternary": lambda: C.Ternary(),
        "powersgd-r4": lambda: C.PowerSGD(rank=4),
        "vsa-1%": lambda: C.VSA(ratio=0.01, unbiased=not ef),
    }
    return C.ErrorFeedback(table[method]()) if ef else table[method]()


def throughput_layout(method: str, n: int):
    """100 vectors, or 10 matrices of about 10:1 for PowerSGD (which works per matrix)."""
    from ..layout import Layout

    if method.startswith("powersgd"):
        rows = max(1, int(np.sqrt(n / 10) / 3))
        per = n // 10
        return Layout({f"w{i}": (rows, max(1, per // rows)) for i in range(10)})
    per = n // 100
    return Layout({f"p{i}": (per,) for i in range(100)})


def throughput_main(argv=None) -> int:
    """``python -m arraytrain.bench compress``."""

    def best(fn, reps):
        return min(timeit(fn, reps))

    p = argparse.ArgumentParser(prog="python -m arraytrain.bench compress",
                                description="compressor throughput beside the machine's bandwidth")
    p.add_argument("--methods", default=",".join(THROUGHPUT_METHODS))
    p.add_argument("--sizes", default="1e6,1e7", help="gradient elements, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in THROUGHPUT_METHODS]
    if bad:
        print(f"--methods: unknown {bad}; choose from {list(THROUGHPUT_METHODS)}", file=sys.stderr)
        return 2
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    triad_fn, triad_bytes = make_triad(20_000_000)
    rng = np.random.default_rng(0)
    cases = []
    for n in sizes:
        for m in methods:
            lay = throughput_layout(m, n)
            g = np.zeros(lay.size, np.float32)
            g[:] = rng.standard_normal(lay.size)
            c = throughput_compressor(m).bind(lay, np.float32)
            ef = throughput_compressor(m, error_feedback=True).bind(lay, np.float32)
            out = np.zeros_like(g)
            payload = c.compress(g)
            c.decompress(payload, out)
            g2 = g.copy()
            ef.roundtrip(g2)  # compile everything before timing
            cases.append({"method": m, "n": lay.num_elements, "payload_bytes": payload.nbytes,
                          "dense_bytes": payload.dense_nbytes,
                          "fns": {"compress": lambda c=c, g=g: c.compress(g),
                                  "decompress": lambda c=c, p=payload, o=out: c.decompress(p, o),
                                  "ef_roundtrip": lambda ef=ef, g=g2: ef.roundtrip(g)},
                          "samples": {"compress": [], "decompress": [], "ef_roundtrip": []}})
        if "topk-1%" in methods:
            gk = rng.standard_normal(n).astype(np.float32)
            k = max(1, int(np.ceil(0.01 * n)))
            cases.append({"method": "np.argpartition 1%", "n": n, "payload_bytes": k * 8, "dense_bytes": 4 * n,
                          "fns": {"compress": lambda g=gk, k=k: np.argpartition(np.abs(g), -k)[-k:]},
                          "samples": {"compress": []}})
    triads = []
    for _ in range(args.rounds):
        triads.append(triad_bytes / best(triad_fn, args.reps) / 1e9)
        for case in cases:
            for key, fn in case["fns"].items():
                case["samples"][key].append(best(fn, args.reps))
    tri = statistics.median(triads)
    print(f"triad {tri:.1f} GB/s (median of {args.rounds} rounds); GB/s = float32 gradient bytes per second")
    print("| method | elements | payload bytes | x smaller | compress ms | GB/s | % triad | decompress ms | GB/s "
          "| EF round trip ms | GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for case in cases:
        med = {k: statistics.median(v) for k, v in case["samples"].items()}
        gb = {k: 4 * case["n"] / v / 1e9 for k, v in med.items()}
        cells = [case["method"], f"{case['n']:,}", f"{case['payload_bytes']:,}",
                 f"{case['dense_bytes'] / case['payload_bytes']:.1f}",
                 f"{1e3 * med['compress']:.2f}", f"{gb['compress']:.1f}", f"{100 * gb['compress'] / tri:.0f}%"]
        for key in ("decompress", "ef_roundtrip"):
            cells += [f"{1e3 * med[key]:.2f}", f"{gb[key]:.1f}"] if key in med else ["—", "—"]
        print("| " + " | ".join(cells) + " |")
        rows.append({"method": case["method"], "n": case["n"], "payload_bytes": case["payload_bytes"],
                     "dense_bytes": case["dense_bytes"], "samples_s": case["samples"]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triad_gbs": triads, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
