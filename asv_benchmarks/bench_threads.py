"""How the fused AdamW step scales with numba's thread count."""

from __future__ import annotations

import numba

import arraytrain as at

from .common import SIZES, make_params


class ThreadScaling:
    params = [[1, 2, 4], SIZES[-2:]]
    param_names = ["threads", "size"]

    def setup(self, threads, n):
        if threads > numba.config.NUMBA_NUM_THREADS:
            raise NotImplementedError(f"numba has {numba.config.NUMBA_NUM_THREADS} threads")  # asv: skip
        self.before = numba.get_num_threads()
        numba.set_num_threads(threads)
        self.engine = at.Engine(make_params(n, "float32"), at.optim.AdamW(lr=1e-3), max_grad_norm=1.0,
                                zero_grad_on_step=False)
        self.engine.step()

    def teardown(self, threads, n):
        numba.set_num_threads(self.before)

    def time_adamw_step(self, threads, n):
        self.engine.step()
