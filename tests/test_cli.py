"""``arraytrain train``, run in-process through ``arraytrain.cli.main``."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import numpy as np
import pytest

import arraytrain as at
from arraytrain.cli import main, optimizers

HAS_SCHEDULE = "schedule" in inspect.signature(at.Engine).parameters
HAS_CHECKPOINT = hasattr(at, "save") and hasattr(at, "load")
QUIET = ["--no-progress"]


def run(capsys, *args):
    rc = main(["train", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def small_npz(path, with_test=False, n=90, seed=0):
    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(0).standard_normal((3, 5)) * 3
    y = np.arange(n) % 3 + 7  # arbitrary labels 7, 8, 9
    x = centers[y - 7] + rng.standard_normal((n, 5))
    arrays = {"X": x, "y": y}
    if with_test:
        arrays["X_test"], arrays["y_test"] = x[:30] + 0.1, y[:30]
    np.savez(path, **arrays)
    return path


def test_default_dataset_json(tmp_path, capsys):
    pytest.importorskip("sklearn")
    js = tmp_path / "out.json"
    rc, out, err = run(capsys, "--epochs", "2", *QUIET, "--json", str(js))
    assert rc == 0, err
    assert "epoch 2/2" in out and "test accuracy" in out and "samples/s" in out and "forward" in out
    summary = json.loads(js.read_text())
    assert summary["epochs"] == 2 and len(summary["history"]) == 2
    assert summary["test_accuracy"] > 0.8
    assert summary["samples_per_second"] > 0
    assert summary["final_loss"] == summary["history"][-1]["loss"]
    assert set(summary["time_split_seconds"]) >= {"forward", "backward", "optimizer", "callbacks"}


def test_progress_bar_and_options(tmp_path, capsys):
    pytest.importorskip("tqdm")
    data = small_npz(tmp_path / "d.npz")
    rc, out, err = run(capsys, "--data", str(data), "--epochs", "2", "--optimizer", "sgd", "--momentum", "0.9",
                       "--hidden", "16", "--activation", "tanh", "--accumulation", "2", "--clip", "1.0",
                       "--batch-size", "8", "--dtype", "float64", "--patience", "5")
    assert rc == 0, err
    assert "epoch 1/2" in err  # the tqdm bar
    assert "model [5, 16, 3]" in out and "SGD(lr=0.05, momentum=0.9" in out


@pytest.mark.parametrize("with_test", [False, True])
def test_data_file(tmp_path, capsys, with_test):
    data = small_npz(tmp_path / "d.npz", with_test)
    js = tmp_path / "s.json"
    rc, out, err = run(capsys, "--data", str(data), "--epochs", "3", *QUIET, "--json", str(js), "--seed", "1")
    assert rc == 0, err
    summary = json.loads(js.read_text())
    assert summary["test_accuracy"] > 0.9
    assert ("test 30" if with_test else "test 18") in summary["dataset"]


@pytest.mark.parametrize("ef", [False, True], ids=["plain", "error-feedback"])
def test_compression(tmp_path, capsys, ef):
    data = small_npz(tmp_path / "d.npz")
    js = tmp_path / "s.json"
    rc, out, err = run(capsys, "--data", str(data), "--epochs", "3", *QUIET, "--json", str(js),
                       "--compress", "topk:ratio=0.05", *(["--error-feedback"] if ef else []))
    assert rc == 0, err
    assert ("compressed: ErrorFeedback(TopK(" if ef else "compressed: TopK(") in out
    summary = json.loads(js.read_text())
    assert summary["processes"] == 1
    assert summary["dense_bytes_per_step"] / summary["payload_bytes_per_step"] > 8
    assert f"{summary['payload_bytes_per_step']:,.0f} bytes/step" in out


def test_every_optimizer_runs(tmp_path, capsys):
    data = small_npz(tmp_path / "d.npz")
    names = optimizers()
    assert {"sgd", "adam", "adamw"} <= set(names)
    for name in names:
        rc, _, err = run(capsys, "--data", str(data), "--epochs", "1", *QUIET, "--optimizer", name)
        assert rc == 0, f"{name}: {err}"


def test_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "curves.png"
    rc, _, err = run(capsys, "--data", str(small_npz(tmp_path / "d.npz")), "--epochs", "2", *QUIET,
                     "--plot", str(png))
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _bad_files(tmp):
    np.savez(tmp / "noy.npz", X=np.zeros((10, 2)))
    np.savez(tmp / "rows.npz", X=np.zeros((10, 2)), y=np.zeros(9))
    np.savez(tmp / "nan.npz", X=np.full((10, 2), np.nan), y=np.arange(10) % 2)
    np.savez(tmp / "fracy.npz", X=np.zeros((10, 2)), y=np.linspace(0, 1, 10))
    np.savez(tmp / "onlytest.npz", X=np.zeros((10, 2)), y=np.arange(10) % 2, X_test=np.zeros((3, 2)))
    np.savez(tmp / "oneclass.npz", X=np.zeros((10, 2)), y=np.zeros(10, int))
    np.savez(tmp / "x1d.npz", X=np.zeros(10), y=np.zeros(10, int))
    np.savez(tmp / "testwidth.npz", X=np.zeros((10, 2)), y=np.arange(10) % 2, X_test=np.zeros((3, 3)),
             y_test=np.zeros(3, int))
    (tmp / "junk.npz").write_bytes(b"not a zip file")
    small_npz(tmp / "good.npz")
    return tmp


BAD_ARGS = [
    (["--lr", "-1"], "argument --lr: expected a value > 0"),
    (["--lr", "fast"], "argument --lr: expected a number"),
    (["--hidden", "12,x"], "argument --hidden: expected comma-separated"),
    (["--hidden", "12,0"], "argument --hidden: layer widths must be >= 1"),
    (["--batch-size", "0"], "argument --batch-size"),
    (["--epochs", "1.5"], "argument --epochs: expected a whole number"),
    (["--optimizer", "nope"], "argument --optimizer: invalid choice"),
    (["--schedule", "linear"], "argument --schedule: invalid choice"),
    (["--val-fraction", "1.5"], "argument --val-fraction"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--checkpoint-every", "2"], "--checkpoint-every needs --save"),
    (["--optimizer", "adam", "--momentum", "0.9"], "--momentum: adam has no momentum"),
    (["--step-epochs", "2"], "--step-epochs applies to --schedule step only"),
    (["--data", "{tmp}/missing.npz"], "missing.npz: no such file"),
    (["--data", "{tmp}/junk.npz"], "junk.npz: cannot read as .npz"),
    (["--data", "{tmp}/noy.npz"], "missing array(s) ['y']"),
    (["--data", "{tmp}/rows.npz"], "X has 10 rows, y has 9"),
    (["--data", "{tmp}/nan.npz"], "X holds NaN or Inf"),
    (["--data", "{tmp}/fracy.npz"], "y must hold integer class labels"),
    (["--data", "{tmp}/onlytest.npz"], "X_test and y_test go together"),
    (["--data", "{tmp}/oneclass.npz"], "classification needs at least 2"),
    (["--data", "{tmp}/x1d.npz"], "X must be 2-D"),
    (["--data", "{tmp}/testwidth.npz"], "X_test has 3 features, X has 2"),
    (["--compress", "zip"], "argument --compress: expected METHOD[:key=value,...]"),
    (["--compress", "topk:ratio"], "argument --compress: expected key=value after topk:"),
    (["--data", "{tmp}/good.npz", "--compress", "topk:bogus=1"], "--compress topk: got an unexpected keyword"),
    (["--data", "{tmp}/good.npz", "--compress", "topk:ratio=2"], "ratio"),
    (["--data", "{tmp}/good.npz", "--error-feedback"], "--error-feedback needs --compress"),
    (["--data", "{tmp}/good.npz", "--resume", "{tmp}/missing.ckpt"],
     "missing.ckpt" if HAS_CHECKPOINT else "checkpoints need arraytrain.save"),
]


@pytest.mark.parametrize("args, text", BAD_ARGS, ids=[" ".join(a[0][:2]) + f" {i}" for i, a in enumerate(BAD_ARGS)])
def test_bad_arguments_one_line(tmp_path, capsys, args, text):
    tmp = _bad_files(tmp_path)
    rc, out, err = run(capsys, *QUIET, *[a.format(tmp=tmp) for a in args])
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("arraytrain train: error:") and text in lines[0], lines[0]
    assert "Traceback" not in err + out


def test_bad_arguments_count():
    assert len(BAD_ARGS) == 29


def test_missing_extras_one_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    rc, _, err = run(capsys, *QUIET)
    assert rc == 2 and err.strip() == ("arraytrain train: error: the digits data set needs sklearn: "
                                       "pip install 'arraytrain[train]'")
    monkeypatch.setitem(sys.modules, "tqdm", None)
    rc, _, err = run(capsys)
    assert rc == 2 and "pip install 'arraytrain[train]'" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc, _, err = run(capsys, *QUIET, "--plot", "x.png")
    assert rc == 2 and "pip install 'arraytrain[plot]'" in err


def test_no_command_and_help(capsys):
    assert main([]) == 2
    assert "train" in capsys.readouterr().err
    assert main(["train", "--help"]) == 0
    assert "--optimizer" in capsys.readouterr().out


def test_python_dash_m(tmp_path):
    data = small_npz(tmp_path / "d.npz")
    res = subprocess.run([sys.executable, "-m", "arraytrain", "train", "--data", str(data), "--epochs", "1",
                          *QUIET], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "test accuracy" in res.stdout


@pytest.mark.skipif(not HAS_SCHEDULE, reason="Engine(schedule=...) is not in this build")
@pytest.mark.parametrize("schedule", ["cosine", "step", "plateau", "constant"])
def test_schedules(tmp_path, capsys, schedule):
    js = tmp_path / "s.json"
    rc, _, err = run(capsys, "--data", str(small_npz(tmp_path / "d.npz")), "--epochs", "3", *QUIET,
                     "--schedule", schedule, "--warmup", "2", "--lr", "0.01", "--json", str(js))
    assert rc == 0, err
    lrs = [h["lr"] for h in json.loads(js.read_text())["history"]]
    if schedule in ("cosine", "step"):
        assert lrs[-1] < 0.01


@pytest.mark.skipif(not HAS_CHECKPOINT, reason="arraytrain.save/load are not in this build")
def test_save_resume_continues_bitwise(tmp_path, capsys):
    data = str(small_npz(tmp_path / "d.npz"))
    common = ["--data", data, *QUIET, "--batch-size", "16", "--accumulation", "3"]
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    ja, jb = tmp_path / "a.json", tmp_path / "b.json"
    assert run(capsys, *common, "--epochs", "4", "--save", str(a), "--json", str(ja))[0] == 0
    assert run(capsys, *common, "--epochs", "2", "--save", str(b))[0] == 0
    rc, out, err = run(capsys, *common, "--epochs", "4", "--resume", str(b), "--save", str(b), "--json", str(jb))
    assert rc == 0, err
    assert "resumed at epoch 2" in out and "epoch 3/4" in out and "epoch 1/4" not in out
    sa, sb = json.loads(ja.read_text()), json.loads(jb.read_text())
    assert sb["epochs"] == 4 and sa["final_loss"] == sb["final_loss"]
    assert sa["test_accuracy"] == sb["test_accuracy"]
    assert a.read_bytes() != b""
    from arraytrain import nn

    engines = []
    for path in (a, b):
        model = nn.MLP([5, 128, 64, 3])
        engine = at.Engine(model.init(seed=0), at.optim.AdamW(), accumulation_steps=3, zero_grad_on_step=False)
        assert at.load(path, engine)["epoch"] == 4
        engines.append(engine)
    np.testing.assert_array_equal(engines[0].params.flat, engines[1].params.flat)
    # a checkpoint of another shape is refused in one line
    rc, _, err = run(capsys, *common, "--hidden", "8", "--resume", str(a))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and str(a) in err
