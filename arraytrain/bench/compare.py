"""``python -m arraytrain.bench compare``: one clipped optimizer step, side by side.

Per optimizer (AdamW, Adam, SGD with momentum) and parameter count, in one run:

* ``arraytrain``: ``engine.step()`` on the zero-copy path: one read-only norm
  pass, one fused kernel;
* ``torch-foreach`` / ``torch-fused``: ``clip_grad_norm_(foreach=True)`` then
  the optimizer with ``foreach=True`` / ``fused=True`` (torch 2.x's fast paths);
* ``numpy``: the same math written by hand with in-place NumPy per tensor;
* ``optax``: ``clip_by_global_norm`` chained with the optimizer, ``jax.jit``
  with donated buffers, on the CPU;
* the machine's streaming bandwidth: a numba triad ``a = b + s*c`` over 5e7
  float32 elements (12 B/element), timed in every round beside the others.

Each contestant's parameters are split into 100 tensors (arraytrain: 100
named views of one buffer), with identical hyperparameters. A contestant whose
library is missing is skipped and said so. Contestants are timed in
alternating blocks (A A A B B B ... A A A), each block after one untimed call,
so nobody pays for another's thread pool winding down; warm-up and JIT
compilation are excluded; min and median are reported. "GB/s" counts the bytes
a fused clipped step cannot avoid (a read of the gradients for the norm, then
read p, g and every state slot, write p and every slot), the same for every
contestant, so it is proportional to speed; "% triad" compares that to the
triad. ``--json`` writes every figure; ``--baseline OLD.json`` flags
arraytrain slowdowns against an earlier run (see :func:`regressions`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

BLOCK = 3  # timed calls per contestant per round
N_TENSORS = 100
LR, BETAS, EPS, WD, MOMENTUM, MAX_NORM = 1e-3, (0.9, 0.999), 1e-8, 1e-2, 0.9, 1.0
SLOTS = {"adamw": 2, "adam": 2, "sgd": 1}


def step_bytes(opt: str, itemsize: int = 4) -> int:
    """Bytes per parameter of a fused clipped step: norm read + (2 + slots) reads + (1 + slots) writes."""
    return itemsize * (1 + (2 + SLOTS[opt]) + (1 + SLOTS[opt]))


def _timeit(fn, reps):
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _split(n: int, parts: int = N_TENSORS) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


def _data(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    sizes = _split(n)
    params = [rng.standard_normal(k, dtype=np.float32) for k in sizes]
    grads = [rng.standard_normal(k, dtype=np.float32) for k in sizes]
    return params, grads


def make_triad(n: int = 50_000_000):
    """A numba triad ``a = b + s*c`` over ``n`` float32 elements (12 B/element), compiled and warm."""
    from numba import njit, prange

    @njit(parallel=True, cache=False)
    def triad(a, b, c, s):
        for i in prange(a.size):
            a[i] = b[i] + s * c[i]

    a, b, c, s = np.zeros(n, np.float32), np.ones(n, np.float32), np.ones(n, np.float32), np.float32(3.0)
    triad(a, b, c, s)
    return (lambda: triad(a, b, c, s)), 12 * n


# -- contestants: each returns a zero-argument step function, already warm (one step taken), -----
# -- whose ``.params()`` lists the parameters after the steps taken so far -------------------


def make_arraytrain(opt: str, n: int, zero_grad: bool = False):
    import arraytrain as at

    params, grads = _data(n)
    optimizer = {"adamw": lambda: at.optim.AdamW(LR, BETAS, EPS, WD),
                 "adam": lambda: at.optim.Adam(LR, BETAS, EPS),
                 "sgd": lambda: at.optim.SGD(LR, momentum=MOMENTUM)}[opt]()
    engine = at.Engine({f"p{i}": p for i, p in enumerate(params)}, optimizer, max_grad_norm=MAX_NORM,
                       zero_grad_on_step=zero_grad)
    engine.grads.load({f"p{i}": g for i, g in enumerate(grads)})

    def step():
        engine.step()

    step.params = lambda: [engine.params[f"p{i}"] for i in range(len(params))]
    step()
    return step


def _make_torch(opt: str, n: int, mode: str, zero_grad: bool = False):
    import torch

    params, grads = _data(n)
    ps = [torch.nn.Parameter(torch.from_numpy(p)) for p in params]
    for p, g in zip(ps, grads):
        p.grad = torch.from_numpy(g)
    flag = {mode: True}
    optimizer = {"adamw": lambda: torch.optim.AdamW(ps, LR, BETAS, EPS, WD, **flag),
                 "adam": lambda: torch.optim.Adam(ps, LR, BETAS, EPS, **flag),
                 "sgd": lambda: torch.optim.SGD(ps, LR, momentum=MOMENTUM, **flag)}[opt]()

    def step():
        torch.nn.utils.clip_grad_norm_(ps, MAX_NORM, foreach=True)
        optimizer.step()
        if zero_grad:
            optimizer.zero_grad(set_to_none=False)

    step.params = lambda: [p.detach().numpy() for p in ps]
    step()
    return step


def make_torch_foreach(opt, n, zero_grad=False):
    return _make_torch(opt, n, "foreach", zero_grad)


def make_torch_fused(opt, n, zero_grad=False):
    return _make_torch(opt, n, "fused", zero_grad)


def make_numpy(opt: str, n: int, zero_grad: bool = False):
    """The same clipped step written by hand: in-place NumPy per tensor, one scratch buffer."""
    params, grads = _data(n)
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params] if opt != "sgd" else None
    scratch = np.empty(max(p.size for p in params), np.float32)
    t = [0]
    b1, b2 = BETAS

    def step():
        norm = np.sqrt(sum(float(np.dot(g, g)) for g in grads))
        coef = min(1.0, MAX_NORM / (norm + 1e-6))
        t[0] += 1
        step_size = LR / (1 - b1 ** t[0])
        bc2_sqrt = np.sqrt(1 - b2 ** t[0])
        for i, (p, g) in enumerate(zip(params, grads)):
            g *= coef
            tmp = scratch[: p.size]
            if opt == "sgd":
                if t[0] == 1:
                    m[i][...] = g
                else:
                    m[i] *= MOMENTUM
                    m[i] += g
                p -= LR * m[i]
            else:
                if opt == "adamw":
                    p *= 1 - LR * WD
                m[i] *= b1
                m[i] += (1 - b1) * g
                np.multiply(g, g, out=tmp)
                tmp *= 1 - b2
                v[i] *= b2
                v[i] += tmp
                np.sqrt(v[i], out=tmp)
                tmp /= bc2_sqrt
                tmp += EPS
                np.divide(m[i], tmp, out=tmp)
                tmp *= -step_size
                p += tmp
            if zero_grad:
                g[...] = 0

    step.params = lambda: params
    step()
    return step


def make_optax(opt: str, n: int, zero_grad: bool = False):
    import jax
    import jax.numpy as jnp
    import optax

    params, grads = _data(n)
    inner = {"adamw": lambda: optax.adamw(LR, *BETAS, EPS, weight_decay=WD),
             "adam": lambda: optax.adam(LR, *BETAS, EPS),
             "sgd": lambda: optax.sgd(LR, momentum=MOMENTUM)}[opt]()
    tx = optax.chain(optax.clip_by_global_norm(MAX_NORM), inner)
    p = [jnp.asarray(x) for x in params]
    g = [jnp.asarray(x) for x in grads]
    box = {"p": p, "s": tx.init(p)}

    @jax.jit
    def update(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    update = jax.jit(update, donate_argnums=(0, 1))

    def step():
        box["p"], box["s"] = update(box["p"], box["s"], g)
        jax.block_until_ready(box["p"])

    step.params = lambda: [np.asarray(x) for x in box["p"]]
    step()
    return step


CONTESTANTS = {
    "arraytrain": make_arraytrain,
    "torch-foreach": make_torch_foreach,
    "torch-fused": make_torch_fused,
    "numpy": make_numpy,
    "optax": make_optax,
}


# -- running and reporting --------------------------------------------------------------


def run(optimizers, sizes, reps, names=tuple(CONTESTANTS), zero_grad=False, log=print):
    """Time every contestant per (optimizer, size); returns the rows and the best triad GB/s."""
    triad, triad_bytes = make_triad()
    triad_times, rows, missing = [], [], {}
    for opt in optimizers:
        for n in sizes:
            contestants = {}
            for name in names:
                try:
                    contestants[name] = CONTESTANTS[name](opt, n, zero_grad)
                except ImportError as exc:
                    missing[name] = str(exc)
            contestants["triad"] = triad
            times = {k: [] for k in contestants}
            rounds = max(3, (reps if n < 50_000_000 else max(3, reps // 3)) // BLOCK)
            for _ in range(rounds):
                for name, fn in contestants.items():
                    fn()  # untimed: absorbs the previous contestant's idle threads winding down
                    times[name] += _timeit(fn, BLOCK)
            triad_times += times.pop("triad")
            rows.append({"optimizer": opt, "n": n, "times": times})
            log(f"  timed {opt} n={n:.0e}: " + ", ".join(f"{k} {min(v) * 1e3:.2f} ms" for k, v in times.items()))
            contestants.clear()
    for name, why in missing.items():
        log(f"  skipped {name}: {why}")
    return rows, triad_bytes / min(triad_times) / 1e9, missing


def table(rows, triad_gbs) -> str:
    out = ["| optimizer | params | contestant | min ms | median ms | GB/s | % triad | time / arraytrain |",
           "|---|---:|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        opt, n, times = row["optimizer"], row["n"], row["times"]
        ours = min(times["arraytrain"]) if "arraytrain" in times else None
        for name, ts in times.items():
            best = min(ts)
            gbs = step_bytes(opt) * n / best / 1e9
            ratio = f"{best / ours:.2f}" if ours else "-"
            out.append(f"| {opt} | {n:.0e} | {name} | {best * 1e3:.2f} | {statistics.median(ts) * 1e3:.2f} | "
                       f"{gbs:.1f} | {gbs / triad_gbs:.0%} | {ratio} |")
    return "\n".join(out)


def regressions(new: dict, old: dict, threshold: float = 1.10) -> list[str]:
    """arraytrain rows whose share of the triad fell by more than ``threshold`` since ``old``.

    Each run's times are divided by its own triad, so a slower or busier
    machine does not read as a regression; what is left is the code.
    """
    def shares(doc):
        return {(r["optimizer"], r["n"]): min(r["times"]["arraytrain"]) * doc["triad_gbs"]
                for r in doc["rows"] if "arraytrain" in r["times"]}

    before, after = shares(old), shares(new)
    found = []
    for key in sorted(before.keys() & after.keys()):
        ratio = after[key] / before[key]
        if ratio > threshold:
            found.append(f"{key[0]} n={key[1]:.0e}: {ratio:.2f}x slower relative to the triad")
    return found


def first_step_seconds(cache_dir: str) -> float:
    """Seconds from interpreter start to the end of the first ``engine.step`` in a fresh process."""
    import subprocess

    code = (
        "import time; t0 = time.perf_counter()\n"
        "import numpy as np, arraytrain as at\n"
        "e = at.Engine({'w': np.ones((256, 256), np.float32)}, at.optim.AdamW(), max_grad_norm=1.0)\n"
        "e.step({'w': np.ones((256, 256), np.float32)})\n"
        "print(time.perf_counter() - t0)\n"
    )
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m arraytrain.bench compare", description=__doc__.splitlines()[0])
    ap.add_argument("--optimizers", default="adamw,adam,sgd", help="comma-separated: adamw, adam, sgd")
    ap.add_argument("--sizes", default="1e6,1e7", help="comma-separated parameter counts (1e8 needs ~4 GB)")
    ap.add_argument("--contestants", default=",".join(CONTESTANTS))
    ap.add_argument("--reps", type=int, default=15, help="timed calls per contestant (in blocks of 3)")
    ap.add_argument("--zero-grad", action="store_true", help="also zero the gradients every step")
    ap.add_argument("--startup", action="store_true", help="also time the first step with a cold/warm cache")
    ap.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    ap.add_argument("--baseline", metavar="OLD.json", help="flag arraytrain slowdowns against an earlier --json")
    ap.add_argument("--threshold", type=float, default=1.10, help="slowdown factor that counts (default 1.10)")
    args = ap.parse_args(argv)

    optimizers = [o.strip() for o in args.optimizers.split(",")]
    names = [c.strip() for c in args.contestants.split(",")]
    for o in optimizers:
        if o not in SLOTS:
            ap.error(f"--optimizers: unknown {o!r}; choose from {sorted(SLOTS)}")
    for c in names:
        if c not in CONTESTANTS:
            ap.error(f"--contestants: unknown {c!r}; choose from {list(CONTESTANTS)}")
    sizes = [int(float(s)) for s in args.sizes.split(",")]

    from arraytrain import threads

    policy = threads.describe()
    rows, tri, missing = run(optimizers, sizes, args.reps, names, args.zero_grad,
                             log=lambda s: print(s, file=sys.stderr))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; python {platform.python_version()}, "
          f"numpy {np.__version__}; {policy}")
    print(f"numba triad bandwidth (best over the run, timed in the same rotation): {tri:.1f} GB/s\n")
    print(table(rows, tri))
    doc = {"triad_gbs": tri, "threads": policy, "rows": rows, "missing": missing, "zero_grad": args.zero_grad,
           "machine": platform.machine(), "cpus": os.cpu_count()}
    if args.startup:
        with tempfile.TemporaryDirectory() as cache:
            doc["startup"] = {"cold_s": first_step_seconds(cache), "warm_s": first_step_seconds(cache)}
        print(f"\nfirst engine.step in a fresh process (import + compile/load + step): "
              f"cold cache {doc['startup']['cold_s']:.2f} s, warm cache {doc['startup']['warm_s']:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.baseline:
        with open(args.baseline) as f:
            found = regressions(doc, json.load(f), args.threshold)
        print("\nregressions against the baseline: " + ("; ".join(found) if found else "none"))
        return 1 if found else 0
    return 0
