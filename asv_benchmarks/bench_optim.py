"""Each fused optimizer kernel: the passes over params, grads and every state slot."""

from __future__ import annotations

import numpy as np

import arraytrain as at
from arraytrain.kernels.interface import family

from .common import DTYPES, SIZES, _Bandwidth, make_params, split

OPTIMIZERS = {
    "SGD": lambda: at.optim.SGD(lr=1e-3),
    "SGD-momentum-nesterov": lambda: at.optim.SGD(lr=1e-3, momentum=0.9, nesterov=True),
    "Adam": lambda: at.optim.Adam(lr=1e-3),
    "Adam-amsgrad": lambda: at.optim.Adam(lr=1e-3, amsgrad=True),
    "AdamW": lambda: at.optim.AdamW(lr=1e-3),
    "AdamW-bf16-state": lambda: at.optim.AdamW(lr=1e-3, state_dtype="bfloat16"),
    "AdamW-8bit-state": lambda: at.optim.AdamW(lr=1e-3, state_dtype="8bit"),
    "SGD-momentum-8bit-state": lambda: at.optim.SGD(lr=1e-3, momentum=0.9, state_dtype="8bit"),
    "AdamW-float8-state": lambda: at.optim.AdamW(lr=1e-3, state_dtype="float8"),
    "Adagrad": lambda: at.optim.Adagrad(lr=1e-2),
    "SGD-momentum-bf16-state": lambda: at.optim.SGD(lr=1e-3, momentum=0.9, state_dtype="bfloat16"),
    "RMSprop-momentum-centered-bf16-state": lambda: at.optim.RMSprop(lr=1e-2, momentum=0.9, centered=True,
                                                                     state_dtype="bfloat16"),
    "Lion-bf16-state": lambda: at.optim.Lion(lr=1e-4, state_dtype="bfloat16"),
    "RMSprop-momentum-centered": lambda: at.optim.RMSprop(lr=1e-2, momentum=0.9, centered=True),
    "Lion": lambda: at.optim.Lion(lr=1e-4),
    "LAMB": lambda: at.optim.LAMB(lr=1e-3, weight_decay=1e-2),
    "Adafactor": lambda: at.optim.Adafactor(lr=1e-2),
    "Sophia": lambda: at.optim.Sophia(lr=1e-4),
    "SAM-AdamW": lambda: at.optim.SAM(at.optim.AdamW(lr=1e-3), rho=0.05),
    "NAdam": lambda: at.optim.NAdam(lr=2e-3),
    "NAdam-decoupled-bf16-state": lambda: at.optim.NAdam(lr=2e-3, weight_decay=1e-2, decoupled_weight_decay=True,
                                                         state_dtype="bfloat16"),
    "RAdam": lambda: at.optim.RAdam(lr=1e-3),
    "Adamax": lambda: at.optim.Adamax(lr=2e-3),
    "Adadelta": lambda: at.optim.Adadelta(lr=1.0),
    "Muon": lambda: at.optim.Muon(lr=0.02),
    "Muon-bf16-state": lambda: at.optim.Muon(lr=0.02, state_dtype="bfloat16"),
    "ScheduleFreeAdamW": lambda: at.optim.ScheduleFreeAdamW(lr=2.5e-3),
    "ScheduleFreeAdamW-bf16-state": lambda: at.optim.ScheduleFreeAdamW(lr=2.5e-3, state_dtype="bfloat16"),
}
# 2-D parameters (Adafactor factors them, Muon orthogonalises them)
MATRIX_OPTIMIZERS = ("Adafactor", "Muon", "Muon-bf16-state")

# Element accesses per parameter that one step must make, as (params-dtype arrays, state arrays):
# each read or write of a parameter-sized array counts once; a state array counts at the
# state's own itemsize (bfloat16 moments: 2 bytes). Small per-row/per-column statistics are
# left out. This is the minimum for the algorithm, so GB/s and the fraction of the triad are
# honest efficiency figures (where arraytrain moves more, the comment says so).
TRAFFIC = {
    "SGD": (3, 0),                        # read p, g; write p
    "SGD-momentum-nesterov": (3, 2),      # + read, write the momentum buffer
    "Adam": (3, 4),                       # read p, g, m, v; write p, m, v
    "Adam-amsgrad": (3, 6),               # + read, write max_exp_avg_sq
    "AdamW": (3, 4),
    "AdamW-bf16-state": (3, 4),           # as AdamW, m and v at 2 bytes: 20 B/param in float32
    # as AdamW, m and v as 1-byte codes (the float32 absmax per 256 elements left out): 16 B/param
    "AdamW-8bit-state": (3, 4),
    "SGD-momentum-8bit-state": (3, 2),
    "AdamW-float8-state": (3, 4),         # as 8-bit state: 1-byte codes, a float32 scale per 256 left out
    "Adagrad": (3, 2),                    # read p, g, sum; write p, sum
    "SGD-momentum-bf16-state": (3, 2),    # as SGD with momentum, the buffer at 2 bytes
    "RMSprop-momentum-centered-bf16-state": (3, 6),
    "Lion-bf16-state": (3, 2),
    "RMSprop-momentum-centered": (3, 6),  # square_avg, grad_avg, momentum_buffer: read and write
    "Lion": (3, 2),                       # read p, g, m; write p, m
    # the trust ratio needs the norms of p and of the update before any p moves: two sweeps,
    # 1) read p, g, m, v; write m, v  2) read p, m, v; write p
    "LAMB": (4, 6),
    # factored (2-D) parameters: the update's RMS needs the row/column statistics of all of g
    # first, and the step size needs the RMS of the update: three sweeps,
    # 1) read g (row and column sums)  2) read p, g (RMS of p and of U)  3) read p, g; write p.
    # arraytrain reads g once more (row and column sums in separate passes): 7 accesses.
    "Adafactor": (6, 0),
    "Sophia": (3, 3),                     # read p, g, m, h; write p, m (h changes every k steps)
    # a perturb + update pair: 1) read p, g; write p and the backup (parameters dtype)
    # 2) read the backup, g, m, v; write p, m, v. arraytrain restores p from the backup in a
    # pass of its own (read backup, write p): 13 accesses instead of 11.
    "SAM-AdamW": (7, 4),
    "NAdam": (3, 4),                      # read p, g, m, v; write p, m, v
    "NAdam-decoupled-bf16-state": (3, 4),
    "RAdam": (3, 4),
    "Adamax": (3, 4),                     # read p, g, exp_avg, exp_inf; write p, exp_avg, exp_inf
    "Adadelta": (3, 4),                   # read p, g, square_avg, acc_delta; write p, square_avg, acc_delta
    # the element-wise part: read p, g, the momentum; write p, the momentum. The Newton-Schulz
    # GEMMs (O(rows^2 cols) flops per matrix) dominate, so the time is the figure; arraytrain
    # also writes and reads the update once in a work matrix (2 more accesses)
    "Muon": (3, 2),
    "Muon-bf16-state": (3, 2),
    # read y, g, z, v; write y, z, v (z in the parameters' dtype, v the state's)
    "ScheduleFreeAdamW": (5, 2),
    "ScheduleFreeAdamW-bf16-state": (5, 2),
}


def matrix_shapes(n: int) -> list[tuple[int, int]]:
    """``n`` elements as 2-D tensors (rows <= columns, as square as the count allows)."""
    shapes = []
    for k in split(n):
        r = int(np.sqrt(k))
        while r > 1 and k % r:
            r -= 1
        shapes.append((max(r, 1), k // max(r, 1)))
    return shapes


def make_matrices(n: int, dtype: str, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {f"p{i}": rng.standard_normal(s).astype(dtype) for i, s in enumerate(matrix_shapes(n))}


def step_bytes(name: str, params: at.FlatBuffer, state) -> int:
    """The bytes of :data:`TRAFFIC` for these buffers (the state's itemsize from its slots)."""
    full, slots = TRAFFIC[name]
    n = sum(params.layout.sizes)  # padding is never touched
    # the moments' itemsize (SAM's backup and schedule-free's z are in the parameters' dtype)
    state_items = [s.flat.itemsize for k, s in state.slots.items() if k not in ("sam_backup", "z", "max_lr", "weight_sum")]
    state_item = state_items[0] if state_items else params.flat.itemsize
    return (full * params.flat.itemsize + slots * state_item) * n


class OptimizerStep(_Bandwidth):
    """``optimizer.update`` alone (no norm pass), as GB/s of its minimal traffic (:data:`TRAFFIC`).

    Adafactor and Muon get 2-D parameters (factored second moments, orthogonalised updates);
    Sophia's Hessian estimate
    is fed once in setup; SAM times a perturb + update pair (one optimizer step, two
    gradient windows) with the gradient norm given, as the engine's norm pass gives it.
    bfloat16 state needs float32 parameters: the float64 row is skipped.
    """

    params = [list(OPTIMIZERS), SIZES, DTYPES]
    param_names = ["optimizer", "size", "dtype"]

    def setup(self, name, n, dtype):
        if name.endswith("bf16-state") and dtype != "float32":
            raise NotImplementedError("bfloat16 moments need float32 parameters")
        arrays = make_matrices(n, dtype) if name in MATRIX_OPTIMIZERS else make_params(n, dtype)
        self.p = at.FlatBuffer.from_arrays(arrays)
        self.g = self.p.zeros_like()
        self.g.flat[:] = np.random.default_rng(1).standard_normal(self.g.flat.size)
        self.opt = OPTIMIZERS[name]()
        self.state = self.opt.init(self.p)
        self.k = family("numpy")
        if name == "Sophia":
            h = {k: np.abs(self.g[k]).reshape(-1) for k in self.p.layout.names}
            self.opt.update_hessian(self.k, self.state, h, self.p.layout)
        self._norm = float(np.linalg.norm(self.g.flat.astype(np.float64)))
        self._call = self._pair if name == "SAM-AdamW" else self._update
        self._bytes = step_bytes(name, self.p, self.state)
        self._call()

    def _update(self):
        self.opt.update(self.k, self.p, self.g, self.state, gscale=1.0)

    def _pair(self):
        self.opt.perturb(self.k, self.p, self.g, self.state, gscale=1.0, grad_norm=self._norm)
        self.opt.update(self.k, self.p, self.g, self.state, gscale=1.0)

    def time_step(self, name, n, dtype):
        self._call()
