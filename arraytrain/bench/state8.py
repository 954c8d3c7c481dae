"""``python -m arraytrain.bench state8``: what 8-bit and float8 optimizer state cost in accuracy.

Two parts (``--parts``):

``transformer``
    A torch ``TransformerEncoder`` (d_model 64, 4 heads, 2 layers, feed-forward 128, a linear
    head: 76k parameters, most of them in 8-bit blocks) bound to the engine with AdamW and a
    global-norm clip of 1.0, trained ``--steps`` steps on a fixed synthetic regression (the
    target a fixed random map of the sequence through tanh), with float32 state, with
    ``state_dtype="8bit"`` and with ``state_dtype="float8"``; and, where bitsandbytes installs, the same model with its CPU
    ``AdamW8bit`` after ``clip_grad_norm_`` as a second reference. The same initialisation
    and batches for all; the final loss is the mean of the last 20 steps' losses.
    ``--transformer-seeds K`` repeats it for seeds 0 to K-1 (initialisation and data) and tables
    every seed's final losses.
``digits``
    ``arraytrain train`` (the built-in MLP on scikit-learn's digits, AdamW) for
    ``--epochs`` epochs with ``--state-dtype float32``, ``8bit`` and ``float8``, over ``--seeds``
    seeds: the test accuracy of each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

PARTS = ("transformer", "digits")


def _model(torch):
    layer = torch.nn.TransformerEncoderLayer(64, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True)
    return torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                               torch.nn.Linear(64, 8))


def transformer(steps: int, seed: int = 0) -> dict:
    """Per contestant: the losses of every step (see the module docstring)."""
    import torch

    from .. import optim
    from ..interop import torch as att

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    init = _model(torch).state_dict()
    gen = torch.Generator().manual_seed(seed + 1)
    mix = torch.randn(64, 8, generator=gen) / 8
    data = []
    for _ in range(32):
        x = torch.randn(32, 16, 64, generator=gen)
        data.append((x, torch.tanh(x @ mix)))

    def run(step):
        losses = []
        for i in range(steps):
            x, y = data[i % len(data)]
            losses.append(step(x, y))
        return losses

    out = {}
    for label, state_dtype in (("float32 state", None), ("8-bit state", "8bit"), ("float8 state", "float8")):
        model = _model(torch)
        model.load_state_dict(init)
        eng = att.bind(model, optim.AdamW(lr=1e-3, weight_decay=0.01, state_dtype=state_dtype), max_grad_norm=1.0)

        def step(x, y, model=model, eng=eng):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            eng.step()
            return float(loss)

        out[label] = run(step)
    try:
        import bitsandbytes as bnb
    except ImportError:
        return out
    model = _model(torch)
    model.load_state_dict(init)
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3, weight_decay=0.01)

    def bnb_step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return float(loss)

    out["bitsandbytes AdamW8bit"] = run(bnb_step)
    return out


def digits(epochs: int, seeds: int) -> dict:
    """``arraytrain train``'s test accuracy per state dtype and seed."""
    out = {"float32": [], "8bit": [], "float8": []}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in out:
            for seed in range(seeds):
                js = os.path.join(tmp, f"{dtype}-{seed}.json")
                cmd = [sys.executable, "-m", "arraytrain", "train", "--no-progress", "--epochs", str(epochs),
                       "--seed", str(seed), "--state-dtype", dtype, "--json", js]
                subprocess.run(cmd, check=True, capture_output=True, text=True)
                with open(js) as f:
                    out[dtype].append(json.load(f)["test_accuracy"])
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m arraytrain.bench state8",
                                description="8-bit and float8 optimizer state against float32 state: losses and accuracy")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--steps", type=int, default=300, help="transformer: training steps")
    p.add_argument("--transformer-seeds", type=int, default=1,
                   help="transformer: seeds (model, data); above 1, a table of every seed's final losses")
    p.add_argument("--epochs", type=int, default=20, help="digits: epochs")
    p.add_argument("--seeds", type=int, default=3, help="digits: seeds")
    p.add_argument("--json", metavar="FILE")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    parts = [s for s in args.parts.split(",") if s]
    bad = [s for s in parts if s not in PARTS]
    if bad:
        print(f"--parts: unknown {bad}; parts {list(PARTS)}", file=sys.stderr)
        return 2
    results = {}
    if "transformer" in parts:
        res = results["transformer"] = transformer(args.steps)
        ref = float(np.mean(res["float32 state"][-20:]))
        print(f"\nTransformerEncoder (d_model 64, 2 layers) through the torch binding, AdamW, clip 1.0, "
              f"{args.steps} steps; the final loss is the mean of the last 20 steps':")
        print("| optimizer state | first loss | final loss | vs float32 state |")
        print("|---|---|---|---|")
        for label, losses in res.items():
            final = float(np.mean(losses[-20:]))
            print(f"| {label} | {losses[0]:.5f} | {final:.5f} | {100 * (final / ref - 1):+.2f}% |")
        if "bitsandbytes AdamW8bit" not in res:
            print("(bitsandbytes is not installed: no second reference)")
        if args.transformer_seeds > 1:
            finals = {0: {k: float(np.mean(v[-20:])) for k, v in res.items()}}
            for seed in range(1, args.transformer_seeds):
                finals[seed] = {k: float(np.mean(v[-20:])) for k, v in transformer(args.steps, seed).items()}
            results["transformer_seeds"] = finals
            labels = list(finals[0])
            print("\nFinal loss against float32 state's, per seed:")
            print("| seed | " + " | ".join(labels) + " |")
            print("|---|" + "---|" * len(labels))
            for seed, row in finals.items():
                ref = row["float32 state"]
                print(f"| {seed} | " + " | ".join(f"{row[k]:.5f} ({100 * (row[k] / ref - 1):+.2f}%)" for k in labels)
                      + " |")
    if "digits" in parts:
        res = results["digits"] = digits(args.epochs, args.seeds)
        print(f"\narraytrain train on the digits, AdamW, {args.epochs} epochs, test accuracy per seed:")
        print("| state | " + " | ".join(f"seed {s}" for s in range(args.seeds)) + " | mean |")
        print("|---|" + "---|" * (args.seeds + 1))
        for dtype, accs in res.items():
            print(f"| {dtype} | " + " | ".join(f"{100 * a:.2f}" for a in accs) + f" | {100 * np.mean(accs):.2f} |")
        for dtype in ("8bit", "float8"):
            print(f"mean gap, {dtype}: {100 * (np.mean(res['float32']) - np.mean(res[dtype])):.2f} points")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
