"""The placements (``parallel/placement.py``) on their own, without an engine: :class:`Replicated` and :class:`Sharded`.

Each rank is a thread of one process (``thread_group.ThreadGroup``: its collectives sum in rank order, its
reduce-scatter leaves the sum in the first block as MPI's in-place form does, and it records every call),
each rank with its own gradient; the references are NumPy over the whole summed gradient. The engine
over a group: ``test_engine_group.py``; under mpiexec: ``test_mpi.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import arraytrain as at
from arraytrain.amp import working_spec
from arraytrain.kernels.interface import family
from arraytrain.layout import REDUCE_CHUNK
from arraytrain.parallel.communicator import LocalComm
from arraytrain.parallel.placement import Placement, Replicated, Sharded, placement, placement_class
from arraytrain.prune import MaskBuffer
from arraytrain.engine.stages import Judge
from thread_group import ThreadGroup

# 44032 elements: 3 reduction chunks, so 2 ranks own 2 chunks each (the last partition mostly padding) and
# 3 ranks one each; "a" and "b" straddle partitions
SHAPES = {"a": (20000,), "b": (150, 100), "c": (9000,), "d": (7,)}
LAYOUT = at.Layout(SHAPES)
KERNELS = family("numpy")
PLACEMENTS = {"replicated": Replicated, "sharded": Sharded}


def _judge(max_norm=None) -> Judge:
    """The engine's judge with ``reduction="mean"`` and no loss scale: the buffer holds the gradient times the
    window's weight sum."""
    return Judge(KERNELS, lambda wsum: wsum, max_norm, 1e-6)


def _weights(dtype=np.float64) -> at.FlatBuffer:
    rng = np.random.default_rng(0)
    return at.FlatBuffer.from_arrays({n: rng.standard_normal(s) for n, s in SHAPES.items()}, dtype=dtype)


def _grad(rank: int, scale: float = 1.0) -> dict:
    rng = np.random.default_rng([7, rank])
    return {n: scale * rng.standard_normal(s) for n, s in SHAPES.items()}


def _summed(ranks: int, scale: float = 1.0) -> dict:
    return {n: sum(_grad(r, scale)[n] for r in range(ranks)) for n in SHAPES}


def _flat(arrays: dict) -> np.ndarray:
    """``arrays`` in LAYOUT's flat order, zero padding."""
    out = at.FlatBuffer.zeros(LAYOUT, np.float64)
    for n, a in arrays.items():
        out[n][...] = a
    return out.flat


def _make(kind, comm, dtype=np.float64, wspec=None):
    params = _weights(dtype)
    return PLACEMENTS[kind](comm, params, wspec) if kind == "sharded" else Replicated(comm, params, wspec)


def _fill(place, rank, scale=1.0) -> None:
    for n, g in _grad(rank, scale).items():
        place.grads[n][...] = g


def _calls(group, rank, since):
    return [c[0] for c in group.calls[rank][since:]]


def _exchanged(kind, rank, comm, scale=1.0):
    """Rank ``rank``'s placement of ``kind`` holding its own gradient, after the exchange, and the collectives
    the exchange ran (as the thread group recorded them)."""
    place = _make(kind, comm)
    _fill(place, rank, scale)
    start = len(comm.group.calls[rank])
    place.exchange()
    return place, comm.group.calls[rank][start:]


# -- lay_out ------------------------------------------------------------------------------------
def test_replicated_lays_the_parameters_out_as_given_and_cuts_no_buckets():
    params = _weights()
    out, members = Replicated.lay_out(params, LocalComm(), at.optim.AdamW(state_dtype="8bit"), 16000)
    assert out is params and members is None
    assert placement_class(False) is Replicated and placement_class(True) is Sharded


def test_sharded_lays_out_on_the_optimizers_alignment_and_deals_the_buckets_to_the_ranks():
    class Two:  # lay_out reads the group's size only
        size, rank = 2, 0

    params = at.FlatBuffer.from_arrays({f"p{i}": np.full(1000, float(i)) for i in range(6)}, dtype=np.float64)
    # 8000-byte parameters, 16000-byte buckets: two a bucket, bucket 0 the last two; rank 0 gets buckets 2 and 0
    for opt, align in ((at.optim.SGD(lr=0.1), 16), (at.optim.AdamW(state_dtype="8bit"), 256)):
        out, members = Sharded.lay_out(params, Two(), opt, 16000)
        assert opt.shard_align in (1, 256) and out.layout.align == align
        assert out.layout.names == ("p0", "p1", "p4", "p5", "p2", "p3")
        assert members == [["p4", "p5"], ["p2", "p3"], ["p0", "p1"]]
        assert all(off % align == 0 for off in out.layout.offsets)
        assert out.layout.offsets[1] == -(-1000 // align) * align
        for i in range(6):
            np.testing.assert_array_equal(out[f"p{i}"], np.full(1000, float(i)))  # the values move with their names
    one, _ = Sharded.lay_out(params, Two(), at.optim.SGD(lr=0.1), 10**9)  # one bucket: the order stays
    assert one is params


# -- the exchange -------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("kind", sorted(PLACEMENTS))
def test_the_exchange_leaves_each_rank_what_it_owns_of_the_sum_in_one_collective(kind, ranks):
    """Replicated: one all-reduce of the whole buffer, every rank the whole sum. Sharded: one reduce-scatter of
    the padded buffer, each rank its partition of the sum (where update() reads it: the thread group's
    reduce-scatter leaves it in the first block, as MPI's in-place form does)."""
    want = _flat(_summed(ranks))

    def rank_run(rank, comm):
        place, calls = _exchanged(kind, rank, comm)
        if kind == "replicated":
            assert calls == [("allreduce", (LAYOUT.size,), "<f8", "sum")]
            return 0, LAYOUT.size, place.grads.flat.copy()
        part = place.partition
        assert part.length == (2 if ranks == 2 else 1) * REDUCE_CHUNK and part.lo == rank * part.length
        assert place.bucket_flat.shape == (part.padded,) and place.grads.flat.base is not None
        assert calls == [("reduce_scatter", (part.padded,), "<f8")]
        assert place._grad_part.flat.shape == (part.length,)
        return part.lo, part.hi, place._grad_part.flat.copy()

    padded = np.concatenate([want, np.zeros(4 * REDUCE_CHUNK - LAYOUT.size)])  # the end padding sums zeros
    for lo, hi, got in ThreadGroup(ranks).run(rank_run):
        np.testing.assert_allclose(got, padded[lo:hi], rtol=1e-14, atol=1e-14)


def test_replicated_exchange_with_one_process_is_the_identity():
    place = Replicated(LocalComm(), _weights())
    _fill(place, 0)
    place.exchange()
    place.buckets_reduced()  # the base's no-op: nothing left to complete
    np.testing.assert_array_equal(place.grads.flat, _flat(_grad(0)))


def test_sharded_buckets_reduced_reads_the_partition_where_the_reduces_left_it():
    """The bucketed sync's reduces (each partition's slice to its owner) leave the rank's partition in place:
    ``buckets_reduced`` takes it there, and the norms equal the reduce-scatter's."""
    want = _summed(2)

    def rank_run(rank, comm):
        place = Sharded(comm, _weights())
        _fill(place, rank)
        for p in place.start_reduce(0, place.bucket_flat.shape[0]):
            p.wait()
        place.buckets_reduced()
        part = place.partition
        n = min(part.hi, LAYOUT.size) - part.lo
        np.testing.assert_allclose(place._grad_part.flat[:n], _flat(want)[part.lo : part.lo + n], rtol=1e-14)
        assert not place._grad_part.flat[n:].any()
        return place.verdict(0.5, _judge()).segment_norms

    for got in ThreadGroup(2).run(rank_run):
        np.testing.assert_allclose(got, [np.linalg.norm(want[n]) for n in SHAPES], rtol=1e-12)


# -- the verdict --------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("kind", sorted(PLACEMENTS))
def test_the_verdicts_norms_are_those_of_the_whole_summed_gradient(kind, ranks):
    summed = _summed(ranks)
    wsum = sum(range(1, ranks + 1))  # rank r's weight sum is r + 1
    norm = math.sqrt(sum(float(np.sum(g * g)) for g in summed.values())) / wsum
    per = [np.linalg.norm(summed[n]) / wsum for n in SHAPES]

    def rank_run(rank, comm):
        place, _ = _exchanged(kind, rank, comm)
        v = place.verdict(float(rank + 1), _judge(max_norm=norm / 4))
        return v.unscale, v.nonfinite, v.norm, v.segment_norms, v.coef, v.gscale()

    for unscale, nonfinite, got, seg, coef, gscale in ThreadGroup(ranks).run(rank_run):
        assert unscale == wsum and not nonfinite
        np.testing.assert_allclose(got, norm, rtol=1e-12)
        np.testing.assert_allclose(seg, per, rtol=1e-12)
        np.testing.assert_allclose(coef, 0.25, rtol=1e-5)  # max_norm / (norm + eps)
        np.testing.assert_allclose(gscale, coef / wsum, rtol=1e-15)


@pytest.mark.parametrize("owner", [0, 1, 2])
@pytest.mark.parametrize("kind", sorted(PLACEMENTS))
def test_a_nan_in_one_ranks_partition_makes_every_ranks_verdict_non_finite(kind, owner):
    """Rank 0's gradient holds a NaN at an element of rank ``owner``'s partition: sharded, only that
    partition's sums see it, and their all-reduce carries it to every rank."""
    at_element = owner * REDUCE_CHUNK + 5  # 3 ranks: one reduction chunk a partition

    def rank_run(rank, comm):
        place = _make(kind, comm)
        _fill(place, rank)
        if rank == 0:
            place.grads.flat[at_element] = np.nan
        place.exchange()
        return place.verdict(1.0, _judge()).nonfinite

    assert at_element < LAYOUT.size
    assert ThreadGroup(3).run(rank_run) == [True, True, True]


@pytest.mark.parametrize("kind", sorted(PLACEMENTS))
def test_huge_finite_float64_gradients_give_finite_norms_on_every_rank(kind):
    """1e200 squared overflows float64: the sharded total takes the overflow path (the peak over ranks,
    the scaled sums), the replicated norm pass its own; both equal the scaled NumPy reference."""
    summed = _summed(2, scale=1e200)
    peak = max(float(np.max(np.abs(g))) for g in summed.values())
    norm = peak * math.sqrt(sum(float(np.sum((g / peak) ** 2)) for g in summed.values()))
    per = [peak * np.linalg.norm(summed[n] / peak) for n in SHAPES]

    def rank_run(rank, comm):
        place, _ = _exchanged(kind, rank, comm, scale=1e200)
        v = place.verdict(0.5, _judge())
        return v.nonfinite, v.norm, v.segment_norms

    for nonfinite, got, seg in ThreadGroup(2).run(rank_run):
        assert not nonfinite and math.isfinite(got)
        np.testing.assert_allclose(got, norm, rtol=1e-12)
        np.testing.assert_allclose(seg, per, rtol=1e-12)


def test_sharded_float32_verdict_with_a_non_finite_total_skips_without_the_overflow_path():
    def rank_run(rank, comm):
        place = Sharded(comm, _weights(np.float32))
        _fill(place, rank)
        if rank == 1:
            place.grads["c"][3] = np.inf
        place.exchange()
        start = len(comm.group.calls[rank])
        v = place.verdict(1.0, _judge())
        return v.nonfinite, [c[0] for c in comm.group.calls[rank][start:]]

    for nonfinite, ops in ThreadGroup(2).run(rank_run):
        assert nonfinite and ops == ["allreduce"]  # the partitions' sums only: no max, no rescaled pass


# -- update, publish, drop ----------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("kind", sorted(PLACEMENTS))
def test_update_then_publish_leaves_every_rank_with_the_same_updated_weights(kind, ranks):
    group = ThreadGroup(ranks)
    opt = at.optim.SGD(lr=0.5)
    want = _flat(_weights().as_dict()) - 0.5 * _flat(_summed(ranks)) / ranks  # weight sum 1 per rank

    def rank_run(rank, comm):
        place, _ = _exchanged(kind, rank, comm)
        state = opt.init(place.master)
        v = place.verdict(1.0, _judge())
        start = len(group.calls[rank])
        place.update(opt, KERNELS, state, v.gscale(), None, True)
        ops = _calls(group, rank, start)
        assert ops == ([] if kind == "replicated" else ["allgather_blocks"])  # the publish
        assert not place.grads.flat.any() and not place.bucket_flat.any()  # cleared for the next window
        return place.params.flat.copy()

    got = group.run(rank_run)
    for flat in got:
        np.testing.assert_array_equal(flat, got[0])  # bitwise across ranks
        np.testing.assert_allclose(flat, want, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("kind", sorted(PLACEMENTS))
def test_drop_window_clears_the_gradient_and_the_scratch(kind):
    def rank_run(rank, comm):
        place, _ = _exchanged(kind, rank, comm)
        before = _weights().flat
        place.drop_window()
        assert not place.grads.flat.any() and not place.bucket_flat.any()
        if kind == "sharded":
            assert place._grad_part is None  # nothing left for update()
        np.testing.assert_array_equal(place.params.flat, before)
        return True

    assert ThreadGroup(2).run(rank_run) == [True, True]


def test_a_deferred_publish_leaves_its_chunks_in_flight_until_settled():
    """``defer_publish``: the all-gather of the update starts as chunks of ``chunk_length`` elements of every
    partition; ``chunk_needed`` names the last chunk a read of some spans waits for (-1: all in the own
    partition), ``settle`` completes chunks in order."""
    opt = at.optim.SGD(lr=0.5)

    def rank_run(rank, comm):
        place = Sharded(comm, _weights())
        place.defer_publish = True
        state = opt.init(place.master)
        assert place.in_flight == 0 and place.settle() is None
        _fill(place, rank)
        place.exchange()
        place.update(opt, KERNELS, state, place.verdict(1.0, _judge()).gscale(), None, True)
        length, chunk = place.partition.length, place.chunk_length
        assert (length, chunk) == (2 * REDUCE_CHUNK, REDUCE_CHUNK) and place.in_flight == 2
        other = (1 - rank) * length
        mine = rank * length
        assert place.chunk_needed([(mine, mine + length)]) == -1
        assert place.chunk_needed([(other, other + 1)]) == 0
        assert place.chunk_needed([(mine, mine + 3), (other + chunk, other + chunk + 1)]) == 1
        assert place.chunk_needed([(other + 10, other + 10)]) == -1  # an empty span reads nothing
        place.settle(0)
        assert place.in_flight == 1
        place.settle()
        assert place.in_flight == 0
        return place.params.flat.copy()

    a, b = ThreadGroup(2).run(rank_run)
    np.testing.assert_array_equal(a, b)


def test_the_bases_publish_is_a_no_op_where_every_rank_updated_everything():
    place = Replicated(LocalComm(), _weights())
    before = place.params.flat.copy()
    assert place.publish() is None and place.settle() is None and place.settle(3) is None
    assert place.in_flight == 0 and place.chunk_needed([(0, LAYOUT.size)]) == -1
    assert not place.defer_publish and place.working is None and place.working_args() is None
    place.weights_moved(KERNELS)  # no working copy: the (empty) publish
    np.testing.assert_array_equal(place.params.flat, before)
    assert place.master is place.params and place.layout.names == LAYOUT.names
    assert issubclass(Replicated, Placement) and issubclass(Sharded, Placement)


# -- masks --------------------------------------------------------------------------------------
def _mask() -> MaskBuffer:
    mask = MaskBuffer.ones(LAYOUT)
    mask["a"][::3] = 0
    mask["c"][-100:] = 0  # in the last partition of 2 ranks
    return mask


def test_replicated_keeps_the_mask_for_the_kernels_and_applies_it_to_every_weight():
    place = Replicated(LocalComm(), _weights())
    before = place.params.flat.copy()
    mask = _mask()
    place.keep_mask(mask)
    assert place.kernel_mask is mask
    np.testing.assert_array_equal(place.params.flat, before)  # kept, not applied
    place.apply_mask(mask)
    np.testing.assert_array_equal(place.params.flat, before * mask.flat)
    assert not place.params["a"][::3].any() and place.params["a"][1] == before[1]
    place.keep_mask(None)
    assert place.kernel_mask is None


@pytest.mark.parametrize("working", [None, "bfloat16"])
def test_sharded_keeps_its_partition_of_the_mask_and_applies_it(working):
    mask = _mask()
    dtype = np.float64 if working is None else np.float32
    full = _weights(dtype).flat.copy()

    def rank_run(rank, comm):
        place = Sharded(comm, _weights(dtype), None if working is None else working_spec(working))
        part = place.partition
        n = max(0, min(part.hi, LAYOUT.size) - part.lo)
        place.keep_mask(mask)
        km = place.kernel_mask
        assert km.dtype == np.uint8 and km.shape == (part.length,)
        np.testing.assert_array_equal(km[:n], mask.flat[part.lo : part.lo + n])
        assert not km[n:].any()  # the end padding
        place.apply_mask(mask)
        if working is None:  # every rank's full weights
            np.testing.assert_array_equal(place.params.flat, full * mask.flat)
        else:  # the sharded masters' partition
            np.testing.assert_array_equal(place.master.flat[:n], full[part.lo : part.lo + n] * mask.flat[part.lo : part.lo + n])
        place.keep_mask(None)
        assert place.kernel_mask is None
        return n

    assert ThreadGroup(2).run(rank_run) == [2 * REDUCE_CHUNK, LAYOUT.size - 2 * REDUCE_CHUNK]


# -- gather_params and memory -------------------------------------------------------------------
@pytest.mark.parametrize("working", [None, "bfloat16"])
@pytest.mark.parametrize("kind", sorted(PLACEMENTS))
def test_gather_params_gives_every_rank_the_full_weights_as_a_new_buffer(kind, working):
    dtype = np.float64 if working is None else np.float32
    want = _weights(dtype)

    def rank_run(rank, comm):
        place = _make(kind, comm, dtype, None if working is None else working_spec(working))
        got = place.gather_params()
        assert got.layout.names == LAYOUT.names and got.flat.shape == (LAYOUT.size,) and got.dtype == dtype
        assert not np.shares_memory(got.flat, place.params.flat)
        if kind == "sharded" and working is not None:
            assert place.sharded_masters and "allgather_blocks" in [c[0] for c in comm.group.calls[rank]]
        return got.flat.copy()

    for flat in ThreadGroup(2).run(rank_run):
        np.testing.assert_array_equal(flat, want.flat)


def test_memory_reports_the_bytes_each_placement_holds():
    padded = 2 * 2 * REDUCE_CHUNK  # 2 ranks of 2 chunks

    def rank_run(rank, comm):
        rep = Replicated(comm, _weights()).memory()
        shard = Sharded(comm, _weights())
        plain = shard.memory()
        shard.keep_mask(_mask())
        masked = shard.memory()
        working = Sharded(comm, _weights(np.float32), working_spec("bfloat16")).memory()
        rep_working = Replicated(comm, _weights(np.float32), working_spec("float16")).memory()
        return rep, plain, masked, working, rep_working

    for rep, plain, masked, working, rep_working in ThreadGroup(2).run(rank_run):
        assert rep == {"params": 8 * LAYOUT.size, "grads": 8 * LAYOUT.size, "working": 0}
        assert rep_working == {"params": 4 * LAYOUT.size, "grads": 4 * LAYOUT.size, "working": 2 * LAYOUT.size}
        assert plain == {"grads": 8 * padded, "scratch": 0, "params": 8 * padded}
        assert masked == {**plain, "scratch": padded // 2}  # the partition's mask, one byte an element
        assert working == {"grads": 4 * padded, "scratch": 0, "master": 4 * padded // 2, "working": 2 * padded}


def test_placement_builds_the_one_the_engine_asked_for():
    def rank_run(rank, comm):
        params = _weights()
        rep, shard = placement(comm, params), placement(comm, params, shard=True)
        assert type(rep) is Replicated and rep.params is params and not rep.device_gate
        assert placement(comm, params, device_gate=True).device_gate
        assert type(shard) is Sharded and shard.partition.rank == rank and not shard.sharded_masters
        np.testing.assert_array_equal(shard.params.flat, params.flat)  # every rank's full weights
        assert shard.master.flat.shape == (shard.partition.length,)
        return True

    assert ThreadGroup(2).run(rank_run) == [True, True]
