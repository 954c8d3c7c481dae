"""The engine on CuPy buffers: against the CPU engine, intake from torch/JAX, checkpoints across devices.

Every test runs on a GPU only (skipped after a probe that runs a tiny kernel).
"""

from __future__ import annotations

import numpy as np
import pytest

import arraytrain as at
from arraytrain.errors import BackendError
from conftest import OPTIMIZER_CONFIGS, engine_snapshot
from cuda_family import require_cuda

pytestmark = pytest.mark.usefixtures("gpu")

SHAPES = {"empty": (0,), "fc1.weight": (64, 33), "fc1.bias": (64,), "fc2.weight": (10, 64), "fc2.bias": (10,)}
CUDA_CONFIGS = OPTIMIZER_CONFIGS


@pytest.fixture
def gpu():
    require_cuda()


def _cp():
    import cupy

    return cupy


def _params(rng, dtype=np.float32):
    return {k: (rng.standard_normal(s) * 0.5).astype(dtype) for k, s in SHAPES.items()}


def _host(engine_buf):
    return {k: (v.get() if hasattr(v, "get") else v) for k, v in engine_buf.as_dict().items()}


def _make(cls_name, kwargs):
    return getattr(at.optim, cls_name)(**kwargs)


@pytest.mark.parametrize("row", CUDA_CONFIGS, ids=[r[0] for r in CUDA_CONFIGS])
@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
def test_cuda_engine_equals_cpu_engine(row, clip):
    """50 steps (accumulation 2, large gradients) on both devices: params and every slot agree."""
    _, cls_name, kwargs = row
    rng = np.random.default_rng(7)
    p0 = _params(rng)
    cpu = at.Engine(p0, _make(cls_name, kwargs), accumulation_steps=2, max_grad_norm=clip)
    gpu = at.Engine(p0, _make(cls_name, kwargs), accumulation_steps=2, max_grad_norm=clip, device="cuda")
    assert type(gpu.params.flat).__module__.startswith("cupy")
    for _ in range(100):
        g = {k: (rng.standard_normal(s) * 1e3).astype(np.float32) for k, s in SHAPES.items()}
        rc = cpu.step(g)
        rg = gpu.step({k: _cp().asarray(v) for k, v in g.items()})
        assert (rc.applied, rc.skipped) == (rg.applied, rg.skipped)
        if rc.applied:
            assert rg.grad_norm == pytest.approx(rc.grad_norm, rel=1e-6)
    assert gpu.state.step == cpu.state.step == 50
    for name, a in _host(gpu.params).items():
        _close(a, cpu.params[name], f"params[{name!r}]")
    for slot, buf in gpu.state.slots.items():
        for name, a in _host(buf).items():
            _close(a, cpu.state.slots[slot][name], f"{slot}[{name!r}]")


def _close(actual, desired, what):
    """The project's float32 tolerance, with an absolute floor of 8 ulps of the array's largest value.

    Momentum buffers fed 1e3-sized gradients hold sums that cancel to ~1; float32
    rounding (and where each side contracts a multiply-add) then differs by an ulp of
    the terms, not of the result: seen as 2e-4 on elements of ~3 in buffers of ~3e3.
    """
    scale = float(np.max(np.abs(desired))) if desired.size else 0.0
    atol = max(5e-5, 8 * float(np.finfo(np.float32).eps) * scale)
    np.testing.assert_allclose(actual, desired, rtol=6.5e-6, atol=atol, err_msg=what)


def test_norm_pass_is_bitwise_repeatable():
    rng = np.random.default_rng(1)
    shapes = {"a": (1_000_003,), "b": (3, 70_001), "c": (0,), "d": (17,)}
    g = {k: _cp().asarray(rng.standard_normal(s).astype(np.float32)) for k, s in shapes.items()}
    out = []
    for _ in range(5):
        eng = at.Engine({k: np.zeros(s, np.float32) for k, s in shapes.items()}, at.optim.SGD(lr=0.1),
                        device="cuda")
        r = eng.step(g)
        out.append((r.grad_norm, tuple(r.grad_norms.values())))
    assert all(o == out[0] for o in out)
    ref = np.sqrt(sum(float((v.get().astype(np.float64) ** 2).sum()) for v in g.values()))
    assert out[0][0] == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("make", [lambda: at.optim.AdamW(lr=1e-2), lambda: at.optim.NAdam(lr=1e-2)],
                         ids=["adamw", "nadam"])
def test_nonfinite_step_changes_nothing_on_the_device(make):
    """The device gate holds the update back; NAdam's host-side mu_product is put back too."""
    rng = np.random.default_rng(2)
    eng = at.Engine(_params(rng), make(), device="cuda", loss_scaler=at.LossScaler())
    g = {k: _cp().asarray(rng.standard_normal(s).astype(np.float32)) for k, s in SHAPES.items()}
    eng.step(g)
    before = {k: v.get().tobytes() for k, v in [("p", eng.params.flat)] + list((s, b.flat) for s, b in eng.state.slots.items())}
    scalars = dict(eng.state.scalars)
    scale = eng.loss_scale
    bad = dict(g)
    bad["fc1.bias"] = bad["fc1.bias"].copy()
    bad["fc1.bias"][3] = np.nan
    r = eng.step(bad)
    assert r.skipped and not r.applied and eng.state.step == 1 and eng.loss_scale == scale / 2
    after = {k: v.get().tobytes() for k, v in [("p", eng.params.flat)] + list((s, b.flat) for s, b in eng.state.slots.items())}
    assert after == before and eng.state.scalars == scalars


def test_numpy_gradient_to_a_cuda_engine_is_refused_and_nothing_changes():
    rng = np.random.default_rng(3)
    eng = at.Engine(_params(rng), at.optim.Adam(lr=1e-2), device="cuda")
    snap = engine_snapshot_cuda(eng)
    g = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    with pytest.raises(BackendError, match="never moves data"):
        eng.step(g)
    assert engine_snapshot_cuda(eng) == snap


def engine_snapshot_cuda(engine):
    return {"params": engine.params.flat.get().tobytes(), "grads": engine.grads.flat.get().tobytes(),
            "slots": {k: b.flat.get().tobytes() for k, b in engine.state.slots.items()},
            "step": engine.state.step, "micro": engine.micro_batches}


def test_device_argument_moves_once_and_back():
    rng = np.random.default_rng(4)
    p = _params(rng)
    eng = at.Engine(p, at.optim.SGD(lr=0.1), device="cuda")
    host = at.Engine({k: _cp().asarray(v) for k, v in p.items()}, at.optim.SGD(lr=0.1), device="cpu")
    assert isinstance(host.params.flat, np.ndarray)
    for k in p:
        np.testing.assert_array_equal(eng.params[k].get(), p[k])
        np.testing.assert_array_equal(host.params[k], p[k])
    with pytest.raises(at.errors.HyperparameterError, match="device"):
        at.Engine(p, at.optim.SGD(lr=0.1), device="gpu")
    assert engine_snapshot(host)["step"] == 0


@pytest.mark.parametrize("make", [lambda: at.optim.AdamW(lr=1e-2, state_dtype="bfloat16"),
                                  lambda: at.optim.SGD(lr=1e-2, momentum=0.9),
                                  lambda: at.optim.LAMB(lr=1e-2),
                                  lambda: at.optim.NAdam(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1)],
                         ids=["adamw_bf16", "sgd", "lamb", "nadam"])
def test_checkpoint_moves_between_devices_bitwise(make, tmp_path):
    """GPU engine -> file -> CPU engine -> file -> GPU engine: params and every slot bit for bit."""
    rng = np.random.default_rng(6)
    gpu = at.Engine(_params(rng), make(), device="cuda", schedule=at.schedules.CosineAnnealingLR(100))
    for _ in range(3):
        gpu.step({k: _cp().asarray(rng.standard_normal(s).astype(np.float32)) for k, s in SHAPES.items()})
    at.save(tmp_path / "gpu.safetensors", gpu)
    cpu = at.Engine(_params(np.random.default_rng(99)), make(), schedule=at.schedules.CosineAnnealingLR(100))
    at.load(tmp_path / "gpu.safetensors", cpu)
    assert cpu.state.step == gpu.state.step and cpu.state.scalars == gpu.state.scalars
    for name in SHAPES:
        np.testing.assert_array_equal(cpu.params[name].view(np.uint8), gpu.params[name].get().view(np.uint8))
        for slot in gpu.state.slots:
            a, b = cpu.state.slots[slot][name], gpu.state.slots[slot][name].get()
            assert a.tobytes() == b.tobytes(), (slot, name)
    at.save(tmp_path / "cpu.safetensors", cpu)
    back = at.Engine(_params(np.random.default_rng(98)), make(), device="cuda", schedule=at.schedules.CosineAnnealingLR(100))
    at.load(tmp_path / "cpu.safetensors", back)
    assert back.params.flat.get().tobytes() == gpu.params.flat.get().tobytes()
    for slot in gpu.state.slots:
        assert back.state.slots[slot].flat.get().tobytes() == gpu.state.slots[slot].flat.get().tobytes()
    # and the two continue identically
    g = {k: _cp().asarray(rng.standard_normal(s).astype(np.float32)) for k, s in SHAPES.items()}
    gpu.step(g)
    back.step(g)
    assert back.params.flat.get().tobytes() == gpu.params.flat.get().tobytes()


def test_mask_and_working_copy_on_the_device():
    rng = np.random.default_rng(8)
    eng = at.Engine(_params(rng), at.optim.AdamW(lr=1e-2), device="cuda", working_dtype="bfloat16")
    mask = {"fc1.weight": (rng.random(SHAPES["fc1.weight"]) > 0.5).astype(np.uint8)}
    eng.set_mask(mask)
    for _ in range(5):
        eng.step({k: _cp().asarray(rng.standard_normal(s).astype(np.float32)) for k, s in SHAPES.items()})
    w = eng.params["fc1.weight"].get()
    assert not np.any(w[mask["fc1.weight"] == 0])
    assert np.all(w[mask["fc1.weight"] == 1] != 0)
    import ml_dtypes

    np.testing.assert_array_equal(eng.working.flat.get().view(np.uint16),
                                  eng.params.flat.get().astype(ml_dtypes.bfloat16).view(np.uint16))


def test_torch_cuda_gradients_are_read_without_a_copy():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    from arraytrain.backend import as_array

    t = torch.randn(64, 33, device="cuda")
    a = as_array(t, "fc1.weight")
    assert a.data.ptr == t.data_ptr()
    rng = np.random.default_rng(9)
    eng = at.Engine(_params(rng), at.optim.SGD(lr=0.1), device="cuda")
    grads = {k: torch.randn(*s, device="cuda") if s != (0,) else torch.zeros(0, device="cuda")
             for k, s in SHAPES.items()}
    before = eng.params["fc1.weight"].get()
    eng.step(grads)
    np.testing.assert_allclose(eng.params["fc1.weight"].get(), before - 0.1 * grads["fc1.weight"].cpu().numpy(),
                               rtol=1e-6, atol=1e-6)


def test_jax_gpu_gradients_are_read_without_a_copy():
    jax = pytest.importorskip("jax")
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU")
    from arraytrain.backend import as_array

    x = jax.device_put(np.arange(12, dtype=np.float32).reshape(3, 4), dev)
    a = as_array(x, "w")
    assert a.data.ptr == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(a.get(), np.arange(12, dtype=np.float32).reshape(3, 4))


@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
def test_sam_on_cuda_equals_cpu(adaptive):
    """SAM's two windows (perturb, then restore and update) on the device follow the CPU engine."""
    rng = np.random.default_rng(11)
    p0 = _params(rng)
    make = lambda: at.optim.SAM(at.optim.AdamW(lr=1e-2), rho=0.05, adaptive=adaptive)  # noqa: E731
    cpu, gpu = at.Engine(p0, make(), max_grad_norm=1.0), at.Engine(p0, make(), max_grad_norm=1.0, device="cuda")
    for _ in range(20):
        g = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
        rc, rg = cpu.step(g), gpu.step({k: _cp().asarray(v) for k, v in g.items()})
        assert (rc.perturbed, rc.applied) == (rg.perturbed, rg.applied)
    for name, a in _host(gpu.params).items():
        _close(a, cpu.params[name], f"params[{name!r}]")


def test_sophia_hessian_feed_on_cuda_equals_cpu():
    rng = np.random.default_rng(12)
    p0 = _params(rng)
    cpu = at.Engine(p0, at.optim.Sophia(lr=1e-2))
    gpu = at.Engine(p0, at.optim.Sophia(lr=1e-2), device="cuda")
    for t in range(10):
        g = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
        if t % 3 == 0:
            h = {k: np.abs(rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}
            cpu.update_hessian(h)
            gpu.update_hessian({k: _cp().asarray(v) for k, v in h.items()})
        cpu.step(g)
        gpu.step({k: _cp().asarray(v) for k, v in g.items()})
    for slot in ("exp_avg", "hessian"):
        _close(gpu.state.slots[slot].flat.get(), cpu.state.slots[slot].flat, slot)
    _close(gpu.params.flat.get(), cpu.params.flat, "params")


def test_float64_overflow_is_not_a_skip_on_cuda():
    """Finite float64 gradients whose sum of squares overflows: the device gate holds the update
    back, the host's overflow-safe norm clips them, and the step is applied as on the CPU."""
    p0 = {"a": np.ones(1000, np.float64), "b": np.ones(7, np.float64)}
    g = {"a": np.full(1000, 1e200), "b": np.full(7, -1e200)}
    cpu = at.Engine(p0, at.optim.SGD(lr=0.1), max_grad_norm=1.0)
    gpu = at.Engine(p0, at.optim.SGD(lr=0.1), max_grad_norm=1.0, device="cuda")
    rc, rg = cpu.step(g), gpu.step({k: _cp().asarray(v) for k, v in g.items()})
    assert rc.applied and rg.applied and not rg.skipped and gpu.state.step == 1
    assert rg.grad_norm == pytest.approx(rc.grad_norm, rel=1e-12)
    np.testing.assert_allclose(gpu.params.flat.get(), cpu.params.flat, rtol=1e-12)
