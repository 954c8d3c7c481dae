"""``python -m arraytrain.bench intake``: the cost of the dict path per tensor, before and after, side by side.

For each tensor count (``--tensors``, default 100 500 2000) the parameters
(``--elements`` float32 elements in all, default 1e6, split evenly) are given
to an Engine as a ``{name: np.ndarray}`` micro-batch, and timed in one run:

* ``before``: the general path (every gradient through ``as_array``, the
  shape, dtype and aliasing checks, one accumulate call each): the dict path
  as it was before the structure cache, still the path of any structure the
  cache does not serve;
* ``after``: the dict path as it is (structure validated once and reused, small
  gradients staged and written by one scatter call per 32K elements);
* ``floor``: one accumulate over the whole flat buffer, the memory traffic any
  copy-in pays; ``per tensor`` is ``(path - floor) / tensors``;
* ``jax``: the same gradients as a pytree of JAX arrays through
  :func:`arraytrain.interop.jax.bind` (one jitted pack, one DLPack read, one
  kernel call), when JAX is installed.

Then one full clipped AdamW step with the same tensors: arraytrain's dict path
(after: one micro-batch a window, so the step reads the gradients where they lie), its
zero-copy path (gradients already in ``engine.grads``, as a torch binding leaves them;
``step/t`` is the dict path's cost beyond it per tensor) and torch's
``clip_grad_norm_(foreach=True)`` + ``AdamW(fused=True)`` when torch is installed. Micro-batch timings accumulate
(``accumulation_steps`` large), so no optimizer step is in them. Each figure is
the best of ``--repeats`` rounds of ``--calls`` calls, contestants alternating
round by round; warm-up and compilation are excluded. torch's step is timed in
rounds of its own after arraytrain's: torch's OpenMP threads spin for a while
after each torch call, on the cores numba's threads then need, so whichever
contestant followed torch's in the alternation paid for them (on a 2-core Zen 3,
600 us a step, which showed as 60 us "per tensor" at 10 tensors).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from . import common

LR, WD, MAX_NORM = 1e-3, 1e-2, 1.0


def measure(n_tensors: int, elements: int, calls: int = 20, repeats: int = 7) -> dict:
    import arraytrain as at
    from arraytrain.kernels import cpu

    size = max(1, elements // n_tensors)
    rng = np.random.default_rng(0)
    params = {f"layer{i}.weight": rng.standard_normal(size).astype(np.float32) for i in range(n_tensors)}
    grads = {k: (v * 0.01).astype(np.float32) for k, v in params.items()}
    micro = dict(accumulation_steps=2**40, max_grad_norm=MAX_NORM)
    before = at.Engine(params, at.optim.AdamW(lr=LR, weight_decay=WD), **micro)
    before.intake.fast = False
    after = at.Engine(params, at.optim.AdamW(lr=LR, weight_decay=WD), **micro)
    src = np.ones(after.grads.flat.size, np.float32)
    fns = {"before": lambda: before.step(grads), "after": lambda: after.step(grads),
           "floor": lambda: cpu.accumulate(after.grads.flat, src, w=1.0, overwrite=False)}
    try:
        import jax.numpy as jnp

        from arraytrain.interop import jax as atj

        jtree = [jnp.asarray(g) for g in grads.values()]
        jeng = atj.bind([jnp.asarray(p) for p in params.values()], at.optim.AdamW(lr=LR, weight_decay=WD), **micro)
        fns["jax"] = lambda: jeng.step(jtree)
    except ImportError:
        pass
    micro_t = common.best_of(fns, calls, repeats)

    full = dict(max_grad_norm=MAX_NORM)
    dict_eng = at.Engine(params, at.optim.AdamW(lr=LR, weight_decay=WD), **full)
    zero_eng = at.Engine(params, at.optim.AdamW(lr=LR, weight_decay=WD), zero_grad_on_step=False, **full)
    zero_eng.grads.load(grads)
    steps = {"dict": lambda: dict_eng.step(grads), "zero-copy": lambda: zero_eng.step()}
    try:
        import torch

        tp = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params.values()]
        for p, g in zip(tp, grads.values()):
            p.grad = torch.from_numpy(g.copy())
        opt = torch.optim.AdamW(tp, lr=LR, weight_decay=WD, fused=True)

        def torch_step():
            torch.nn.utils.clip_grad_norm_(tp, MAX_NORM, foreach=True)
            opt.step()

    except ImportError:
        torch_step = None
    step_t = common.best_of(steps, max(1, calls // 2), repeats)
    if torch_step is not None:
        step_t.update(common.best_of({"torch-fused": torch_step}, max(1, calls // 2), repeats))
    floor = micro_t["floor"]
    out = {"tensors": n_tensors, "elements_per_tensor": size, "micro_batch_s": micro_t, "step_s": step_t,
           "per_tensor_s": {k: (v - floor) / n_tensors for k, v in micro_t.items() if k != "floor"},
           # a whole step: what the dict path costs beyond the zero-copy path, per tensor (it reads the
           # gradients where they lie, each in the caller's array)
           "step_per_tensor_s": (step_t["dict"] - step_t["zero-copy"]) / n_tensors}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m arraytrain.bench intake", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, nargs="+", default=[100, 500, 2000])
    ap.add_argument("--elements", type=float, default=1e6, help="float32 elements in all (default 1e6)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args(argv)
    rows = [measure(n, int(args.elements), args.calls, args.repeats) for n in args.tensors]
    us = 1e6
    print(f"dict path, one micro-batch of float32 gradients, {int(args.elements):,} elements in all "
          "(best of rounds; per tensor = (path - floor) / tensors)")
    print(f"{'tensors':>8} {'elems/t':>8} | {'before us':>10} {'after us':>9} {'jax us':>8} {'floor us':>9} | "
          f"{'before/t':>9} {'after/t':>8} {'jax/t':>7} | full AdamW step: {'dict':>7} {'zero-copy':>9} "
          f"{'torch-fused':>11} {'step/t':>7} (us)")
    for r in rows:
        m, p, s = r["micro_batch_s"], r["per_tensor_s"], r["step_s"]

        def f(d, k, scale=us, width=8, prec=1):
            return f"{d[k] * scale:>{width}.{prec}f}" if k in d else f"{'-':>{width}}"

        print(f"{r['tensors']:>8} {r['elements_per_tensor']:>8} | {f(m, 'before', width=10)} {f(m, 'after', width=9)} "
              f"{f(m, 'jax')} {f(m, 'floor', width=9)} | {f(p, 'before', width=9, prec=2)} "
              f"{f(p, 'after', prec=2)} {f(p, 'jax', width=7, prec=2)} |                  {f(s, 'dict', width=7)} "
              f"{f(s, 'zero-copy', width=9)} {f(s, 'torch-fused', width=11)} "
              f"{r['step_per_tensor_s'] * us:>7.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
