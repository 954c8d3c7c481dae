"""The Engine over a group of ranks (threads) with its exchanges overlapped: the backward pass's buckets
(``Engine(overlap=True)``, :class:`~arraytrain.parallel.sync.BucketedSync`) and the next forward pass's gathers
(``bind(..., gather_in_forward=True)``, :class:`~arraytrain.parallel.placement.Sharded`'s deferred publish).

The overlapped result equals the blocking exchange's bit for bit with 2 ranks, replicated and sharded,
whatever order the ranks mark in and whether a parameter is never marked. The gradient syncs on their own:
``test_sync.py``; the real nonblocking collectives run under mpiexec in ``test_mpi.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

import arraytrain as at
from arraytrain import nn
from arraytrain.errors import ConcurrentUseError, HyperparameterError, UnknownParameterError
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
