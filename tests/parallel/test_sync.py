"""The gradient syncs (``parallel/sync.py``) on their own, against fake communicators and compressors in one
process: the buckets (cut from the buffer's end, started in order and only when complete), the blocking sync
(:meth:`~arraytrain.parallel.sync.BucketedSync.blocking`), the bucketed one, the compressed ones
(:class:`~arraytrain.parallel.sync.CompressedSync`, :class:`~arraytrain.parallel.sync.AutoSync`) and
:func:`~arraytrain.parallel.sync.gradient_sync`'s choice; then the compressors' group exchange that the
compressed sync runs, over a group of threads. The syncs inside an engine over a group:
``test_engine_group_overlap.py``.
"""

from __future__ import annotations

import contextlib
import types

import numpy as np
import pytest

import arraytrain as at
from arraytrain import compress as C
from arraytrain.engine.stages import Judge
from arraytrain.errors import ArgumentTypeError, ConcurrentUseError, UnknownParameterError
from arraytrain.kernels.interface import family
from arraytrain.parallel.communicator import DONE, LocalComm
from arraytrain.parallel.placement import Replicated, Sharded
from arraytrain.parallel.sync import AutoSync, BucketedSync, CompressedSync, buckets, default_bucket_bytes, gradient_sync
from thread_group import ThreadGroup


class _Recording:
    """A group of ``size`` ranks seen from rank 0, every rank holding what rank 0 holds (so each sum is ``size``
    times the input); it records each call: ``(collective, elements)`` or ``("ireduce", elements, root)``."""

    rank = 0

    def __init__(self, size: int = 2):
        self.size, self.calls = size, []

    @property
    def is_local(self) -> bool:
        return self.size == 1

    def allreduce(self, x, op="sum"):
        self.calls.append(("allreduce", x.size))
        if op == "sum":
            x *= self.size

    def iallreduce(self, x, op="sum"):
        self.calls.append(("iallreduce", x.size))
        x *= self.size
        return DONE

    def ireduce(self, x, root=0):
        self.calls.append(("ireduce", x.size, root))
        return DONE


def _judge() -> Judge:
    """As the engine's with ``reduction="mean"`` and no loss scale: the buffer holds the gradient times the weight sum."""
    return Judge(family("numpy"), lambda wsum: wsum, None, 1e-6)


LAY4 = at.Layout({"a": (10,), "b": (10,), "c": (10,), "d": (10,)})  # offsets 0, 16, 32, 48; 64 elements


def _filled(comm, lay=LAY4) -> Replicated:
    place = Replicated(comm, at.FlatBuffer(lay, np.zeros(lay.size)))
    for i, n in enumerate(lay.names):
        place.grads[n][...] = np.arange(10.0) + 10 * i
    return place


# -- buckets ------------------------------------------------------------------------------------
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
    # one bucket [0, 35008): its first 32768 elements (rank 0's partition) to rank 0, the rest to rank 1
    assert comm.calls == [("ireduce", part.length, 0), ("ireduce", lay.size - part.length, 1)]


# -- the blocking sync: BucketedSync.blocking ---------------------------------------------------
def test_the_blocking_sync_has_no_buckets_and_mark_ready_only_checks_the_names():
    comm = _Recording()
    sync = BucketedSync.blocking(_filled(comm))
    assert sync.buckets == () and not sync.overlaps and not sync.started
    sync.mark_ready(["a", "b", "c", "d"], last=True)
    sync.mark_ready("d", last=False)
    assert comm.calls == [] and not sync.started  # nothing starts before the boundary
    with pytest.raises(UnknownParameterError, match="nope"):
        sync.mark_ready("nope", last=True)
    with pytest.raises(UnknownParameterError, match="nope"):
        sync.mark_ready(["a", "nope"], last=False)
    with pytest.raises(ArgumentTypeError, match="names"):
        sync.mark_ready(3, last=True)
    sync.drain()  # nothing started: nothing to complete
    assert comm.calls == []


def test_the_blocking_sync_reduces_with_the_placements_one_exchange():
    comm = _Recording()
    place = _filled(comm)
    local = place.grads.flat.copy()
    sync = BucketedSync.blocking(place)
    verdict, payload = sync.reduce(1.5, _judge())
    assert payload is None
    # the placement's exchange (one all-reduce of the whole buffer), then the weight sums' small one
    assert comm.calls == [("allreduce", LAY4.size), ("allreduce", 2)]
    np.testing.assert_array_equal(place.grads.flat, 2 * local)
    assert verdict.unscale == 3.0 and not verdict.nonfinite
    np.testing.assert_allclose(verdict.norm, np.linalg.norm(2 * local) / 3.0, rtol=1e-14)
    np.testing.assert_allclose(verdict.segment_norms, [np.linalg.norm(place.grads[n]) / 3.0 for n in LAY4.names],
                               rtol=1e-14)
    again, _ = sync.ascent(1.5, _judge())  # SAM's first window: the same exchange
    assert comm.calls[2:] == [("allreduce", LAY4.size), ("allreduce", 2)]
    np.testing.assert_allclose(again.norm, np.linalg.norm(4 * local) / 3.0, rtol=1e-14)


def test_the_blocking_sync_alone_is_the_identity():
    place = _filled(LocalComm())
    local = place.grads.flat.copy()
    verdict, _ = BucketedSync.blocking(place).reduce(2.0, _judge())
    np.testing.assert_array_equal(place.grads.flat, local)
    np.testing.assert_allclose(verdict.norm, np.linalg.norm(local) / 2.0, rtol=1e-14)


# -- the bucketed sync --------------------------------------------------------------------------
def test_the_bucketed_sync_starts_buckets_in_the_last_micro_batch_and_completes_them_at_the_boundary():
    comm = _Recording()
    place = _filled(comm)
    local = place.grads.flat.copy()
    sync = BucketedSync(place, 8 * 16)  # one parameter a bucket: d, c, b, a
    assert sync.overlaps and [b.params for b in sync.buckets] == [(3,), (2,), (1,), (0,)]
    assert [(b.lo, b.hi) for b in sync.buckets] == [(48, 64), (32, 48), (16, 32), (0, 16)]
    sync.mark_ready(["d", "c"], last=False)  # not the window's last micro-batch: nothing starts
    assert comm.calls == [] and not sync.started
    sync.mark_ready("d", last=True)
    assert comm.calls == [("iallreduce", 16)] and sync.started
    verdict, payload = sync.reduce(1.0, _judge())
    # the buckets nobody marked, in order; then the placement's norm pass (no whole-buffer all-reduce)
    assert comm.calls == [("iallreduce", 16)] * 4 + [("allreduce", 2)]
    assert payload is None and not sync.started  # a new window
    np.testing.assert_array_equal(place.grads.flat, 2 * local)
    np.testing.assert_allclose(verdict.norm, np.linalg.norm(2 * local) / 2.0, rtol=1e-14)
    sync.mark_ready("d", last=True)  # the next window starts its buckets again
    assert comm.calls[-1] == ("iallreduce", 16) and sync.started


def test_drain_completes_the_started_window_then_forgets_it():
    comm = _Recording()
    sync = BucketedSync(_filled(comm), 8 * 16)
    sync.drain()  # nothing started: nothing moves
    assert comm.calls == []
    sync.mark_ready(["d", "c"], last=True)
    sync.drain()
    assert [c[0] for c in comm.calls] == ["iallreduce"] * 4 and not sync.started  # no norm pass
    sync.mark_ready("d", last=True)  # marking again after the drain is a new window, not a second backward
    assert len(comm.calls) == 5


# -- the compressed syncs -----------------------------------------------------------------------
class _Halving:
    """A compressor as the compressed sync calls it: records what it was given, and leaves half of it in
    the buffer (the decoded sum), returning a payload."""

    def __init__(self):
        self.got = []

    def exchange(self, flat):
        self.got.append(flat.copy())
        flat *= 0.5
        return "payload"


class _Auto(_Halving):
    """An Auto as :class:`AutoSync` calls it: dense while ``dense_next``, each dense call counted."""

    dense_next = True

    def __init__(self):
        super().__init__()
        self.dense = 0

    @contextlib.contextmanager
    def dense_call(self, x):
        self.dense += 1
        yield types.SimpleNamespace(payload="dense")


def test_the_compressed_sync_hands_the_compressor_the_mean_and_judges_what_it_decoded():
    comp = _Halving()
    place = _filled(LocalComm())
    local = place.grads.flat.copy()
    sync = CompressedSync(place, comp)
    assert sync.buckets == () and not sync.overlaps
    with pytest.raises(UnknownParameterError):
        sync.mark_ready("nope", last=True)
    verdict, payload = sync.reduce(4.0, _judge())
    assert payload == "payload" and len(comp.got) == 1
    np.testing.assert_allclose(comp.got[0], local / 4.0, rtol=1e-15)  # the mean, unscaled before it is sent
    np.testing.assert_allclose(place.grads.flat, local / 8.0, rtol=1e-15)  # what the compressor decoded
    assert verdict.unscale == 1.0
    np.testing.assert_allclose(verdict.norm, np.linalg.norm(local / 8.0), rtol=1e-14)


def test_the_compressed_ascent_keeps_the_exact_local_gradient():
    comp = _Halving()
    place = _filled(LocalComm())
    local = place.grads.flat.copy()
    verdict, payload = CompressedSync(place, comp).ascent(4.0, _judge())
    assert payload is None and comp.got == []  # nothing compressed
    np.testing.assert_array_equal(place.grads.flat, local)
    assert verdict.unscale == 4.0
    np.testing.assert_allclose(verdict.norm, np.linalg.norm(local) / 4.0, rtol=1e-14)


def test_the_compressed_sync_agrees_on_the_weight_sum_and_compresses_nothing_non_finite():
    comm = _Recording()
    comp = _Halving()
    place = _filled(comm)
    local = place.grads.flat.copy()
    CompressedSync(place, comp).reduce(1.5, _judge())
    assert comm.calls == [("allreduce", 2)]  # the weight sums and the finiteness flags; the rest is the compressor's
    np.testing.assert_allclose(comp.got[0], local / 3.0, rtol=1e-15)
    place.grads["b"][4] = np.nan
    before = place.grads.flat.copy()
    assert CompressedSync(place, comp).reduce(1.5, _judge()) == (None, None)  # the step skips
    assert len(comp.got) == 1
    np.testing.assert_array_equal(place.grads.flat, before)


def test_the_auto_sync_runs_the_placements_dense_exchange_while_dense():
    comm = _Recording()
    auto = _Auto()
    place = _filled(comm)
    local = place.grads.flat.copy()
    sync = AutoSync(place, auto)
    verdict, payload = sync.reduce(1.0, _judge())
    assert payload == "dense" and auto.dense == 1 and auto.got == []
    assert comm.calls == [("allreduce", LAY4.size), ("allreduce", 2)]  # the blocking exchange, in dense_call
    np.testing.assert_allclose(verdict.norm, np.linalg.norm(2 * local) / 2.0, rtol=1e-14)
    auto.dense_next = False
    _, payload = sync.reduce(1.0, _judge())
    assert payload == "payload" and auto.dense == 1 and len(auto.got) == 1


def test_gradient_sync_picks_the_engines_sync():
    group, alone = _filled(_Recording()), _filled(LocalComm())
    assert type(gradient_sync(group, compressor=_Halving())) is CompressedSync
    assert type(gradient_sync(group, compressor=_Auto())) is AutoSync
    for place, overlap in ((group, False), (alone, False), (alone, True)):  # one process: nothing to overlap
        sync = gradient_sync(place, overlap=overlap, bucket_bytes=8 * 16)
        assert type(sync) is BucketedSync and not sync.overlaps
    sync = gradient_sync(group, overlap=True, bucket_bytes=8 * 16)
    assert sync.overlaps and sync.bucket_bytes == 128 and len(sync.buckets) == 4
    assert gradient_sync(group, overlap=True).bucket_bytes == default_bucket_bytes(LAY4.size * 8)
    # an interleaved layout's buckets: the members given, in their start order
    sync = gradient_sync(group, overlap=True, members=[["d"], ["b", "c"], ["a"]])
    assert [[LAY4.names[i] for i in b.params] for b in sync.buckets] == [["d"], ["b", "c"], ["a"]]
    assert [(b.lo, b.hi) for b in sync.buckets] == [(48, 64), (16, 48), (0, 16)]


# -- the compressors' group exchange (what CompressedSync.reduce calls), over threads ---------------
SHAPES = {"w1": (12, 9), "b1": (12,), "w2": (4, 12), "b2": (4,)}
GATHERED = {"topk": lambda: C.TopK(ratio=0.1, min_size=16, ramp=0), "sign": lambda: C.Sign(min_size=16),
            "topk_ramp": lambda: C.TopK(ratio=0.1, min_size=16, ramp=2),  # 1/4 kept for 2 calls, then 0.1
            "ternary": lambda: C.Ternary(seed=2)}


@pytest.mark.parametrize("name", sorted(GATHERED))
def test_a_gathered_exchange_sums_every_ranks_decode_and_feedback_stays_per_rank(name):
    ranks, steps = 3, 4
    layout = at.Layout(SHAPES)
    rng = np.random.default_rng(3)
    xs = np.zeros((steps, ranks, layout.size))
    for n in layout.names:  # live elements only: the padding of a gradient buffer is zero
        xs[:, :, layout.slice(n)] = rng.standard_normal((steps, ranks, layout.slice(n).stop - layout.slice(n).start))

    def rank_run(rank, comm):
        ef = C.ErrorFeedback(GATHERED[name]()).bind(layout, np.float64, comm=comm)
        twin = C.ErrorFeedback(GATHERED[name]()).bind(layout, np.float64)
        out = []
        for t in range(steps):
            x = xs[t, rank].copy()
            before = ef.residual.flat.copy()
            payload = ef.exchange(x)
            sent = ef.compressor.decompress(payload)  # this rank's own contribution
            # error feedback keeps what this rank failed to send, whatever the others sent
            np.testing.assert_allclose(ef.residual.flat, before + xs[t, rank] - sent, rtol=1e-13, atol=1e-13)
            if not GATHERED[name]().stochastic:  # deterministic: the one-process roundtrip sends the same
                mine = xs[t, rank].copy()
                assert twin.roundtrip(mine).nbytes == payload.nbytes
                np.testing.assert_array_equal(mine, sent)
                np.testing.assert_array_equal(ef.residual.flat, twin.residual.flat)
            out.append((x, sent))
        return out

    results = ThreadGroup(ranks).run(rank_run)
    for t in range(steps):
        total = sum(results[r][t][1] for r in range(ranks))
        for r in range(ranks):
            np.testing.assert_allclose(results[r][t][0], total, rtol=1e-13, atol=1e-13)
    if GATHERED[name]().stochastic:  # each rank rounds with its own draws
        assert not np.array_equal(results[0][0][1], results[1][0][1])


def test_a_gathered_exchange_all_reduces_its_dense_part():
    """Top-k's warm-up (the whole gradient raw) and its small parameters travel by all-reduce: a
    process receives them once, not once per process; the sum equals the one-process decode's."""
    ranks = 3
    layout = at.Layout(SHAPES)
    rng = np.random.default_rng(5)
    live = np.zeros(layout.size, bool)
    for n in layout.names:
        live[layout.slice(n)] = True
    xs = [np.where(live, rng.standard_normal(layout.size), 0.0) for _ in range(ranks)]  # zero padding
    group = ThreadGroup(ranks)

    def rank_run(rank, comm):
        c = C.TopK(ratio=0.1, min_size=16, warmup=1, ramp=0).bind(layout, np.float64, comm=comm)
        out = []
        for _ in range(2):  # the warm-up call, then a compressed one
            x = xs[rank].copy()
            c.exchange(x)
            out.append(x)
        return out

    results = group.run(rank_run)
    np.testing.assert_allclose(results[0][0], sum(xs), rtol=1e-13, atol=1e-13)  # warm-up: the dense sum
    for rank in range(ranks):
        gathers = [call[1] for call in group.calls[rank] if call[0] == "allgather"]
        assert all(int(np.prod(shape)) < layout.size // 2 for shape in gathers), gathers
        np.testing.assert_array_equal(results[rank][1], results[0][1])
    small = [n for n in layout.names if int(np.prod(layout.shape(n))) < 16]
    assert small
    for n in small:  # the small parameters travel raw: the exact sum
        np.testing.assert_allclose(results[0][1][layout.slice(n)], sum(xs)[layout.slice(n)], rtol=1e-13, atol=1e-13)
