"""``python -m arraytrain.bench dropin``: the drop-in AdamW's step beside torch's fused AdamW, and the param groups' cost.

A model of :data:`~arraytrain.bench.common.N_TENSORS` float32 tensors (``--sizes`` elements
in all, default 1e6 1e7 1e8; matrices and their biases) is trained by two optimizers with
the same hyperparameters, timed side by side in one run, contestants alternating round
by round, the best of ``--repeats`` rounds of ``--calls`` steps:

* ``drop-in``: ``arraytrain.interop.torch.AdamW(model.parameters(), ...).step()``, the
  gradients in the engine's buffer (where ``backward()`` leaves them after
  ``zero_grad(set_to_none=False)``, or with no ``zero_grad`` at all): reading the param groups,
  reconnecting the tensors, the norm pass and the fused kernel, which also zeroes the gradients;
* ``drop-in, fresh .grad``: the same, with every ``.grad`` a tensor torch allocated (what
  ``backward()`` leaves after ``zero_grad()``'s default ``set_to_none=True``): the step copies
  them into the buffer first;
* ``torch fused``: ``torch.optim.AdamW(..., fused=True).step()``;

and the clipped step, ``max_grad_norm=1.0`` inside the drop-in's step against
``clip_grad_norm_(foreach=True)`` + the fused step. The figure of merit is the ratio of each
to torch fused (below 1: arraytrain is faster).

Then the loop every torch tutorial writes, on three models (``--loops``): ``opt.zero_grad()``
(torch's default ``set_to_none=True``), forward, backward, ``clip_grad_norm_(params, 1.0)``,
``opt.step()``, ``OneCycleLR``, two param groups (weight decay on the matrices, none on biases and
norms); timed: the clip and the step, summed over ``--loop-steps`` steps a round, contestants
alternating round by round (the median and best of ``--repeats`` rounds):

* ``torch fused``: ``torch.optim.AdamW(fused=True)`` after ``clip_grad_norm_(foreach=True)``;
* ``drop-in``: ``arraytrain.interop.torch.AdamW`` after the same ``clip_grad_norm_``: the fresh
  ``.grad`` tensors are read where they lie;
* ``drop-in, apply``: the same with ``nonfinite="apply"`` (torch's choice without a GradScaler:
  a NaN/Inf gradient is applied, so the step makes no norm pass of its own);
* ``drop-in, max_grad_norm``: the clip inside the step (no ``clip_grad_norm_``): the fast form.

and the whole iteration's median beside it (forward and backward run next to the step's threads:
the thread policy shows there, :mod:`arraytrain.threads`). ``--parts`` adds a round of the drop-in
with its step's parts wrapped in timers (:func:`step_parts`): the step, the param groups' read,
the ``.data``/``.grad`` check, the one compiled call of norm pass and update. ``--cold`` times
single operations where the step runs against their warm cost (:func:`measure_cold`): why the step's
Python costs several times its warm time inside the loop.

Then the cost of reading the param groups (``read_param_groups()``, which every step calls
first), per group, for 1, 10 and 100 groups over 100 one-element tensors: groups unchanged
(the steady state), every group's ``lr`` set anew before each read (a scheduler that changes
the rate every step), and ``lr`` a 0-d tensor rewritten in place (``fill_``); the writes
themselves are timed alone and subtracted. The target is at most 2 us per group.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

from . import common

LR, BETAS, EPS, WD, MAX_NORM = common.LR, common.BETAS, common.EPS, common.WD, common.MAX_NORM
GROUPS = (1, 10, 100)


def make_model(n: int, seed: int = 0, tensors: int = common.N_TENSORS):
    """``tensors`` float32 parameters (default :data:`~arraytrain.bench.common.N_TENSORS`) of ``n``
    elements in all (matrices with a bias after each), and gradients for them; returns ``(params,
    grads)`` (lists of tensors)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    half = tensors // 2
    bias = max(1, min(1024, n // (tensors * 64)))
    sizes = common.split(n - half * bias, half)
    shapes = []
    for k in sizes:
        shapes += [common.matrix(k), (bias,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    grads = [torch.randn(s, generator=g) * 1e-2 for s in shapes]
    return params, grads


def contestants(n: int, clipped: bool, tensors: int = common.N_TENSORS) -> dict:
    """``{name: step function}`` for one size; each step function also returns its parameters."""
    import torch

    from arraytrain.interop import torch as at_torch

    out = {}
    kw = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD}

    params, grads = make_model(n, tensors=tensors)
    opt = at_torch.AdamW(params, max_grad_norm=MAX_NORM if clipped else None, **kw)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()  # the gradients now live in the engine's buffer, which every step leaves zeroed
    out["drop-in"] = (opt.step, params)

    fparams, fgrads = make_model(n, tensors=tensors)
    fopt = at_torch.AdamW(fparams, max_grad_norm=MAX_NORM if clipped else None, **kw)

    def fresh():
        for p, g in zip(fparams, fgrads):
            p.grad = g  # a tensor of torch's, as backward() allocates after zero_grad(set_to_none=True)
        fopt.step()

    out["drop-in, fresh .grad"] = (fresh, fparams)

    tparams, tgrads = make_model(n, tensors=tensors)
    for p, g in zip(tparams, tgrads):
        p.grad = g
    topt = torch.optim.AdamW(tparams, fused=True, **kw)

    def torch_step():
        if clipped:
            torch.nn.utils.clip_grad_norm_(tparams, MAX_NORM, foreach=True)
        topt.step()

    out["torch fused"] = (torch_step, tparams)
    return out


def measure_step(n: int, calls: int, repeats: int, tensors: int = common.N_TENSORS) -> dict:
    """Seconds per step of each contestant, plain and clipped, at ``n`` elements in ``tensors`` tensors."""
    row = {"elements": n, "tensors": tensors}
    for clipped in (False, True):
        fns = {k: fn for k, (fn, _) in contestants(n, clipped, tensors).items()}
        row["clipped" if clipped else "plain"] = common.best_of(fns, calls, repeats)
    return row


def measure_groups(groups: int, calls: int = 2000, repeats: int = 7) -> dict:
    """Microseconds per group of ``read_param_groups()`` over ``groups`` groups of 100 tensors in all."""
    import torch

    from arraytrain.interop import torch as at_torch

    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(common.N_TENSORS)]
    per = common.N_TENSORS // groups
    layout = [{"params": params[i * per:(i + 1) * per]} for i in range(groups)]
    opt = at_torch.AdamW(layout, lr=LR)
    others = [torch.nn.Parameter(torch.zeros(1)) for _ in range(common.N_TENSORS)]
    topt = at_torch.AdamW([{"params": others[i * per:(i + 1) * per], "lr": torch.tensor(LR)} for i in range(groups)])
    rates = [LR * (1 + i / calls) for i in range(calls + 1)]
    state = {"i": 0}

    def set_floats():
        state["i"] = (state["i"] + 1) % calls
        r = rates[state["i"]]
        for g in opt.param_groups:
            g["lr"] = r

    def fill_tensors():
        state["i"] = (state["i"] + 1) % calls
        r = rates[state["i"]]
        for g in topt.param_groups:
            g["lr"].fill_(r)

    def scheduled():
        set_floats()
        opt.read_param_groups()

    def tensor_lr():
        fill_tensors()
        topt.read_param_groups()

    best = common.best_of({"unchanged": opt.read_param_groups, "lr set every step": scheduled, "0-d tensor lr": tensor_lr,
                           "set": set_floats, "fill": fill_tensors}, calls, repeats)
    # the scheduler's own writes (a float assigned, a tensor's fill_) are timed alone and taken off
    read = {"unchanged": best["unchanged"], "lr set every step": best["lr set every step"] - best["set"],
            "0-d tensor lr": best["0-d tensor lr"] - best["fill"]}
    return {"groups": groups, "us_per_group": {k: v * 1e6 / groups for k, v in read.items()},
            "writes_us_per_group": {"set": best["set"] * 1e6 / groups, "fill_": best["fill"] * 1e6 / groups}}


#: The everyday loop's models. ``transformer-128-frozen``: the small TransformerEncoder fine-tuned as
#: people do, its input projection and first layer frozen (``requires_grad=False``) but handed to the
#: optimizer with the rest, so their ``.grad`` stays None at every step (torch's rule leaves them out).
LOOP_MODELS = ("transformer-128", "cnn-bn", "transformer-512x4", "transformer-128-frozen")


def loop_model(kind: str):
    """A model of ``kind`` (:data:`LOOP_MODELS`), its input batch and integer targets (seeded)."""
    import torch

    if kind.endswith("-frozen"):
        model, x, y = loop_model(kind[:-len("-frozen")])
        for part in (model.embed, model.encoder.layers[0]):
            part.requires_grad_(False)
        return model, x, y
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    nn = torch.nn
    if kind.startswith("transformer"):
        d, layers = (128, 2) if kind == "transformer-128" else (512, 4)
        layer = nn.TransformerEncoderLayer(d, nhead=8 if d == 512 else 4, dim_feedforward=4 * d, dropout=0.0,
                                           batch_first=True)

        class Encoder(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Linear(32, d)
                self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
                self.norm = nn.LayerNorm(d)
                self.head = nn.Linear(d, 10)

            def forward(self, x):
                return self.head(self.norm(self.encoder(self.embed(x))).mean(1))

        return Encoder(), torch.randn(16, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 192, 3, padding=1, bias=False), nn.BatchNorm2d(192), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(192, 10))
    return model, torch.randn(32, 3, 16, 16, generator=g), torch.randint(0, 10, (32,), generator=g)


LOOP_CONTESTANTS = ("torch fused", "drop-in", "drop-in, apply", "drop-in, max_grad_norm")


def baseline_torch(src: str):
    """``arraytrain.interop.torch`` of another checkout (``src``: the folder that holds its ``arraytrain/``),
    imported beside this one as ``arraytrain_baseline`` (a copy in a temporary folder; its kernels compile
    once there): the code before a change and after it, measured side by side in one process."""
    import importlib
    import shutil
    import tempfile
    from pathlib import Path

    pkg = Path(src) / "arraytrain"
    if not (pkg / "__init__.py").is_file():
        raise SystemExit(f"--baseline {src}: no arraytrain/ package there")
    where = tempfile.mkdtemp(prefix="arraytrain-baseline-")
    shutil.copytree(pkg, Path(where) / "arraytrain_baseline", ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, where)
    return importlib.import_module("arraytrain_baseline.interop.torch")


def loop_contestants(kind: str, steps: int, total: int, baseline=None) -> dict:
    """``{name: (round, model)}``: each contestant's copy of the model, and a function that runs
    ``steps`` steps of the everyday loop on it and returns the mean seconds of clip + step
    (``total``: the steps OneCycleLR is set up for). ``baseline``: another checkout's drop-in module
    (:func:`baseline_torch`), which adds its default and ``max_grad_norm`` forms as contestants."""
    import copy

    import torch

    from arraytrain.interop import torch as at_torch

    base, x, y = loop_model(kind)

    def groups(m):
        decay = [p for n, p in m.named_parameters() if p.ndim >= 2]
        rest = [p for n, p in m.named_parameters() if p.ndim < 2]
        return [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}]

    def make(which):
        m = copy.deepcopy(base)
        kw = {"lr": LR, "betas": BETAS, "eps": EPS}
        if which == "torch fused":
            opt = torch.optim.AdamW(groups(m), fused=True, **kw)
        else:
            inside = which.endswith("max_grad_norm")
            module = baseline if which.startswith("baseline") else at_torch
            opt = module.AdamW(groups(m), max_grad_norm=MAX_NORM if inside else None,
                               nonfinite="apply" if which == "drop-in, apply" else "skip", **kw)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=total + 10)
        clip = not which.endswith("max_grad_norm")
        params = list(m.parameters())

        def round_(whole=None):
            spent = 0.0
            start = time.perf_counter()
            for _ in range(steps):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(m(x), y)
                loss.backward()
                t = time.perf_counter()
                if clip:
                    torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
                opt.step()
                spent += time.perf_counter() - t
                sched.step()
            if whole is not None:  # the whole iteration too: forward and backward run beside the step's threads
                whole.append((time.perf_counter() - start) / steps)
            return spent / steps

        return round_, m

    return {k: make(k) for k in LOOP_CONTESTANTS + (BASELINE_CONTESTANTS if baseline is not None else ())}


#: With ``--baseline``: the other checkout's drop-in, in the default and the fast form.
BASELINE_CONTESTANTS = ("baseline drop-in", "baseline max_grad_norm")


def measure_loop(kind: str, steps: int = 20, repeats: int = 5, parts: bool = False, baseline=None) -> dict:
    """Seconds of clip + step per step in the everyday loop, by contestant (median and best of rounds),
    and of the whole iteration (median); with ``parts``, the drop-in's step in parts (:func:`step_parts`)."""
    import statistics

    made = loop_contestants(kind, steps, steps * (repeats + 2), baseline)
    rounds = {k: fn for k, (fn, _) in made.items()}
    names = tuple(made)
    base = made["torch fused"][1]
    for fn in rounds.values():  # warm-up: kernels compiled, state allocated
        fn()
    times = {k: [] for k in names}
    whole = {k: [] for k in names}
    for _ in range(repeats):
        for k, fn in rounds.items():
            times[k].append(fn(whole[k]))
    n = sum(p.numel() for p in base.parameters())
    out = {"model": kind, "elements": n, "tensors": len(list(base.parameters())),
           "median": {k: statistics.median(v) for k, v in times.items()}, "best": {k: min(v) for k, v in times.items()},
           "iteration_median": {k: statistics.median(v) for k, v in whole.items()}}
    if parts:
        with step_parts() as spent:
            rounds["drop-in"]()
        out["drop_in_parts_us"] = {k: v * 1e6 / steps for k, v in spent.items()}
    return out


def cold_probes():
    """``{what: fn}``: single operations of the kinds a step is made of, for :func:`measure_cold`, in the
    order they run (a kind's first use pays for bringing its code and data back into the caches, a second
    use of it does not: see that function)."""
    import numpy as np

    from arraytrain.kernels import cpu

    x, pieces, values = np.ones(16, np.float32), np.array([[0, 16, 0]], np.int64), [1e-3, 0.0, 1e-3, 1e-2]
    cpu.sumsq(x, pieces, nseg=1)  # compiled (or loaded) here, not in the loop
    return {
        "an empty Python call": lambda: None,
        "a numba kernel on 16 elements (the first)": lambda: cpu.sumsq(x, pieces, nseg=1),
        "the same kernel again": lambda: cpu.sumsq(x, pieces, nseg=1),
        "np.array of 4 floats (its first use in the step)": lambda: np.array(values),
        "np.array again": lambda: np.array(values),
        "np.ascontiguousarray (another NumPy call)": lambda: np.ascontiguousarray(x, np.float32),
    }


def measure_cold(kind: str = "cnn-bn", steps: int = 200) -> dict:
    """What one operation costs where the drop-in's step runs, in microseconds (25th percentile and median
    of ``steps``): after ``backward()`` and ``clip_grad_norm_`` of the everyday loop on ``kind``
    (torch's fused AdamW takes the loop's steps), against the same operation in a warm loop of itself. Every
    probe of :func:`cold_probes` runs in each step, in order, plus one read of every parameter's
    ``.grad`` ``dtype`` and ``shape`` (the drop-in's check reads such attributes, torch's step too).

    The figures say why a step of a few hundred microseconds costs three to four times its warm time
    there: forward and backward leave the caches full of torch's code and data, and each kind of
    operation the step uses (a NumPy function, numba's dispatcher, a torch attribute) pays for its
    first use in the step, whatever its size; the same kind used again right after costs its warm time."""
    import statistics

    import torch

    m, x, y = loop_model(kind)
    opt = torch.optim.AdamW(m.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    params = list(m.parameters())
    probes = cold_probes()
    probes["the parameters' .grad dtype and shape"] = lambda: [(p.grad.dtype, p.grad.shape) for p in params]
    cold = {k: [] for k in probes}
    for i in range(steps + 2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
        for k, fn in probes.items():
            t = time.perf_counter()
            fn()
            if i >= 2:  # (warm-up)
                cold[k].append(time.perf_counter() - t)
        opt.step()
    warm = {}
    for k, fn in probes.items():
        spent = []
        for _ in range(steps):
            t = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - t)
        warm[k] = spent

    def quantiles(v):
        v = sorted(v)
        return {"p25_us": v[len(v) // 4] * 1e6, "median_us": statistics.median(v) * 1e6}

    return {"model": kind, "in_the_loop": {k: quantiles(v) for k, v in cold.items()},
            "warm": {k: quantiles(v) for k, v in warm.items()}}


#: The drop-in step's parts that ``--parts`` times: (what, owner, attribute).
#: (The loop's AdamW takes its step in one compiled call, ``GroupEngine.lean_step``: the engine's staged
#: step and its kernels' Python wrappers do not run there.)
PARTS = (("step", "arraytrain.interop._torch_optim:TorchOptimizer", "_step"),  # (inside the step wrapper)
         ("read_param_groups", "arraytrain.interop._torch_optim:TorchOptimizer", "read_param_groups"),
         ("check (.data, .grad)", "arraytrain.interop._torch_engine:GroupEngine", "check"),
         ("the one compiled call (lean_step)", "arraytrain.interop._torch_engine:GroupEngine", "lean_step"))


@contextlib.contextmanager
def step_parts():
    """Inside: the functions of :data:`PARTS` wrapped in timers; yields ``{what: seconds}`` summed over
    the calls (each part includes those it calls; the wrappers add well under a microsecond each)."""
    import importlib

    spent, saved = {}, []
    for what, where, attr in PARTS:
        module, _, cls = where.partition(":")
        owner = importlib.import_module(module)
        if cls:
            owner = getattr(owner, cls)
        fn = getattr(owner, attr)

        def timed(*args, _fn=fn, _what=what, **kwargs):
            t = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_what] = spent.get(_what, 0.0) + time.perf_counter() - t

        saved.append((owner, attr, owner.__dict__[attr] if isinstance(owner, type) else fn))
        setattr(owner, attr, timed)
    try:
        yield spent
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m arraytrain.bench dropin", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 1e8])
    ap.add_argument("--tensors", type=int, nargs="+", default=[common.N_TENSORS],
                    help="tensors the elements are split into (default 100; e.g. 10 100 at 1e3-1e5 elements: "
                         "the per-step fixed cost)")
    ap.add_argument("--calls", type=int, default=5, help="steps per round (default 5)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--group-calls", type=int, default=2000, help="group reads per round (default 2000)")
    ap.add_argument("--loops", nargs="*", default=list(LOOP_MODELS), choices=LOOP_MODELS,
                    help="the everyday loop's models (default: all; none: skip it)")
    ap.add_argument("--loop-steps", type=int, default=20, help="steps of the everyday loop per round (default 20)")
    ap.add_argument("--parts", action="store_true",
                    help="also time the drop-in's step in parts inside the loop (one more round each)")
    ap.add_argument("--cold", action="store_true",
                    help="also time single operations where the step runs in the loop (cnn-bn), against their warm "
                         "cost: what a kind of operation costs the first time a step uses it")
    ap.add_argument("--baseline", metavar="DIR",
                    help="also run another checkout's drop-in in the loop (DIR holds its arraytrain/): before and "
                         "after a change, side by side in one process")
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args(argv)
    import torch

    baseline = baseline_torch(args.baseline) if args.baseline else None

    rows = [measure_step(int(n), args.calls, args.repeats, k) for k in args.tensors for n in args.sizes]
    names = ("drop-in", "drop-in, fresh .grad", "torch fused")
    print(f"AdamW step, float32 tensors, torch {torch.__version__}, {torch.get_num_threads()} "
          "threads (ms per step, best of rounds; x: ratio to torch fused)")
    print(f"{'elements':>10} {'tensors':>7} {'':>8} | " + " | ".join(f"{k:>20}" for k in names))
    for r in rows:
        for mode in ("plain", "clipped"):
            t = r[mode]
            ref = t["torch fused"]
            cells = " | ".join(f"{t[k] * 1e3:>11.3f} ({t[k] / ref:4.2f}x)" for k in names)
            print(f"{r['elements']:>10.0e} {r['tensors']:>7} {mode:>8} | {cells}")
    loops = [measure_loop(k, args.loop_steps, args.repeats, args.parts, baseline) for k in args.loops]
    if loops:
        names = tuple(loops[0]["median"])
        print("\nThe everyday loop: clip + step, ms per step (median / best of rounds; x: torch fused / it, "
              "above 1: faster than torch)")
        print(f"{'model':>18} {'params':>9} {'tensors':>7} | " + " | ".join(f"{k:>26}" for k in names))
        for r in loops:
            ref = r["median"]["torch fused"]
            cells = " | ".join(f"{r['median'][k] * 1e3:6.2f} / {r['best'][k] * 1e3:6.2f} ({ref / r['median'][k]:4.2f}x)"
                               for k in names)
            print(f"{r['model']:>18} {r['elements']:>9} {r['tensors']:>7} | {cells}")
        print("\nThe whole iteration (zero_grad, forward, backward, clip, step, scheduler), ms, median of rounds:")
        for r in loops:
            print(f"{r['model']:>18} | " + " | ".join(f"{k} {v * 1e3:.2f}" for k, v in r["iteration_median"].items()))
        for r in loops:
            if "drop_in_parts_us" in r:
                print(f"\nThe drop-in's step in parts inside the loop, {r['model']}, us per step (each part includes "
                      "those below it that it calls):")
                print("  " + " | ".join(f"{k} {v:.0f}" for k, v in r["drop_in_parts_us"].items()))
    cold = measure_cold(steps=10 * args.loop_steps) if args.cold else None
    if cold is not None:
        print(f"\nOne operation where the step runs ({cold['model']}: after backward and clip_grad_norm_) and in "
              "a warm loop, us (25th percentile / median):")
        for k, v in cold["in_the_loop"].items():
            w = cold["warm"][k]
            print(f"  {k:<45} in the loop {v['p25_us']:6.1f} / {v['median_us']:6.1f} | warm {w['p25_us']:5.1f} / "
                  f"{w['median_us']:5.1f}")
    groups = [measure_groups(g, args.group_calls, args.repeats) for g in GROUPS]
    print("\nread_param_groups(), us per group (target <= 1):")
    print(f"{'groups':>7} | " + " | ".join(f"{k:>18}" for k in groups[0]["us_per_group"]))
    for g in groups:
        print(f"{g['groups']:>7} | " + " | ".join(f"{v:>18.3f}" for v in g["us_per_group"].values()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"steps": rows, "loops": loops, "groups": groups, "cold": cold}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
