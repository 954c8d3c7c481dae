"""The notice of a step that compiled: on stderr, like JAX's "compiling" log.

numba compiles a kernel signature the first time a process calls it unless its on-disk cache holds
it (2-7 s a signature here, ~10 s with 8-bit state). :meth:`arraytrain.Engine.step` reads the
compile clock of the CPU kernels (:data:`arraytrain.kernels.cpu._jit.COMPILE_CLOCK`) around each
step; every step that compiled for over :data:`SECONDS` prints one line (a signature compiles once
per process, so the lines are as many as the new signatures at most), the first naming the
``arraytrain compile`` command (:mod:`arraytrain.precompile`) that compiles them ahead.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import numpy as np

from . import optim

#: A step that compiled for longer prints the notice.
SECONDS = 1.0

_shown = False
_silenced = 0


def clock(numba_kernels: bool):
    """The compile clock an engine reads around its steps: numba's (for the CPU kernels), else None."""
    if not numba_kernels:
        return None
    from .kernels.cpu._jit import COMPILE_CLOCK

    return COMPILE_CLOCK


@contextmanager
def silenced():
    """No notice inside (``arraytrain compile`` steps engines in order to compile)."""
    global _silenced
    _silenced += 1
    try:
        yield
    finally:
        _silenced -= 1


def command_for(optimizer, dtype, working_dtype) -> str:
    """The ``arraytrain compile`` line that compiles ahead what an engine with these settings runs."""
    name = type(optimizer).__name__.lower()
    parts = ["arraytrain compile"]
    if name in optim.by_name():
        parts.append(f"--optimizers {name}")
    if np.dtype(dtype) != np.float32:
        parts.append(f"--dtype {np.dtype(dtype).name}")
    if getattr(optimizer, "state_dtype", None) not in (None, "float32"):
        parts.append(f"--state-dtype {optimizer.state_dtype}")
    if working_dtype is not None:
        parts.append(f"--working-dtype {working_dtype}")
    return " ".join(parts)


def notice(seconds: float, command, file=None) -> bool:
    """Print that a step spent ``seconds`` compiling when that is over :data:`SECONDS`, the first time
    in a process naming the command ``command()`` returns. Returns whether it printed."""
    global _shown
    if _silenced or seconds <= SECONDS:
        return False
    if _shown:
        line = f"arraytrain: this step compiled kernels for {seconds:.1f} s (a signature the steps before it did not use)"
    else:
        line = (f"arraytrain: this step compiled kernels for {seconds:.1f} s (numba compiles each kernel signature "
                f"once; later processes load it from its cache). To compile them ahead: {command()}")
    _shown = True
    print(line, file=sys.stderr if file is None else file, flush=True)
    return True
