"""``arraytrain train`` reaching the library's capabilities: gradient prediction, pruning, int8
evaluation, low precision and compression with error feedback, each against plain training.

Short runs on digits (6 epochs, where plain training reaches ~95% test accuracy): the bounds
are looser than the 20-epoch figures in docs/guide.md, but each would catch a flag that does
nothing or breaks training.
"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest

import arraytrain as at
from arraytrain import nn
from arraytrain.cli import main
from arraytrain.prune import MaskBuffer

pytest.importorskip("sklearn")
EPOCHS = ["--epochs", "6", "--no-progress"]


def train(tmp_path, *args, name="run"):
    """Run the command in-process; return (stdout, the JSON summary)."""
    js = tmp_path / f"{name}.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["train", *EPOCHS, "--json", str(js), *args])
    assert rc == 0, out.getvalue()
    return out.getvalue(), json.loads(js.read_text())


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return train(tmp_path_factory.mktemp("plain"))[1]


def test_plain_reference(plain):
    assert plain["test_accuracy"] > 0.9
    assert plain["precision"] == "fp32" and plain["prediction"] is None and plain["sparsity"] is None


def test_predict(tmp_path, plain):
    out, run = train(tmp_path, "--predict")
    assert "gradient prediction: full 2, predict 6, correct every 3, history 4, beta 1" in out
    p = run["prediction"]
    assert p["optimizer_steps"] == run["optimizer_steps"] == plain["optimizer_steps"]
    assert p["backward_passes"] < 0.5 * p["optimizer_steps"] and p["step_ratio"] > 2
    assert f"{p['backward_passes']} backward passes" in out
    assert abs(run["test_accuracy"] - plain["test_accuracy"]) < 0.03
    assert all("backward_passes" in h for h in run["history"])

    out, run = train(tmp_path, "--predict", "full=3,predict=4,correct=2,history=3,beta=0.5", name="spec")
    assert "full 3, predict 4, correct every 2, history 3, beta 0.5" in out
    assert run["prediction"]["full_steps"] == 3 and run["prediction"]["predict_steps"] == 4


def test_predict_resumes_mid_phase(tmp_path):
    """--save/--resume with --predict keep the phase controller: the resumed run is the straight one."""
    ckpt = tmp_path / "p.safetensors"
    _, straight = train(tmp_path, "--predict", name="straight")
    main(["train", "--epochs", "3", "--no-progress", "--predict", "--save", str(ckpt)])
    out, resumed = train(tmp_path, "--predict", "--resume", str(ckpt), name="resumed")
    assert "resumed at epoch 3" in out
    assert resumed["final_loss"] == straight["final_loss"]
    assert resumed["prediction"]["backward_passes"] == straight["prediction"]["backward_passes"]
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in straight["history"]]


def test_prune(tmp_path, plain):
    out, run = train(tmp_path, "--prune", "0.5")
    assert "pruning 50% of the weights at the end of epochs 1-3" in out
    weights = (64 * 128 + 128 * 64 + 64 * 10)
    assert run["sparsity"] == (weights // 2) / weights
    # the cubic schedule over epochs 1-3: 0.5 * (1 - (1 - j/3)^3), then kept
    want = [0.5 * (1 - (1 - j / 3) ** 3) for j in (1, 2, 3)] + [0.5] * 3
    np.testing.assert_allclose([h["sparsity"] for h in run["history"]], want, atol=1e-4)
    assert abs(run["test_accuracy"] - plain["test_accuracy"]) < 0.03

    # one cut at the end of epoch 4, saved with the engine: the zeros are in the checkpoint
    ckpt = tmp_path / "pruned.safetensors"
    _, run = train(tmp_path, "--prune", "0.75", "--prune-epochs", "4", "--save", str(ckpt), name="once")
    sparsity = [h["sparsity"] for h in run["history"]]
    assert sparsity[:3] == [0.0] * 3 and sparsity[3:] == pytest.approx([0.75] * 3, abs=1e-4)
    model = nn.MLP([64, 128, 64, 10])
    engine = at.Engine(model.init(seed=0), at.optim.AdamW(), zero_grad_on_step=False)
    engine.set_mask(MaskBuffer.ones(engine.layout))
    at.load(ckpt, engine)
    assert at.sparsity(engine.mask)["total"] > 0.7
    for name in ("fc1.weight", "fc2.weight", "fc3.weight"):
        assert np.all(engine.params[name][engine.mask[name] == 0] == 0)


def test_quantize_eval(tmp_path, plain):
    out, run = train(tmp_path, "--quantize-eval", "int8")
    q = run["quantized"]
    assert run["test_accuracy"] == plain["test_accuracy"]  # the float model is untouched
    assert abs(q["test_accuracy"] - run["test_accuracy"]) <= 0.006  # two test samples of 359
    assert q["int8_bytes"] < q["float_bytes"] / 3
    assert f"int8 weights (symmetric, per output channel): test accuracy {q['test_accuracy']:.4f}" in out


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_precision(tmp_path, plain, precision):
    out, run = train(tmp_path, "--precision", precision)
    assert run["precision"] == precision and f"precision {precision} (float32 master weights" in out
    assert abs(run["test_accuracy"] - plain["test_accuracy"]) < 0.03
    assert run["final_loss"] != plain["final_loss"]  # the working copy did drive the passes
    if precision == "fp16":
        assert run["loss_scale"] > 1 and "dynamic loss scaling" in out
    else:
        assert run["loss_scale"] is None


def test_compression_with_error_feedback(tmp_path):
    """PowerSGD rank 2 with error feedback sends 15x fewer bytes; compressed training starts slower,
    so this one runs 10 epochs against a plain run of 10."""
    ten = ["--epochs", "10"]
    _, plain10 = train(tmp_path, *ten, name="plain10")
    out, run = train(tmp_path, *ten, "--compress", "powersgd:rank=2", "--error-feedback")
    assert "compressed: ErrorFeedback(PowerSGD(" in out
    assert run["dense_bytes_per_step"] / run["payload_bytes_per_step"] > 10
    assert abs(run["test_accuracy"] - plain10["test_accuracy"]) < 0.02


def test_random_k_with_error_feedback_is_not_rescaled(tmp_path, plain):
    """Rescaled by n/k, random-k's residual grows every time an element is drawn and the run diverges
    (NaN within 2 epochs at 5%); with --error-feedback the CLI sends the drawn values unscaled."""
    out, run = train(tmp_path, "--compress", "randomk:ratio=0.25", "--error-feedback")
    assert "RandomK(" in out and "rescale=False" in out
    assert abs(run["test_accuracy"] - plain["test_accuracy"]) < 0.03
    out, _ = train(tmp_path, "--compress", "randomk:ratio=0.05", "--epochs", "1", name="unbiased")
    assert "rescale=True" in out  # without error feedback: the unbiased form, as the library's default


CAPABILITIES = {
    "bf16": ["--precision", "bf16"],
    "fp16": ["--precision", "fp16"],
    "topk-ef": ["--compress", "topk:ratio=0.01", "--error-feedback"],
    "predict": ["--predict"],
    "prune-int8": ["--prune", "0.5", "--quantize-eval", "int8"],
}


@pytest.mark.parametrize("flags", list(CAPABILITIES.values()), ids=list(CAPABILITIES))
def test_capability_on_the_gpu_as_on_the_cpu(tmp_path, flags):
    """Each capability flag with ``--device cuda`` trains as the CPU run with the same flags does
    (the kernels agree to rounding; over six epochs the test accuracies stay within a few samples)."""
    from cuda_family import require_cuda

    require_cuda()
    _, cpu = train(tmp_path, *flags, name="cpu")
    out, gpu = train(tmp_path, *flags, "--device", "cuda", name="gpu")
    assert gpu["config"]["device"] == "cuda" and cpu["config"]["device"] == "cpu"
    assert abs(gpu["test_accuracy"] - cpu["test_accuracy"]) < 0.015, (cpu["test_accuracy"], gpu["test_accuracy"])
    for key in ("precision", "prediction", "sparsity", "loss_scale"):
        if isinstance(cpu.get(key), (str, type(None))):
            assert gpu.get(key) == cpu.get(key), key
    if "--prune" in flags:
        assert gpu["sparsity"] == pytest.approx(cpu["sparsity"], abs=0.01)
    if "--quantize-eval" in flags:
        assert abs(gpu["quantized"]["test_accuracy"] - cpu["quantized"]["test_accuracy"]) < 0.015
    if "--predict" in flags:
        assert gpu["prediction"]["backward_passes"] == cpu["prediction"]["backward_passes"]


# -- the Trainer's working copy, which --precision drives ----------------------------------------
def _blobs(n=96, seed=0):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 3
    x = np.random.default_rng(0).standard_normal((3, 6))[y] * 2 + rng.standard_normal((n, 6))
    return x.astype(np.float32), y


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_trainer_forward_reads_the_working_copy(dtype):
    x, y = _blobs()
    model = nn.MLP([6, 16, 3])
    engine = at.Engine(model.init(seed=0), at.optim.AdamW(lr=1e-2), zero_grad_on_step=False, working_dtype=dtype)
    trainer = nn.Trainer(model, engine, batch_size=16)
    trainer.fit(x, y, epochs=10)
    trainer.evaluate(x, y)  # refreshes the model's weights from the working copy
    for name in model.shapes:
        np.testing.assert_array_equal(model.params[name], engine.working[name].astype(np.float32))
    assert np.any(model.params["fc1.weight"] != engine.params["fc1.weight"])  # rounded, not the master
    assert trainer.evaluate(x, y)["accuracy"] > 0.9


def test_trainer_fp16_overflow_skips_and_backs_off():
    """A loss scale far too large overflows float16 gradients: those steps are skipped, the scale halves
    until the gradients fit, and training goes on from there."""
    x, y = _blobs()
    model = nn.MLP([6, 16, 3])
    engine = at.Engine(model.init(seed=0), at.optim.AdamW(lr=1e-2), zero_grad_on_step=False,
                       working_dtype="float16", loss_scaler=at.LossScaler(init_scale=2.0**24))
    trainer = nn.Trainer(model, engine, batch_size=16)
    history = trainer.fit(x, y, epochs=10)
    skipped = sum(h["skipped_steps"] for h in history)
    assert skipped > 0 and engine.loss_scale == 2.0**24 / 2**skipped
    assert history[-1]["loss_scale"] == engine.loss_scale
    assert engine.state.step == 10 * 6 - skipped
    assert trainer.evaluate(x, y)["accuracy"] > 0.9
