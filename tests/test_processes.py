"""Whole-process behaviour: cold numba caches under concurrency, thread-count independence."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from arraytrain.kernels import cpu
from arraytrain.layout import Layout

# A short training run whose output is the hex digest of the final parameters.
RUN = textwrap.dedent("""
    import hashlib, numpy as np, arraytrain as at
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((300, 400)).astype(np.float32), "b": np.zeros(7, np.float32)}
    engine = at.Engine(params, at.optim.AdamW(lr=1e-2), accumulation_steps=2, max_grad_norm=1.0)
    for _ in range(6):
        engine.step({k: rng.standard_normal(v.shape) for k, v in params.items()})
    print(hashlib.sha256(engine.params.flat.tobytes()).hexdigest())
""")

# sum of squares of a buffer large enough for the parallel path, printed bit-exactly
SUMSQ = textwrap.dedent("""
    import numpy as np
    from arraytrain.kernels import cpu
    from arraytrain.layout import Layout
    layout = Layout({"a": (3,), "b": (278011,), "c": (5 * 16384 + 3,)})
    x = np.random.default_rng(1).standard_normal(layout.size).astype(np.float32)
    total, per_seg = cpu.sumsq(x, layout.pieces, nseg=len(layout))
    print(float(total).hex(), *[float(s).hex() for s in per_seg])
""")


def _spawn(code, **env):
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, **env))


@pytest.mark.slow  # the slow tier: three processes race on a cold cache
def test_concurrent_cold_cache_starts_agree(tmp_path):
    procs = [_spawn(RUN, NUMBA_CACHE_DIR=str(tmp_path)) for _ in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    digests = {out.strip() for out, _ in outs}
    assert len(digests) == 1
    # and a later warm start (loading the cache the three wrote) gives the same bits
    out, err = _spawn(RUN, NUMBA_CACHE_DIR=str(tmp_path)).communicate(timeout=600)
    assert out.strip() in digests, err


def test_sumsq_bits_equal_across_1_2_4_threads():
    results = set()
    for threads in ("1", "2", "4"):
        proc = _spawn(SUMSQ, NUMBA_NUM_THREADS=threads)
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        results.add(out.strip())
    assert len(results) == 1
    layout = Layout({"a": (3,), "b": (278011,), "c": (5 * 16384 + 3,)})
    x = np.random.default_rng(1).standard_normal(layout.size).astype(np.float32)
    total, _ = cpu.sumsq(x, layout.pieces, nseg=len(layout))
    assert results.pop().split()[0] == float(total).hex()
