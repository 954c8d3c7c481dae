"""``python -m arraytrain.bench [step|threads]``: the fused AdamW step against torch, side by side.

``threads`` measures the threading policy instead (see ``arraytrain.bench.threads``).

Prints one markdown table from one run:

* the machine's streaming bandwidth, a numba triad ``a = b + s*c`` (12 B/element)
  over 5e7 elements, timed in every round beside the contestants;
* arraytrain's AdamW step with global-norm clipping through ``engine.step()``
  on the zero-copy path (one read-only norm pass + one fused kernel);
* torch: ``clip_grad_norm_`` + ``AdamW(fused=True)`` on the same number of
  parameters split into 100 tensors (skipped when torch is missing);
* the cold (empty numba cache) and warm first-step times in fresh processes.

Contestants are timed in alternating blocks (A A A B B B A A A ...), each
block after one untimed call, so neither pays for the other's thread pool
winding down (torch's OpenMP workers spin for milliseconds after a step);
warm-up calls are excluded; min and median are reported. "GB/s" counts the 32 bytes/parameter
a fused clip+AdamW step cannot avoid (read g for the norm; read p, g, m, v and
write p, m, v for the update), for every contestant alike, so GB/s is
proportional to speed and "% triad" says how close a step gets to the
machine's bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

BLOCK = 3  # timed calls per contestant per round
STEP_BYTES = 32  # per float32 parameter: 4 (norm pass) + 28 (AdamW read p,g,m,v; write p,m,v)
N_TENSORS = 100


def _timeit(fn, reps):
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def make_triad(n: int = 50_000_000):
    """A numba triad ``a = b + s*c`` over ``n`` float32 elements (12 B/element), compiled and warm."""
    from numba import njit, prange

    @njit(parallel=True, cache=False)
    def triad(a, b, c, s):
        for i in prange(a.size):
            a[i] = b[i] + s * c[i]

    a = np.zeros(n, np.float32)
    b = np.ones(n, np.float32)
    c = np.ones(n, np.float32)
    s = np.float32(3.0)
    triad(a, b, c, s)
    return (lambda: triad(a, b, c, s)), 12 * n


def _split(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


def make_arraytrain(n: int, zero_grad: bool, seed: int = 0):
    import arraytrain as at

    rng = np.random.default_rng(seed)
    params = {f"p{i}": rng.standard_normal(k, dtype=np.float32) for i, k in enumerate(_split(n, N_TENSORS))}
    engine = at.Engine(params, at.optim.AdamW(lr=1e-3), max_grad_norm=1.0, zero_grad_on_step=zero_grad)
    engine.grads.flat[:] = rng.standard_normal(engine.grads.flat.size, dtype=np.float32)
    engine.step()  # compile / warm up
    return engine.step


def make_torch(n: int, zero_grad: bool, seed: int = 0):
    import torch

    rng = np.random.default_rng(seed)
    params = [torch.nn.Parameter(torch.from_numpy(rng.standard_normal(k, dtype=np.float32)))
              for k in _split(n, N_TENSORS)]
    for p in params:
        p.grad = torch.from_numpy(rng.standard_normal(p.numel(), dtype=np.float32))
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if zero_grad:
            opt.zero_grad(set_to_none=False)

    step()
    return step


def first_step_seconds(cache_dir: str) -> float:
    """Seconds from interpreter start to the end of the first ``engine.step`` in a fresh process."""
    code = (
        "import time; t0 = time.perf_counter()\n"
        "import numpy as np, arraytrain as at\n"
        "e = at.Engine({'w': np.ones((256, 256), np.float32)}, at.optim.AdamW(), max_grad_norm=1.0)\n"
        "e.step({'w': np.ones((256, 256), np.float32)})\n"
        "print(time.perf_counter() - t0)\n"
    )
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def run(sizes, reps, with_torch=True, zero_grad=False):
    """Time every contestant per size in alternating blocks; the triad joins every round.

    Returns the rows and the best triad bandwidth seen over the whole run (GB/s).
    """
    triad, triad_bytes = make_triad()
    triad_times = []
    rows = []
    for n in sizes:
        contestants = {"arraytrain engine.step": make_arraytrain(n, zero_grad)}
        if with_torch:
            try:
                contestants["torch clip_grad_norm_ + AdamW(fused)"] = make_torch(n, zero_grad)
            except ImportError:
                pass
        contestants["triad"] = triad
        times = {k: [] for k in contestants}
        rounds = max(3, (reps if n < 50_000_000 else max(3, reps // 3)) // BLOCK)
        for _ in range(rounds):  # alternate blocks, so drift hits everyone alike
            for name, fn in contestants.items():
                fn()  # untimed: absorbs the previous contestant's idle threads winding down
                times[name] += _timeit(fn, BLOCK)
        triad_times += times.pop("triad")
        rows.append({"n": n, "times": times})
        contestants.clear()
    return rows, triad_bytes / min(triad_times) / 1e9


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["threads"]:
        from .threads import main as threads_main

        return threads_main(argv[1:])
    if argv[:1] == ["step"]:
        argv = argv[1:]
    ap = argparse.ArgumentParser(prog="python -m arraytrain.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1e6,1e7,1e8", help="comma-separated parameter counts")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--zero-grad", action="store_true",
                    help="also zero the gradients each step (arraytrain in-kernel, torch zero_grad)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-startup", action="store_true", help="skip the cold/warm first-step timing")
    ap.add_argument("--json", metavar="FILE", help="also write the raw figures as JSON")
    args = ap.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",")]

    from arraytrain import threads

    policy = threads.describe()
    rows, tri = run(sizes, args.reps, with_torch=not args.no_torch, zero_grad=args.zero_grad)

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"python {platform.python_version()}, numpy {np.__version__}; threads: {policy}")
    print(f"numba triad bandwidth (best over the run, timed in the same rotation): {tri:.1f} GB/s\n")
    print("| params | contestant | min ms | median ms | GB/s | % triad | speedup vs torch |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for row in rows:
        n, times = row["n"], row["times"]
        best = {k: min(v) for k, v in times.items()}
        torch_best = next((v for k, v in best.items() if k.startswith("torch")), None)
        for name, ts in times.items():
            gbs = STEP_BYTES * n / best[name] / 1e9
            speed = f"{torch_best / best[name]:.2f}x" if torch_best else "-"
            print(f"| {n:.0e} | {name} | {best[name] * 1e3:.2f} | {statistics.median(ts) * 1e3:.2f} | "
                  f"{gbs:.1f} | {gbs / tri:.0%} | {speed} |")
    startup = None
    if not args.no_startup:
        with tempfile.TemporaryDirectory() as cache:
            cold = first_step_seconds(cache)
            warm = first_step_seconds(cache)
        startup = {"cold_s": cold, "warm_s": warm}
        print(f"\nfirst engine.step in a fresh process (import + compile/load + step): "
              f"cold cache {cold:.2f} s, warm cache {warm:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triad_gbs": tri, "threads": policy, "step_bytes": STEP_BYTES, "rows": rows,
                       "startup": startup, "zero_grad": args.zero_grad}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
