"""arraytrain.nn.Trainer, batching and callbacks."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import arraytrain as at
from arraytrain import nn



def blobs(n=96, features=8, classes=3, seed=0, dtype=np.float32):
    centers = np.random.default_rng(0).standard_normal((classes, features)) * 2
    rng = np.random.default_rng(seed)
    y = np.arange(n) % classes
    x = centers[y] + rng.standard_normal((n, features))
    return x.astype(dtype), y


def make(optimizer=None, dtype=np.float32, sizes=(8, 16, 3), engine_kw=None, **trainer_kw):
    model = nn.MLP(list(sizes), dtype=dtype)
    engine = at.Engine(model.init(seed=0), optimizer or at.optim.Adam(lr=1e-2), zero_grad_on_step=False,
                       **(engine_kw or {}))
    trainer_kw.setdefault("batch_size", 16)
    return model, engine, nn.Trainer(model, engine, **trainer_kw)


# -- batching ------------------------------------------------------------------------------------
def test_batches_cover_every_sample_once():
    x, y = np.arange(10.0)[:, None], np.arange(10)
    b = nn.Batches(x, y, 4, shuffle=True, seed=3)
    assert len(b) == 3
    seen = [yb for _, yb in b.epoch(0)]
    assert [len(s) for s in seen] == [4, 4, 2]
    assert sorted(np.concatenate(seen)) == list(range(10))
    assert not np.array_equal(b.order(0), b.order(1))                 # a new order every epoch
    np.testing.assert_array_equal(b.order(1), nn.Batches(x, y, 4, seed=3).order(1))  # a function of the seed
    dropped = nn.Batches(x, y, 4, seed=3, drop_last=True)
    assert len(dropped) == 2 and [len(yb) for _, yb in dropped.epoch(0)] == [4, 4]
    plain = [yb for _, yb in nn.Batches(x, y, 4, shuffle=False).epoch(5)]
    np.testing.assert_array_equal(np.concatenate(plain), np.arange(10))


def test_batches_bad_input():
    with pytest.raises(at.HyperparameterError, match="batch_size"):
        nn.Batches(np.zeros((3, 2)), np.zeros(3), 0)
    with pytest.raises(at.LayoutError, match="y: 2 rows, x has 3"):
        nn.Batches(np.zeros((3, 2)), np.zeros(2))


# -- fit -------------------------------------------------------------------------------------------
def test_fit_learns_and_logs_metrics():
    x, y = blobs()
    xv, yv = blobs(48, seed=1)
    _, engine, trainer = make()
    history = trainer.fit(x, y, epochs=4, validation=(xv, yv))
    assert [h["epoch"] for h in history] == [1, 2, 3, 4]
    first, last = history[0], history[-1]
    assert last["loss"] < first["loss"]
    assert last["val_accuracy"] > 0.9
    for key in ("accuracy", "precision", "recall", "f1", "val_loss", "val_f1", "lr", "time"):
        assert key in last
    assert last["val_confusion_matrix"].sum() == len(yv)
    assert last["confusion_matrix"].sum() == len(y)
    assert engine.state.step == 4 * math.ceil(len(y) / 16) == last["steps"]
    # every step after the first is timed
    assert trainer._timed_samples == 4 * len(y) - 16
    assert trainer.samples_per_second > 0


def test_two_runs_bitwise_equal():
    x, y = blobs(100)
    runs = []
    for _ in range(2):
        _, engine, trainer = make(shuffle=True, seed=5, engine_kw={"max_grad_norm": 0.5})
        hist = trainer.fit(x, y, epochs=3)
        runs.append((engine.params.flat.copy(), [h["loss"] for h in hist]))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]


def test_accumulation_through_engine_equals_big_batches():
    x, y = blobs(96, dtype=np.float64)
    kw = dict(optimizer=at.optim.SGD(lr=0.1), dtype=np.float64, seed=2)
    _, big, t_big = make(batch_size=32, **kw)
    t_big.fit(x, y, epochs=2)
    _, small, t_small = make(batch_size=8, engine_kw={"accumulation_steps": 4}, **kw)
    t_small.fit(x, y, epochs=2)
    assert big.state.step == small.state.step == 6
    np.testing.assert_allclose(small.params.flat, big.params.flat, rtol=1e-12, atol=1e-12)


def test_regression_with_mse_has_no_class_metrics():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    y = (x @ rng.standard_normal((4, 2))).astype(np.float32)
    _, _, trainer = make(sizes=(4, 8, 2), loss="mse")
    hist = trainer.fit(x, y, epochs=3, validation=(x, y))
    assert "accuracy" not in hist[-1] and "val_accuracy" not in hist[-1]
    assert hist[-1]["loss"] < hist[0]["loss"]


# -- callbacks -------------------------------------------------------------------------------------
def test_gradient_monitor_reports_real_layer_norms():
    x, y = blobs(32)
    mon = nn.GradientMonitor()
    _, engine, trainer = make(optimizer=at.optim.SGD(lr=0.01), batch_size=32, callbacks=[mon],
                              engine_kw={"max_grad_norm": 1e-3})
    hist = trainer.fit(x, y, epochs=1)
    # one step; zero_grad_on_step=False leaves that step's gradient in engine.grads
    for layer in ("fc1", "fc2"):
        want = math.sqrt(sum(float(np.sum(engine.grads[f"{layer}.{k}"].astype(np.float64) ** 2))
                             for k in ("weight", "bias")))
        assert hist[0]["grad_norms"][layer] == pytest.approx(want, rel=1e-5)
        assert hist[0]["grad_norm_max"][layer] == pytest.approx(want, rel=1e-5)
    assert mon.history[0]["steps"] == 1


def test_profiler_splits_the_step():
    x, y = blobs()
    prof = nn.Profiler()
    _, _, trainer = make(callbacks=[prof])
    hist = trainer.fit(x, y, epochs=2, validation=(x, y))
    split = hist[-1]["time_split"]
    assert {"forward", "backward", "optimizer", "callbacks"} <= set(split)
    assert all(split[k] > 0 for k in ("forward", "backward", "optimizer", "evaluation"))
    total = prof.summary(trainer)
    assert sum(total["fraction"].values()) == pytest.approx(1.0)
    assert total["seconds"]["forward"] == pytest.approx(sum(e["forward"] for e in prof.epochs))


def test_early_stopping_patience_and_restore_best():
    x, y = blobs()
    saved = {}

    def keep(trainer, epoch, logs):
        saved[epoch] = trainer.engine.params.flat.copy()

    # train loss falls every epoch, so "max" mode never improves after epoch 1
    stop = nn.EarlyStopping("loss", patience=2, mode="max", restore_best=True)
    _, engine, trainer = make(callbacks=[nn.LambdaCallback(on_epoch_end=keep), stop])
    hist = trainer.fit(x, y, epochs=10)
    assert len(hist) == 3 and stop.stopped_epoch == 3 and stop.best_epoch == 1
    np.testing.assert_array_equal(engine.params.flat, saved[1])
    # min_delta: a fall smaller than min_delta is not an improvement
    stop = nn.EarlyStopping("loss", patience=1, min_delta=1e9)
    _, _, trainer = make(callbacks=[stop])
    assert len(trainer.fit(x, y, epochs=10)) == 2


def test_callbacks_bad_input():
    x, y = blobs()
    _, _, trainer = make(callbacks=[nn.EarlyStopping("val_loss")])
    with pytest.raises(at.HyperparameterError, match="monitor 'val_loss' is not in the epoch logs"):
        trainer.fit(x, y, epochs=1)
    with pytest.raises(at.HyperparameterError, match="mode"):
        nn.EarlyStopping(mode="up")
    with pytest.raises(at.HyperparameterError, match="patience"):
        nn.EarlyStopping(patience=-1)
    with pytest.raises(at.HyperparameterError, match="on_step"):
        nn.LambdaCallback(on_step=print)
    _, _, trainer = make(callbacks=[nn.ReduceLROnPlateauCallback()])
    with pytest.raises(at.ArgumentTypeError, match="ReduceLROnPlateauCallback: the engine's schedule"):
        trainer.fit(x, y, epochs=1, validation=(x, y))


def test_trainer_bad_input():
    model = nn.MLP([8, 3])
    engine = at.Engine(model.init(seed=0), at.optim.SGD(lr=0.1))
    with pytest.raises(at.HyperparameterError, match="loss"):
        nn.Trainer(model, engine, loss="hinge")
    with pytest.raises(at.ArgumentTypeError, match=r"callbacks\[0\]"):
        nn.Trainer(model, engine, callbacks=[print])
    with pytest.raises(at.ArgumentTypeError, match="model"):
        nn.Trainer(object(), engine)
    trainer = nn.Trainer(model, engine, batch_size=64, drop_last=True)
    with pytest.raises(at.HyperparameterError, match="leaves no batch"):
        trainer.fit(*blobs(32), epochs=1)


def test_reduce_lr_on_plateau_feeds_the_schedule():
    from arraytrain import schedules

    x, y = blobs()
    # the schedule maximises: the falling train loss is a plateau every epoch
    sched = schedules.ReduceLROnPlateau(mode="max", factor=0.5, patience=0)
    _, engine, trainer = make(optimizer=at.optim.SGD(lr=0.1), engine_kw={"schedule": sched},
                              callbacks=[nn.ReduceLROnPlateauCallback("loss")])
    hist = trainer.fit(x, y, epochs=4)
    lrs = [h["lr"] for h in hist]
    assert lrs[0] == pytest.approx(0.1) and lrs[-1] < lrs[0]
    assert sched.num_reductions >= 2


def test_checkpoint_every_n_epochs(tmp_path):
    x, y = blobs()
    ck = nn.Checkpoint(tmp_path / "ck-{epoch}.safetensors", every=2, extra={"tag": "t"})
    model, engine, trainer = make(callbacks=[ck])
    trainer.fit(x, y, epochs=5)
    assert [p.rsplit("-", 1)[1] for p in ck.saved] == ["2.safetensors", "4.safetensors", "5.safetensors"]
    fresh = at.Engine(nn.MLP([8, 16, 3]).init(seed=9), at.optim.Adam(lr=1e-2), zero_grad_on_step=False)
    extra = at.load(ck.saved[-1], fresh)
    assert extra["epoch"] == 5 and extra["tag"] == "t"
    np.testing.assert_array_equal(fresh.params.flat, engine.params.flat)


def test_each_epoch_logs_its_throughput():
    """Each epoch's logs hold samples/s over its timed micro-batches; the run's mean weighs them by time."""
    x, y = np.random.default_rng(0).standard_normal((64, 5)).astype(np.float32), np.arange(64) % 3
    model = nn.MLP([5, 8, 3])
    trainer = nn.Trainer(model, at.Engine(model.init(seed=0), at.optim.AdamW()), batch_size=8)
    history = trainer.fit(x, y, epochs=3)
    rates = [h["samples_per_second"] for h in history]
    assert len(rates) == 3 and all(r > 0 and math.isfinite(r) for r in rates)
    assert min(rates) <= trainer.samples_per_second <= max(rates)
    # an epoch whose every micro-batch is a warm-up one has no figure (NaN), not 0 or inf
    one = nn.Trainer(model, at.Engine(model.init(seed=0), at.optim.AdamW()), batch_size=64)
    assert math.isnan(one.fit(x, y, epochs=1)[0]["samples_per_second"])


@pytest.mark.parametrize("content, text", [(b"{}\n", "not an .npz archive"), (b"", "got an empty file"),
                                           (None, "holds an object array (pickled Python objects)")])
def test_load_npz_says_what_the_file_is_not(tmp_path, content, text):
    path = tmp_path / "data.npz"
    if content is None:
        np.savez(path, X=np.array([{}], dtype=object), y=np.zeros(1))
    else:
        path.write_bytes(content)
    with pytest.raises(at.errors.DataError, match=re.escape(text)) as info:
        nn.load_npz(path)
    assert "allow_pickle" not in str(info.value) and str(path) in str(info.value)
