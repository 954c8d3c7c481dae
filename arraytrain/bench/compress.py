r"""``python -m arraytrain.bench compress``: compressor throughput beside the machine's bandwidth.

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
import statistics
import sys

import numpy as np

METHODS = ("topk-1%", "randomk-1%", "int8-256", "int8-256-sr", "sign", "ternary", "powersgd-r4", "vsa-1%")


def make(method: str, error_feedback: bool = False):
    """The method's compressor; with ``error_feedback``, wrapped in :class:`ErrorFeedback`, random-k and
    VSA in their contraction form (their unbiased decode scales up: ErrorFeedback refuses it)."""
    from .. import compress as C

    ef = error_feedback
    table = {
        "topk-1%": lambda: C.TopK(ratio=0.01),
        "randomk-1%": lambda: C.RandomK(ratio=0.01, rescale=not ef),
        "int8-256": lambda: C.Int8Block(block=256),
        "int8-256-sr": lambda: C.Int8Block(block=256, stochastic_rounding=True),
        "sign": lambda: C.Sign(),
        "ternary": lambda: C.Ternary(),
        "powersgd-r4": lambda: C.PowerSGD(rank=4),
        "vsa-1%": lambda: C.VSA(ratio=0.01, unbiased=not ef),
    }
    return C.ErrorFeedback(table[method]()) if ef else table[method]()


def layout_for(method: str, n: int):
    """100 vectors, or 10 matrices of about 10:1 for PowerSGD (which works per matrix)."""
    from ..layout import Layout

    if method.startswith("powersgd"):
        rows = max(1, int(np.sqrt(n / 10) / 3))
        per = n // 10
        return Layout({f"w{i}": (rows, max(1, per // rows)) for i in range(10)})
    per = n // 100
    return Layout({f"p{i}": (per,) for i in range(100)})


def main(argv=None) -> int:
    from .compare import _timeit, make_triad

    def best(fn, reps):
        return min(_timeit(fn, reps))

    p = argparse.ArgumentParser(prog="python -m arraytrain.bench compress", description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--sizes", default="1e6,1e7", help="gradient elements, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        print(f"--methods: unknown {bad}; choose from {list(METHODS)}", file=sys.stderr)
        return 2
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    triad_fn, triad_bytes = make_triad(20_000_000)
    rng = np.random.default_rng(0)
    cases = []
    for n in sizes:
        for m in methods:
            lay = layout_for(m, n)
            g = np.zeros(lay.size, np.float32)
            g[:] = rng.standard_normal(lay.size)
            c = make(m).bind(lay, np.float32)
            ef = make(m, error_feedback=True).bind(lay, np.float32)
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
