"""The exchange overlapped with the backward pass (``Engine(overlap=True)``) over in-process rank groups.

Buckets cut from the end of the flat buffer start as ``mark_ready`` completes them, in
order; the result equals the blocking exchange's bit for bit with 2 ranks, replicated and
sharded, whatever order the ranks mark in and whether a parameter is never marked. The
real nonblocking collectives run under mpiexec in ``tests/distributed/test_distributed.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

import arraytrain as at
from arraytrain import nn
from arraytrain.errors import ConcurrentUseError, HyperparameterError, UnknownParameterError
from arraytrain.parallel.communicator import DONE
from arraytrain.parallel.placement import Replicated, Sharded
from arraytrain.parallel.sync import BucketedSync, buckets, default_bucket_bytes
from thread_group import ThreadGroup

SIZES = [20, 64, 48, 32, 10]


def _data(rank, t, m):
    rng = np.random.default_rng([rank, t, m])
    return rng.standard_normal((16, SIZES[0])), rng.integers(0, SIZES[-1], 16)


def _train(ranks, overlap, *, shard=False, micro=2, steps=3, bucket_bytes=4096, nan_at=None, order=None,
           unused_on=None):
    """Every rank's weights after an MLP trained with the zero-copy path (backward marks each layer)."""

    def rank_run(rank, comm):
        model = nn.MLP(SIZES, dtype=np.float64)
        params = model.init(seed=0)
        eng = at.Engine(params, at.optim.AdamW(lr=1e-2, weight_decay=0.01), comm=comm, accumulation_steps=micro,
                        max_grad_norm=1.0, overlap=overlap, shard_state=shard, bucket_bytes=bucket_bytes)
        model.bind(eng)
        for t in range(steps):
            for m in range(micro):
                x, y = _data(rank, t, m)
                if order is not None or unused_on is not None:  # mark by hand instead of in backward
                    model._engine = None
                logits = model.forward(x)
                _, d = nn.softmax_cross_entropy(logits, y)
                if nan_at == (t, m) and rank == ranks - 1:
                    d[0, 0] = np.nan
                model.backward(d, accumulate=m > 0)
                if order is not None or unused_on is not None:
                    model._engine = eng
                    names = list(eng.layout.names)
                    if unused_on == rank:
                        eng.grads["fc1.bias"][...] = 0  # as if it took no part in this rank's forward
                        names.remove("fc1.bias")
                    for name in (names if order is None else order(rank, names)):
                        eng.mark_ready(name)
                eng.step()
        return np.concatenate([eng.params[n].ravel() for n in params])  # the model's order (sharded and
        # overlapped engines lay their buckets out interleaved: shard.interleaved)

    return ThreadGroup(ranks).run(rank_run)


def test_buckets_cover_the_buffer_from_its_end_in_whole_parameters():
    lay = at.Layout({"a": (100,), "b": (7, 9), "c": (3000,), "d": (5,), "e": (0,), "f": (200,)})
    for nbytes in (1, 64, 1000, 4096, 10**9):
        bs = buckets(lay, nbytes, 4)
        assert bs[0].hi == lay.size and bs[-1].lo == 0
        assert all(a.lo == b.hi for a, b in zip(bs, bs[1:]))  # contiguous, from the end
        assert sorted(i for b in bs for i in b.params) == list(range(len(lay)))
        assert all(list(b.params) == sorted(b.params, reverse=True) for b in bs)
        for b in bs[:-1]:
            assert (b.hi - b.lo) * 4 >= nbytes  # full before it closes (the first bucket takes the rest)
    # one bucket per non-empty parameter at the smallest size (the empty "e" joins the bucket before it)
    assert len(buckets(lay, 10**9, 4)) == 1 and len(buckets(lay, 1, 4)) == len(lay) - 1


@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("bucket_bytes", [1, 4096, 2**30])
def test_overlapped_equals_blocking_bitwise(shard, bucket_bytes):
    kw = dict(shard=shard, bucket_bytes=bucket_bytes, nan_at=(1, 1))
    want = _train(2, False, **kw)
    got = _train(2, True, **kw)
    for r in range(2):
        np.testing.assert_array_equal(got[r], want[r])
    np.testing.assert_array_equal(got[0], got[1])


def test_ranks_that_mark_in_different_orders_or_never_mark_a_parameter():
    want = _train(2, False, unused_on=1)
    shuffled = lambda rank, names: names if rank == 0 else names[::-1]  # noqa: E731
    for kw in (dict(order=shuffled), dict(unused_on=1), dict(unused_on=1, shard=True)):
        got = _train(2, True, **kw)
        ref = want if "unused_on" in kw else _train(2, False)
        if kw.get("shard"):
            ref = _train(2, False, unused_on=1, shard=True)
        for r in range(2):
            np.testing.assert_array_equal(got[r], ref[r])


def test_three_ranks_follow_the_blocking_exchange():
    want = _train(3, False, shard=True)
    got = _train(3, True, shard=True)
    for r in range(3):
        np.testing.assert_allclose(got[r], want[r], rtol=1e-13)


class _Recording:
    """A communicator that records which slices each nonblocking call got (a group of 2, rank 0)."""

    rank, size = 0, 2

    def __init__(self):
        self.calls = []

    def iallreduce(self, x, op="sum"):
        self.calls.append(("allreduce", x.size))
        return DONE

    def ireduce(self, x, root=0):
        self.calls.append(("reduce", x.size, root))
        return DONE


def _bucketed(comm, lay, bucket_bytes, shard=False):
    params = at.FlatBuffer(lay, np.zeros(lay.size))
    return BucketedSync(Sharded(comm, params) if shard else Replicated(comm, params), bucket_bytes)


def test_default_buckets_are_an_eighth_of_the_gradient_within_1_and_25_mib():
    mib = 2**20
    assert [default_bucket_bytes(n) for n in (0, 8 * mib - 1, 8 * mib, 80 * mib, 200 * mib, 10**12)] == \
        [mib, mib, mib, 10 * mib, 25 * mib, 25 * mib]
    # the 16.8M-parameter MLP of docs/cluster.md (4 x [2048 x 2048] + bias, float32): one bucket a layer
    # (25 MiB made two buckets of two layers each: the second waited for the first layer's gradient)
    lay = at.Layout({f"{n}{i}": (2048, 2048) if n == "w" else (2048,) for i in range(4) for n in "wb"})
    assert len(buckets(lay, default_bucket_bytes(lay.size * 4), 4)) == 4 and len(buckets(lay, 25 * mib, 4)) == 2
    sync = BucketedSync(Replicated(_Recording(), at.FlatBuffer.zeros(lay, np.float32)), None)
    assert sync.bucket_bytes == default_bucket_bytes(lay.size * 4) and len(sync.buckets) == 4


def test_buckets_start_in_order_and_only_when_complete():
    lay = at.Layout({"a": (10,), "b": (10,), "c": (10,), "d": (10,)})
    comm = _Recording()
    ex = _bucketed(comm, lay, 8 * 16)  # one parameter per bucket
    ex.ready([0])  # "a" is bucket 3: nothing may start before buckets 0..2
    assert comm.calls == [] and not ex.started
    ex.ready([3, 2])  # buckets 0 ("d") and 1 ("c")
    assert len(comm.calls) == 2 and ex.started
    ex.finish()  # "b" (bucket 2) was never marked: started here, then "a"
    assert len(comm.calls) == 4
    ex.reset()
    assert not ex.started


def test_a_gradient_marked_again_while_its_bucket_is_in_flight_is_refused():
    lay = at.Layout({"a": (10,), "b": (10,)})
    ex = _bucketed(_Recording(), lay, 8 * 16)
    ex.ready([0])  # "a" is bucket 1: not started yet, so marking it again is harmless
    ex.ready([0])
    ex.ready([1])  # both buckets start
    with pytest.raises(ConcurrentUseError, match="'b'.*second backward"):
        ex.ready([1])


def test_sharded_buckets_reduce_each_partition_to_its_owner():
    lay = at.Layout({"a": (30000,), "b": (5000,)})
    from arraytrain.parallel.shard import partition

    part = partition(lay, 2, 0)
    comm = _Recording()
    ex = _bucketed(comm, lay, 2**30, shard=True)
    ex.finish()
    # one bucket [0, 35008): its first 16384 elements to rank 0, the rest to rank 1
    assert comm.calls == [("reduce", part.length, 0), ("reduce", lay.size - part.length, 1)]


def test_mark_ready_checks_names_acts_in_the_last_micro_batch_only_and_guards_the_buffer():
    def rank_run(rank, comm):
        eng = at.Engine({"w": np.zeros(8), "b": np.zeros(3)}, at.optim.SGD(lr=0.1), comm=comm, overlap=True,
                        accumulation_steps=2, bucket_bytes=8)
        with pytest.raises(UnknownParameterError):
            eng.mark_ready("nope")
        eng.mark_ready(["w", "b"])  # the first micro-batch: nothing starts
        assert not eng._sync.started
        eng.step({"w": np.ones(8), "b": np.ones(3)})
        eng.mark_ready("b")  # the last micro-batch: its bucket starts
        assert eng._sync.started
        with pytest.raises(ConcurrentUseError, match="being exchanged"):
            eng.step({"w": np.ones(8), "b": np.ones(3)})
        with pytest.raises(ConcurrentUseError, match="being exchanged"):
            eng.state_dict()
        eng.zero_grad()  # completes the window's exchange, then drops it
        assert not eng._sync.started and eng.micro_batches == 0
        eng.step({"w": np.ones(8), "b": np.ones(3)})
        rep = eng.step({"w": np.ones(8), "b": np.ones(3)})
        return rep.applied, eng.params["w"].copy()

    out = ThreadGroup(2).run(rank_run)
    assert out[0][0] and np.array_equal(out[0][1], out[1][1])
    np.testing.assert_allclose(out[0][1], -0.1)


def test_overlap_is_refused_with_a_compressor_or_sam_and_ignored_alone():
    def rank_run(rank, comm, make):
        comp = at.compress.TopK(0.5)
        with pytest.raises(HyperparameterError, match="overlap"):
            at.Engine({"w": np.zeros(8)}, comm=comm, overlap=True, **make(comp))
        assert comp.layout is None  # refused before anything was bound

    ThreadGroup(2).run(rank_run, lambda comp: dict(optimizer=at.optim.SGD(lr=0.1), compressor=comp))
    ThreadGroup(2).run(rank_run, lambda comp: dict(optimizer=at.optim.SAM(at.optim.SGD(lr=0.1), rho=0.05)))
    eng = at.Engine({"w": np.zeros(8)}, at.optim.SGD(lr=0.1), overlap=True)  # one process: nothing to overlap
    eng.mark_ready("w")
    assert eng.step({"w": np.ones(8)}).applied
    with pytest.raises(HyperparameterError, match="bucket_bytes"):
        at.Engine({"w": np.zeros(8)}, at.optim.SGD(lr=0.1), bucket_bytes=0)


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("shard", [False, True])
def test_the_torch_binding_overlaps_by_default_and_equals_blocking(shard, ranks):
    """Accumulation, clipping, loss scaling, a NaN micro-batch, an unused branch: bitwise with 2 ranks."""
    torch = pytest.importorskip("torch")
    from arraytrain.interop import torch as att

    torch.manual_seed(0)  # the global generator: once, not in the rank threads

    class Net(torch.nn.Module):  # "extra" takes part on rank 0 only (a branch some batches skip)
        def __init__(self):
            super().__init__()
            self.a, self.b, self.extra = torch.nn.Linear(30, 60), torch.nn.Linear(60, 10), torch.nn.Linear(60, 10)

        def forward(self, x, use_extra):
            h = torch.tanh(self.a(x))
            return self.b(h) + (self.extra(h) if use_extra else 0)

    init = Net().state_dict()

    def rank_run(rank, comm, overlap, set_to_none):
        model = Net()
        model.load_state_dict(init)
        kw = {} if overlap is None else {"overlap": overlap}
        eng = att.bind(model, at.optim.AdamW(lr=1e-2), comm=comm, shard_state=shard, accumulation_steps=2,
                       bucket_bytes=2048, max_grad_norm=1.0, loss_scaler=at.LossScaler(init_scale=2.0**6), **kw)
        assert eng.overlapped == (overlap is None)
        gen = torch.Generator().manual_seed(rank)
        reports = []
        for t in range(4):
            if set_to_none and t == 1:
                model.zero_grad(set_to_none=True)
            for m in range(2):
                loss = model(torch.randn(8, 30, generator=gen), use_extra=rank == 0).square().mean()
                if t == 2 and m == 1 and rank == ranks - 1:
                    loss = loss * float("nan")  # the window's last micro-batch: its buckets carry the NaN
                (loss * eng.loss_scale).backward()
                reports.append(eng.step())
        assert [r.skipped for r in reports[1::2]] == [False, False, True, False]
        return eng.params.flat.copy()

    for set_to_none in (False, True):
        want = ThreadGroup(ranks).run(rank_run, False, set_to_none)
        got = ThreadGroup(ranks).run(rank_run, None, set_to_none)
        for r in range(ranks):
            if ranks == 2:
                np.testing.assert_array_equal(got[r], want[r])
            else:
                np.testing.assert_allclose(got[r], want[r], rtol=1e-6, atol=1e-7)


def test_a_second_backward_pass_into_gradients_in_flight_is_refused():
    torch = pytest.importorskip("torch")
    from arraytrain.interop import torch as att

    def rank_run(rank, comm):
        model = torch.nn.Linear(4, 3)
        eng = att.bind(model, at.optim.SGD(lr=0.1), comm=comm)
        model(torch.ones(2, 4)).sum().backward()  # every bucket starts from the hooks
        with pytest.raises(ConcurrentUseError, match="second backward"):
            model(torch.ones(2, 4)).sum().backward()
        return True

    assert ThreadGroup(2).run(rank_run) == [True, True]


def _gather_net(torch):
    """Five modules over four pieces of each partition (2 or 3 ranks): the first layer in the first piece."""
    return torch.nn.Sequential(torch.nn.Linear(20, 50), torch.nn.Tanh(), torch.nn.Linear(50, 400), torch.nn.Tanh(),
                               torch.nn.Linear(400, 100), torch.nn.Tanh(), torch.nn.Linear(100, 10)).double()


@pytest.mark.parametrize("ranks", [2, 3])
def test_weights_gathered_in_the_next_forward_pass_equal_the_publish_at_the_step(ranks):
    """``gather_in_forward``: the all-gather after the update is left in flight; each module waits for the pieces
    its parameters lie in (none where this rank owns them), ``state_dict()`` and the engine's calls for all;
    outputs, weights and losses equal the publish at the step bit for bit."""
    torch = pytest.importorskip("torch")
    from arraytrain.interop import torch as att

    torch.manual_seed(0)
    init = _gather_net(torch).state_dict()

    def rank_run(rank, comm, gif):
        model = _gather_net(torch)
        model.load_state_dict(init)
        eng = att.bind(model, at.optim.AdamW(lr=1e-2), comm=comm, shard_state=True, max_grad_norm=1.0,
                       gather_in_forward=gif)
        place = eng._placement
        assert place.defer_publish == gif and place.partition.length // place.chunk_length == 2
        gen = torch.Generator().manual_seed(rank)
        outs, firsts = [], []
        for t in range(4):
            x = torch.randn(8, 20, dtype=torch.float64, generator=gen)
            if gif and t:
                assert place.in_flight == 2  # both pieces of every partition, started by the last update
                model[0](x)  # the first layer lies in rank 0's first piece
                firsts.append(place.in_flight)
            out = model(x)
            assert place.in_flight == 0  # the last layers lie in the last pieces of another rank's partition
            outs.append(out.detach().numpy().copy())
            out.square().mean().backward()
            eng.step()
        assert place.in_flight == (2 if gif else 0)
        eng.state_dict()  # an engine call that reads the weights waits for every piece
        assert place.in_flight == 0
        model(x).square().mean().backward()
        eng.step()
        state = {k: v.numpy().copy() for k, v in model.state_dict().items()}  # so does the module's
        assert place.in_flight == 0
        return outs, state, firsts

    want = ThreadGroup(ranks).run(rank_run, False)
    got = ThreadGroup(ranks).run(rank_run, True)
    for r in range(ranks):
        for a, b in zip(got[r][0], want[r][0]):
            np.testing.assert_array_equal(a, b)
        for k in want[r][1]:
            np.testing.assert_array_equal(got[r][1][k], want[r][1][k])
    assert got[0][2] == [2, 2, 2] and all(got[r][2] == [1, 1, 1] for r in range(1, ranks))


def test_gather_in_forward_needs_sharded_state_and_a_bool():
    torch = pytest.importorskip("torch")
    from arraytrain.interop import torch as att

    def rank_run(rank, comm):
        with pytest.raises(HyperparameterError, match="gather_in_forward.*shard_state"):
            att.bind(torch.nn.Linear(4, 3), at.optim.SGD(lr=0.1), comm=comm, gather_in_forward=True)
        with pytest.raises(HyperparameterError, match="gather_in_forward"):
            att.bind(torch.nn.Linear(4, 3), at.optim.SGD(lr=0.1), comm=comm, shard_state=True, gather_in_forward="yes")
        eng = att.bind(torch.nn.Linear(4, 3), at.optim.SGD(lr=0.1), comm=comm)
        eng.wait_weights()  # nothing in flight: nothing to do
        return True

    assert ThreadGroup(2).run(rank_run) == [True, True]


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
