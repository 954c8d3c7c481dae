"""torch's optimizer test matrix (``optim_db``, torch.testing._internal.common_optimizers), read once.

Importing torch's test utilities costs about 5 s and disables torch.backends' global flags for the
rest of the process (other tests set them), and needs ``expecttest``: the matrix is read in a
subprocess, once per torch version, and kept as JSON in the temporary directory, where every later
process (each pytest-xdist worker collects the tests) finds it. An exclusive file lock makes the
workers that start together read it once.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile

import torch

#: The optimizers read (those arraytrain has, under torch's names).
CLASSES = ("Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta")
_READ = f"""
import json, torch
from torch.testing._internal.common_optimizers import optim_db

def plain(v):  # a tensor as {{"tensor": value}}, also inside a tuple (CUDA's tensor betas)
    if isinstance(v, torch.Tensor):
        return {{"tensor": float(v.reshape(-1)[0])}}
    return [plain(x) for x in v] if isinstance(v, (tuple, list)) else v

rows = []
for info in optim_db:
    if info.optim_cls.__name__ not in {CLASSES!r}:
        continue
    for device in ("cpu", "cuda"):
        for inp in info.optim_inputs_func(device=device):
            kw = {{k: plain(v) for k, v in inp.kwargs.items()}}
            rows.append({{"optimizer": info.optim_cls.__name__, "device": device, "desc": inp.desc, "kwargs": kw}})
print(json.dumps(rows))
"""


def rows() -> list[dict] | str:
    """Every configuration of the matrix for :data:`CLASSES` (``optimizer``, ``device``, ``desc``, ``kwargs`` with a tensor
    written ``{"tensor": value}``), or why it could not be read (the last line of the error)."""
    path = os.path.join(tempfile.gettempdir(), f"arraytrain-tests-optim-db-{torch.__version__}.json")
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
        out = subprocess.run([sys.executable, "-c", _READ], capture_output=True, text=True, timeout=300)
        if out.returncode:
            return (out.stderr.strip().splitlines() or ["no output"])[-1]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        with open(path + ".tmp", "w") as f:
            json.dump(got, f)
        os.replace(path + ".tmp", path)
        return got
