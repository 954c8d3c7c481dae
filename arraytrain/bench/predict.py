r"""``python -m arraytrain.bench predict``: gradient prediction on the digits MLP, against full training.

The data, split, model and defaults of ``arraytrain train`` (scikit-learn's
digits split by the seed and standardised, MLP 64-128-64-10 with ReLU,
AdamW at its default lr, batch 32, the seed's weights and batch order,
``zero_grad_on_step=False``), trained per seed by:

* ``full``: :class:`arraytrain.nn.Trainer` for ``--epochs`` epochs;
* ``phase``: :class:`arraytrain.nn.PhaseTrainer` for the same epochs, i.e. the
  same number of optimizer steps, of which only the FULL and CORRECT ones run
  a backward pass (the comparison the target is stated in);
* ``full, equal backward``: the Trainer for ``round(epochs / step ratio)``
  epochs, about as many backward passes as ``phase``: the control that says
  whether the predicted steps add anything over simply training less.

``full`` and ``phase`` alternate their order from seed to seed; every mode is
run once untimed first (JIT compile). Timed: the wall clock of ``fit`` (the
training loop, no validation), whose speedup is full time / phase time. The
step ratio is optimizer steps / backward passes: a count, not a speedup.
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

from ..cli import PREDICT_DEFAULTS

EPOCHS = 20
MODES = ("full", "phase", "full, equal backward")


def train_once(mode: str, seed: int, epochs: int, cfg: dict) -> dict:
    """One run; returns test accuracy, steps, backward passes and the loop's wall clock."""
    import arraytrain as at
    from arraytrain import nn

    data = nn.load_digits(seed=seed)
    model = nn.MLP([data.num_features, 128, 64, data.num_classes], activation="relu", dtype=np.float32)
    engine = at.Engine(model.init(seed=seed), at.optim.AdamW(), zero_grad_on_step=False)
    model.bind(engine)
    if mode == "phase":
        trainer = nn.PhaseTrainer(model, engine, batch_size=32, seed=seed, **cfg)
    else:
        trainer = nn.Trainer(model, engine, batch_size=32, seed=seed)
    t0 = time.perf_counter()
    trainer.fit(data.x_train, data.y_train, epochs=epochs)
    seconds = time.perf_counter() - t0
    test = trainer.evaluate(data.x_test, data.y_test)
    steps = engine.state.step
    out = {"mode": mode, "seed": seed, "epochs": epochs, "test_accuracy": test["accuracy"], "steps": steps,
           "backward_passes": steps, "seconds": seconds}
    if mode == "phase":
        s = trainer.stats
        out.update(backward_passes=s.backward_passes, full=s.full_steps, predict=s.predict_steps,
                   correct=s.correct_steps, phase_seconds=dict(s.seconds))
    return out


def run(seeds, epochs: int, cfg: dict, log=print) -> list[dict]:
    samples = []
    for m in MODES:  # untimed: compiles (or loads) every kernel
        train_once(m if m != "full, equal backward" else "full", seeds[0], 1, cfg)
    for i, seed in enumerate(seeds):
        order = ("full", "phase") if i % 2 == 0 else ("phase", "full")
        got = {m: train_once(m, seed, epochs, cfg) for m in order}
        ratio = got["phase"]["steps"] / max(got["phase"]["backward_passes"], 1)
        control = train_once("full", seed, max(1, round(epochs / ratio)), cfg)
        control["mode"] = "full, equal backward"
        for r in (got["full"], got["phase"], control):
            samples.append(r)
            log(f"  seed {seed} {r['mode']}: test accuracy {r['test_accuracy']:.4f}, {r['steps']} steps, "
                f"{r['backward_passes']} backward, {r['seconds']:.2f} s")
    return samples


def summarize(samples) -> list[dict]:
    full_time = statistics.median(r["seconds"] for r in samples if r["mode"] == "full")
    rows = []
    for m in MODES:
        rs = [r for r in samples if r["mode"] == m]
        acc = [r["test_accuracy"] for r in rs]
        steps = statistics.mean(r["steps"] for r in rs)
        back = statistics.mean(r["backward_passes"] for r in rs)
        t = statistics.median(r["seconds"] for r in rs)
        rows.append({"mode": m, "epochs": statistics.mean(r["epochs"] for r in rs), "accuracy_mean": statistics.mean(acc),
                     "accuracy_min": min(acc), "accuracy_max": max(acc), "steps": steps, "backward_passes": back,
                     "step_ratio": steps / back, "seconds": t, "speedup": full_time / t})
    return rows


def table(rows) -> str:
    lines = ["| mode | epochs | test acc. mean | min / max | optimizer steps | backward passes | step ratio "
             "| loop time (median) | speedup vs full |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['epochs']:g} | {100 * r['accuracy_mean']:.2f}% | "
                     f"{100 * r['accuracy_min']:.2f} / {100 * r['accuracy_max']:.2f} | {r['steps']:.0f} | "
                     f"{r['backward_passes']:.0f} | {r['step_ratio']:.2f} | {r['seconds']:.2f} s | {r['speedup']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m arraytrain.bench predict", description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds (split, weights, batch order)")
    ap.add_argument("--epochs", type=int, default=EPOCHS)
    # the defaults of `arraytrain train --predict` (arraytrain.cli.PREDICT_DEFAULTS: the sweep behind them there)
    ap.add_argument("--full-steps", type=int, default=PREDICT_DEFAULTS["full_steps"])
    ap.add_argument("--predict-steps", type=int, default=PREDICT_DEFAULTS["predict_steps"])
    ap.add_argument("--correct-every", type=int, default=PREDICT_DEFAULTS["correct_every"])
    ap.add_argument("--history", type=int, default=PREDICT_DEFAULTS["history"])
    ap.add_argument("--correction-beta", type=float, default=PREDICT_DEFAULTS["correction_beta"])
    ap.add_argument("--adaptive", action="store_true", help="adaptive phase lengths (bounds: 1..4x the given ones)")
    ap.add_argument("--json", metavar="FILE", help="write every sample as JSON")
    args = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--seeds: expected comma-separated ints, got {args.seeds!r}")
    if not seeds or min(seeds) < 0 or args.epochs < 1:
        ap.error("--seeds: expected seeds >= 0; --epochs: expected >= 1")
    cfg = {"full_steps": args.full_steps, "predict_steps": args.predict_steps, "correct_every": args.correct_every,
           "history": args.history, "correction_beta": args.correction_beta, "adaptive": args.adaptive}
    if args.adaptive:
        cfg.update(full_bounds=(1, 4 * args.full_steps), predict_bounds=(1, 4 * args.predict_steps))

    from arraytrain import threads
    from arraytrain.errors import ArrayTrainError

    policy = threads.describe()
    try:
        samples = run(seeds, args.epochs, cfg, log=lambda s: print(s, file=sys.stderr))
    except ArrayTrainError as exc:
        ap.error(str(exc))
    rows = summarize(samples)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; python {platform.python_version()}, "
          f"numpy {np.__version__}; {policy}")
    print(f"digits MLP 64-128-64-10, AdamW, batch 32, {args.epochs} epochs, seeds {seeds}; PhaseTrainer "
          + ", ".join(f"{k}={v}" for k, v in cfg.items()) + "\n")
    print(table(rows))
    full, phase = rows[0], rows[1]
    print(f"\nphase vs full at equal optimizer steps: accuracy {100 * (phase['accuracy_mean'] - full['accuracy_mean']):+.2f} "
          f"points, {full['backward_passes'] / phase['backward_passes']:.2f}x fewer backward passes, "
          f"wall clock {phase['speedup']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
                       "epochs": args.epochs, "seeds": seeds, "threads": policy, "machine": platform.machine(),
                       "cpus": os.cpu_count(), "samples": samples, "rows": rows}, f, indent=1)
    return 0 if all(math.isfinite(r["accuracy_mean"]) for r in rows) else 1
