"""The compressors' multi-rank exchange on every rank (run by ``checks.py compress``).

For every method: the exchange decodes, on every rank and with the same bits, to
the sum of what each rank sent (its own payload's decode); where the method is
linear (random-k, VSA, PowerSGD) to what one process's round trip gives for the
summed gradient; int8's scales are the group's maximum. Under error feedback each
rank keeps what *it* failed to send: per rank, sent + residual telescopes to the
inputs, and the ranks' sends add up to the exchanged gradient.
"""

from __future__ import annotations

import numpy as np
from comm_checks import same_everywhere

from arraytrain import Layout
from arraytrain import compress as C
from arraytrain.errors import ArgumentTypeError

LAYOUT = Layout({"w1": (24, 16), "b1": (24,), "w2": (10, 24), "b2": (10,), "s": (3,)})
MIN_SIZE = 20  # b2 and s travel raw (all-reduced or gathered with the payload)
METHODS = {
    "topk": lambda **kw: C.TopK(ratio=0.1, min_size=MIN_SIZE, ramp=0, **kw),
    "randomk": lambda **kw: C.RandomK(ratio=0.1, min_size=MIN_SIZE, seed=3, ramp=0, **kw),
    "randomk_contract": lambda **kw: C.RandomK(k=40, rescale=False, min_size=MIN_SIZE, seed=4, ramp=0, **kw),
    # the ramp: k changes from call to call (1/4 kept for 2 calls, then 0.1): every rank derives the same k
    "topk_ramp": lambda **kw: C.TopK(ratio=0.1, min_size=MIN_SIZE, ramp=2, **kw),
    "randomk_ramp": lambda **kw: C.RandomK(ratio=0.1, min_size=MIN_SIZE, seed=3, ramp=2, **kw),
    "int8": lambda **kw: C.Int8Block(block=64, min_size=MIN_SIZE, **kw),
    "int8_sr": lambda **kw: C.Int8Block(block=64, stochastic_rounding=True, min_size=MIN_SIZE, seed=3, **kw),
    "sign": lambda **kw: C.Sign(block=64, min_size=MIN_SIZE, **kw),
    "ternary": lambda **kw: C.Ternary(block=64, min_size=MIN_SIZE, seed=3, **kw),
    "powersgd": lambda **kw: C.PowerSGD(rank=2, min_size=MIN_SIZE, seed=3, **kw),
    "powersgd_ref": lambda **kw: C.PowerSGD(rank=2, min_size=MIN_SIZE, seed=3, kernels="reference", **kw),
    "vsa": lambda **kw: C.VSA(ratio=0.25, block=64, min_size=MIN_SIZE, seed=3, **kw),
    "vsa_contract": lambda **kw: C.VSA(ratio=0.25, block=64, unbiased=False, min_size=MIN_SIZE, seed=3, **kw),
}
# exchange == one process's round trip of the summed gradient
LINEAR = {"randomk", "randomk_contract", "randomk_ramp", "powersgd", "powersgd_ref", "vsa", "vsa_contract"}
# this rank's payload does not depend on the others': its residual equals a lone twin's
OWN_PAYLOAD = {"topk", "topk_ramp", "randomk", "randomk_ramp", "randomk_contract", "sign", "vsa", "vsa_contract"}  # ternary: own draws per rank
TOL = {np.dtype(np.float64): dict(rtol=1e-11, atol=1e-11), np.dtype(np.float32): dict(rtol=2e-5, atol=2e-5)}


def grad(t: int, rank: int, dtype=np.float64, layout=LAYOUT) -> np.ndarray:
    """Rank ``rank``'s gradient at step ``t``: live elements random, padding zero."""
    rng = np.random.default_rng([t, rank, 11])
    x = np.zeros(layout.size, dtype)
    for name in layout.names:
        s = layout.slice(name)
        x[s] = rng.standard_normal(s.stop - s.start) * (1 + rank)
    return x


def summed(t: int, size: int, dtype) -> np.ndarray:
    acc = grad(t, 0, dtype)
    for r in range(1, size):
        acc += grad(t, r, dtype)
    return acc


def in_rank_order_sum(arrays) -> np.ndarray:
    acc = arrays[0].copy()
    for a in arrays[1:]:
        acc += a
    return acc


def check_every_exchange_is_the_sum_of_what_each_rank_sent(comm) -> int:
    cases = 0
    for dtype in (np.float64, np.float32):
        tol = TOL[np.dtype(dtype)]
        for name, make in METHODS.items():
            for warmup in (0, 1):
                c = make(warmup=warmup).bind(LAYOUT, dtype, comm=comm)
                twin = make(warmup=warmup).bind(LAYOUT, dtype) if name in LINEAR else None
                for t in range(3):
                    g = grad(t, comm.rank, dtype)
                    payload = c.compress(g)
                    mine = c.sent(payload, np.zeros_like(g))
                    x = g.copy()
                    assert c.aggregate(payload, x) is x
                    what = f"{name} {np.dtype(dtype)} warmup={warmup} step {t}"
                    assert same_everywhere(comm, x), f"{what}: ranks differ"
                    np.testing.assert_allclose(x, in_rank_order_sum(comm.allgather(mine)), **tol, err_msg=what)
                    assert len(set(comm.gather_objects(payload.nbytes))) == 1, what
                    big = summed(t, comm.size, dtype)
                    if t < warmup:
                        np.testing.assert_allclose(x, big, **tol, err_msg=what)  # everything raw: exact sums
                    if twin is not None:
                        one = big.copy()
                        twin.roundtrip(one)
                        np.testing.assert_allclose(x, one, **(tol if "powersgd" not in name or dtype == np.float64
                                                             else dict(rtol=1e-3, atol=1e-3)), err_msg=what)
                    cases += 1
    return cases


def check_int8_shares_the_groups_scale_and_sums_its_codes(comm) -> int:
    cases = 0
    for stochastic in (False, True):
        c = C.Int8Block(block=64, stochastic_rounding=stochastic, seed=1).bind(LAYOUT, np.float64, comm=comm)
        alone = C.Int8Block(block=64).bind(LAYOUT, np.float64)
        for t in range(2):
            g = grad(t, comm.rank)
            own_scales = alone.compress(g).arrays["scales"]
            payload = c.compress(g)
            codes, scales = payload.arrays["codes"], payload.arrays["scales"]
            assert codes.dtype == np.int16 and np.abs(codes).max() <= 127
            np.testing.assert_array_equal(scales, np.max(comm.allgather(own_scales), axis=0))
            assert payload.nbytes == 2 * codes.size + scales.nbytes
            x = g.copy()
            c.aggregate(payload, x)
            big = summed(t, comm.size, np.float64)
            s = np.repeat(scales, 64)[: LAYOUT.num_elements]
            live = np.concatenate([np.arange(LAYOUT.slice(n).start, LAYOUT.slice(n).stop) for n in LAYOUT.names])
            err = np.abs(x[live] - big[live])
            bound = comm.size * s * (1.0 if stochastic else 0.5)
            assert np.all(err <= bound * (1 + 1e-12) + 1e-12), float((err - bound).max())
            cases += 1
    return cases


def check_error_feedback_keeps_what_each_rank_failed_to_send(comm) -> int:
    cases = 0
    for name, make in METHODS.items():
        if not make().contraction:  # ErrorFeedback refuses a decode that scales up
            continue
        ef = C.ErrorFeedback(make()).bind(LAYOUT, np.float64, comm=comm)
        twin = C.ErrorFeedback(make()).bind(LAYOUT, np.float64) if name in OWN_PAYLOAD else None
        total_in = np.zeros(LAYOUT.size)
        total_sent = np.zeros(LAYOUT.size)
        for t in range(4):
            g = grad(t, comm.rank)
            before = ef.residual.flat.copy()
            x = g.copy()
            payload = ef.exchange(x)
            sent = before + g - ef.residual.flat  # what this rank sent this step
            np.testing.assert_allclose(x, in_rank_order_sum(comm.allgather(sent)), rtol=1e-10, atol=1e-10,
                                       err_msg=f"{name} step {t}: the ranks' sends do not add up to the exchange")
            total_in += g
            total_sent += sent
            if twin is not None:
                mine = g.copy()
                p = twin.roundtrip(mine)
                assert p.nbytes == payload.nbytes
                np.testing.assert_array_equal(ef.residual.flat, twin.residual.flat, err_msg=f"{name} step {t}")
        np.testing.assert_allclose(total_sent + ef.residual.flat, total_in, rtol=1e-10, atol=1e-10, err_msg=name)
        residuals = comm.allgather(ef.residual.flat)
        assert comm.size == 1 or not all(np.array_equal(r, residuals[0]) for r in residuals), \
            f"{name}: every rank holds the same residual (the aggregate's?)"
        cases += 1
    return cases


def check_a_bad_payload_or_buffer_is_refused_before_any_collective(comm) -> int:
    table = []
    for name in ("randomk", "int8", "powersgd", "topk"):
        c = METHODS[name]().bind(LAYOUT, np.float32, comm=comm)
        g = grad(0, comm.rank, np.float32)
        table += [(lambda c=c, g=g: c.compress(g[::2]), ArgumentTypeError),
                  (lambda c=c, g=g: c.compress(g.astype(np.float64)), TypeError)]
        if name != "topk":  # the summed aggregate checks first; the gathered one is the engine's default
            table += [(lambda c=c, g=g: c.aggregate("payload", g), ArgumentTypeError),
                      (lambda c=c, g=g: c.aggregate(C.Payload("other"), g), ArgumentTypeError)]
    for i, (call, error) in enumerate(table):
        try:
            call()
        except error:
            pass
        else:
            raise AssertionError(f"case {i}: no {error.__name__}")
    x = np.ones(2, np.int32)
    comm.allreduce(x)  # still in step
    assert np.all(x == comm.size)
    return len(table)
