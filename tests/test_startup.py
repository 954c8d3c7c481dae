"""Start-up: a warm numba cache's first step loads machine code only, and a later compile still works.

arraytrain's kernels load from numba's on-disk cache without numba's full context refresh
(``arraytrain.kernels.cpu._jit``): that refresh imports every implementation numba has,
scipy.linalg included. Each probe runs in a fresh process on a cache directory of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # the slow tier: fresh processes on cold caches of their own

PROBE = """
import json, sys
import numpy as np
import arraytrain as at

def first_step(dtype, kernels="numba"):
    shapes = {"0.w": (64, 128), "0.b": (128,), "1.w": (128, 10), "1.b": (10,)}
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}
    e = at.Engine(params, at.optim.AdamW(lr=1e-2), zero_grad_on_step=False, kernels=kernels)
    for _ in range(2):
        e.step({k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()})
    return e.params.flat.tolist()

out = {"f32": first_step(np.float32)}
out["registries"] = sorted(m for m in ("scipy.linalg", "numba.np.linalg", "numba.np.polynomial", "ml_dtypes")
                          if m in sys.modules)
if sys.argv[1] == "more":  # a signature the cache does not hold yet: numba compiles it as usual
    out["f64"], out["f64_reference"] = first_step(np.float64), first_step(np.float64, "reference")
print(json.dumps(out))
"""


def _run(cache, what):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    out = subprocess.run([sys.executable, "-c", PROBE, what], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_warm_first_step_loads_only_machine_code(tmp_path):
    cold = _run(tmp_path, "f32")  # compiles, through numba's own path, and fills the cache
    warm = _run(tmp_path, "more")
    assert warm["f32"] == cold["f32"]  # the cached machine code computes what the compiled one did
    # numba's context refresh (and scipy.linalg) did not run for the cache loads, and float32 state
    # did not import ml_dtypes (1.2 s of ml_dtypes 0.7.0's import on a Zen 3)
    assert warm["registries"] == []
    np.testing.assert_allclose(warm["f64"], warm["f64_reference"], rtol=1e-7, atol=1e-7)
