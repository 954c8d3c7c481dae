"""The Engine end to end over a group of ranks: threads standing for ranks (``thread_group.ThreadGroup``); the
same checks under mpiexec in ``test_mpi.py``.

Dense data parallelism must give what one process gives for the same global batch, every rank ending
identical; the ranks start from rank 0's weights, and a mismatched set-up raises the same error on every
rank; compressed data parallelism keeps the ranks identical, error feedback per rank; a group's checkpoint
resumes; the trainer shares each batch out. With overlapped exchanges: ``test_engine_group_overlap.py``; with
sharded state: ``test_shard.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

import arraytrain as at
from arraytrain import compress as C
from arraytrain.errors import HyperparameterError, LayoutError
from builders import random_engine, random_params, rank_windows
from test_sync import GATHERED
from thread_group import ThreadGroup

SHAPES = {"w1": (12, 9), "b1": (12,), "w2": (4, 12), "b2": (4,)}

OPTIMIZERS = {
    "sgd": lambda: at.optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adamw": lambda: at.optim.AdamW(lr=1e-2, weight_decay=0.01, amsgrad=True),
    "adagrad": lambda: at.optim.Adagrad(lr=0.05),
    "rmsprop": lambda: at.optim.RMSprop(lr=1e-3, momentum=0.5, centered=True),
    "lion": lambda: at.optim.Lion(lr=1e-3),
    "lamb": lambda: at.optim.LAMB(lr=1e-2),
    "adafactor": lambda: at.optim.Adafactor(lr=1e-2),
    "sam": lambda: at.optim.SAM(at.optim.SGD(lr=0.05, momentum=0.9), rho=0.05),
}


def _windows(steps, ranks, micro, seed=1, nan_at=None):
    """grads[step][rank][micro] and weights, with a NaN in 'w2' on rank ranks-1 at step ``nan_at``."""
    return rank_windows(SHAPES, steps, ranks, micro, seed=seed, nan_at=nan_at, nan_in='w2')


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_dense_data_parallel_equals_one_process_with_the_global_batch(name, ranks):
    """Clipping, weighted accumulation, loss scaling and a NaN window on one rank."""
    steps, micro = 7, 2
    grads, weights = _windows(steps, ranks, micro, nan_at=3)
    settings = dict(max_grad_norm=2.0, schedule=at.schedules.CosineAnnealingLR(10))

    def rank_run(rank, comm):
        eng = random_engine(SHAPES, OPTIMIZERS[name](), comm=comm, seed=rank,  # rank 0's weights are broadcast
                            accumulation_steps=micro, loss_scaler=at.LossScaler(init_scale=64.0), **settings)
        reports = []
        for t in range(steps):
            for m in range(micro):
                g = {n: a * eng.loss_scale for n, a in grads[t][rank][m].items()}
                rep = eng.step(g, weight=weights[t, rank, m])
            reports.append(rep)
        return eng, reports

    results = ThreadGroup(ranks).run(rank_run)
    one = random_engine(SHAPES, OPTIMIZERS[name](), accumulation_steps=micro * ranks,
                        loss_scaler=at.LossScaler(init_scale=64.0), **settings)
    for t in range(steps):
        for r in range(ranks):
            for m in range(micro):
                g = {n: a * one.loss_scale for n, a in grads[t][r][m].items()}
                rep = one.step(g, weight=weights[t, r, m])
        for eng, reports in results:
            got = reports[t]
            assert (got.applied, got.skipped, got.perturbed) == (rep.applied, rep.skipped, rep.perturbed)
            if rep.grad_norm is not None and not rep.skipped:
                np.testing.assert_allclose(got.grad_norm, rep.grad_norm, rtol=1e-12)
    assert results[0][1][3].skipped
    for eng, _ in results:
        np.testing.assert_array_equal(eng.params.flat, results[0][0].params.flat)  # the ranks agree bitwise
        np.testing.assert_allclose(eng.params.flat, one.params.flat, rtol=1e-10, atol=1e-12)
        for k, buf in eng.state.slots.items():
            np.testing.assert_allclose(buf.flat, one.state.slots[k].flat, rtol=1e-9, atol=1e-12, err_msg=k)
        assert eng.state.step == one.state.step and eng.loss_scale == one.loss_scale


def test_rank_zero_weights_and_state_are_broadcast_at_start():
    def rank_run(rank, comm):
        return random_engine(SHAPES, at.optim.AdamW(lr=0.1), comm=comm, seed=rank + 5)

    engines = ThreadGroup(3).run(rank_run)
    ref = random_params(SHAPES, 5)
    for eng in engines:
        for n in SHAPES:
            np.testing.assert_array_equal(eng.params[n], ref[n])


@pytest.mark.parametrize("what", ["layout", "dtype", "optimizer", "accumulation"])
def test_a_mismatched_setup_raises_the_same_error_on_every_rank(what):
    def rank_run(rank, comm):
        params, opt, kw = random_params(SHAPES), at.optim.AdamW(lr=0.1), {}
        odd = rank == 1
        if what == "layout" and odd:
            params["b2"] = np.zeros(5)
        if what == "dtype" and odd:
            kw["dtype"] = np.float32
        if what == "optimizer" and odd:
            opt = at.optim.AdamW(lr=0.2)
        if what == "accumulation" and odd:
            kw["accumulation_steps"] = 2
        try:
            at.Engine(params, opt, comm=comm, **kw)
        except (LayoutError, HyperparameterError) as exc:
            return exc
        return None

    errors = ThreadGroup(3).run(rank_run)
    assert all(e is not None for e in errors), errors
    assert len({(type(e), str(e)) for e in errors}) == 1  # the same error everywhere
    assert "rank 1" in str(errors[0])


@pytest.mark.parametrize("name", ["topk", "sign"])
def test_compressed_data_parallel_keeps_the_ranks_identical(name):
    ranks, steps = 2, 5
    grads, _ = _windows(steps, ranks, 1, seed=4)

    def rank_run(rank, comm):
        eng = random_engine(SHAPES, at.optim.AdamW(lr=1e-2), comm=comm, compressor=C.ErrorFeedback(GATHERED[name]()),
                            max_grad_norm=1.0)
        reps = [eng.step(grads[t][rank][0]) for t in range(steps)]
        return eng, reps

    results = ThreadGroup(ranks).run(rank_run)
    (a, ra), (b, rb) = results
    np.testing.assert_array_equal(a.params.flat, b.params.flat)
    assert [r.grad_norm for r in ra] == [r.grad_norm for r in rb]
    assert all(r.applied and r.payload_bytes < r.dense_bytes for r in ra)
    assert not np.array_equal(a.compressor.residual.flat, b.compressor.residual.flat)  # each its own


# -- checkpoints of a group -----------------------------------------------------------------------
def _run_group(ranks, steps, grads, make_comp, path=None, save_at=None, load=None, micro=1):
    """Each rank steps through ``grads``; resuming ``load[0]``, after the micro-batch ``load[1]`` = (t, m)."""

    def rank_run(rank, comm):
        eng = random_engine(SHAPES, at.optim.AdamW(lr=1e-2), comm=comm, compressor=make_comp(),
                            accumulation_steps=micro, schedule=at.schedules.CosineAnnealingLR(20))
        done = (-1, micro - 1)
        if load is not None:
            at.load(load[0], eng)
            done = load[1]
        for t in range(steps):
            for m in range(micro):
                if (t, m) <= done:
                    continue
                eng.step(grads[t][rank % len(grads[t])][m])
                if save_at == (t, m):
                    at.save(path, eng)
        return eng

    return ThreadGroup(ranks).run(rank_run)


@pytest.mark.parametrize("compressed", [False, True], ids=["dense", "ef-topk"])
def test_a_group_checkpoint_resumes_bitwise_on_the_same_number_of_ranks(tmp_path, compressed):
    grads, _ = _windows(8, 3, 2, seed=9)
    make = (lambda: C.ErrorFeedback(C.TopK(ratio=0.2))) if compressed else (lambda: None)
    path = tmp_path / "group.safetensors"
    full = _run_group(3, 8, grads, make, path=path, save_at=(3, 0), micro=2)  # saved mid-window
    resumed = _run_group(3, 8, grads, make, load=(path, (3, 0)), micro=2)
    for a, b in zip(full, resumed):
        np.testing.assert_array_equal(a.params.flat, b.params.flat)
        if compressed:
            np.testing.assert_array_equal(a.compressor.residual.flat, b.compressor.residual.flat)


def test_residuals_refuse_another_number_of_ranks_everywhere_and_change_nothing(tmp_path):
    grads, _ = _windows(4, 3, 1, seed=2)
    make = lambda: C.ErrorFeedback(C.TopK(ratio=0.2))  # noqa: E731
    path = tmp_path / "g.safetensors"
    _run_group(3, 4, grads, make, path=path, save_at=(2, 0))

    def rank_run(rank, comm):
        eng = random_engine(SHAPES, at.optim.AdamW(lr=1e-2), comm=comm, compressor=make(),
                            schedule=at.schedules.CosineAnnealingLR(20))
        before = eng.params.flat.copy()
        with pytest.raises(at.CheckpointError, match="saved by 3 processes, this group has 2"):
            at.load(path, eng)
        np.testing.assert_array_equal(eng.params.flat, before)
        return True

    assert ThreadGroup(2).run(rank_run) == [True, True]
    one = random_engine(SHAPES, at.optim.AdamW(lr=1e-2), compressor=make(), schedule=at.schedules.CosineAnnealingLR(20))
    with pytest.raises(at.CheckpointError, match="error-feedback residuals are per rank"):
        at.load(path, one)


def test_a_dense_boundary_checkpoint_resumes_on_any_number_of_ranks(tmp_path):
    grads, _ = _windows(6, 3, 1, seed=5)
    path = tmp_path / "d.safetensors"
    saved = _run_group(3, 6, grads, lambda: None, path=path, save_at=(2, 0))[0]
    two = _run_group(2, 3, grads, lambda: None, load=(path, (2, 0)))  # nothing left to run: just the load
    one = random_engine(SHAPES, at.optim.AdamW(lr=1e-2), schedule=at.schedules.CosineAnnealingLR(20))
    at.load(path, one)
    for eng in [*two, one]:
        assert eng.state.step == 3
    assert saved.state.step == 6


def test_a_mid_window_checkpoint_refuses_another_number_of_ranks(tmp_path):
    grads, _ = _windows(4, 2, 2, seed=6)
    path = tmp_path / "m.safetensors"
    _run_group(2, 4, grads, lambda: None, path=path, save_at=(1, 0), micro=2)
    one = random_engine(SHAPES, at.optim.AdamW(lr=1e-2), accumulation_steps=2,
                        schedule=at.schedules.CosineAnnealingLR(20))
    with pytest.raises(at.CheckpointError, match="accumulated part-way"):
        at.load(path, one)


# -- the trainer on a group ---------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [2, 3])
def test_the_trainer_shards_each_batch_and_follows_the_one_process_trajectory(ranks):
    from arraytrain import nn

    rng = np.random.default_rng(0)
    centers = rng.standard_normal((3, 8)) * 2
    y = np.arange(100) % 3
    x = centers[y] + rng.standard_normal((100, 8))

    def fit(comm=None):
        model = nn.MLP([8, 16, 3], dtype=np.float64)
        engine = at.Engine(model.init(seed=0), at.optim.AdamW(lr=1e-2), zero_grad_on_step=False,
                           max_grad_norm=1.0, comm=comm)
        trainer = nn.Trainer(model, engine, batch_size=16, seed=1)
        history = trainer.fit(x, y, epochs=3, validation=(x[:30], y[:30]))
        return engine, history

    one, h1 = fit()
    results = ThreadGroup(ranks).run(lambda rank, comm: fit(comm))
    for eng, h in results:
        np.testing.assert_allclose(eng.params.flat, one.params.flat, rtol=1e-9, atol=1e-12)
        for a, b in zip(h, h1):
            assert a["steps"] == b["steps"]
            np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-9)
            assert a["accuracy"] == b["accuracy"] and a["val_accuracy"] == b["val_accuracy"]


def test_a_batch_smaller_than_the_group_is_refused_before_training():
    from arraytrain import nn

    x, y = np.zeros((10, 4)), np.arange(10) % 2

    def fit(rank, comm):
        model = nn.MLP([4, 2], dtype=np.float64)
        engine = at.Engine(model.init(seed=0), at.optim.SGD(lr=0.1), comm=comm, zero_grad_on_step=False)
        with pytest.raises(HyperparameterError, match="cannot be shared by 3 processes"):
            nn.Trainer(model, engine, batch_size=4).fit(x, y, epochs=1)  # the last batch has 2 samples
        return engine.state.step

    assert ThreadGroup(3).run(fit) == [0, 0, 0]
