"""``compressor="auto"``: the choice follows the link, every rank takes rank 0's, the link changing
re-decides, and the choice and the candidates' states survive a checkpoint.

The link is simulated (a thread group whose collectives take as long as their bytes at a set rate)
and so are the times: each rank's :class:`Auto` reads a virtual clock that only the link, the step's
modelled compute (:data:`COMPUTE` a step) and the candidates' modelled encodes (:data:`CODEC` a
call) advance, so every decision here is a function of those times and never of how busy the
machine is. One test runs on real time and checks only that the times are recorded."""

from __future__ import annotations

import numpy as np
import pytest
from builders import random_engine
from thread_group import ThreadGroup

import arraytrain as at
from arraytrain import compress as C
from arraytrain.errors import ArgumentTypeError, HyperparameterError, StateDictError

SHAPES = {"w1": (384, 384), "b1": (384,), "w2": (384, 384)}  # 1.2 MB of float32 gradient
DENSE_BYTES = 4 * (2 * 384 * 384 + 384)
COMPUTE = 0.02  # modelled seconds of compute between two exchanges
CODEC = 0.002  # modelled seconds of one compress or decompress call


def _grads(steps, ranks, seed=0):
    rng = np.random.default_rng(seed)
    return [[{n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()} for _ in range(ranks)]
            for _ in range(steps)]


def _rank_engine(comm=None, compressor=None):
    """A rank's (or one process's) engine: AdamW over random float32 parameters (seed 1), clipped at 1."""
    return random_engine(SHAPES, at.optim.AdamW(lr=1e-3), seed=1, param_dtype=np.float32, comm=comm,
                         compressor=compressor, max_grad_norm=1.0)


def _costed(candidates, clock):
    """``candidates`` (None: Auto's default) whose compressors' calls each advance ``clock`` by CODEC."""
    candidates = C.default_candidates() if candidates is None else candidates

    def costed(make):
        def made():
            c = make()
            for method in ("compress", "decompress"):
                def timed(*args, _call=getattr(c, method), **kwargs):
                    clock.advance(CODEC)
                    return _call(*args, **kwargs)
                setattr(c, method, timed)
            return c
        return made

    return {n: costed(f) for n, f in candidates.items()}


def _auto(clock, candidates=None, **kw):
    return C.Auto(_costed(candidates, clock), clock=clock, **kw)


def _run(group, steps, make, change=None):
    """``make(clock)`` -> each rank's Auto (``clock``: the rank's virtual clock, None on real time)."""
    grads = _grads(steps, group.size)

    def rank_run(rank, comm):
        clock = None if group.clocks is None else group.clocks[rank]
        eng = _rank_engine(comm, make(clock))
        reports = []
        for t in range(steps):
            if change is not None and rank == 0 and t == change[0]:
                group.rate = change[1]
            if clock is not None:
                clock.advance(COMPUTE)
            reports.append(eng.step(grads[t][rank]))
        return eng, reports

    return group.run(rank_run)


def test_one_process_is_dense_and_says_so():
    eng, plain = _rank_engine(compressor="auto"), _rank_engine()
    for g in _grads(3, 1):
        rep = eng.step(g[0])
        plain.step(g[0])
    assert rep.compression == "auto:dense" and isinstance(eng.compressor, C.Auto)
    assert [d["choice"] for d in eng.compressor.decisions] == ["dense"]
    np.testing.assert_array_equal(eng.params.flat, plain.params.flat)


TWO = {"powersgd": lambda: C.ErrorFeedback(C.PowerSGD(rank=4)), "topk": lambda: C.TopK(ratio=0.01, ramp=0)}


@pytest.mark.parametrize("candidates", [None, TWO], ids=["default", "powersgd-topk"])
def test_a_slow_link_chooses_a_compressor_on_every_rank(candidates):
    """At 5 MB/s a dense exchange of 1.2 MB takes 240 ms; PowerSGD's and top-k's bytes far less, and
    their encodes 2 ms a call."""
    (a, ra), (b, rb) = _run(ThreadGroup(2, rate=5e6, virtual=True), 7,
                            lambda clock: _auto(clock, candidates, probe=3))
    assert a.compressor.choice == b.compressor.choice != "dense"
    said = a.compressor.decisions[0]
    assert said["step"] == 2 and said["exchange_s"]["dense"] >= DENSE_BYTES / 5e6
    assert said["compute_s"] >= COMPUTE and said["exchange_s"][said["choice"]] < said["exchange_s"]["dense"] / 10
    assert "said" in said and "said" not in b.compressor.decisions[0]  # rank 0 estimates, the others follow
    assert [r.compression for r in ra[:3]] == ["auto:dense"] * 3
    assert ra[3].compression.startswith(f"auto:{said['choice']}:") and ra[3].payload_bytes < ra[3].dense_bytes
    np.testing.assert_array_equal(a.params.flat, b.params.flat)


@pytest.mark.parametrize("candidates", [None, TWO], ids=["default", "powersgd-topk"])
def test_a_fast_link_stays_dense(candidates):
    """At 20 GB/s the dense exchange takes 60 us, less than one encode."""
    (a, ra), (b, _) = _run(ThreadGroup(2, rate=20e9, virtual=True), 5,
                           lambda clock: _auto(clock, candidates, probe=3))
    assert a.compressor.choice == b.compressor.choice == "dense"
    assert a.compressor.decisions[0]["exchange_s"]["dense"] < CODEC
    assert all(r.compression == "auto:dense" for r in ra)
    np.testing.assert_array_equal(a.params.flat, b.params.flat)


def test_the_link_speeding_up_is_seen_at_the_next_dense_check():
    """Slow at the choice, 4000x faster from step 4: the dense check at step 6 (probe 3, reprobe 4)
    finds the exchange far faster and re-decides dense on every rank; the residual of error feedback
    went out dense."""
    (a, ra), (b, _) = _run(ThreadGroup(2, rate=5e6, virtual=True), 7,
                           lambda clock: _auto(clock, probe=3, reprobe=4, gain=2.5), change=(4, 20e9))
    first, again = a.compressor.decisions
    assert first["choice"] == "powersgd" and again["step"] == 6 and "took" in again["why"]
    assert again["exchange_s"]["dense"] < first["exchange_s"]["dense"] / 1000
    assert again["choice"] == b.compressor.choice == a.compressor.choice == "dense"
    assert [r.compression.split(":")[1] for r in ra] == ["dense"] * 3 + ["powersgd"] * 3 + ["dense"]
    for c in a.compressor.candidates.values():  # flushed by the check at step 6, the last call
        if isinstance(c, C.ErrorFeedback):
            assert not c.residual.flat.any()
    np.testing.assert_array_equal(a.params.flat, b.params.flat)


def test_real_times_are_recorded():
    """On the real clock (a link that sleeps) the decision records the times it was made from; which
    method they favour depends on this machine's speed, so it is not checked."""
    (a, ra), (b, _) = _run(ThreadGroup(2, rate=5e6), 4, lambda clock: C.Auto(TWO, probe=3))
    said = a.compressor.decisions[0]
    assert said["step"] == 2 and said["exchange_s"]["dense"] >= DENSE_BYTES / 5e6  # at least the sleep
    assert said["compute_s"] > 0 and set(said["exchange_s"]) == {"dense", *TWO}
    assert all(0 < t < float("inf") for t in said["exchange_s"].values())
    assert said["choice"] == a.compressor.choice == b.compressor.choice
    assert f"{1e3 * said['exchange_s']['dense']:.1f} ms" in said["said"]
    np.testing.assert_array_equal(a.params.flat, b.params.flat)


def test_the_choice_and_candidates_resume_from_a_checkpoint(tmp_path):
    group = ThreadGroup(2, rate=5e6, virtual=True)
    grads = _grads(8, 2)
    path = tmp_path / "auto.safetensors"

    def first(rank, comm):
        clock = group.clocks[rank]
        eng = _rank_engine(comm, _auto(clock, probe=3, reprobe=0))
        for t in range(5):
            clock.advance(COMPUTE)
            eng.step(grads[t][rank])
        at.save(path, eng)
        for t in range(5, 8):
            eng.step(grads[t][rank])
        return eng

    def resumed(rank, comm):
        eng = _rank_engine(comm, _auto(group.clocks[rank], probe=3, reprobe=0))
        at.load(path, eng)
        assert eng.compressor.step == 5 and eng.compressor.choice == "powersgd"
        for t in range(5, 8):
            eng.step(grads[t][rank])
        return eng

    full = group.run(first)
    again = group.run(resumed)
    for x, y in zip(full, again):
        np.testing.assert_array_equal(x.params.flat, y.params.flat)


def test_a_bad_state_is_refused_and_changes_nothing():
    eng = _rank_engine(compressor=C.Auto())
    eng.step(_grads(1, 1)[0][0])
    good = eng.compressor.state_dict()
    for bad in ({**good, "choice": "zip"}, {**good, "dense_seconds": -1.0}, {**good, "dense_seconds": float("nan")},
                {**good, "candidates": {}}, {**good, "type": "Auto()"},
                {k: v for k, v in good.items() if k != "step"}):
        with pytest.raises(StateDictError):
            eng.compressor.load_state_dict(bad)
        assert eng.compressor.step == 1 and eng.compressor.choice == "dense"


@pytest.mark.parametrize("make, error, match", [
    (lambda: C.Auto(candidates={}), ArgumentTypeError, "candidates"),
    (lambda: C.Auto(candidates={"dense": lambda: C.TopK(0.1)}), ArgumentTypeError, "candidates"),
    (lambda: C.Auto(candidates={"x": lambda: 3}), ArgumentTypeError, r"candidates\['x'\]"),
    (lambda: C.Auto(probe=1), HyperparameterError, "probe"),
    (lambda: C.Auto(gain=0.5), HyperparameterError, "gain"),
    (lambda: C.Auto(drift=1.0), HyperparameterError, "drift"),
    (lambda: C.Auto(reprobe=-1), HyperparameterError, "reprobe"),
    (lambda: C.Auto(clock=3.0), ArgumentTypeError, "clock"),
    (lambda: _rank_engine(compressor="autoo"), ArgumentTypeError, "compressor"),
])
def test_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()
