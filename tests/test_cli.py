"""``arraytrain train``, run in-process through ``arraytrain.cli.main``."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import arraytrain as at
from arraytrain import cli
from arraytrain.cli import main, optimizers

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


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_default_dataset_json(tmp_path, capsys):
    pytest.importorskip("sklearn")
    js = tmp_path / "out.json"
    rc, out, err = run(capsys, "--epochs", "2", *QUIET, "--json", str(js))
    assert rc == 0, err
    assert "epoch 2/2" in out and "test accuracy" in out and "samples/s" in out and "forward" in out
    summary = json.loads(js.read_text())
    assert summary["epochs"] == 2 and len(summary["history"]) == 2
    assert summary["test_accuracy"] > 0.8
    assert summary["samples_per_second"] > 0 and "samples_per_second" in summary["history"][0]
    assert summary["final_loss"] == summary["history"][-1]["loss"]
    assert set(summary["time_split_seconds"]) >= {"forward", "backward", "optimizer", "callbacks"}


def test_progress_bar_on_a_terminal_only(tmp_path, capsys, monkeypatch):
    pytest.importorskip("tqdm")
    data = small_npz(tmp_path / "d.npz")
    args = ["--data", str(data), "--epochs", "2", "--optimizer", "sgd", "--momentum", "0.9", "--hidden", "16",
            "--activation", "tanh", "--accumulation", "2", "--clip", "1.0", "--batch-size", "8", "--dtype",
            "float64", "--patience", "5"]
    rc, out, err = run(capsys, *args)  # stderr is not a terminal here: no bar, nothing on stderr
    assert rc == 0 and err == "", err
    assert "model [5, 16, 3]" in out and "SGD(lr=0.05, momentum=0.9" in out
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    rc, out, _ = run(capsys, *args)
    assert rc == 0
    bar = term.getvalue()
    # one bar over the run: 8 micro-batches an epoch, 16 in all, with the epoch, loss and accuracy
    assert "16/16" in bar and "epoch=2/2" in bar and "loss=" in bar and "acc=" in bar
    assert "/8 " not in bar  # no bar per epoch
    assert out.count("epoch 1/2") == 1 and "epoch 1/2" not in bar  # the epoch lines go to stdout
    rc, _, _ = run(capsys, *args, "--no-progress")
    assert rc == 0 and len(term.getvalue()) == len(bar)


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
                       "--compress", "topk:ratio=0.05,ramp=0", *(["--error-feedback"] if ef else []))
    assert rc == 0, err
    assert ("compressed: ErrorFeedback(TopK(" if ef else "compressed: TopK(") in out
    summary = json.loads(js.read_text())
    assert summary["processes"] == 1
    assert summary["dense_bytes_per_step"] / summary["payload_bytes_per_step"] > 8
    assert f"{summary['payload_bytes_per_step']:,.0f} bytes/step" in out


def test_sparsifier_ramps_over_two_epochs_by_default(tmp_path, capsys):
    """Without warmup= or ramp=, top-k keeps 1/4, then 1/16 of the gradient for an epoch each, then its
    ratio: the bytes per step are exactly those three sizes' mean over a 3-epoch run."""
    data = small_npz(tmp_path / "d.npz")
    js = tmp_path / "s.json"
    rc, out, err = run(capsys, "--data", str(data), "--epochs", "3", *QUIET, "--json", str(js),
                       "--compress", "topk:ratio=0.05")
    assert rc == 0, err
    summary = json.loads(js.read_text())
    per_epoch = summary["optimizer_steps"] // 3
    schedule = f"1/4, 1/16 kept over the next {2 * per_epoch} calls; then ratio 0.05"
    assert summary["compression_schedule"] == schedule and f"ramp={2 * per_epoch}" in out and schedule in out
    n = int(summary["dense_bytes_per_step"]) // 4
    ks = [math.ceil(n / 4), math.ceil(n / 16), math.ceil(0.05 * n)]
    assert summary["payload_bytes_per_step"] == pytest.approx(8 * sum(ks) / 3, rel=1e-12)


def test_error_feedback_is_the_methods_default(tmp_path, capsys):
    """PowerSGD's algorithm includes error feedback: on unless --no-error-feedback; top-k: off unless asked."""
    data = small_npz(tmp_path / "d.npz")
    for flags, shown in ((["powersgd"], "ErrorFeedback(PowerSGD("), (["powersgd", "--no-error-feedback"], "PowerSGD("),
                         (["topk:ratio=0.1"], "TopK("), (["topk:ratio=0.1", "--error-feedback"], "ErrorFeedback(TopK(")):
        rc, out, err = run(capsys, "--data", str(data), "--epochs", "1", *QUIET, "--compress", *flags)
        assert rc == 0, err
        assert f"compressed: {shown}" in out, flags


def test_compress_auto_in_one_process_says_dense_once(tmp_path, capsys):
    data = small_npz(tmp_path / "d.npz")
    js = tmp_path / "s.json"
    rc, out, err = run(capsys, "--data", str(data), "--epochs", "2", *QUIET, "--json", str(js), "--compress", "auto")
    assert rc == 0, err
    assert "compressed: Auto({powersgd=ErrorFeedback(PowerSGD(" in out
    assert out.count("compression auto, step 0: dense (one process: nothing travels") == 1
    summary = json.loads(js.read_text())
    assert [d["choice"] for d in summary["compression_decisions"]] == ["dense"]
    assert summary["payload_bytes_per_step"] == summary["dense_bytes_per_step"]
    rc, _, err = run(capsys, "--data", str(data), "--epochs", "1", *QUIET, "--compress", "auto:gain=0.5")
    assert rc == 2 and "--compress auto:gain=0.5: gain:" in err


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
    (tmp / "run.json").write_text("{}")
    np.savez(tmp / "objects.npz", X=np.array([{}], dtype=object), y=np.zeros(1))
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
    (["--step-epochs", "2"], "--step-epochs applies to --schedule step only"),
    (["--data", "{tmp}/junk.npz"], "--data {tmp}/junk.npz: not an .npz archive (the zip of .npy arrays"),
    (["--data", "{tmp}/run.json"], "run.json: not an .npz archive"),  # not "allow_pickle"
    (["--data", "{tmp}/objects.npz"], "objects.npz: holds an object array (pickled Python objects)"),
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
    (["--data", "{tmp}/good.npz", "--compress", "topk:ratio=2"],
     "--compress topk:ratio=2: ratio: expected a value in (0.0, 1.0], got 2.0"),
    (["--data", "{tmp}/good.npz", "--compress", "topk:ratio=2", "--error-feedback"],
     "--compress topk:ratio=2 --error-feedback: ratio:"),
]


@pytest.mark.parametrize("args, text", BAD_ARGS, ids=[" ".join(a[0][:2]) + f" {i}" for i, a in enumerate(BAD_ARGS)])
def test_bad_arguments_one_line(tmp_path, capsys, args, text):
    tmp = _bad_files(tmp_path)
    rc, out, err = run(capsys, *QUIET, *[a.format(tmp=tmp) for a in args])
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("arraytrain train: error:") and text.format(tmp=tmp) in lines[0], lines[0]
    assert "Traceback" not in err + out and "allow_pickle" not in err


def test_bad_arguments_count():
    assert len(BAD_ARGS) == 26


# Refused before the data are loaded: no training, nothing on stdout, one line on stderr, exit 2.
# "{tmp}" is a scratch directory holding good.npz.
EARLY = [
    (["--save", "/nonexistent_dir/x.safetensors"], "--save /nonexistent_dir/x.safetensors: no such directory"),
    (["--json", "/nonexistent_dir/x.json"], "--json /nonexistent_dir/x.json: no such directory"),
    (["--plot", "/nonexistent_dir/x.png"], "--plot /nonexistent_dir/x.png: no such directory"),
    (["--json", "{tmp}/good.npz/x.json"], "no such directory"),  # the "directory" is a file
    (["--json", "{tmp}"], "is a directory"),
    (["--plot", "{tmp}/curves.txt"], "matplotlib cannot write a .txt file; use one of"),
    (["--plot", "{tmp}/curves"], "matplotlib cannot write a file name without an extension"),
    (["--save", "{tmp}/run-{step}.safetensors"], "the only field a file name may hold is {{epoch}}"),
    (["--json", "{tmp}/same.png", "--plot", "{tmp}/same.png"], "--json and --plot name the same file"),
    (["--save", "{tmp}/good.npz", "--data", "{tmp}/good.npz"], "--save and --data name the same file"),
    (["--data", "{tmp}/missing.npz"], "--data {tmp}/missing.npz: no such file"),
    (["--data", "{tmp}"], "--data {tmp}: is a directory"),
    (["--resume", "{tmp}/missing.ckpt"], "--resume {tmp}/missing.ckpt: no such file"),
    (["--checkpoint-every", "2"], "--checkpoint-every needs --save"),
    (["--optimizer", "adam", "--momentum", "0.9"], "--momentum: adam has no momentum"),
    (["--error-feedback"], "--error-feedback needs --compress"),
    (["--no-error-feedback"], "--no-error-feedback needs --compress"),
    (["--compress", "topk:bogus=1"], "--compress topk: got an unexpected keyword"),
    (["--compress", "randomk:ratio=0.1,rescale=true", "--error-feedback"], "scales what it keeps up by n/k"),
    (["--predict", "--accumulation", "2"], "--predict needs one micro-batch per optimizer step"),
    (["--predict", "--precision", "bf16"], "--predict with --precision"),
    (["--predict", "full=0"], "argument --predict: full: expected a whole number >= 1"),
    (["--predict", "bogus=1"], "argument --predict: expected key=value with key one of full, predict"),
    (["--predict", "beta=2"], "argument --predict: beta: expected a number in [0, 1]"),
    (["--predict", "adaptive=true"], "full_steps: 2 is outside its bounds [5, 50]"),
    (["--prune", "1.5"], "argument --prune: expected a number in (0, 1)"),
    (["--prune-epochs", "2"], "--prune-epochs needs --prune RATIO"),
    (["--prune", "0.5", "--prune-epochs", "3-30"], "--prune-epochs 3-30: past --epochs 20"),
    (["--prune", "0.5", "--prune-epochs", "4-2"], "argument --prune-epochs: expected 1 <= N <= M"),
    (["--quantize-eval", "int4"], "argument --quantize-eval: invalid choice"),
    (["--precision", "bf16", "--dtype", "float64"], "--precision bf16 keeps float32 master weights"),
    # the file itself cannot be created there, though the directory's permission bits say yes
    (["--save", "/proc/x.at"], "--save /proc/x.at: cannot create the file there"),
    (["--json", "/proc/x.json"], "--json /proc/x.json: cannot create the file there"),
    (["--plot", "/proc/x.png"], "--plot /proc/x.png: cannot create the file there"),
    (["--json", "{tmp}/" + "n" * 300 + ".json"], "cannot create the file there (File name too long)"),
    (["--val-fraction", "0.99"], "--val-fraction 0.99 and --test-fraction 0.2 leave no training data"),
    (["--val-fraction", "0.5", "--test-fraction", "0.5", "--data", "{tmp}/good.npz"],
     "--val-fraction 0.5 and --test-fraction 0.5 leave no training data"),
]


@pytest.mark.parametrize("args, text", EARLY, ids=[" ".join(a[0][:2]) + f" {i}" for i, a in enumerate(EARLY)])
def test_refused_before_training(tmp_path, capsys, monkeypatch, args, text):
    if any(a.startswith("--plot") for a in args):
        pytest.importorskip("matplotlib")
    if any(a.startswith("/proc/") for a in args) and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    small_npz(tmp_path / "good.npz")
    loaded = []
    monkeypatch.setattr(cli.run, "_load_data", lambda a: loaded.append(a))  # the first step of a run
    rc, out, err = run(capsys, *QUIET, *[a.format(tmp=tmp_path, step="{step}") for a in args])
    assert rc == 2 and out == "" and not loaded
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("arraytrain train: error:") and text.format(tmp=tmp_path) in lines[0], lines[0]


def test_refused_before_training_count():
    assert len(EARLY) == 37


def test_output_probe_leaves_nothing_behind_and_clobbers_nothing(tmp_path, capsys, monkeypatch):
    """The outputs are created (and removed) or opened for writing before the run; a refusal after
    the probe (here --plot's format, checked next) leaves no new file and an existing one as it was."""
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(cli.run, "_load_data", lambda a: pytest.fail("loaded the data"))
    old = tmp_path / "old.json"
    old.write_text("keep me")
    os.utime(old, (1_000_000, 1_000_000))
    for target in (tmp_path / "new.json", old):
        rc, out, err = run(capsys, *QUIET, "--json", str(target), "--save", str(tmp_path / "run-{epoch}.at"),
                           "--plot", str(tmp_path / "curves.txt"))
        assert rc == 2 and "--plot" in err and out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]
    assert old.read_text() == "keep me" and old.stat().st_mtime == 1_000_000
    if os.access("/dev/stdout", os.W_OK):  # a device is written in place, not probed
        cli.arguments.check_output("--json", "/dev/stdout")


def test_only_the_rank_that_writes_probes_the_outputs(tmp_path):
    """Rank 0 writes --json, --plot and --save: another rank (on a node without that folder) neither
    probes nor touches those paths, and still checks the inputs it reads and names used twice."""
    args = cli.build_parser().parse_args(["train", "--json", str(tmp_path / "no" / "s.json"),
                                                    "--save", str(tmp_path / "no" / "a.at")])
    with pytest.raises(cli.arguments.UsageError, match="no such directory"):
        cli.arguments.check_files(args, writes=True)
    cli.arguments.check_files(args, writes=False)  # nothing probed: the folder need not exist here
    assert not (tmp_path / "no").exists()
    args.resume = str(tmp_path / "missing.at")
    with pytest.raises(cli.arguments.UsageError, match="--resume"):
        cli.arguments.check_files(args, writes=False)
    args.resume, args.json = None, args.save
    with pytest.raises(cli.arguments.UsageError, match="name the same file"):
        cli.arguments.check_files(args, writes=False)


def test_every_output_is_announced(tmp_path, capsys):
    """--checkpoint-every's saves, the last --save, --json and --plot each say what was written where."""
    pytest.importorskip("matplotlib")
    data = small_npz(tmp_path / "d.npz")
    ck, js, png = tmp_path / "run-{epoch}.at", tmp_path / "s.json", tmp_path / "c.png"
    rc, out, err = run(capsys, "--data", str(data), "--epochs", "3", *QUIET, "--save", str(ck),
                       "--checkpoint-every", "2", "--json", str(js), "--plot", str(png))
    assert rc == 0, err
    lines = out.splitlines()
    saved = [line for line in lines if line.startswith("saved ")]
    assert saved == [f"saved {tmp_path}/run-2.at (epoch 2)", f"saved {tmp_path}/run-3.at (epoch 3)"]
    assert lines.index(saved[0]) == lines.index(next(x for x in lines if x.startswith("epoch 2/3"))) + 1
    assert f"wrote the JSON summary to {js}" in lines and f"drew the loss and accuracy curves to {png}" in lines
    assert js.exists() and png.exists()
    rc, out, err = run(capsys, "--data", str(data), "--epochs", "1", *QUIET, "--save", str(tmp_path / "a.at"))
    assert rc == 0 and f"saved {tmp_path}/a.at (epoch 1)" in out.splitlines()


def test_resume_names_the_architecture_flags(tmp_path, capsys):
    data = str(small_npz(tmp_path / "d.npz"))
    ckpt = tmp_path / "a.at"
    assert run(capsys, "--data", data, "--epochs", "1", *QUIET, "--hidden", "16,8", "--save", str(ckpt))[0] == 0
    for flags, text in ((["--hidden", "16"], "trained with --hidden 16,8, this run asks for --hidden 16"),
                        (["--hidden", "16,8", "--activation", "tanh"],
                         "trained with --activation relu, this run asks for --activation tanh")):
        rc, out, err = run(capsys, "--data", data, "--epochs", "2", *QUIET, *flags, "--resume", str(ckpt))
        assert rc == 2 and "epoch 2/2" not in out
        assert err.strip() == f"arraytrain train: error: --resume {ckpt}: the checkpoint's model was {text}: " \
                              "the architecture differs; give the flags it was trained with"
    # a checkpoint without the command's config (saved from Python): the loader's message, with the hint
    import arraytrain as at_

    at_.save(tmp_path / "bare.at", at_.Engine({"w": np.ones(3, np.float32)}, at_.optim.AdamW()), extra={"epoch": 1})
    rc, _, err = run(capsys, "--data", data, "--epochs", "2", *QUIET, "--resume", str(tmp_path / "bare.at"))
    assert rc == 2 and err.startswith(f"arraytrain train: error: --resume {tmp_path}/bare.at: params:")
    assert "resume with the --hidden, --activation and --dtype it was trained with" in err


def test_resuming_a_finished_run_says_nothing_was_left(tmp_path, capsys):
    data = str(small_npz(tmp_path / "d.npz"))
    ckpt, js = tmp_path / "a.at", tmp_path / "s.json"
    assert run(capsys, "--data", data, "--epochs", "2", *QUIET, "--save", str(ckpt))[0] == 0
    rc, out, err = run(capsys, "--data", data, "--epochs", "2", *QUIET, "--resume", str(ckpt), "--json", str(js))
    assert rc == 0, err
    assert f"nothing left to train: --resume {ckpt} is at epoch 2 of --epochs 2" in out
    assert "samples/s" not in out and "0 micro-batches" not in out and "test accuracy" in out
    summary = json.loads(js.read_text())
    assert summary["samples_per_second"] is None and summary["micro_batches_this_run"] == 0


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"arraytrain {at.__version__}"


def test_throughput_is_the_best_and_median_epoch(tmp_path, capsys):
    """The figure is per timed epoch (the warm-up left out), the fastest and the median, and says what it measures."""
    js = tmp_path / "s.json"
    rc, out, err = run(capsys, "--data", str(small_npz(tmp_path / "d.npz")), "--epochs", "4", *QUIET,
                       "--json", str(js))
    assert rc == 0, err
    summary = json.loads(js.read_text())
    rates = [h["samples_per_second"] for h in summary["history"]]
    assert len(rates) == 4 and all(r > 0 for r in rates)
    tp = summary["throughput_samples_per_second"]
    assert summary["samples_per_second"] == tp["best"] == max(rates)
    assert tp["median"] == float(np.median(rates)) and tp["epochs"] == 4 and tp["mean"] > 0
    assert "after the warm-up" in tp["measures"] and "not the evaluation" in tp["measures"]
    line = next(x for x in out.splitlines() if x.startswith("throughput: "))
    assert f"{tp['best']:,.0f} samples/s in the fastest epoch, {tp['median']:,.0f} the median of 4 epochs" in line
    assert "(measures training samples per second" in out


def test_lr_too_high_ends_in_one_line_without_numpy_warnings(capsys):
    pytest.importorskip("sklearn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc, out, err = run(capsys, *QUIET, "--lr", "1e6", "--epochs", "3")
    assert rc == 2
    assert [w for w in caught if issubclass(w.category, RuntimeWarning)] == []
    assert err.count("\n") == 1 and "training diverged: try a smaller --lr (now 1e+06)" in err
    assert "epoch 1/3" in out and "skipped" in out  # the epoch line counts the skipped steps


def test_figures_name_their_units(tmp_path, capsys):
    """Micro-batches and optimizer steps are told apart, and the warm-up is reported on its own."""
    js = tmp_path / "s.json"
    rc, out, err = run(capsys, "--data", str(small_npz(tmp_path / "d.npz")), "--epochs", "3", *QUIET,
                       "--batch-size", "8", "--accumulation", "4", "--json", str(js))
    assert rc == 0, err
    summary = json.loads(js.read_text())
    # 58 training samples in batches of 8: 8 micro-batches an epoch, 2 optimizer steps
    assert summary["micro_batches"] == summary["micro_batches_this_run"] == 24
    assert summary["optimizer_steps"] == 6
    assert [h["micro_batches"] for h in summary["history"]] == [8, 16, 24]
    assert [h["optimizer_steps"] for h in summary["history"]] == [2, 4, 6]
    assert all("steps" not in h for h in summary["history"])
    # the first accumulated and the first applied micro-batch compile: both are the warm-up
    assert summary["warmup_micro_batches"] == 2 and summary["warmup_seconds"] > 0
    assert "warm-up: " in out and "in 2 micro-batches" in out
    assert "22 of the 24 micro-batches of this run timed (6 optimizer steps in all)" in out


def test_trainer_keeps_the_warmup_out_of_the_figures():
    x, y = np.random.default_rng(0).standard_normal((64, 5)).astype(np.float32), np.arange(64) % 3
    model = at.nn.MLP([5, 8, 3])
    engine = at.Engine(model.init(seed=0), at.optim.AdamW(), accumulation_steps=4, zero_grad_on_step=False)
    trainer = at.nn.Trainer(model, engine, batch_size=8)
    trainer.fit(x, y, epochs=2)
    assert trainer.steps == 16 and trainer.warmup_batches == 2
    assert trainer._timed_samples == 64 * 2 - 16
    per_batch = sum(trainer.timings[k] for k in ("data", "forward", "backward", "optimizer"))
    assert per_batch <= trainer._timed_seconds  # no phase holds warm-up time


def test_missing_extras_one_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    rc, _, err = run(capsys, *QUIET)
    assert rc == 2 and err.strip() == ("arraytrain train: error: the digits data set needs sklearn: "
                                       "pip install 'arraytrain[train]'")
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setattr(sys, "stderr", _Terminal())  # the bar is wanted on a terminal only
    rc = main(["train"])
    err = sys.stderr.getvalue()
    monkeypatch.undo()
    assert rc == 2 and "pip install 'arraytrain[train]'" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc, _, err = run(capsys, *QUIET, "--plot", "x.png")
    assert rc == 2 and "pip install 'arraytrain[plot]'" in err


def test_no_command_and_help(capsys):
    assert main([]) == 2
    assert "train" in capsys.readouterr().err
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--optimizer" in text and "``" not in text
    help_of, flag = {}, None
    for line in text.split("options:")[1].splitlines():  # "  --flag ARG   help" with continuation lines
        if line.startswith("  -"):
            flag = line.split()[0]
            help_of[flag] = line
        elif flag:
            help_of[flag] += " " + line.strip()
    for name in ("--accumulation", "--clip", "--momentum", "--precision", "--prune-epochs", "--predict",
                 "--warmup", "--epochs", "--batch-size", "--seed"):
        assert "default:" in help_of[name], help_of[name]


def test_python_dash_m(tmp_path):
    data = small_npz(tmp_path / "d.npz")
    res = subprocess.run([sys.executable, "-m", "arraytrain", "train", "--data", str(data), "--epochs", "1",
                          *QUIET], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "test accuracy" in res.stdout


@pytest.mark.parametrize("schedule", ["cosine", "step", "plateau", "constant"])
def test_schedules(tmp_path, capsys, schedule):
    js = tmp_path / "s.json"
    rc, _, err = run(capsys, "--data", str(small_npz(tmp_path / "d.npz")), "--epochs", "3", *QUIET,
                     "--schedule", schedule, "--warmup", "2", "--lr", "0.01", "--json", str(js))
    assert rc == 0, err
    lrs = [h["lr"] for h in json.loads(js.read_text())["history"]]
    if schedule in ("cosine", "step"):
        assert lrs[-1] < 0.01


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
    # the history covers the whole run, the epochs before the checkpoint included, with the real lr
    assert [h["epoch"] for h in sb["history"]] == [1, 2, 3, 4]
    for key in ("loss", "lr", "val_accuracy", "optimizer_steps", "micro_batches"):
        assert [h[key] for h in sb["history"]] == [h[key] for h in sa["history"]], key
    assert all(h["lr"] == 0.001 for h in sb["history"])
    assert sb["micro_batches"] == sa["micro_batches"] and sb["micro_batches_this_run"] < sa["micro_batches"]
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


def test_a_usage_error_on_one_rank_stops_every_rank():
    """Under mpiexec the ranks agree on validation: a check that fails on one rank only (a file probe)
    raises the same one-line error everywhere, so none goes on to wait in a collective alone."""
    from thread_group import ThreadGroup

    def rank_run(rank, comm):
        def check():
            if rank == 1:
                raise cli.UsageError("arraytrain train: error: --json out.json: not writable")
            return "ok"

        try:
            return cli.arguments.agreed(comm, check)
        except cli.UsageError as exc:
            return str(exc)

    assert ThreadGroup(2).run(rank_run) == ["arraytrain train: error: --json out.json: not writable"] * 2
    assert ThreadGroup(2).run(lambda rank, comm: cli.arguments.agreed(comm, lambda: rank)) == [0, 1]


def test_state_dtype_8bit(tmp_path, capsys):
    """--state-dtype 8bit trains; it is refused where it cannot work, in one line."""
    rc, _, _ = run(capsys, *QUIET, "--state-dtype", "8bit", "--epochs", "1", "--json", str(tmp_path / "r.json"))
    assert rc == 0
    assert json.loads((tmp_path / "r.json").read_text())["test_accuracy"] > 0.5
    for args, text in ((["--optimizer", "adafactor"], "no element-wise state"),
                       (["--dtype", "float64"], "needs float32 parameters")):
        rc, _, err = run(capsys, *QUIET, "--state-dtype", "8bit", "--epochs", "1", *args)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and text in err, err
