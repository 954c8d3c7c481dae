"""The framework examples: zero-copy views, and the oracle optimizers' trajectories over 100 steps.

``examples/torch_interop.py`` (arraytrain AdamW fed by ``loss.backward()``)
against ``torch.optim.AdamW`` (for-loop mode), and ``examples/jax_interop.py``
(JAX gradients handed over through DLPack) against ``optax.adamw``: same
initialisation, same batches, every parameter compared after every step at
the float32 tolerance. Both scripts also run as scripts. ``examples/torch_phase.py``
(gradient prediction driven from a torch loop by ``arraytrain.phase.PhaseController``):
backward passes on FULL/CORRECT steps only, the bound engine and ``torch.optim.AdamW``
on one trajectory, a run resumed from a checkpoint bitwise the uninterrupted one.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import arraytrain as at
from arraytrain.backend import as_array
from conftest import assert_close

pytestmark = pytest.mark.slow  # the slow tier: the examples run as scripts (torch, JAX, phases)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
STEPS = 100
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.1


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def torch_example():
    pytest.importorskip("torch")
    return load_example("torch_interop")


@pytest.fixture(scope="module")
def jax_example():
    pytest.importorskip("jax")
    return load_example("jax_interop")


def _shares(arrays, flat) -> bool:
    return all(np.shares_memory(a, flat) for a in arrays)


@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_torch_example_follows_torch_adamw(torch_example, max_grad_norm):
    import torch

    ex = torch_example
    x, y = ex.make_data(1024, seed=1)
    ours = ex.make_model(seed=3)
    theirs = ex.make_model(seed=3)
    engine = ex.bind(ours, at.optim.AdamW(LR, BETAS, EPS, WD), max_grad_norm=max_grad_norm)
    reference = torch.optim.AdamW(theirs.parameters(), LR, BETAS, EPS, WD, foreach=False)
    names = [n for n, _ in ours.named_parameters()]
    assert names == list(engine.layout.names)
    for (_, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert torch.equal(a, b)  # the same initialisation, now living in the engine's buffer

    clipped = 0
    for step, idx in enumerate(ex.batches(len(x), 32, STEPS, seed=2), 1):
        loss, report = ex.train_step(ours, engine, x[idx], y[idx])
        reference.zero_grad()
        ref_loss = torch.nn.functional.cross_entropy(theirs(x[idx]), y[idx])
        ref_loss.backward()
        if max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(list(theirs.parameters()), max_grad_norm, foreach=False)
            assert_close(np.float32(report.grad_norm), norm.numpy(), err_msg=f"grad norm, step {step}")
            clipped += report.clip_coef < 1
        reference.step()
        assert report.applied and report.step == step
        assert_close(np.float32(loss), np.float32(ref_loss.item()), err_msg=f"loss, step {step}")
        for name, (_, b) in zip(names, theirs.named_parameters()):
            assert_close(engine.params[name], b.detach().numpy(), err_msg=f"{name!r}, step {step}")

    if max_grad_norm is not None:
        assert clipped > 0  # the clipping branch was exercised
    # Still zero-copy after 100 steps: backward() never replaced a .grad, step() never a parameter.
    assert _shares([p.detach().numpy() for p in ours.parameters()], engine.params.flat)
    assert _shares([p.grad.numpy() for p in ours.parameters()], engine.grads.flat)
    assert not np.any(engine.grads.flat)  # zeroed by the optimizer kernel for the next backward()


def test_torch_example_bind_is_zero_copy(torch_example):
    ex = torch_example
    model = ex.make_model(seed=0)
    before = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    engine = ex.bind(model, at.optim.AdamW())
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(engine.params[name], before[name])
        assert np.shares_memory(p.detach().numpy(), engine.params.flat)
        assert np.shares_memory(p.grad.numpy(), engine.grads.flat)
    engine.params.flat[:] = 0  # a write to the engine's buffer is the model's new weights
    assert all(not p.detach().abs().sum() for p in model.parameters())


def test_jax_example_follows_optax_adamw(jax_example):
    import jax
    import jax.numpy as jnp

    optax = pytest.importorskip("optax")
    ex = jax_example
    with jax.default_device(jax.devices("cpu")[0]):  # the example's engine is a CPU one; so is the reference
        _follow_optax_adamw(ex, jax, jnp, optax)


def _follow_optax_adamw(ex, jax, jnp, optax):
    x, y = ex.make_data(1024, seed=1)
    init = ex.init_params(seed=3)
    engine = at.Engine(ex.aligned_params(init), at.optim.AdamW(LR, BETAS, EPS, WD))
    tx = optax.adamw(LR, *BETAS, EPS, weight_decay=WD)
    theirs = {k: jnp.asarray(v) for k, v in init.items()}
    state = tx.init(theirs)

    @jax.jit
    def reference_step(params, state, x, y):
        loss, grads = jax.value_and_grad(ex.loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return loss, optax.apply_updates(params, updates), state

    flat = engine.params.flat
    assert flat.ctypes.data % 64 == 0
    for name, arr in ex.as_jax(engine).items():  # parameters to JAX: DLPack aliases the buffer
        assert arr.unsafe_buffer_pointer() == engine.params[name].ctypes.data, name
    _, grads = ex.value_and_grad(ex.as_jax(engine), x[:8], y[:8])
    for name, g in grads.items():  # gradients to the engine: its intake reads JAX's buffer in place
        assert as_array(g, name).ctypes.data == g.unsafe_buffer_pointer(), name

    for step, idx in enumerate(ex.batches(len(x), 32, STEPS, seed=2), 1):
        loss, report = ex.train_step(engine, x[idx], y[idx])
        ref_loss, theirs, state = reference_step(theirs, state, x[idx], y[idx])
        assert report.applied and report.step == step
        assert_close(np.float32(loss), np.asarray(ref_loss), err_msg=f"loss, step {step}")
        for name in engine.layout.names:
            assert_close(engine.params[name], np.asarray(theirs[name]), err_msg=f"{name!r}, step {step}")


@pytest.mark.parametrize("name", ["torch_interop", "jax_interop"])
def test_example_runs_as_a_script(name):
    pytest.importorskip("torch" if name.startswith("torch") else "jax")
    out = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py")],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    assert out.count("step ") >= 6  # progress lines
    final = float(re.search(r"final test accuracy ([0-9.]+)", out).group(1))
    assert final > 0.8  # 4 Gaussian classes; chance is 0.25


# -- examples/torch_phase.py: gradient prediction driven from a torch loop ------------------------------------


@pytest.fixture(scope="module")
def phase_example():
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny MLP: more threads only contend
    yield load_example("torch_phase")
    torch.set_num_threads(threads)


def test_torch_phase_example_backward_only_on_full_and_correct_steps(phase_example, monkeypatch):
    ex = phase_example
    x, y = ex.blobs(512, seed=1)
    calls = []
    forward_loss = ex.forward_loss
    monkeypatch.setattr(ex, "forward_loss", lambda *a: calls.append(1) or forward_loss(*a))
    model, engine, ctl = ex.bound(seed=3)
    ex.train(model, engine, ctl, x, y, 0, 40, log=lambda _: None)
    s = ctl.stats()
    assert len(calls) == s.backward_passes == s.full_steps + s.correct_steps < 40 == s.steps == engine.state.step
    assert s.step_ratio == 40 / s.backward_passes
    assert _shares([p.grad.numpy() for p in model.parameters()], engine.grads.flat)  # still zero-copy


def test_torch_phase_example_two_ways_agree(phase_example):
    """The engine's AdamW fed through the bound model and torch's AdamW fed by name: one trajectory."""
    ex = phase_example
    x, y = ex.blobs(512, seed=1)
    ours, engine, ctl = ex.bound(seed=0)
    ex.train(ours, engine, ctl, x, y, 0, 30, log=lambda _: None)
    theirs, their_ctl = ex.train_with_torch_optimizer(x, y, 30)
    assert their_ctl.stats().counts() == ctl.stats().counts()
    for name, p in theirs.named_parameters():
        assert_close(engine.params[name], p.detach().numpy(), err_msg=name)


@pytest.mark.parametrize("split", [4, 6, 10])  # after a PREDICT, a CORRECT and a FULL step
def test_torch_phase_example_resumes_bitwise(phase_example, tmp_path, split):
    import torch

    ex = phase_example
    x, y = ex.blobs(512, seed=1)
    model, engine, ctl = ex.bound(seed=0)
    ex.train(model, engine, ctl, x, y, 0, 24, log=lambda _: None)
    first, first_engine, first_ctl = ex.bound(seed=0)
    ex.train(first, first_engine, first_ctl, x, y, 0, split, log=lambda _: None)
    assert first_ctl.phase.value == {4: "predict", 6: "correct", 10: "full"}[split]
    at.phase.save(tmp_path / "p.safetensors", first_ctl, extra={"step": split})
    again, again_engine, again_ctl = ex.bound(seed=5)
    start = at.phase.load(tmp_path / "p.safetensors", again_ctl)["step"]
    ex.train(again, again_engine, again_ctl, x, y, start, 24, log=lambda _: None)
    assert np.array_equal(again_engine.params.flat, engine.params.flat)
    assert all(torch.equal(p.detach(), q.detach()) for p, q in zip(again.parameters(), model.parameters()))
    assert again_ctl.predictor.steps == ctl.predictor.steps


def test_torch_phase_example_runs_as_a_script():
    pytest.importorskip("torch")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(EXAMPLES / "torch_phase.py")], capture_output=True, text=True,
                         check=True, timeout=300, env=env).stdout
    assert out.count("step ") >= 6
    assert "resumed: bitwise the uninterrupted run: True" in out
    assert float(re.search(r"step ratio ([0-9.]+)", out).group(1)) > 2
    assert float(re.search(r"final test accuracy ([0-9.]+)", out).group(1)) > 0.8
