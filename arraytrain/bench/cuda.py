"""``python -m arraytrain.bench compare --device cuda``: one clipped optimizer step on a GPU.

arraytrain's ``engine.step()`` (zero-copy path: the gradients are already in
``engine.grads``; norm pass, one host synchronisation, one fused update) beside torch
CUDA's ``clip_grad_norm_(foreach=True)`` + ``torch.optim.<X>(fused=True)`` and
``(foreach=True)``, on the same parameters split into 100 tensors. Contestants
alternate in blocks; every call is timed with CUDA events on each side's stream after
a synchronisation, so the figure is device time plus the host gaps inside the step.
The device's copy bandwidth (a device-to-device copy of 2 GB, bytes read plus bytes
written) is measured in the same rotation. Named with ``--contestants`` only:
``arraytrain-bf16``, ``arraytrain-8bit`` and ``arraytrain-float8`` (``state_dtype="bfloat16"`` /
``"8bit"`` / ``"float8"``) and
``bnb-8bit`` (bitsandbytes' CUDA ``AdamW8bit`` and siblings after the same
``clip_grad_norm_``; bitsandbytes is a benchmark-only dependency). GB/s counts the bytes a fused clipped step
cannot avoid (:func:`arraytrain.bench.common.step_bytes`), for everyone alike.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import numpy as np

from .common import (
    MAX_NORM,
    N_TENSORS,
    NOT_AVAILABLE,
    bnb_optimizer,
    first_step_seconds,
    make_engine,
    shapes,
    step_bytes,
    torch_optimizer,
)

BLOCK = 5
DEFAULT_OPTIMIZERS = ("adamw", "adam", "sgd", "adagrad", "rmsprop", "lion", "lamb", "adafactor")
CONTESTANTS = ("arraytrain", "torch-fused", "torch-foreach")
#: Run only where named: arraytrain with bfloat16 or 8-bit state, bitsandbytes' CUDA 8-bit optimizers
#: (``AdamW8bit`` and siblings, a benchmark-only dependency).
OPTIONAL = ("arraytrain-bf16", "arraytrain-8bit", "arraytrain-float8", "bnb-8bit")
STATE_DTYPES = {"arraytrain": None, "arraytrain-bf16": "bfloat16", "arraytrain-8bit": "8bit",
                "arraytrain-float8": "float8"}


def _cuda_data(n: int, seed: int = 0, opt: str = ""):
    """100 parameters and gradients of ``n`` elements in all, CuPy float32; matrices for
    :data:`~arraytrain.bench.common.MATRIX_OPTIMIZERS`."""
    import cupy as cp

    rs = cp.random.RandomState(seed)
    return ([rs.standard_normal(s, dtype=cp.float32) for s in shapes(n, opt)],
            [rs.standard_normal(s, dtype=cp.float32) for s in shapes(n, opt)])


def _timer():
    import cupy as cp

    def time_call(fn) -> float:
        cp.cuda.Device().synchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) / 1e3

    return time_call


def make_arraytrain(opt: str, n: int, state_dtype: str | None = None):
    params, grads = _cuda_data(n, opt=opt)
    engine = make_engine(opt, params, grads, state_dtype=state_dtype)
    del params, grads

    def step():
        engine.step()

    step.engine = engine
    step()
    return step


def _torch_step(opt: str, n: int, build, what: str):
    """A clipped step of the torch optimizer ``build(params)`` makes, on CUDA tensors sharing the data's
    memory: torch's ``clip_grad_norm_(foreach=True)``, then its ``step()``."""
    import torch

    params, grads = _cuda_data(n, opt=opt)
    ps = [torch.nn.Parameter(torch.from_dlpack(p)) for p in params]
    for p, g in zip(ps, grads):
        p.grad = torch.from_dlpack(g)
    try:
        optimizer = build(ps)
        optimizer.step()  # torch checks the device here (its fused Adagrad is CPU-only)
    except (RuntimeError, ImportError) as exc:
        raise LookupError(f"{what} {opt}: {str(exc).splitlines()[0][:80]}") from None

    def step():
        torch.nn.utils.clip_grad_norm_(ps, MAX_NORM, foreach=True)
        optimizer.step()

    step()
    return step


def make_torch(opt: str, n: int, mode: str):
    flags = {"foreach": False} if mode == "forloop" else {mode: True}
    return _torch_step(opt, n, lambda ps: torch_optimizer(opt, ps, flags), f"torch.optim {mode}")


def make_contestant(name: str, opt: str, n: int):
    """Contestant ``name``'s step for ``opt`` on ``n`` parameters; LookupError where it has none."""
    why = NOT_AVAILABLE.get((name, opt))
    if why is not None:
        raise LookupError(why)
    if name in STATE_DTYPES:
        return make_arraytrain(opt, n, STATE_DTYPES[name])
    if name == "bnb-8bit":
        return _torch_step(opt, n, lambda ps: bnb_optimizer(opt, ps), "bitsandbytes 8-bit")
    return make_torch(opt, n, name.split("-")[1])


def make_copy(nbytes: int = 2 << 30):
    import cupy as cp

    a = cp.ones(nbytes // 4, cp.float32)
    b = cp.empty_like(a)

    def copy():
        cp.copyto(b, a)

    copy()
    return copy, 2 * nbytes


def per_step_counts(opt: str, n: int = 1_000_000, steps: int = 5) -> dict:
    """Kernel launches and host synchronisations per ``engine.step()`` (arraytrain's own counters)."""
    from arraytrain.kernels.cuda import core

    step = make_arraytrain(opt, n)
    before = dict(core.counters)
    for _ in range(steps):
        step()
    return {k: (core.counters[k] - before[k]) / steps for k in before}


def stage_times(opt: str, n: int, reps: int = 20) -> dict:
    """Median seconds of the norm pass alone, the update kernel(s) alone, and the whole ``engine.step()``.

    ``step - norm - update`` is the host's share: Python between the norm pass's read-back
    and the update's launch, during which the device idles.
    """
    import cupy as cp

    from arraytrain.backend import backend_of
    from arraytrain.kernels.interface import family
    from arraytrain.ops import norm_pass

    step = make_arraytrain(opt, n)
    engine = step.engine
    k = family(backend_of(engine.params.flat))  # the family the engine runs (kernels="numba": CUDA's on CuPy)
    time_call = _timer()

    def update():
        engine.optimizer.update(k, engine.params, engine.grads, engine.state, gscale=0.5)

    out = {}
    for name, fn in (("norm", lambda: norm_pass(k, engine.grads.flat, engine.layout)), ("update", update),
                     ("step", step)):
        fn()
        out[name] = float(np.median([time_call(fn) for _ in range(reps)]))
    cp.get_default_memory_pool().free_all_blocks()
    return out


def run(optimizers, sizes, reps, names=CONTESTANTS, log=print):
    import torch  # noqa: F401  # initialises its CUDA context before the timings

    time_call = _timer()
    copy, copy_bytes = make_copy()
    copy_times, rows, unavailable = [], [], {}
    for opt in optimizers:
        for n in sizes:
            contestants = {}
            for name in names:
                try:
                    contestants[name] = make_contestant(name, opt, n)
                except LookupError as exc:
                    unavailable[f"{name}/{opt}"] = str(exc)
            contestants["copy"] = copy
            times = {k: [] for k in contestants}
            for _ in range(max(3, reps // BLOCK)):
                for name, fn in contestants.items():
                    fn()
                    times[name] += [time_call(fn) for _ in range(BLOCK)]
            copy_times += times.pop("copy")
            rows.append({"optimizer": opt, "n": n, "times": times})
            log(f"  timed {opt} n={n:.0e}: " + ", ".join(f"{k} {np.median(v) * 1e3:.3f} ms" for k, v in times.items()))
            contestants.clear()
            import cupy as cp

            cp.get_default_memory_pool().free_all_blocks()
    return rows, copy_bytes / float(np.median(copy_times)) / 1e9, unavailable


def table(rows, copy_gbs) -> str:
    out = ["| optimizer | params | contestant | min ms | median ms | GB/s | % copy | time / arraytrain |",
           "|---|---:|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        opt, n, times = row["optimizer"], row["n"], row["times"]
        ours = float(np.median(times["arraytrain"]))
        for name, t in times.items():
            med = float(np.median(t))
            gbs = step_bytes(opt) * n / med / 1e9
            out.append(f"| {opt} | {n:.0e} | {name} | {min(t) * 1e3:.3f} | {med * 1e3:.3f} | {gbs:.0f} | "
                       f"{100 * gbs / copy_gbs:.0f}% | {med / ours:.2f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m arraytrain.bench compare --device cuda")
    ap.add_argument("--device", default="cuda", choices=("cuda",))
    ap.add_argument("--optimizers", default=",".join(DEFAULT_OPTIMIZERS))
    ap.add_argument("--sizes", default="1e6,1e7,1e8", help="comma-separated parameter counts (1e9 needs ~40 GB)")
    ap.add_argument("--contestants", default=",".join(CONTESTANTS),
                    help=f"comma-separated, from: {', '.join(CONTESTANTS + OPTIONAL)} (arraytrain among them)")
    ap.add_argument("--reps", type=int, default=30, help="timed calls per contestant (in blocks of 5)")
    ap.add_argument("--startup", action="store_true", help="also time the first step with a cold/warm kernel cache")
    ap.add_argument("--stages", action="store_true", help="also time the norm pass and the update alone")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    names = [c.strip() for c in args.contestants.split(",")]
    unknown = [c for c in names if c not in CONTESTANTS + OPTIONAL]
    if unknown or "arraytrain" not in names:
        ap.error(f"--contestants: unknown {unknown}" if unknown else "--contestants: the table compares with arraytrain")
    from arraytrain.backend import require_cuda

    require_cuda("--device cuda")
    import cupy as cp

    optimizers = [o.strip() for o in args.optimizers.split(",")]
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    rows, copy_gbs, unavailable = run(optimizers, sizes, args.reps, names, log=lambda s: print(s, file=sys.stderr))
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    print(f"device: {props['name'].decode()}, CuPy {cp.__version__}; {N_TENSORS} tensors")
    print(f"device-to-device copy bandwidth (median over the run, read + write): {copy_gbs:.0f} GB/s\n")
    print(table(rows, copy_gbs))
    counts = {opt: per_step_counts(opt) for opt in optimizers}
    doc = {"copy_gbs": copy_gbs, "rows": rows, "counts": counts, "unavailable": unavailable,
           "device": props["name"].decode()}
    print("\nper engine.step(): " + "; ".join(f"{o} {c['launches']:.0f} launches, {c['syncs']:.0f} host sync"
                                             for o, c in counts.items()))
    if args.stages:
        doc["stages"] = []
        print("\n| optimizer | params | norm pass ms | update ms | update % copy | engine.step ms | host gap ms |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for opt in optimizers:
            for n in sizes:
                st = stage_times(opt, n)
                doc["stages"].append({"optimizer": opt, "n": n, **st})
                upd_gbs = (step_bytes(opt) - 4) * n / st["update"] / 1e9
                print(f"| {opt} | {n:.0e} | {st['norm'] * 1e3:.3f} | {st['update'] * 1e3:.3f} | "
                      f"{100 * upd_gbs / copy_gbs:.0f}% | {st['step'] * 1e3:.3f} | "
                      f"{(st['step'] - st['norm'] - st['update']) * 1e3:.3f} |")
    if unavailable:
        print("\nnot available: " + "; ".join(f"{k}: {v}" for k, v in unavailable.items()))
    if args.startup:
        with tempfile.TemporaryDirectory() as cache:
            doc["startup"] = {"cold_s": first_step_seconds(cache, "cuda"), "warm_s": first_step_seconds(cache, "cuda")}
        print(f"\nfirst CUDA engine.step in a fresh process (import + NVRTC compile or cache load + step): "
              f"cold kernel cache {doc['startup']['cold_s']:.2f} s, warm {doc['startup']['warm_s']:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
