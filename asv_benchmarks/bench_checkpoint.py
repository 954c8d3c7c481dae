"""``arraytrain.save`` / ``arraytrain.load``: an AdamW engine's state to and from a safetensors file."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np

import arraytrain as at

from .common import QUICK, make_params

SIZES = [10_000] if QUICK else [100_000, 1_000_000]


class Checkpoint:
    """Save (temp file, fsync, rename) and load (validate, then copy in) of a whole engine state.

    float32 parameters split into 100 tensors; the file holds one tensor per
    parameter for the params, ``exp_avg``, ``exp_avg_sq`` and the gradient
    accumulation buffer (16 B/param) plus the JSON metadata (tens of KB for
    100 names), which ``track_bytes`` includes. The save time includes the
    fsync, so it depends on the file system of the temp dir.
    """

    params = [SIZES]
    param_names = ["size"]
    timeout = 120

    def setup(self, n):
        self.dir = tempfile.mkdtemp(prefix="arraytrain-bench-")
        self.path = os.path.join(self.dir, "state.safetensors")
        p = make_params(n, "float32")
        self.engine = at.Engine(p, at.optim.AdamW(lr=1e-3), max_grad_norm=1.0)
        rng = np.random.default_rng(1)
        self.engine.step({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in p.items()})
        at.save(self.path, self.engine)
        at.load(self.path, self.engine)

    def teardown(self, n):
        shutil.rmtree(self.dir, ignore_errors=True)

    def time_save(self, n):
        at.save(self.path, self.engine)

    def time_load(self, n):
        at.load(self.path, self.engine)

    def track_bytes(self, n):
        return os.path.getsize(self.path)

    track_bytes.unit = "bytes"
