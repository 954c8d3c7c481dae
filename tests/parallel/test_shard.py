"""Sharded optimizer state (``Engine(shard_state=True)``) over in-process rank groups.

The sharded engine must follow the replicated data-parallel engine step for step: every
element-wise optimizer, with clipping, accumulation, weighted micro-batches, a NaN
micro-batch, loss scaling, bfloat16 state, working copies, a pruning mask and a schedule.
The rank groups here are threads whose reduce-scatter puts a rank's sum where MPI's
in-place form does (the first block, not the own one); ``tests/parallel/test_mpi.py``
runs the same under ``mpiexec``.
"""

from __future__ import annotations

import numpy as np
import pytest

import arraytrain as at
from arraytrain import compress as C
from arraytrain import schedules
from arraytrain.errors import HyperparameterError, LayoutError, StateDictError
from arraytrain.layout import REDUCE_CHUNK
from arraytrain.parallel.shard import ShardBuffer, partition
from builders import rank_windows
from conftest import tiered
from thread_group import ThreadGroup

# 7 reduction chunks: with 2 and 3 ranks every rank owns elements, and "mid" straddles a cut
SHAPES = {"emb": (130, 101), "b": (7,), "mid": (41000,), "tiny": (3, 5), "head": (95, 400), "empty": (0,)}

ELEMENTWISE = {
    "sgd": lambda **kw: at.optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, **kw),
    "adam": lambda **kw: at.optim.Adam(lr=1e-2, weight_decay=1e-3, **kw),
    "adamw-amsgrad": lambda **kw: at.optim.AdamW(lr=1e-2, weight_decay=0.01, amsgrad=True, **kw),
    "nadam": lambda **kw: at.optim.NAdam(lr=1e-2, **kw),
    "radam": lambda **kw: at.optim.RAdam(lr=1e-2, **kw),
    "adamax": lambda **kw: at.optim.Adamax(lr=1e-2, **kw),
    "adagrad": lambda **kw: at.optim.Adagrad(lr=0.05, initial_accumulator_value=0.1, **kw),
    "rmsprop": lambda **kw: at.optim.RMSprop(lr=1e-3, momentum=0.5, centered=True, **kw),
    "lion": lambda **kw: at.optim.Lion(lr=1e-3, weight_decay=0.1, **kw),
    "lamb": lambda **kw: at.optim.LAMB(lr=1e-2, weight_decay=0.01, **kw),
    "adadelta": lambda **kw: at.optim.Adadelta(lr=1.0, **kw),
    "schedule-free": lambda **kw: at.optim.ScheduleFreeAdamW(lr=1e-2, warmup_steps=2, **kw),
}


def _params(dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}


def _windows(steps, ranks, micro, seed=1, nan_at=None):
    """grads[step][rank][micro] and weights, with a NaN in 'head' on rank ranks-1 at step ``nan_at``."""
    return rank_windows(SHAPES, steps, ranks, micro, seed=seed, nan_at=nan_at, nan_in='head')


def _train(ranks, shard, make_opt, *, steps=4, micro=2, dtype=np.float64, nan_at=None, mask=False, **kw):
    """Every rank's final weights, reports and engine (replicated or sharded), with the same data."""
    grads, weights = _windows(steps, ranks, micro, nan_at=nan_at)

    def rank_run(rank, comm):
        eng = at.Engine(_params(dtype), make_opt(), comm=comm, shard_state=shard, accumulation_steps=micro,
                        **kw)
        if mask:
            eng.set_mask({"head": (np.arange(95 * 400).reshape(95, 400) % 3 != 0)})
        reports = []
        for t in range(steps):
            for m in range(micro):
                reports.append(eng.step(grads[t][rank][m], weight=weights[t, rank, m]))
        weights_now = eng.working if eng.working is not None else eng.params
        return {n: np.array(v, dtype=np.float64) for n, v in weights_now.items()}, reports, eng

    return ThreadGroup(ranks).run(rank_run)


def _close(a, b, rtol):
    for n in a:
        np.testing.assert_allclose(a[n], b[n], rtol=rtol, atol=rtol * 1e-3, err_msg=n)


# the default tier: Adam on two ranks (test_sharded_low_precision_follows_replicated and the 8-bit
# checks add others); the slow tier: every optimizer on 2 and 3 ranks
SHARD_DEFAULT = ("adam",)


@pytest.mark.parametrize("ranks", tiered([2, 3], default=(2,)))
@pytest.mark.parametrize("name", tiered(sorted(ELEMENTWISE), default=SHARD_DEFAULT))
def test_sharded_follows_replicated_float64(name, ranks):
    kw = dict(max_grad_norm=5.0, nan_at=2, schedule=schedules.CosineAnnealingLR(T_max=6))
    rep = _train(ranks, False, ELEMENTWISE[name], **kw)
    sha = _train(ranks, True, ELEMENTWISE[name], **kw)
    for r in range(ranks):
        _close(sha[r][0], rep[r][0], 1e-12)
        for a, b in zip(sha[r][1], rep[r][1]):
            assert (a.applied, a.skipped, a.step) == (b.applied, b.skipped, b.step)
            if a.grad_norm is not None and b.applied:
                assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-12)
                assert a.grad_norms.keys() == b.grad_norms.keys()
    assert any(rep_.skipped for rep_ in sha[0][1]), "the NaN micro-batch skipped a step"
    # every rank holds the same weights
    for r in range(1, ranks):
        _close(sha[r][0], sha[0][0], 0.0)


@pytest.mark.parametrize("name", tiered(["adamw-amsgrad", "sgd", "lion", "lamb", "rmsprop", "adadelta", "nadam",
                                         "schedule-free"], default=("adamw-amsgrad",)))
@pytest.mark.parametrize("low", tiered(["state", "working-bf16", "working-f16"], default=("state",)))
def test_sharded_low_precision_follows_replicated(name, low):
    kw = dict(dtype=np.float32, max_grad_norm=5.0, mask=True, loss_scaler=at.LossScaler(init_scale=2.0**10))
    make = ELEMENTWISE[name]
    if low == "state":
        make = (lambda f: lambda: f(state_dtype="bfloat16"))(ELEMENTWISE[name])
    else:
        kw["working_dtype"] = "bfloat16" if low == "working-bf16" else "float16"
    rep = _train(2, False, make, **kw)
    sha = _train(2, True, make, **kw)
    for r in range(2):
        _close(sha[r][0], rep[r][0], 1e-5)
    pruned = sha[0][0]["head"].reshape(-1)[::3]
    assert not pruned.any(), "pruned weights stay exactly zero"


def test_sharded_state_is_a_partition_and_memory_says_so():
    def rank_run(rank, comm):
        rep = at.Engine(_params(np.float32), at.optim.AdamW(), comm=comm)
        sha = at.Engine(_params(np.float32), at.optim.AdamW(), comm=comm, shard_state=True)
        low = at.Engine(_params(np.float32), at.optim.AdamW(), comm=comm, shard_state=True,
                        working_dtype="bfloat16")
        return rep.memory(), sha.memory(), low.memory(), sha, low, low.gather_params()

    for ranks in (2, 3):
        out = ThreadGroup(ranks).run(rank_run)
        for rank, (rep, sha, low, eng, leng, full) in enumerate(out):
            part = partition(eng.layout, ranks, rank)
            assert isinstance(eng.state.slots["exp_avg"], ShardBuffer)
            assert eng.state.slots["exp_avg"].flat.size == part.length
            # at most 1/K of the replicated state plus one reduction chunk per slot
            assert sha["state"] <= rep["state"] / ranks + 2 * REDUCE_CHUNK * 4
            assert sha["params"] >= rep["params"] and sha["master"] == 0
            # under a working copy the float32 masters are sharded too
            assert low["params"] == 0 and low["master"] == part.length * 4
            assert low["working"] >= eng.layout.size * 2
            assert isinstance(leng.params, ShardBuffer)
            for n, v in _params(np.float32).items():
                np.testing.assert_array_equal(full[n], v)


def test_a_state_dict_keeps_the_replicated_form_and_loads_anywhere():
    """Saved by 2 sharded ranks: the replicated engine's name-keyed form; loaded by 3 sharded ranks,
    by one process and by a replicated group, every one continues as the replicated run does."""
    make = ELEMENTWISE["adamw-amsgrad"]
    grads, weights = _windows(6, 1, 1)

    def feed(eng, t0, t1):
        for t in range(t0, t1):
            eng.step(grads[t][0][0])  # every rank the same gradient: the mean is K-independent

    def save_two(rank, comm):
        eng = at.Engine(_params(), make(), comm=comm, shard_state=True, max_grad_norm=5.0)
        feed(eng, 0, 3)
        return eng.state_dict()

    saved = ThreadGroup(2).run(save_two)
    ref = at.Engine(_params(), make(), max_grad_norm=5.0)
    feed(ref, 0, 3)
    want = ref.state_dict()
    for k, v in want["optimizer"]["slots"].items():
        for n in v:
            np.testing.assert_allclose(saved[0]["optimizer"]["slots"][k][n], v[n], rtol=1e-12,
                                       atol=1e-12 * np.abs(v[n]).max(initial=0.0))
            np.testing.assert_array_equal(saved[1]["optimizer"]["slots"][k][n], saved[0]["optimizer"]["slots"][k][n])
    feed(ref, 3, 6)

    def resume(rank, comm, shard):
        eng = at.Engine(_params(seed=9), make(), comm=comm, shard_state=shard, max_grad_norm=5.0)
        eng.load_state_dict(saved[0])
        feed(eng, 3, 6)
        return {n: v.copy() for n, v in eng.params.items()}

    one = at.Engine(_params(seed=9), make(), max_grad_norm=5.0)
    one.load_state_dict(saved[0])
    feed(one, 3, 6)
    for got in (*ThreadGroup(3).run(resume, True), *ThreadGroup(2).run(resume, False), dict(one.params)):
        _close(got, dict(ref.params), 1e-13)


def test_a_sharded_checkpoint_resumes_on_another_number_of_ranks(tmp_path):
    path = tmp_path / "shard.safetensors"
    make = ELEMENTWISE["lamb"]
    grads, _ = _windows(6, 1, 1)

    def engine(comm=None):
        return at.Engine(_params(np.float32), make(state_dtype="bfloat16"), comm=comm, shard_state=comm is not None,
                         working_dtype="bfloat16")

    def run(rank, comm, load):
        eng = engine(comm)
        if load:
            at.load(path, eng)
        for t in range(3, 6) if load else range(3):
            eng.step(grads[t][0][0])
        if not load:
            at.save(path, eng)
        return dict(eng.gather_params())  # the float32 masters (bfloat16 copies may round one ulp apart)

    ThreadGroup(2).run(run, False)
    one = engine()
    at.load(path, one)
    for t in range(3, 6):
        one.step(grads[t][0][0])
    ref = engine()
    for t in range(6):
        ref.step(grads[t][0][0])
    # bfloat16 moments: partial sums added in another order may round a moment one ulp (2**-8) apart
    for got in (*ThreadGroup(3).run(run, True), dict(one.params)):
        _close(got, dict(ref.params), 1e-3)


def test_bad_set_ups_raise_the_same_error_on_every_rank_before_allocating():
    with pytest.raises(HyperparameterError, match="shard_state: sharded state needs a group"):
        at.Engine(_params(), at.optim.AdamW(), shard_state=True)
    with pytest.raises(HyperparameterError, match="shard_state: expected a bool"):
        at.Engine(_params(), at.optim.AdamW(), shard_state="yes")
    refused = {
        "muon": (lambda: at.optim.Muon(lr=0.02), "Newton-Schulz"),
        "adafactor": (lambda: at.optim.Adafactor(lr=1e-2), "factored"),
        "sophia": (lambda: at.optim.Sophia(lr=1e-3), "Hessian"),
        "sam": (lambda: at.optim.SAM(at.optim.SGD(lr=0.1), rho=0.05), "ascent"),
    }

    def make(rank, comm, opt, compressor=None):
        try:
            at.Engine(_params(), opt(), comm=comm, shard_state=True, compressor=compressor)
        except (HyperparameterError, LayoutError) as exc:
            return type(exc), str(exc)
        return None

    for name, (opt, words) in refused.items():
        errs = ThreadGroup(2).run(make, opt)
        assert errs[0] == errs[1] and errs[0][0] is HyperparameterError and words in errs[0][1], name
        assert "shard_state=False" in errs[0][1]
    errs = ThreadGroup(2).run(make, lambda: at.optim.AdamW(), C.TopK(0.1))
    assert errs[0] == errs[1] and "compress" in errs[0][1]

    def odd_layout(rank, comm):
        params = _params()
        if rank == 1:
            params["extra"] = np.zeros(3)
        try:
            at.Engine(params, at.optim.AdamW(), comm=comm, shard_state=True)
        except LayoutError as exc:
            return str(exc)
        return None

    errs = ThreadGroup(2).run(odd_layout)
    assert errs[0] == errs[1] and "layout" in errs[0]

    def odd_setting(rank, comm):
        try:
            at.Engine(_params(), at.optim.AdamW(), comm=comm, shard_state=rank == 0)
        except HyperparameterError as exc:
            return str(exc)
        return None

    errs = ThreadGroup(2).run(odd_setting)
    assert errs[0] == errs[1] and "shard_state" in errs[0]


def test_a_refused_state_changes_nothing_on_any_rank():
    def rank_run(rank, comm):
        eng = at.Engine(_params(), at.optim.AdamW(), comm=comm, shard_state=True)
        eng.step(_windows(1, 1, 1)[0][0][0][0])
        state = eng.state_dict()
        before = {k: b.flat.copy() for k, b in eng.state.slots.items()}
        bad = dict(state, optimizer=dict(state["optimizer"], slots={
            k: {n: (a[:-1] if n == "mid" and rank == 1 else a) for n, a in v.items()}
            for k, v in state["optimizer"]["slots"].items()}))
        with pytest.raises(StateDictError):
            eng.load_state_dict(bad)
        return all(np.array_equal(before[k], b.flat) for k, b in eng.state.slots.items())

    assert ThreadGroup(2).run(rank_run) == [True, True]


def test_partitions_are_equal_chunk_multiples_covering_the_layout():
    lay = at.Layout(SHAPES)
    for ranks in (1, 2, 3, 4, 8):
        parts = [partition(lay, ranks, r) for r in range(ranks)]
        assert {p.length for p in parts} == {parts[0].length} and parts[0].length % REDUCE_CHUNK == 0
        chunks = -(-lay.size // REDUCE_CHUNK)  # the shortest equal chunk-multiple partitions that cover it
        assert parts[0].length == -(-chunks // ranks) * REDUCE_CHUNK and parts[-1].hi >= lay.size
        pieces = np.concatenate([p.pieces + [p.lo, p.lo, 0] for p in parts])
        np.testing.assert_array_equal(pieces, lay.pieces)
        covered = {}
        for p in parts:
            for name, a, b, _ in p.spans():
                covered.setdefault(name, []).append((a, b))
        for name, size in zip(lay.names, lay.sizes):
            spans = covered.get(name, [])
            assert sum(b - a for a, b in spans) == size, name


@pytest.mark.slow  # the slow tier: three set-ups (bfloat16 model, 8-bit state), each its kernel signatures
def test_the_torch_binding_passes_shard_state_through():
    torch = pytest.importorskip("torch")
    from arraytrain.interop import torch as att

    torch.manual_seed(0)  # the global generator: once, not in the rank threads
    init = torch.nn.Sequential(torch.nn.Linear(300, 120), torch.nn.Tanh(), torch.nn.Linear(120, 10)).state_dict()

    def rank_run(rank, comm, shard, lowp, state_dtype=None):
        model = torch.nn.Sequential(torch.nn.Linear(300, 120), torch.nn.Tanh(), torch.nn.Linear(120, 10))
        model.load_state_dict(init)
        if lowp:
            model = model.to(torch.bfloat16)
        eng = att.bind(model, at.optim.AdamW(lr=1e-2, state_dtype=state_dtype), comm=comm, shard_state=shard,
                       max_grad_norm=1.0)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x = torch.randn(16, 300, generator=gen).to(model[0].weight.dtype)
            model(x).float().square().mean().backward()
            eng.step()
        return [p.detach().float().numpy().copy() for p in model.parameters()], eng.memory()

    for lowp, state_dtype in ((False, None), (True, None), (False, "8bit")):
        rep = ThreadGroup(2).run(rank_run, False, lowp, state_dtype)
        sha = ThreadGroup(2).run(rank_run, True, lowp, state_dtype)
        for r in range(2):
            for a, b in zip(sha[r][0], rep[r][0]):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        assert sha[0][1]["state"] < rep[0][1]["state"]
        assert (sha[0][1]["master"] > 0) == lowp


@pytest.mark.slow  # the slow tier: Lion with 8-bit state, a kernel signature of its own (~8 s to compile here)
def test_the_jax_binding_passes_shard_state_through():
    jax = pytest.importorskip("jax")
    from arraytrain.interop import jax as atj

    tree = {"w": np.random.default_rng(0).standard_normal((300, 120)).astype(np.float32),
            "b": np.zeros(120, np.float32)}

    def rank_run(rank, comm, shard, state_dtype=None):
        start = jax.tree_util.tree_map(jax.numpy.asarray, tree)
        eng = atj.bind(start, at.optim.Lion(lr=1e-3, state_dtype=state_dtype), comm=comm, shard_state=shard)
        for t in range(3):
            g = {k: np.random.default_rng([t, rank]).standard_normal(v.shape).astype(np.float32)
                 for k, v in tree.items()}
            eng.step(g)
        return {k: np.asarray(v).copy() for k, v in eng.tree().items()}

    for state_dtype in (None, "8bit"):
        rep = ThreadGroup(2).run(rank_run, False, state_dtype)
        sha = ThreadGroup(2).run(rank_run, True, state_dtype)
        for r in range(2):
            _close(sha[r], rep[r], 1e-6)

    def lowp(rank, comm):
        with pytest.raises(HyperparameterError, match="shard_state with working_dtype"):
            atj.bind(tree, at.optim.Lion(lr=1e-3), comm=comm, shard_state=True, working_dtype="bfloat16")

    ThreadGroup(2).run(lowp)


@pytest.mark.parametrize("state_dtype", ["bfloat16", "8bit"])
def test_sharded_state_on_cupy_buffers_follows_the_replicated_engine(state_dtype):
    """The CUDA family with sharded state (thread ranks sharing one GPU; NCCL itself needs a GPU per rank);
    8-bit state: its windows gathered into a state dict that loads back into a sharded engine."""
    from cuda_family import device_cupy, require_cuda

    require_cuda()
    cupy = device_cupy()

    def rank_run(rank, comm, shard):
        start = at.FlatBuffer.from_arrays(_params(np.float32), align=256)
        eng = at.Engine(start, at.optim.LAMB(lr=1e-2, state_dtype=state_dtype), comm=comm,
                        shard_state=shard, device="cuda", max_grad_norm=1.0, working_dtype="bfloat16")
        for t in range(3):
            eng.step({n: cupy.asarray(g) for n, g in _windows(1, 1, 1, seed=t)[0][0][0][0].items()})
        state = eng.state_dict()
        eng.load_state_dict(state)
        again = eng.state_dict()["optimizer"]["slots"]
        for k, v in state["optimizer"]["slots"].items():
            _same_state({n: _host_entry(e) for n, e in again[k].items()}, {n: _host_entry(e) for n, e in v.items()})
        return {n: cupy.asnumpy(eng.gather_params()[n]) for n in SHAPES}

    rep = ThreadGroup(2).run(rank_run, False)
    sha = ThreadGroup(2).run(rank_run, True)
    for r in range(2):
        _close(sha[r], rep[r], 1e-3)


def _host_entry(e):
    """A state-dict entry's arrays on the host (an 8-bit entry's codes and absmax, or the array)."""
    from cuda_family import device_cupy

    cupy = device_cupy()

    if isinstance(e, dict):
        return {k: cupy.asnumpy(v) if hasattr(v, "get") else v for k, v in e.items()}
    return cupy.asnumpy(e)


def test_schedule_free_evaluation_weights_are_gathered():
    grads, _ = _windows(3, 2, 1)

    def rank_run(rank, comm, shard):
        eng = at.Engine(_params(), at.optim.ScheduleFreeAdamW(lr=1e-2), comm=comm, shard_state=shard)
        for t in range(3):
            eng.step(grads[t][rank][0])
        y = eng.params.flat.copy()
        with eng.evaluation() as x:
            evaluated = {n: v.copy() for n, v in x.items()}
        assert np.array_equal(eng.params.flat, y), "y is back bit for bit"
        return evaluated

    rep = ThreadGroup(2).run(rank_run, False)
    sha = ThreadGroup(2).run(rank_run, True)
    for r in range(2):
        _close(sha[r], rep[r], 1e-12)
        assert not all(np.array_equal(sha[r][n], _params()[n]) for n in SHAPES)


def test_a_state_assembled_on_one_rank_only():
    """state_dict(root=r): the full state on rank r (what a save writes), None on the others."""

    def rank_run(rank, comm):
        eng = at.Engine(_params(), at.optim.AdamW(), comm=comm, shard_state=True, accumulation_steps=2)
        for t in range(3):
            eng.step(_windows(1, 1, 1, seed=t)[0][0][0][0])  # ends mid-window: per-rank gradients too
        with pytest.raises(at.errors.ArgumentTypeError, match="root"):
            eng.state_dict(root=2)
        return eng.state_dict(), eng.state_dict(root=1)

    out = ThreadGroup(2).run(rank_run)
    assert out[0][1] is None
    full, rooted = out[1]
    for key in ("exp_avg", "exp_avg_sq"):
        for n in SHAPES:
            np.testing.assert_array_equal(rooted["optimizer"]["slots"][key][n], full["optimizer"]["slots"][key][n])
    assert len(rooted["accumulation"]["ranks"]) == 2
    for r in range(2):
        for n in SHAPES:
            np.testing.assert_array_equal(rooted["accumulation"]["ranks"][r]["grads"][n],
                                          full["accumulation"]["ranks"][r]["grads"][n])


def _record_whole_reads(monkeypatch) -> list:
    """The keys of every tensor safetensors reads whole from now on (``get_tensor``), recorded in
    the returned list; slices (``get_slice``) pass through unrecorded."""
    import safetensors

    whole = []
    real_open = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kw):
            self._f = real_open(*args, **kw)

        def __enter__(self):
            self._inner = self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def get_tensor(self, key):
            whole.append(key)
            return self._inner.get_tensor(key)

        def __getattr__(self, name):
            return getattr(self._inner, name)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    return whole


def test_a_sharded_load_reads_only_the_owned_range_of_each_slot(tmp_path, monkeypatch):
    import safetensors

    from arraytrain import checkpoint
    from arraytrain.parallel.shard import Owned

    path = tmp_path / "c.safetensors"
    one = at.Engine(_params(), at.optim.AdamW())
    one.step(_windows(1, 1, 1)[0][0][0][0])
    at.save(path, one)
    # the reader's range read against slicing the whole tensor, over shapes and ranges
    with safetensors.safe_open(str(path), framework="numpy") as f:
        keys = [k for k in f.keys() if "exp_avg_sq" in k]
        for key in keys:
            full = f.get_tensor(key).reshape(-1)
            for a, b in ((0, 0), (0, full.size), (3, 17), (full.size // 3, full.size - 1)):
                a = min(a, full.size)
                b = min(max(a, b), full.size)
                shape = tuple(f.get_slice(key).get_shape())
                got = checkpoint._read_owned(str(path), f, key, Owned(shape, full.dtype, a, b, False))
                np.testing.assert_array_equal(got.data, full[a:b])
    whole = _record_whole_reads(monkeypatch)

    def rank_run(rank, comm):
        eng = at.Engine(_params(seed=5), at.optim.AdamW(), comm=comm, shard_state=True)
        at.load(path, eng)
        return {n: v.copy() for n, v in eng.gather_params().items()}, eng.state_dict()

    out = ThreadGroup(2).run(rank_run)
    assert whole and not [k for k in whole if "slots" in k], "the slots were read whole"
    for k, v in one.state_dict()["optimizer"]["slots"].items():
        for n in SHAPES:
            np.testing.assert_array_equal(out[0][1]["optimizer"]["slots"][k][n], v[n])


# -- 8-bit state: partitions cut between 256-element blocks ---------------------------------------

EIGHT_BIT = sorted(ELEMENTWISE)


def _aligned_params(seed=0):
    """The parameters in the layout a sharded 8-bit engine uses (every offset on a block)."""
    return at.FlatBuffer.from_arrays(_params(np.float32, seed), align=256)


def _train8(ranks, shard, make, *, steps=4, seed=0, mask=False, loss_scale=None, **kw):
    grads, weights = _windows(steps, ranks, 2, nan_at=2)

    def rank_run(rank, comm):
        scaler = None if loss_scale is None else at.LossScaler(init_scale=loss_scale)  # one per engine
        eng = at.Engine(_aligned_params(seed), make(), comm=comm, shard_state=shard, accumulation_steps=2,
                        max_grad_norm=5.0, loss_scaler=scaler, **kw)
        if mask:
            eng.set_mask({"head": (np.arange(95 * 400).reshape(95, 400) % 3 != 0)})
        for t in range(steps):
            for m in range(2):
                eng.step(grads[t][rank][m], weight=weights[t, rank, m])
        weights_now = eng.working if eng.working is not None else eng.params
        return {n: np.array(v) for n, v in weights_now.items()}, eng.state_dict(), eng

    return ThreadGroup(ranks).run(rank_run)


def _same_state(got, want):
    """Two slots' name-keyed state, bitwise: 8-bit entries' codes and absmax, float32 arrays."""
    assert got.keys() == want.keys()
    for n, w in want.items():
        g = got[n]
        if isinstance(w, dict):
            assert g["map"] == w["map"], n
            np.testing.assert_array_equal(g["codes"], w["codes"], err_msg=n)
            key = at.lowbit.scale_key(w["map"])
            np.testing.assert_array_equal(g[key], w[key], err_msg=n)
        else:
            np.testing.assert_array_equal(g, w, err_msg=n)


# the slow tier: every optimizer in 8 bits on 2 ranks (the windows' code is the optimizers' own), and
# on 3 ranks Adam and LAMB (whose trust ratios sum over every rank's partition)
QUANTIZED_CASES = ([(n, "8bit", 2) for n in EIGHT_BIT] + [(n, "8bit", 3) for n in ("adam", "lamb")]
                   + [("adam", "float8", 2), ("lamb", "float8", 2)])


@pytest.mark.parametrize("name,sd,ranks", [c if c == ("adam", "8bit", 2)
                                           else pytest.param(*c, marks=pytest.mark.slow) for c in QUANTIZED_CASES])
def test_sharded_8bit_state_follows_replicated_bitwise(name, sd, ranks):
    """The partitions of a block-aligned layout cut no block: each rank encodes its blocks exactly as
    the replicated engine does, so weights and every code and scale agree bit for bit (with a NaN
    micro-batch, weighted accumulation and clipping), in 8 bits and in float8."""
    make = (lambda f: lambda: f(state_dtype=sd))(ELEMENTWISE[name])
    rep = _train8(ranks, False, make)
    sha = _train8(ranks, True, make)
    q8 = [k for k, b in sha[0][2].state.slots.items() if isinstance(b, at.optim.state8.Quant8Buffer)]
    assert q8 and all(sha[0][2].state.slots[k].window is not None for k in q8)  # schedule-free: z stays float32
    assert any(isinstance(e, dict) for e in sha[0][1]["optimizer"]["slots"][q8[0]].values())
    for r in range(ranks):
        for n in SHAPES:
            np.testing.assert_array_equal(sha[r][0][n], rep[r][0][n], err_msg=n)
        for k, v in rep[0][1]["optimizer"]["slots"].items():
            _same_state(sha[r][1]["optimizer"]["slots"][k], v)


@pytest.mark.slow  # the slow tier: three set-ups on 3 ranks, each an 8-bit kernel signature of its own
def test_sharded_8bit_state_with_the_reference_kernels_overlap_a_working_copy_and_every_parameter_in_8_bits():
    def make():
        opt = at.optim.AdamW(lr=1e-2, weight_decay=0.01, amsgrad=True, state_dtype="8bit")
        opt.min_8bit_size = 1  # even the 7-element bias: one block, cut by no partition
        return opt

    for kw in ({"kernels": "reference"}, {"overlap": True},
               {"working_dtype": "bfloat16", "mask": True, "loss_scale": 2.0**10}):
        same = {k: v for k, v in kw.items() if k != "overlap"}  # the replicated run of the same set-up
        rep = _train8(3, False, make, steps=3, **same)
        sha = _train8(3, True, make, steps=3, **kw)
        for n in SHAPES:
            np.testing.assert_array_equal(sha[1][0][n], rep[1][0][n], err_msg=f"{kw} {n}")
        assert isinstance(sha[1][1]["optimizer"]["slots"]["exp_avg"]["b"], dict)
        for k, v in rep[1][1]["optimizer"]["slots"].items():
            _same_state(sha[1][1]["optimizer"]["slots"][k], v)


def test_a_sharded_8bit_engine_lays_parameters_on_blocks_and_holds_its_partition():
    params = _params(np.float32)

    def rank_run(rank, comm):
        rep = at.Engine(params, at.optim.AdamW(state_dtype="8bit"), comm=comm)
        sha = at.Engine(params, at.optim.AdamW(state_dtype="8bit"), comm=comm, shard_state=True)
        return rep, sha

    for ranks in (2, 3):
        for rank, (rep, sha) in enumerate(ThreadGroup(ranks).run(rank_run)):
            assert rep.layout.align == 16 and sha.layout.align == 256
            assert sha.layout.names == rep.layout.names and sha.layout.shapes == rep.layout.shapes
            assert all(off % 256 == 0 for off in sha.layout.offsets)
            for n, v in params.items():
                np.testing.assert_array_equal(sha.params[n], v)
            part = partition(sha.layout, ranks, rank)
            slot = sha.state.slots["exp_avg"]
            assert slot.window == (part.lo, part.length) and slot.codes.size == part.length
            with pytest.raises(LayoutError, match="gather_window"):
                slot.as_dict()
            # about 1/K of the replicated 8-bit state: the codes of a partition plus its scales and
            # the small parameters' float32 values it holds
            assert sha.memory()["state"] <= rep.memory()["state"] / ranks + 2 * (REDUCE_CHUNK + 4096)
    # a layout already on blocks is used as it is
    buf = _aligned_params()
    out = ThreadGroup(2).run(lambda rank, comm: at.Engine(buf, at.optim.AdamW(state_dtype="8bit"), comm=comm,
                                                          shard_state=True).layout)
    assert out[0] == buf.layout


def test_a_sharded_8bit_checkpoint_loads_on_any_number_of_ranks_and_converts(tmp_path):
    """Saved by 2 sharded ranks with 8-bit state: the replicated engine's entries, bit for bit; resumed
    by 2 (bitwise) and 3 sharded ranks and by one process (its own layout) as the uninterrupted run goes on; loaded
    into sharded float32 state (decoded) and a float32 file into sharded 8-bit state (encoded)."""
    path = tmp_path / "q8.safetensors"
    make = (lambda: at.optim.AdamW(lr=1e-2, weight_decay=0.01, amsgrad=True, state_dtype="8bit"))
    grads, _ = _windows(6, 1, 1)

    def engine(comm=None, shard=True, opt=make, seed=0):
        return at.Engine(_aligned_params(seed), opt(), comm=comm, shard_state=shard and comm is not None,
                         max_grad_norm=5.0)

    def first(rank, comm):
        eng = engine(comm)
        for t in range(3):
            eng.step(grads[t][0][0])
        at.save(path, eng)
        return eng.state_dict()

    saved = ThreadGroup(2).run(first)[0]
    ref = engine()
    for t in range(3):
        ref.step(grads[t][0][0])
    for k, v in ref.state_dict()["optimizer"]["slots"].items():
        _same_state(saved["optimizer"]["slots"][k], v)
    for t in range(3, 6):
        ref.step(grads[t][0][0])

    def resume(rank, comm):
        eng = engine(comm, seed=9)
        at.load(path, eng)
        for t in range(3, 6):
            eng.step(grads[t][0][0])
        return {n: v.copy() for n, v in eng.params.items()}, eng.state_dict()

    for params, _ in ThreadGroup(3).run(resume):  # the mean of 3 equal gradients may round an ulp off
        _close(params, dict(ref.params), 1e-5)
    for params, state in ThreadGroup(2).run(resume):
        for n in SHAPES:
            np.testing.assert_array_equal(params[n], ref.params[n], err_msg=n)
        for k, v in ref.state_dict()["optimizer"]["slots"].items():
            _same_state(state["optimizer"]["slots"][k], v)
    one = at.Engine(_params(np.float32, 9), make(), max_grad_norm=5.0)  # the default layout
    at.load(path, one)
    for t in range(3, 6):
        one.step(grads[t][0][0])
    _close(dict(one.params), dict(ref.params), 1e-5)

    def as_float(rank, comm):
        eng = engine(comm, opt=lambda: at.optim.AdamW(lr=1e-2, weight_decay=0.01, amsgrad=True), seed=9)
        at.load(path, eng)
        return eng.state_dict()

    decoded = ThreadGroup(2).run(as_float)[0]["optimizer"]["slots"]
    for k, v in saved["optimizer"]["slots"].items():
        for n, e in v.items():
            want = at.lowbit.dequantize(e["codes"], e["absmax"], e["map"] == "signed").reshape(SHAPES[n]) \
                if isinstance(e, dict) else e
            np.testing.assert_array_equal(decoded[k][n], want, err_msg=f"{k} {n}")
    fpath = tmp_path / "f32.safetensors"
    f32 = engine(opt=lambda: at.optim.AdamW(lr=1e-2, weight_decay=0.01, amsgrad=True))
    f32.step(grads[0][0][0])
    at.save(fpath, f32)

    def as_8bit(rank, comm):
        eng = engine(comm, seed=9)
        at.load(fpath, eng)
        return eng.state_dict()

    encoded = ThreadGroup(2).run(as_8bit)[0]["optimizer"]["slots"]
    for k, v in f32.state_dict()["optimizer"]["slots"].items():
        for n, a in v.items():
            e = encoded[k][n]
            if a.size >= at.optim.state8.DEFAULT_THRESHOLD:
                codes, absmax = at.lowbit.quantize(a, signed=k == "exp_avg")
                np.testing.assert_array_equal(e["codes"].reshape(-1), codes, err_msg=f"{k} {n}")
                np.testing.assert_array_equal(e["absmax"], absmax, err_msg=f"{k} {n}")
            else:
                np.testing.assert_array_equal(e, a, err_msg=f"{k} {n}")


def test_a_sharded_8bit_load_reads_only_the_owned_range_and_refuses_a_bad_state(tmp_path, monkeypatch):
    path = tmp_path / "c.safetensors"
    one = at.Engine(_params(np.float32), at.optim.AdamW(state_dtype="8bit"))
    one.step(_windows(1, 1, 1)[0][0][0][0])
    at.save(path, one)
    whole = _record_whole_reads(monkeypatch)

    def rank_run(rank, comm):
        eng = at.Engine(_params(np.float32, 5), at.optim.AdamW(state_dtype="8bit"), comm=comm, shard_state=True)
        at.load(path, eng)
        state = eng.state_dict()
        before = {k: b.flat.copy() for k, b in eng.state.slots.items()}
        bad = dict(state, optimizer=dict(state["optimizer"], slots=dict(state["optimizer"]["slots"])))
        entry = dict(bad["optimizer"]["slots"]["exp_avg"]["mid"])
        entry["absmax"] = entry["absmax"][:-1] if rank == 1 else entry["absmax"]
        bad["optimizer"]["slots"]["exp_avg"] = dict(bad["optimizer"]["slots"]["exp_avg"], mid=entry)
        with pytest.raises(StateDictError):
            eng.load_state_dict(bad)
        return state, all(np.array_equal(before[k], b.flat) for k, b in eng.state.slots.items())

    out = ThreadGroup(2).run(rank_run)
    assert whole and not [k for k in whole if "slots" in k], "the slots were read whole"
    assert [ok for _, ok in out] == [True, True]
    for k, v in one.state_dict()["optimizer"]["slots"].items():
        _same_state(out[0][0]["optimizer"]["slots"][k], v)


def test_sharded_8bit_state_where_ranks_own_only_padding():
    """One reduction chunk of parameters over 3 ranks: ranks 1 and 2 hold no element, and the state
    dict, a reload and the steps still follow the replicated engine."""
    shapes = {"w": (50, 100), "b": (3,), "none": (0,)}
    start = {n: np.random.default_rng(0).standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    grads = [{n: np.random.default_rng(t).standard_normal(s) for n, s in shapes.items()} for t in range(3)]

    def rank_run(rank, comm, shard):
        eng = at.Engine(at.FlatBuffer.from_arrays(start, align=256), at.optim.Adam(lr=1e-2, state_dtype="8bit"),
                        comm=comm, shard_state=shard)
        for g in grads[:2]:
            eng.step(g)
        eng.load_state_dict(eng.state_dict())
        eng.step(grads[2])
        return {n: np.array(v) for n, v in eng.params.items()}, eng.state_dict(), eng.state.slots["exp_avg"]

    rep = ThreadGroup(3).run(rank_run, False)
    sha = ThreadGroup(3).run(rank_run, True)
    assert [s.window[0] for _, _, s in sha] == [0, REDUCE_CHUNK, 2 * REDUCE_CHUNK]
    assert sha[2][2].aux.size == 0  # nothing of any parameter
    for r in range(3):
        for n in shapes:
            np.testing.assert_array_equal(sha[r][0][n], rep[r][0][n], err_msg=n)
        for k, v in rep[0][1]["optimizer"]["slots"].items():
            _same_state(sha[r][1]["optimizer"]["slots"][k], v)


@pytest.mark.slow  # the slow tier: a masked 8-bit kernel signature (~10 s to compile here)
def test_a_mask_built_on_the_users_layout_prunes_a_sharded_8bit_engine():
    """The sharded 8-bit engine lays the parameters on blocks; a uint8 FlatBuffer mask of the user's
    own layout (the same names and shapes) is read by name, anything else refused."""
    from arraytrain.errors import DTypeError

    user = at.prune.magnitude_mask(at.FlatBuffer.from_arrays(_params(np.float32)), ratio=0.3)
    assert user.layout.align == 16
    grads, _ = _windows(3, 2, 1)

    def rank_run(rank, comm, shard, mask):
        eng = at.Engine(_aligned_params(), at.optim.AdamW(lr=1e-2, state_dtype="8bit"), comm=comm, shard_state=shard)
        eng.set_mask(mask)
        for t in range(3):
            eng.step(grads[t][rank][0])
        return {n: np.array(v) for n, v in eng.params.items()}

    rep = ThreadGroup(2).run(rank_run, False, {n: np.array(v) for n, v in user.items()})
    sha = ThreadGroup(2).run(rank_run, True, user)
    for n in SHAPES:
        np.testing.assert_array_equal(sha[0][n], rep[0][n], err_msg=n)
        assert not sha[0][n][user[n] == 0].any()
    eng = at.Engine(_params(np.float32), at.optim.AdamW(state_dtype="8bit"))
    bad = at.prune.MaskBuffer.ones(user.layout)
    bad.flat[...] = 2
    with pytest.raises(DTypeError, match="0/1"):
        at.Engine(_aligned_params(), at.optim.AdamW(state_dtype="8bit")).set_mask(bad)
    with pytest.raises(LayoutError, match="layout"):
        eng.set_mask(at.prune.MaskBuffer.ones(at.Layout({"w": (3,)})))
    assert eng.mask is None


def test_a_sharded_layout_deals_the_buckets_to_the_ranks_in_turn():
    """``shard.interleaved``: consecutive buckets of the backward pass lie in different halves (2 ranks) or
    thirds (3 ranks) of the buffer, each bucket whole and contiguous, the buckets tiling the buffer; the
    values move with their names; one bucket (or one rank) keeps the layout as it is."""
    from arraytrain.parallel.shard import interleaved
    from arraytrain.parallel.sync import buckets_in

    shapes = {f"p{i}": (1000 + 10 * i,) for i in range(12)}
    flat = at.FlatBuffer.from_arrays({n: np.full(s, float(i)) for i, (n, s) in enumerate(shapes.items())})
    for ranks in (2, 3):
        out, members = interleaved(flat, ranks, 8000 * 3)  # three parameters a bucket
        lay = out.layout
        assert members == [[f"p{i}", f"p{i + 1}", f"p{i + 2}"] for i in (9, 6, 3, 0)]
        for n in shapes:
            np.testing.assert_array_equal(out[n], flat[n])
        bs = buckets_in(lay, members)
        assert sorted((b.lo, b.hi) for b in bs)[0][0] == 0 and max(b.hi for b in bs) == lay.size
        spans = sorted((b.lo, b.hi) for b in bs)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # they tile the buffer
        for b, names in zip(bs, members):
            assert [lay.names[i] for i in b.params] == names
            assert b.lo <= min(lay.offsets[i] for i in b.params) and b.hi >= max(lay.offsets[i] + lay.sizes[i]
                                                                                  for i in b.params)
        owner = [min(ranks - 1, b.lo * ranks // lay.size) for b in bs]  # the partition each bucket starts in
        assert all(a != b for a, b in zip(owner, owner[1:])), owner
    same, members = interleaved(flat, 2, 10**9)
    assert same is flat and len(members) == 1
    assert interleaved(flat, 1, 8000 * 3)[0] is flat
