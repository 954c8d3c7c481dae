"""The engine over MPIComm on every rank (run by ``checks.py engine``).

Data parallel equals one process with the same global batch (a NaN on one rank
skips the step on all); with every compressor the ranks stay identical; a group
checkpoint resumes bitwise on the same number of ranks. The thread-backed group of
``tests/parallel/test_engine_group.py`` covers the engine's stages in depth; these run them
through real MPI collectives.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
from comm_checks import same_everywhere
from compress_checks import METHODS

import arraytrain as at
from arraytrain import compress as C

SHAPES = {"w1": (12, 9), "b1": (12,), "w2": (4, 12), "b2": (4,)}


def params(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s) for n, s in SHAPES.items()}


def grads(t: int, rank: int, m: int = 0, nan: bool = False) -> dict:
    rng = np.random.default_rng([t, rank, m, 5])
    g = {n: 3 * rng.standard_normal(s) for n, s in SHAPES.items()}
    if nan:
        g["w2"][1, 2] = np.nan
    return g


def check_dense_data_parallel_equals_one_process_with_the_global_batch(comm) -> int:
    steps, micro, nan_at = 5, 2, 2
    last = comm.size - 1
    kw = dict(max_grad_norm=2.0, schedule=at.schedules.CosineAnnealingLR(10))
    eng = at.Engine(params(comm.rank), at.optim.AdamW(lr=1e-2, weight_decay=0.01), comm=comm,
                    accumulation_steps=micro, **kw)  # rank 0's weights are broadcast
    one = at.Engine(params(0), at.optim.AdamW(lr=1e-2, weight_decay=0.01), accumulation_steps=micro * comm.size,
                    **kw)
    for t in range(steps):
        for m in range(micro):
            w = 1.0 + 0.25 * comm.rank + m
            rep = eng.step(grads(t, comm.rank, m, nan=(t == nan_at and comm.rank == last and m == 0)), weight=w)
        for r in range(comm.size):
            for m in range(micro):
                want = one.step(grads(t, r, m, nan=(t == nan_at and r == last and m == 0)), weight=1.0 + 0.25 * r + m)
        assert (rep.applied, rep.skipped) == (want.applied, want.skipped), (t, rep, want)
        assert rep.skipped == (t == nan_at)
        if not rep.skipped:
            np.testing.assert_allclose(rep.grad_norm, want.grad_norm, rtol=1e-12)
    assert same_everywhere(comm, eng.params.flat)
    np.testing.assert_allclose(eng.params.flat, one.params.flat, rtol=1e-10, atol=1e-12)
    for k, buf in eng.state.slots.items():
        assert same_everywhere(comm, buf.flat), k
        np.testing.assert_allclose(buf.flat, one.state.slots[k].flat, rtol=1e-9, atol=1e-12, err_msg=k)
    return 1


def _without(t: int, rank: int) -> dict:
    """Rank ``rank``'s gradients at step ``t``, some parameters without one: the second layer on some
    ranks at some steps (present: another rank had it), ``b1`` on every rank at steps 2-3 (absent)."""
    g = grads(t, rank)
    if (t + rank) % 3 == 0:
        del g["w2"], g["b2"]
    if t in (2, 3):
        del g["b1"]
    return g


def check_a_parameter_without_gradient_on_some_ranks_or_all(comm) -> int:
    """``missing="skip"`` over the group, replicated and sharded: a parameter is stepped when any rank
    had a gradient for it and left alone (its own step count too) when none had; the same as one
    process taking the ranks' micro-batches as one window."""
    steps, cases = 6, 0
    for shard in (False, True):
        eng = at.Engine(params(comm.rank), at.optim.AdamW(lr=1e-2, weight_decay=0.01), comm=comm, missing="skip",
                        max_grad_norm=2.0, shard_state=shard)
        one = at.Engine(params(0), at.optim.AdamW(lr=1e-2, weight_decay=0.01), missing="skip", max_grad_norm=2.0,
                        accumulation_steps=comm.size)
        for t in range(steps):
            rep = eng.step(_without(t, comm.rank))
            for r in range(comm.size):
                want = one.step(_without(t, r))
            np.testing.assert_allclose(rep.grad_norm, want.grad_norm, rtol=1e-12)
        full = eng.gather_params().flat
        assert same_everywhere(comm, full)
        np.testing.assert_allclose(full, one.params.flat, rtol=1e-10, atol=1e-12, err_msg=f"shard={shard}")
        assert eng.state.counts.tolist() == one.state.counts.tolist() == [steps, steps - 2, steps, steps]
        cases += 1
    return cases


def check_every_compressor_keeps_the_ranks_identical(comm) -> int:
    cases = 0
    for name, make in METHODS.items():
        for ef in (False, True) if make().contraction else (False,):
            comp = C.ErrorFeedback(make()) if ef else make()
            eng = at.Engine(params(0), at.optim.AdamW(lr=1e-2), comm=comm, compressor=comp, max_grad_norm=5.0)
            reps = [eng.step(grads(t, comm.rank)) for t in range(3)]
            what = f"{name} ef={ef}"
            assert same_everywhere(comm, eng.params.flat), what
            assert all(r.applied for r in reps), what
            assert len(set(comm.gather_objects(tuple(r.payload_bytes for r in reps)))) == 1, what
            assert len(set(comm.gather_objects(tuple(r.grad_norm for r in reps)))) == 1, what
            cases += 1
    return cases


def check_a_group_checkpoint_resumes_bitwise_on_the_same_number_of_ranks(comm) -> int:
    folder = comm.gather_objects(tempfile.mkdtemp(prefix="arraytrain-mpi-") if comm.rank == 0 else None)[0]
    path = os.path.join(folder, "ckpt.safetensors")

    def engine():
        return at.Engine(params(0), at.optim.AdamW(lr=1e-2), comm=comm, compressor=C.ErrorFeedback(C.TopK(ratio=0.2)),
                         schedule=at.schedules.CosineAnnealingLR(20))

    try:
        full = engine()
        for t in range(5):
            full.step(grads(t, comm.rank))
            if t == 1:
                at.save(path, full)
        resumed = engine()
        at.load(path, resumed)
        for t in range(2, 5):
            resumed.step(grads(t, comm.rank))
        np.testing.assert_array_equal(resumed.params.flat, full.params.flat)
        np.testing.assert_array_equal(resumed.compressor.residual.flat, full.compressor.residual.flat)
        assert not same_everywhere(comm, full.compressor.residual.flat)  # each rank its own residual
    finally:
        comm.gather_objects(None)  # every rank is done with the file
        if comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    return 1


def check_a_mismatched_set_up_raises_the_same_error_on_every_rank(comm) -> int:
    """A layout, dtype or optimizer setting that differs on one rank: the same typed error everywhere, no hang."""
    from arraytrain.errors import HyperparameterError, LayoutError

    last = comm.rank == comm.size - 1
    cases = [
        (lambda: {**params(0), "extra": np.ones(3)} if last else params(0), lambda: at.optim.AdamW(lr=1e-2), LayoutError),
        (lambda: {k: v.astype(np.float32) for k, v in params(0).items()} if last else params(0),
         lambda: at.optim.AdamW(lr=1e-2), LayoutError),
        (lambda: params(0), lambda: at.optim.AdamW(lr=2e-2 if last else 1e-2), HyperparameterError),
        # the policy for a parameter without a gradient: "skip" adds a collective at every boundary
        (lambda: params(0), lambda: at.optim.AdamW(lr=1e-2), HyperparameterError, {"missing": "zero" if last else "skip"}),
    ]
    for make_params, make_opt, error, *kw in cases:
        try:
            at.Engine(make_params(), make_opt(), comm=comm, **(kw[0] if kw else {}))
        except error as exc:
            got = type(exc).__name__
        else:
            got = None
        names = comm.gather_objects(got)
        assert names == [error.__name__] * comm.size, names
    return len(cases)

