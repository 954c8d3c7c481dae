"""Kernels compiled ahead of the first step: ``arraytrain compile``.

numba compiles a kernel on its first call for each signature (the dtypes of its arrays and
which variants it takes: a bfloat16 or 8-bit state slot, a working copy, the gradient zeroed in
the same pass), 2-7 s a signature on a 2-core machine, and keeps the machine code in its on-disk
cache (``__pycache__`` next to the package, or ``NUMBA_CACHE_DIR``) for every later process. A
first AdamW step therefore took 2.9 s, 8.7 s with 8-bit state, before anything trained.

:func:`compile_ahead` fills that cache for the kernels a run will use, in parallel processes:
for each optimizer, parameter dtype, state dtype and working copy asked for it builds a small
engine and steps it the ways a run does (the gradient zeroed in the kernel, as the torch
binding and the drop-in optimizers do, and not, as ``arraytrain train`` does; micro-batches
accumulated; clipped), with both twins of every kernel compiled (the serial one that small
buffers run and the parallel one of large buffers). It is the same code path as a real step,
so what it compiles is what the step will load. Processes that meet the same kernel at once
compile it once (a file lock per signature, see :mod:`arraytrain.kernels.cpu._jit`).

A step that has to compile for more than a second says so on stderr, the first such step with the
command that would have compiled it ahead (:mod:`arraytrain._compile_notice`).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from . import _compile_notice, optim
from .engine import Engine
from .errors import HyperparameterError

#: Parameter dtypes a kernel compiles for.
DTYPES = ("float32", "float64")
#: Storage of the optimizer's element-wise state: "float32" is the parameters' own dtype.
STATE_DTYPES = optim.Optimizer.STATE_DTYPES
#: Low-precision working copies ("none": without). bfloat16 and float16 copies share one
#: compiled signature (the kind is an argument of the kernel), so either compiles both.
WORKING_DTYPES = ("none", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")

# the engine a job steps: one matrix over the 8-bit threshold (4096 elements: 8-bit state
# keeps smaller parameters in float32, so both kinds are in the slot) and a vector
_SHAPES = {"w": (64, 80), "b": (80,)}


def optimizer_names() -> list[str]:
    """The optimizers ``arraytrain train --optimizer`` and ``arraytrain compile`` know, by name."""
    return sorted(optim.by_name())


def _takes_state_dtype(name: str) -> bool:
    return "state_dtype" in inspect.signature(optim.by_name()[name]).parameters


@dataclass(frozen=True)
class Job:
    """One engine configuration whose kernels are compiled together."""

    optimizer: str
    dtype: str = "float32"
    state_dtype: str = "float32"
    working_dtype: str = "none"
    device: str = "cpu"

    def __str__(self) -> str:
        parts = [self.optimizer, self.dtype]
        if self.state_dtype != "float32":
            parts.append(f"{self.state_dtype} state")
        if self.working_dtype != "none":
            parts.append(f"{self.working_dtype} copy")
        return " ".join(parts) + (" (cuda)" if self.device == "cuda" else "")


def _choices(flag: str, text: str, known) -> list[str]:
    """A comma-separated list of ``known`` names (``all``: every one), in ``known``'s order."""
    wanted = [w.strip() for w in text.split(",") if w.strip()]
    if "all" in wanted:
        return list(known)
    unknown = [w for w in wanted if w not in known]
    if unknown or not wanted:
        raise HyperparameterError(f"{flag}: expected 'all' or a comma-separated list of {', '.join(known)}; "
                                  f"got {text!r}")
    return [k for k in known if k in wanted]


def jobs(optimizers: str = "all", dtypes: str = "float32", state_dtypes: str = "float32",
         working_dtypes: str = "none", device: str = "cpu") -> list[Job]:
    """The jobs for comma-separated lists of names (or ``all``), the combinations that exist.

    Low-precision state and working copies need float32 parameters; Adafactor and Sophia keep no
    state another dtype could hold. Raises :class:`HyperparameterError` naming the flag for an
    unknown name, or when the lists leave no combination at all.
    """
    if device not in DEVICES:
        raise HyperparameterError(f"--device: expected one of {', '.join(DEVICES)}, got {device!r}")
    names = _choices("--optimizers", optimizers, optimizer_names())
    dts = _choices("--dtype", dtypes, DTYPES)
    sds = _choices("--state-dtype", state_dtypes, STATE_DTYPES)
    wds = _choices("--working-dtype", working_dtypes, WORKING_DTYPES)
    if "bfloat16" in wds and "float16" in wds:  # one signature serves both (see WORKING_DTYPES)
        wds.remove("float16")
    out = []
    for name in names:
        for dt in dts:
            for sd in sds:
                if sd != "float32" and (dt != "float32" or not _takes_state_dtype(name)):
                    continue
                for wd in wds:
                    if wd == "none" or dt == "float32":
                        out.append(Job(name, dt, sd, wd, device))
    if not out:
        raise HyperparameterError("no combination to compile: low-precision state (--state-dtype) and working "
                                  "copies (--working-dtype) need --dtype float32, and adafactor and sophia keep no "
                                  "state in another dtype")
    # the slowest first, so that the last process to finish does not start one at the end
    return sorted(out, key=lambda j: (j.state_dtype not in ("8bit", "float8"), j.working_dtype == "none", j.optimizer))


def _engine(job: Job, zero_grad: bool, accumulation: int):
    cls = optim.by_name()[job.optimizer]
    kwargs = {} if job.state_dtype == "float32" else {"state_dtype": job.state_dtype}
    if cls is optim.Muon:  # as arraytrain train builds it: the matrices, and AdamW for the rest
        kwargs["fallback"] = optim.AdamW(**kwargs)
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s).astype(job.dtype) for k, s in _SHAPES.items()}
    return Engine(params, cls(**kwargs), max_grad_norm=1.0, zero_grad_on_step=zero_grad,
                  accumulation_steps=accumulation, device=None if job.device == "cpu" else job.device,
                  working_dtype=None if job.working_dtype == "none" else job.working_dtype)


def run(job: Job) -> tuple[float, int]:
    """Compile ``job``'s kernels in this process: ``(seconds compiling, kernel signatures compiled)``
    (0 of both when the cache held them all)."""
    from .kernels.cpu._jit import COMPILE_CLOCK, both_twins

    before, count = COMPILE_CLOCK.seconds, COMPILE_CLOCK.count
    rng = np.random.default_rng(1)
    with both_twins(), _compile_notice.silenced():  # compiling is what these steps are for
        # the gradient zeroed in the kernel (the bindings, the drop-ins) over windows of two
        # micro-batches, not zeroed (arraytrain train) with one, and an Engine's defaults, whose
        # second step reads the gradients where they lie (the dict path, the drop-ins' fresh .grad)
        for zero_grad, accumulation in ((True, 2), (False, 1), (True, 1)):
            engine = _engine(job, zero_grad, accumulation)
            xp = np if job.device == "cpu" else _cupy()
            for _ in range(2 * accumulation):
                engine.step({k: xp.asarray(rng.standard_normal(s).astype(job.dtype)) for k, s in _SHAPES.items()})
        if job.optimizer in ("adam", "adamw") and job == Job(job.optimizer):  # (CPU, float32 throughout)
            _one_call(engine)
    return COMPILE_CLOCK.seconds - before, COMPILE_CLOCK.count - count


def _one_call(engine) -> None:
    """The torch drop-ins' Adam/AdamW step in one compiled call (the CPU family's ``adam_checked``), both
    twins, with the argument types the drop-ins pass, on ``engine``'s buffers (its gradient buffer, read
    where it lies)."""
    from .kernels.cpu import adam_checked

    state, flat, slots, pieces = engine.state, engine.params.flat, engine.state.slots, engine.layout.pieces
    adam_checked(flat, engine.grads.flat, slots["exp_avg"].flat, slots["exp_avg_sq"].flat, np.zeros(0, flat.dtype),
                 state.hp["lr"].copy(), state.hp["weight_decay"].copy(), np.zeros((len(engine.layout), 2)),
                 engine.grad_addresses.copy(), np.asarray(engine.layout.offsets, np.int64), pieces,
                 np.array([0, len(pieces)], np.int64), pieces, unscale=1.0, max_norm=1.0, clip_eps=1e-6, check=True,
                 maximize=False, decoupled=True, beta1=0.9, beta2=0.999, eps=1e-8, amsgrad=False, lr_div=[1.0],
                 inv_bc2_sqrt=[1.0])  # (inside run's both_twins(): the serial and the parallel twin)


def _cupy():
    import cupy

    return cupy


def _run_timed(job: Job):
    start = time.perf_counter()
    seconds, count = run(job)
    return job, time.perf_counter() - start, seconds, count


def _workers(processes: int | None, n: int) -> int:
    if processes is None:
        processes = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(processes, n))


def compile_ahead(todo: list[Job], processes: int | None = None, progress: bool = True, file=None) -> dict:
    """Compile the kernels of ``todo`` in ``processes`` processes (default: one per usable core).

    Prints a progress bar (tqdm, where installed and ``file`` is a terminal) or a line per
    job on ``file`` (default stderr); ``progress=False`` prints nothing. Returns
    ``{"jobs", "signatures", "seconds", "processes"}``: the jobs, the kernel signatures compiled
    (0 when numba's cache already held them all) and the wall-clock seconds.
    """
    file = sys.stderr if file is None else file
    if any(j.device == "cuda" for j in todo):
        from .backend import require_cuda

        require_cuda("--device cuda")
    workers = _workers(processes, len(todo))
    start = time.perf_counter()
    bar = _bar(len(todo), file) if progress else None
    compiled = 0
    done = 0

    def report(job, took, seconds, count):
        nonlocal compiled, done
        compiled += count
        done += 1
        if bar is not None:
            bar.set_postfix_str(str(job), refresh=False)
            bar.update(1)
        elif progress:
            what = (f"{count} kernel signature{'s' if count != 1 else ''} compiled" if count else "cached"
                    ) if job.device == "cpu" else "compiled or cached by CuPy"
            print(f"[{done:{len(str(len(todo)))}d}/{len(todo)}] {job}: {what} ({took:.1f} s)", file=file, flush=True)

    try:
        if workers == 1:
            for job in todo:
                report(*_run_timed(job))
        else:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor, as_completed

            # spawn: a fresh interpreter per worker, whatever threads (numba's, BLAS's) this one runs
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
                for fut in as_completed([pool.submit(_run_timed, job) for job in todo]):
                    report(*fut.result())
    finally:
        if bar is not None:
            bar.close()
    return {"jobs": len(todo), "signatures": compiled, "seconds": time.perf_counter() - start,
            "processes": workers}


def _bar(total: int, file):
    if not getattr(file, "isatty", lambda: False)():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="job", file=file, desc="compiling")


def cache_location() -> str:
    """Where numba keeps the compiled kernels: ``NUMBA_CACHE_DIR``, or ``__pycache__`` folders
    next to the package's kernel sources."""
    from numba.core.config import CACHE_DIR

    if CACHE_DIR:
        return CACHE_DIR
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels", "cpu", "__pycache__")


# -- the command ------------------------------------------------------------------------------

DESCRIPTION = ("Compile the numba kernels a run will use, ahead of its first step, into numba's on-disk cache "
               "(in parallel processes). Each list is comma-separated, or 'all'. A later process's first step "
               "then loads machine code instead of compiling it.")


def add_parser(sub) -> argparse.ArgumentParser:
    """The ``compile`` subcommand of ``arraytrain``."""
    p = sub.add_parser("compile", help="compile the kernels a run will use, ahead of its first step",
                       description=DESCRIPTION)
    p.add_argument("--optimizers", default="all", metavar="NAMES",
                   help="optimizers, by arraytrain train's names (default: all)")
    p.add_argument("--dtype", default="float32", metavar="DTYPES",
                   help=f"parameter dtypes: {', '.join(DTYPES)} (default: float32)")
    p.add_argument("--state-dtype", default="float32", metavar="DTYPES",
                   help=f"optimizer state: {', '.join(STATE_DTYPES)} (default: float32, the parameters' own)")
    p.add_argument("--working-dtype", default="none", metavar="DTYPES",
                   help=f"low-precision working copy: {', '.join(WORKING_DTYPES)} (default: none)")
    p.add_argument("--device", default="cpu", choices=DEVICES,
                   help="cpu: numba's kernels; cuda: CuPy's (compiled into CuPy's own cache; needs a GPU)")
    p.add_argument("--processes", type=int, default=None, metavar="N",
                   help="compile in N processes (default: one per usable core)")
    p.add_argument("--quiet", action="store_true", help="print only the summary line")
    p.set_defaults(func=main)
    return p


def main(args) -> int:
    """``arraytrain compile``."""
    if args.processes is not None and args.processes < 1:
        raise HyperparameterError(f"--processes: expected a whole number >= 1, got {args.processes}")
    todo = jobs(args.optimizers, args.dtype, args.state_dtype, args.working_dtype, args.device)
    out = compile_ahead(todo, args.processes, progress=not args.quiet)
    configs = f"{out['jobs']} configuration{'s' if out['jobs'] != 1 else ''}"
    procs = f"{out['processes']} process{'es' if out['processes'] != 1 else ''}"
    if args.device == "cpu":
        print(f"compiled {out['signatures']} kernel signature{'s' if out['signatures'] != 1 else ''} for {configs} "
              f"in {out['seconds']:.1f} s ({procs}); cache: {cache_location()}")
    else:  # CuPy keeps no count of its compiles; its cache is ~/.cupy/kernel_cache (CUPY_CACHE_DIR)
        print(f"compiled or found cached the CUDA kernels of {configs} in {out['seconds']:.1f} s ({procs}); "
              "cache: CuPy's kernel cache")
    return 0
