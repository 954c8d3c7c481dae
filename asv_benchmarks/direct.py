"""Run modules of this benchmark suite in one process, without asv.

``python -m asv_benchmarks.direct bench_cuda bench_cuda_compress [--repeat 7] [--match TEXT]``
imports each module and runs every benchmark class over its parameter grid: ``setup``,
each ``track_*`` once, each ``time_*`` best of ``--repeat`` calls (wall clock; the
benchmarks synchronise the device themselves), ``teardown``. One line per figure. For a
machine where ``asv run`` cannot work (no git checkout, no network to build an
environment); the figures come from the same methods asv calls. A ``setup`` that raises
``NotImplementedError`` is a skip, as in asv.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import itertools
import sys
import time


def _grid(cls) -> tuple[list[str], list[tuple]]:
    params = getattr(cls, "params", None)
    if not params:
        return [], [()]
    if not isinstance(params[0], (list, tuple)):
        params = [params]
    names = list(getattr(cls, "param_names", [f"p{i}" for i in range(len(params))]))
    return names, list(itertools.product(*params))


def _best(fn, args, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def run_class(cls, repeat: int, out=sys.stdout) -> int:
    """Run one benchmark class over its grid; returns the number of figures printed."""
    names, grid = _grid(cls)
    methods = sorted(m for m in dir(cls) if m.startswith(("time_", "track_")))
    printed = 0
    for args in grid:
        label = " ".join(f"{k}={v}" for k, v in zip(names, args))
        bench = cls()
        t0 = time.perf_counter()
        try:
            if hasattr(bench, "setup"):
                bench.setup(*args)
        except NotImplementedError as e:
            print(f"{cls.__name__:28s} {label}: skipped ({e})", file=out)
            continue
        setup_s = time.perf_counter() - t0
        try:
            for m in methods:
                fn = getattr(bench, m)
                if m.startswith("time_"):
                    value, unit = _best(fn, args, repeat) * 1e3, "ms"
                else:
                    value, unit = fn(*args), getattr(fn, "unit", "")
                print(f"{cls.__name__:28s} {m:26s} {label:34s} {value:12.4g} {unit:9s} (setup {setup_s:.2f} s)",
                      file=out, flush=True)
                printed += 1
        finally:
            if hasattr(bench, "teardown"):
                bench.teardown(*args)
    return printed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asv_benchmarks.direct", description=__doc__.splitlines()[0])
    ap.add_argument("modules", nargs="+", help="module names in asv_benchmarks, e.g. bench_cuda")
    ap.add_argument("--repeat", type=int, default=7, help="calls per time_* figure (the best is kept)")
    ap.add_argument("--match", default="", help="only classes whose name contains this text")
    args = ap.parse_args(argv)
    for name in args.modules:
        mod = importlib.import_module(f"asv_benchmarks.{name}")
        for cls_name, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ != mod.__name__ or cls_name.startswith("_") or args.match not in cls_name:
                continue
            run_class(cls, args.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
