"""The engine on CuPy buffers: against the CPU engine, intake from torch/JAX, checkpoints across devices.

Every test runs on a GPU only (skipped after a probe that runs a tiny kernel).
"""

from __future__ import annotations

import numpy as np
import pytest

import arraytrain as at
from arraytrain.errors import BackendError
from conftest import OPTIMIZER_CONFIGS, engine_snapshot
from cuda_family import device_cupy, on_device, require_cuda

pytestmark = pytest.mark.usefixtures("gpu")

SHAPES = {"empty": (0,), "fc1.weight": (64, 33), "fc1.bias": (64,), "fc2.weight": (10, 64), "fc2.bias": (10,)}
CUDA_CONFIGS = OPTIMIZER_CONFIGS


@pytest.fixture
def gpu():
    require_cuda()


def _cp():
    return device_cupy()


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
    assert on_device(gpu.params.flat)
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


# -- 8-bit optimizer state on the device ------------------------------------------------------------
#
# SHAPES' matrices (2112 and 640 elements) hold 8-bit slots with min_8bit_size 256, with a partial
# last block each; the biases keep float32 slots. The per-step equality of the CUDA and numba
# kernels is checked in tests/optim/test_state8.py; here the engine: training against the CPU
# engine, skips, checkpoints across devices, masks and working copies.

EIGHT_BIT = {
    "adamw": lambda: at.optim.AdamW(lr=1e-2, state_dtype="8bit"),
    "sgd": lambda: at.optim.SGD(lr=1e-2, momentum=0.9, state_dtype="8bit"),
    "lion": lambda: at.optim.Lion(lr=1e-3, state_dtype="8bit"),
    "rmsprop": lambda: at.optim.RMSprop(lr=1e-3, centered=True, momentum=0.5, state_dtype="8bit"),
    "lamb": lambda: at.optim.LAMB(lr=1e-2, state_dtype="8bit"),
    "muon": lambda: at.optim.Muon(lr=2e-2, fallback=at.optim.AdamW(lr=1e-2), state_dtype="8bit"),
}


def _8bit(name):
    opt = EIGHT_BIT[name]()
    opt.min_8bit_size = 256
    return opt


def _decoded(buf):
    """An 8-bit slot's values on the host (float32 per name), or a float slot's arrays."""
    from arraytrain.optim import state8

    if isinstance(buf, state8.Quant8Buffer):
        return {k: (v.get() if hasattr(v, "get") else v) for k, v in ((k, buf.values(k)) for k in buf.names)}
    return _host(buf)


@pytest.mark.parametrize("name", list(EIGHT_BIT))
def test_cuda_engine_with_8bit_state_follows_the_cpu_engine(name):
    """30 clipped steps on both devices from the same start: the slots' values and the parameters
    stay together (a code one off at a rounding boundary moves a value by one code, so not bitwise)."""
    from arraytrain.optim import state8

    rng = np.random.default_rng(21)
    p0 = _params(rng)
    cpu = at.Engine(p0, _8bit(name), max_grad_norm=1.0)
    gpu = at.Engine(p0, _8bit(name), max_grad_norm=1.0, device="cuda")
    quantized = [b for b in gpu.state.slots.values() if isinstance(b, state8.Quant8Buffer)]
    assert quantized and all(b.is_quantized("fc1.weight") and not b.is_quantized("fc1.bias") for b in quantized)
    for _ in range(30):
        g = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
        cpu.step(g)
        gpu.step({k: _cp().asarray(v) for k, v in g.items()})
    for slot, buf in gpu.state.slots.items():
        mine, theirs = _decoded(buf), _decoded(cpu.state.slots[slot])
        for k in SHAPES:
            scale = float(np.abs(theirs[k]).max()) if theirs[k].size else 0.0
            np.testing.assert_allclose(mine[k], theirs[k], rtol=0, atol=0.03 * scale + 1e-6, err_msg=f"{slot}[{k!r}]")
    for k, a in _host(gpu.params).items():
        np.testing.assert_allclose(a, cpu.params[k], rtol=1e-3, atol=3e-3, err_msg=f"params[{k!r}]")


def test_cuda_8bit_state_trains():
    rng = np.random.default_rng(22)
    shapes = {"w": (96, 80), "b": (30,)}
    curv = {k: _cp().asarray(rng.uniform(0.5, 2.0, s).astype(np.float32)) for k, s in shapes.items()}
    p0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    eng = at.Engine(p0, at.optim.AdamW(lr=0.03, state_dtype="8bit"), device="cuda")

    def loss():
        return sum(float((curv[k] * eng.params[k].astype(_cp().float64) ** 2).sum()) for k in shapes)

    start = loss()
    for _ in range(40):
        eng.step({k: curv[k] * eng.params[k] for k in shapes})
    assert loss() < 0.7 * start


def test_nonfinite_step_changes_no_8bit_state_on_the_device():
    rng = np.random.default_rng(23)
    eng = at.Engine(_params(rng), _8bit("adamw"), device="cuda", loss_scaler=at.LossScaler())
    g = {k: _cp().asarray(rng.standard_normal(s).astype(np.float32)) for k, s in SHAPES.items()}
    eng.step(g)
    before = [eng.params.flat.get().tobytes()] + [b.flat.get().tobytes() for b in eng.state.slots.values()]
    bad = dict(g)
    bad["fc1.weight"] = bad["fc1.weight"].copy()
    bad["fc1.weight"][3, 4] = np.nan
    r = eng.step(bad)
    assert r.skipped and eng.state.step == 1
    assert [eng.params.flat.get().tobytes()] + [b.flat.get().tobytes() for b in eng.state.slots.values()] == before


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_8bit_checkpoint_moves_between_devices_bitwise(name, tmp_path):
    """GPU engine (8-bit) -> file -> CPU engine (8-bit) -> file -> GPU engine: every code, absmax and
    float32 value bit for bit; the file loads into a float32 engine decoded."""
    rng = np.random.default_rng(24)
    gpu = at.Engine(_params(rng), _8bit(name), device="cuda")
    for _ in range(3):
        gpu.step({k: _cp().asarray(rng.standard_normal(s).astype(np.float32)) for k, s in SHAPES.items()})
    at.save(tmp_path / "gpu.safetensors", gpu)
    cpu = at.Engine(_params(np.random.default_rng(99)), _8bit(name))
    at.load(tmp_path / "gpu.safetensors", cpu)
    assert cpu.state.step == gpu.state.step
    assert cpu.params.flat.tobytes() == gpu.params.flat.get().tobytes()
    for slot, buf in gpu.state.slots.items():
        assert cpu.state.slots[slot].flat.tobytes() == buf.flat.get().tobytes(), slot
    at.save(tmp_path / "cpu.safetensors", cpu)
    back = at.Engine(_params(np.random.default_rng(98)), _8bit(name), device="cuda")
    at.load(tmp_path / "cpu.safetensors", back)
    for slot, buf in gpu.state.slots.items():
        assert back.state.slots[slot].flat.get().tobytes() == buf.flat.get().tobytes(), slot
    g = {k: _cp().asarray(rng.standard_normal(s).astype(np.float32)) for k, s in SHAPES.items()}
    gpu.step(g)
    back.step(g)
    assert back.params.flat.get().tobytes() == gpu.params.flat.get().tobytes()
    for slot, buf in gpu.state.slots.items():
        assert back.state.slots[slot].flat.get().tobytes() == buf.flat.get().tobytes(), slot
    if name == "adamw":
        f32 = at.Engine(_params(np.random.default_rng(97)), at.optim.AdamW(lr=1e-2))
        at.load(tmp_path / "gpu.safetensors", f32)
        np.testing.assert_array_equal(f32.state.slots["exp_avg"]["fc1.weight"],
                                      cpu.state.slots["exp_avg"].values("fc1.weight"))


def test_8bit_state_dict_round_trip_on_the_device():
    """state_dict/load_state_dict within the device (CuPy entries), decoded into float32 slots and encoded back."""
    rng = np.random.default_rng(25)
    a = at.Engine(_params(rng), _8bit("adamw"), device="cuda")
    for _ in range(2):
        a.step({k: _cp().asarray(rng.standard_normal(s).astype(np.float32)) for k, s in SHAPES.items()})
    b = at.Engine(_params(rng), _8bit("adamw"), device="cuda")
    b.load_state_dict(a.state_dict(copy=True))
    for slot, buf in a.state.slots.items():
        assert b.state.slots[slot].flat.get().tobytes() == buf.flat.get().tobytes(), slot
    f32 = at.Engine(_params(rng), at.optim.AdamW(lr=1e-2), device="cuda")
    f32.load_state_dict(a.state_dict(copy=True))  # 8 bits -> float32 on the device: decoded
    np.testing.assert_array_equal(f32.state.slots["exp_avg"]["fc1.weight"].get(),
                                  a.state.slots["exp_avg"].values("fc1.weight").get())
    c = at.Engine(_params(rng), _8bit("adamw"), device="cuda")
    c.load_state_dict(f32.state_dict(copy=True))  # and back: encoded as lowbit.quantize encodes
    from arraytrain import lowbit

    entry = c.state_dict()["optimizer"]["slots"]["exp_avg"]["fc1.weight"]
    codes, absmax = lowbit.quantize(f32.state.slots["exp_avg"]["fc1.weight"].get(), True)
    np.testing.assert_array_equal(entry["codes"].get().ravel(), codes)
    np.testing.assert_array_equal(entry["absmax"].get(), absmax)


def test_mask_and_working_copy_under_8bit_state_on_the_device():
    import ml_dtypes

    rng = np.random.default_rng(26)
    eng = at.Engine(_params(rng), _8bit("adamw"), device="cuda", working_dtype="bfloat16")
    mask = {"fc1.weight": (rng.random(SHAPES["fc1.weight"]) > 0.5).astype(np.uint8)}
    eng.set_mask(mask)
    for _ in range(5):
        eng.step({k: _cp().asarray(rng.standard_normal(s).astype(np.float32)) for k, s in SHAPES.items()})
    w = eng.params["fc1.weight"].get()
    assert not np.any(w[mask["fc1.weight"] == 0]) and np.all(w[mask["fc1.weight"] == 1] != 0)
    np.testing.assert_array_equal(eng.working.flat.get().view(np.uint16),
                                  eng.params.flat.get().astype(ml_dtypes.bfloat16).view(np.uint16))
