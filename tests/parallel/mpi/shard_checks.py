"""Sharded optimizer state over MPIComm on every rank (run by ``checks.py shard``).

The sharded engine follows the replicated data-parallel engine through MPI's
reduce-scatter and all-gather; a checkpoint written by one number of ranks resumes on
another; bad set-ups raise the same typed error on every rank. The thread-backed
groups of ``tests/parallel/test_shard.py`` cover the same in depth.

``ARRAYTRAIN_SHARD_DIR``: a folder shared by successive launches. Each launch resumes
every checkpoint an earlier launch with another number of ranks left there, checks
that it continues the one-process trajectory, and leaves its own.
"""

from __future__ import annotations

import glob
import os

import numpy as np
from comm_checks import same_everywhere

import arraytrain as at
from arraytrain.errors import HyperparameterError, LayoutError

SHAPES = {"emb": (130, 101), "b": (7,), "mid": (41000,), "tiny": (3, 5), "head": (95, 400)}

# What runs over MPI: one optimizer per kind of sharded step (momentum alone, Adam's moments with
# amsgrad's maximum, LAMB's per-parameter sums across ranks, schedule-free's averaged weights).
# Every element-wise optimizer, in every state dtype, is checked sharded against replicated on
# groups of threads (tests/parallel/test_shard.py); here the transport is what differs, and
# each optimizer's kernels cost a CI compile (11 optimizers in float64, 4 in low precision and 4
# in 8 bits took 3 minutes of one core).
ELEMENTWISE = {
    "sgd": lambda **kw: at.optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, **kw),
    "adamw": lambda **kw: at.optim.AdamW(lr=1e-2, weight_decay=0.01, amsgrad=True, **kw),
    "lamb": lambda **kw: at.optim.LAMB(lr=1e-2, weight_decay=0.01, **kw),
    "schedule-free": lambda **kw: at.optim.ScheduleFreeAdamW(lr=1e-2, **kw),
}
LOW_PRECISION = ("adamw", "lamb")
EIGHT_BIT = ("adamw", "lamb")


def params(dtype=np.float64) -> dict:
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}


def grads(t: int, rank: int, m: int = 0, nan: bool = False) -> dict:
    rng = np.random.default_rng([t, rank, m, 7])
    g = {n: 3 * rng.standard_normal(s) for n, s in SHAPES.items()}
    if nan:
        g["head"][1, 2] = np.nan
    return g


def check_block_collectives(comm) -> int:
    """reduce_scatter: the own block's sum (where MPI puts it in place: the first block); allgather_blocks."""
    cases = 0
    for dtype in (np.float32, np.float64, np.uint8, np.uint16):
        n = 5
        x = (np.arange(comm.size * n) * (comm.rank + 1)).astype(dtype)
        total = sum((np.arange(comm.size * n) * (r + 1)).astype(dtype) for r in range(comm.size)).astype(dtype)
        got = comm.reduce_scatter(x)
        assert got.shape == (n,) and np.shares_memory(got, x)
        np.testing.assert_array_equal(got, total[comm.rank * n : (comm.rank + 1) * n])
        y = np.zeros(comm.size * n, dtype)
        y[comm.rank * n : (comm.rank + 1) * n] = comm.rank + 1
        comm.allgather_blocks(y)
        np.testing.assert_array_equal(y, np.repeat(np.arange(1, comm.size + 1), n).astype(dtype))
        cases += 1
    for root in range(comm.size):  # gather: to one rank only
        got = comm.gather(np.full(3, comm.rank, np.float32), root)
        if comm.rank == root:
            np.testing.assert_array_equal(np.stack(got), np.repeat(np.arange(comm.size), 3).reshape(-1, 3))
        else:
            assert got is None
    try:
        comm.reduce_scatter(np.zeros(comm.size * 3 + 1))
    except at.errors.ArgumentTypeError as exc:
        assert "multiple of the group's size" in str(exc)
    else:
        raise AssertionError("a length that does not divide was taken")
    return cases + 1


def _run(comm, make, shard, dtype=np.float64, steps=4, micro=2, align=16, **kw):
    start = at.FlatBuffer.from_arrays(params(dtype), align=align)
    eng = at.Engine(start, make(), comm=comm, shard_state=shard, accumulation_steps=micro, max_grad_norm=5.0, **kw)
    last = comm.size - 1
    reports = []
    for t in range(steps):
        for m in range(micro):
            nan = t == 2 and m == 0 and comm.rank == last
            reports.append(eng.step(grads(t, comm.rank, m, nan), weight=1.0 + 0.25 * comm.rank + m))
    weights = eng.working if eng.working is not None else eng.params
    return np.array(weights.flat, np.float64), reports, eng


def check_sharded_equals_replicated_for_every_kind_of_elementwise_step(comm) -> int:
    for name, make in ELEMENTWISE.items():
        kw = dict(schedule=at.schedules.CosineAnnealingLR(10), loss_scaler=at.LossScaler(init_scale=2.0**8))
        want, want_reps, _ = _run(comm, make, False, **kw)
        kw = dict(schedule=at.schedules.CosineAnnealingLR(10), loss_scaler=at.LossScaler(init_scale=2.0**8))
        got, reps, eng = _run(comm, make, True, **kw)
        assert same_everywhere(comm, got), name
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15, err_msg=name)
        assert [(r.applied, r.skipped) for r in reps] == [(r.applied, r.skipped) for r in want_reps], name
        assert any(r.skipped for r in reps), name
        norms = [(r.grad_norm, w.grad_norm) for r, w in zip(reps, want_reps) if r.applied]
        np.testing.assert_allclose(*zip(*norms), rtol=1e-12, err_msg=name)
    return len(ELEMENTWISE)


def check_low_precision_sharded_equals_replicated(comm) -> int:
    cases = 0
    for name in LOW_PRECISION:
        bf16 = (lambda f: lambda: f(state_dtype="bfloat16"))(ELEMENTWISE[name])
        for make, kw in ((bf16, {}), (ELEMENTWISE[name], {"working_dtype": "bfloat16"}),
                         (ELEMENTWISE[name], {"working_dtype": "float16"})):
            want = _run(comm, make, False, np.float32, **kw)[0]
            got = _run(comm, make, True, np.float32, **kw)[0]
            assert same_everywhere(comm, got), name
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{name} {kw}")
            cases += 1
    return cases


def check_8bit_sharded_equals_replicated(comm) -> int:
    """8-bit state: the sharded engine lays the parameters on 256-element blocks, its partitions cut
    no block, and it follows the replicated engine of the same layout; the gathered state dict holds
    the replicated form (8-bit entries), the same on every rank."""
    cases = 0
    for name in EIGHT_BIT:
        make = (lambda f: lambda: f(state_dtype="8bit"))(ELEMENTWISE[name])
        want, _, rep = _run(comm, make, False, np.float32, align=256)
        got, _, eng = _run(comm, make, True, np.float32)
        assert eng.layout == rep.layout and same_everywhere(comm, got), name
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
        state = eng.state_dict()["optimizer"]["slots"]
        q8 = [k for k, v in state.items() if isinstance(v["mid"], dict)]
        assert q8, name
        for k in q8:
            codes = state[k]["mid"]["codes"]
            assert same_everywhere(comm, codes), name
            # a code may differ where the sum of 3+ ranks' gradients rounds in another order
            assert np.mean(codes != rep.state_dict()["optimizer"]["slots"][k]["mid"]["codes"]) < 1e-3, name
        cases += 1
    return cases


def check_a_checkpoint_resumes_on_any_number_of_ranks(comm) -> int:
    """The one-process trajectory (the same gradient on every rank: the mean does not depend on K).
    ``comm=None``: one process, a replicated engine."""
    folder = os.environ.get("ARRAYTRAIN_SHARD_DIR")
    if not folder:
        return 0

    def engine(c=None):
        return at.Engine(params(np.float32), at.optim.LAMB(lr=1e-2), comm=c,
                         shard_state=c is not None, working_dtype="bfloat16", max_grad_norm=1.0)

    ref = engine()
    for t in range(6):
        ref.step(grads(t, 0))
    cases = 0
    for path in sorted(glob.glob(os.path.join(folder, "saved-by-*.safetensors"))):
        eng = engine(comm)
        at.load(path, eng)
        for t in range(3, 6):
            eng.step(grads(t, 0))
        # the float32 masters to float tolerance (their bfloat16 working copies may round one ulp apart)
        np.testing.assert_allclose(eng.gather_params().flat, ref.params.flat, rtol=1e-5, atol=1e-6, err_msg=path)
        cases += 1
    eng = engine(comm)
    for t in range(3):
        eng.step(grads(t, 0))
    size = 1 if comm is None else comm.size
    at.save(os.path.join(folder, f"saved-by-{size}.safetensors"), eng)
    return cases + 1


def check_bad_set_ups_raise_the_same_error_on_every_rank(comm) -> int:
    last = comm.rank == comm.size - 1
    cases = [
        (lambda: ({**params(), "extra": np.ones(3)} if last else params()), lambda: at.optim.AdamW(), True,
         LayoutError),
        (params, lambda: at.optim.AdamW(), not last, HyperparameterError),
        (params, lambda: at.optim.Muon(lr=0.02), True, HyperparameterError),
        (params, lambda: at.optim.Adafactor(), True, HyperparameterError),
    ]
    for make_params, make_opt, shard, error in cases:
        try:
            at.Engine(make_params(), make_opt(), comm=comm, shard_state=shard)
        except error as exc:
            got = (type(exc).__name__, str(exc))
        else:
            got = None
        seen = comm.gather_objects(got)
        assert seen[0] is not None and seen == [seen[0]] * comm.size, seen
    return len(cases)
