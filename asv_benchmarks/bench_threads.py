"""How the fused AdamW step scales with numba's thread count."""

from __future__ import annotations

import numba

import arraytrain as at

from arraytrain import threads as policy

from .common import SIZES, make_params


class ThreadScaling:
    params = [[1, 2, 4], SIZES[-2:]]
    param_names = ["threads", "size"]

    def setup(self, threads, n):
        policy.start_numba_threads()  # the layer arraytrain would choose, before set_num_threads
        self.before = numba.get_num_threads()
        if threads > numba.config.NUMBA_NUM_THREADS:
            # asv's way to skip a parameter combination this machine cannot run
            raise NotImplementedError(f"numba has {numba.config.NUMBA_NUM_THREADS} threads")
        numba.set_num_threads(threads)
        self.engine = at.Engine(make_params(n, "float32"), at.optim.AdamW(lr=1e-3), max_grad_norm=1.0,
                                zero_grad_on_step=False)
        self.engine.step()

    def teardown(self, threads, n):
        numba.set_num_threads(self.before)

    def time_adamw_step(self, threads, n):
        self.engine.step()
