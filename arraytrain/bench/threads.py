"""``python -m arraytrain.bench threads``: the threading policy, measured.

A hand-written NumPy MLP (784-1024-256-10, ~1.07M float32 parameters; BLAS
matmuls) whose gradients go zero-copy into ``engine.grads`` and whose update
is ``engine.step()`` (AdamW + clipping: parallel numba kernels), run in a fresh
process per configuration, configurations alternated over several rounds:

* ``policy``: arraytrain's choice, numba's TBB layer;
* ``omp``: the policy switched off, numba's default OpenMP layer (spinning workers);
* ``omp-passive``: OpenMP with ``OMP_WAIT_POLICY=PASSIVE`` (process-wide: torch shares it);
* ``workqueue``: numba's own pool (not thread-safe);
* ``numba-1-thread``: ``NUMBA_NUM_THREADS=1`` (no fight, but serial kernels).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

CONFIGS = {
    "policy": {},
    "omp": {"ARRAYTRAIN_THREAD_POLICY": "off"},
    "omp-passive": {"ARRAYTRAIN_THREAD_POLICY": "off", "OMP_WAIT_POLICY": "PASSIVE"},
    "workqueue": {"NUMBA_THREADING_LAYER": "workqueue"},
    "numba-1-thread": {"NUMBA_NUM_THREADS": "1"},
}
CLEARED = ("OMP_WAIT_POLICY", "ARRAYTRAIN_THREAD_POLICY", "NUMBA_THREADING_LAYER", "NUMBA_NUM_THREADS")

WORKLOAD = r"""
import sys, time
import numpy as np
import arraytrain as at

batch, steps = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
sizes = [784, 1024, 256, 10]
params = {}
for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    params[f"W{i}"] = (rng.standard_normal((a, b)) * np.sqrt(2 / a)).astype(np.float32)
    params[f"b{i}"] = np.zeros(b, np.float32)
engine = at.Engine(params, at.optim.AdamW(lr=1e-3), max_grad_norm=1.0, zero_grad_on_step=False)
P, G = engine.params, engine.grads
x = rng.standard_normal((batch, 784)).astype(np.float32)
y = rng.integers(0, 10, batch)

def step():
    h, acts = x, [x]
    for i in range(3):
        h = h @ P[f"W{i}"] + P[f"b{i}"]
        if i < 2:
            h = np.maximum(h, 0)
        acts.append(h)
    p = np.exp(h - h.max(1, keepdims=True)); p /= p.sum(1, keepdims=True)
    p[np.arange(batch), y] -= 1; d = p / batch
    for i in (2, 1, 0):
        np.matmul(acts[i].T, d, out=G[f"W{i}"]); np.sum(d, 0, out=G[f"b{i}"])
        if i:
            d = (d @ P[f"W{i}"].T) * (acts[i] > 0)
    engine.step()

for _ in range(5):
    step()
t0 = time.perf_counter()
for _ in range(steps):
    step()
print(steps / (time.perf_counter() - t0), at.threads.describe().split(";")[0].replace(" ", "_"))
"""


def measure(batch: int, steps: int, rounds: int) -> dict:
    out = {k: [] for k in CONFIGS}
    layers = {}
    for _ in range(rounds):
        for name, env in CONFIGS.items():
            full = {k: v for k, v in os.environ.items() if k not in CLEARED}
            full.update(env)
            res = subprocess.run([sys.executable, "-c", WORKLOAD, str(batch), str(steps)], env=full,
                                 capture_output=True, text=True, check=True)
            rate, layer = res.stdout.split()[-2:]
            out[name].append(float(rate))
            layers[name] = layer.replace("_", " ")
    return out, layers


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m arraytrain.bench threads", description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    print("| batch | configuration | numba | steps/s median | min | max | vs policy |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for batch in (int(b) for b in args.batches.split(",")):
        res, layers = measure(batch, args.steps, args.rounds)
        base = statistics.median(res["policy"])
        for name, v in res.items():
            med = statistics.median(v)
            print(f"| {batch} | {name} | {layers[name]} | {med:.1f} | {min(v):.1f} | {max(v):.1f} | "
                  f"{med / base:.2f} |")
    return 0
