"""Each fused optimizer kernel: one pass over params, grads and every state slot."""

from __future__ import annotations

import numpy as np

import arraytrain as at
from arraytrain.backend import kernels_for

from .common import DTYPES, SIZES, _Bandwidth, make_params

OPTIMIZERS = {
    "SGD": lambda: at.optim.SGD(lr=1e-3),
    "SGD-momentum-nesterov": lambda: at.optim.SGD(lr=1e-3, momentum=0.9, nesterov=True),
    "Adam": lambda: at.optim.Adam(lr=1e-3),
    "Adam-amsgrad": lambda: at.optim.Adam(lr=1e-3, amsgrad=True),
    "AdamW": lambda: at.optim.AdamW(lr=1e-3),
}


class OptimizerStep(_Bandwidth):
    """``optimizer.update`` alone (no norm pass), as GB/s of its minimal traffic."""

    params = [list(OPTIMIZERS), SIZES, DTYPES]
    param_names = ["optimizer", "size", "dtype"]

    def setup(self, name, n, dtype):
        self.p = at.FlatBuffer.from_arrays(make_params(n, dtype))
        self.g = self.p.zeros_like()
        self.g.flat[:] = np.random.default_rng(1).standard_normal(self.g.flat.size)
        self.opt = OPTIMIZERS[name]()
        self.state = self.opt.init(self.p)
        self.k = kernels_for(self.p.flat)
        slots = len(self.state.slots)
        # read p, g and every slot; write p and every slot
        self._bytes = (2 + slots + 1 + slots) * self.p.flat.itemsize * self.p.flat.size
        self._call()

    def _call(self):
        self.opt.update(self.k, self.p, self.g, self.state, gscale=1.0)

    def time_step(self, name, n, dtype):
        self._call()
