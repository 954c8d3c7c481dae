"""The CUDA compression, projection and trend kernels, the compressors and the predictor on CuPy buffers.

The CPU families' own tests of these (test_compress, test_compress_lowrank, test_predict) run the
CUDA family through the ``family`` and ``numba_family`` fixtures of conftest.py. Here, what is
CUDA-only, every test skipped without a usable GPU (a probe runs a tiny kernel):

* Kernels beyond the CPU tests' cases: every radix pass and chunk edge of top-k, large random-k,
  the quantizers at block and piece edges, long Hadamard blocks, selections whose permutation
  lives in global memory, the counter RNG bit for bit.
* Cross-device: a payload encoded by one family decodes on the other (random-k, top-k,
  int8 with deterministic rounding, sign, ternary, VSA), compressors run natively on CuPy
  equal the CPU ones, PowerSGD on the device, the predictor on the device, mixed
  backends refused.
* The engine: ``ErrorFeedback(TopK(0.01))`` on a CUDA engine equals the CPU engine over
  20 steps, and resumes from its in-memory state dict.
"""

from __future__ import annotations

import numpy as np
import pytest

import arraytrain as at
import test_compress
from arraytrain import Layout
from arraytrain import compress as C
from arraytrain.compress import ErrorFeedback, Payload, TopK
from arraytrain.errors import ArgumentTypeError, BackendError, BackendUnavailableError
from arraytrain.kernels.cpu import compression as nb_compress
from arraytrain.kernels.cpu import projection as project
from arraytrain.kernels.reference import compression as compress_reference
from arraytrain.kernels.reference import projection as project_reference
from arraytrain.kernels.counter_rng import step_key, uniform_np
from arraytrain.phase.predict import GradientPredictor
from builders import random_params
from conftest import assert_close, padded_layout, random_flat
from cuda_family import OnDevice, device_cupy, on_device, require_cuda

COMPRESS_ON_DEVICE = OnDevice("arraytrain.kernels.cuda.compression", compress_reference)
PROJECT_ON_DEVICE = OnDevice("arraytrain.kernels.cuda.projection", project_reference)


@pytest.fixture(autouse=True)
def _cuda():
    require_cuda()


def _cp():
    return device_cupy()


def _host(a):
    return a.get() if on_device(a) else a


# -- kernels beyond the CPU tests' cases -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_topk_every_radix_pass_and_chunk_edge(dtype, rng):
    """Magnitudes that differ only in the lowest bits (every 8-bit pass decides), ±0 and NaN ties,
    sizes around the 4096-element chunk of the count/write passes, k from 1 to n."""
    eps = np.finfo(dtype).eps
    for n in (1, 4095, 4096, 4097, 3 * 4096 + 17, 200_003):
        x = (1 + rng.integers(0, 300, n) * eps).astype(dtype) * rng.choice(np.array([-1, 1], dtype), n)
        x[rng.integers(0, n, max(1, n // 50))] = 0.0
        x[rng.integers(0, n, max(1, n // 50))] = -0.0
        if n > 10:
            x[[3, n - 2]] = np.nan
        for k in sorted({1, min(7, n), n // 3 or 1, n - 1 or 1, n}):
            got = (np.empty(k, np.int64), np.empty(k, dtype))
            want = (np.empty(k, np.int64), np.empty(k, dtype))
            COMPRESS_ON_DEVICE.topk(x, *got, k=k)
            compress_reference.topk(x, *want, k=k)
            np.testing.assert_array_equal(got[0], want[0], err_msg=f"indices n={n} k={k} {np.dtype(dtype)}")
            np.testing.assert_array_equal(got[1], want[1], err_msg=f"values n={n} k={k} {np.dtype(dtype)}")
    idx = np.empty(5, np.uint32)  # the uint32 index instance
    COMPRESS_ON_DEVICE.topk(np.arange(10, dtype=dtype), idx, np.empty(5, dtype), k=5)
    np.testing.assert_array_equal(idx, [5, 6, 7, 8, 9])


@pytest.mark.parametrize("n,k", [(64, 63), (65, 1), (1_000_000, 100_000), (1_000_003, 999_999), (5_000_000, 50_000)])
def test_randk_indices_large_equal_numba(n, k):
    for key in (7, step_key(3, 11)):
        got = COMPRESS_ON_DEVICE.randk_indices(n=n, k=k, key=key)
        want = nb_compress.randk_indices(n=n, k=k, key=key)
        assert got.dtype == np.int64 and got.shape == (k,), (got.dtype, got.shape)
        mismatch = np.flatnonzero(got != want)
        assert mismatch.size == 0, f"n={n} k={k} key={key}: {mismatch.size} positions differ, first {mismatch[:5]}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("block", [1, 64, 100, 2048, 2049, 10_000, None])
def test_quantizer_kernels_bitwise_on_block_and_piece_edges(block, dtype, rng):
    """int8 (both roundings), sign and ternary at block sizes around the 2048-element piece."""
    n = 23_456
    b = block or n
    x = (rng.standard_normal(n) * np.repeat(10.0 ** rng.integers(-3, 3, -(-n // 500)), 500)[:n]).astype(dtype)
    x[:b // 2] = 0  # an all-zero (part of a) block
    key = step_key(5, 2)
    nblocks = -(-n // b)
    for stochastic in (False, True):
        got = (np.empty(n, np.int8), np.empty(nblocks, dtype))
        want = (np.empty(n, np.int8), np.empty(nblocks, dtype))
        COMPRESS_ON_DEVICE.int8_encode(x, *got, block=b, key=key, stochastic=stochastic)
        compress_reference.int8_encode(x, *want, block=b, key=key, stochastic=stochastic)
        np.testing.assert_array_equal(got[1], want[1], err_msg=f"int8 scales block={b} stochastic={stochastic}")
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"int8 codes block={b} stochastic={stochastic}")
        given = want[1] * dtype(2.5)  # shared scales (a group's maximum): read, codes against them
        got_shared, want_shared = np.empty(n, np.int8), np.empty(n, np.int8)
        COMPRESS_ON_DEVICE.int8_encode(x, got_shared, given.copy(), block=b, key=key, stochastic=stochastic,
                                       shared=True)
        compress_reference.int8_encode(x, want_shared, given.copy(), block=b, key=key, stochastic=stochastic,
                                       shared=True)
        np.testing.assert_array_equal(got_shared, want_shared, err_msg=f"int8 shared codes block={b}")
        out, ref_out = np.empty(n, dtype), np.empty(n, dtype)
        COMPRESS_ON_DEVICE.int8_decode(*want, out, block=b)
        compress_reference.int8_decode(*want, ref_out, block=b)
        np.testing.assert_array_equal(out, ref_out, err_msg=f"int8 decode block={b}")
    for name, nbytes in (("sign", -(-n // 8)), ("ternary", -(-n // 4))):
        got = (np.empty(nbytes, np.uint8), np.empty(nblocks, np.float32))
        want = (np.empty(nbytes, np.uint8), np.empty(nblocks, np.float32))
        extra = {} if name == "sign" else {"key": key}
        getattr(COMPRESS_ON_DEVICE, f"{name}_encode")(x, *got, block=b, **extra)
        getattr(compress_reference, f"{name}_encode")(x, *want, block=b, **extra)
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"{name} packed codes block={b}")
        if name == "sign":  # float64 L1 sums added in another order: at most one float32 ulp apart
            np.testing.assert_allclose(got[1], want[1], rtol=float(np.finfo(np.float32).eps), atol=0,
                                       err_msg=f"sign scales block={b}")
        else:
            np.testing.assert_array_equal(got[1], want[1], err_msg=f"ternary scales block={b}")
        out, ref_out = np.empty(n, dtype), np.empty(n, dtype)
        getattr(COMPRESS_ON_DEVICE, f"{name}_decode")(*want, out, block=b)
        getattr(compress_reference, f"{name}_decode")(*want, ref_out, block=b)
        np.testing.assert_array_equal(out, ref_out, err_msg=f"{name} decode block={b}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("block,nb", [(8192, 2), (32768, 1), (2048, 5)])
def test_fwht_long_blocks_take_the_global_stages(block, nb, dtype, rng):
    x = rng.standard_normal(block * nb).astype(dtype)
    a, b = x.copy(), x.copy()
    PROJECT_ON_DEVICE.fwht(a, block=block)
    project_reference.fwht(b, block=block)
    assert_close(a, b, err_msg=f"block={block}")
    PROJECT_ON_DEVICE.fwht(a, block=block)
    assert_close(a, x, err_msg=f"block={block}: H applied twice")


@pytest.mark.parametrize("block,nb,d", [(8192, 3, 5000), (16384, 1, 16384), (4096, 2, 1), (4097 - 1, 1, 0)])
def test_selection_with_a_permutation_in_global_memory(block, nb, d, rng):
    z = rng.standard_normal(block * nb)
    key = step_key(8, 1)
    ya, yb = np.empty(d), np.empty(d)
    PROJECT_ON_DEVICE.select_gather(z, ya, key=key, block=block)
    project.select_gather(z, yb, key=key, block=block)
    np.testing.assert_array_equal(ya, yb, err_msg=f"gather block={block} d={d}")
    y = rng.standard_normal(d)
    za, zb = np.full_like(z, np.nan), np.full_like(z, np.nan)
    PROJECT_ON_DEVICE.select_scatter(y, za, key=key, block=block, factor=0.5)
    project.select_scatter(y, zb, key=key, block=block, factor=0.5)
    np.testing.assert_array_equal(za, zb, err_msg=f"scatter block={block} d={d}")


def test_counter_rng_matches_the_host_bit_for_bit():
    """sign_bind exposes u(key, i) >= 0.5 element by element; ternary exposes u(key, i) * s < |x|."""
    n = 100_003
    for key in (0, 1, 2**63 + 5, 2**64 - 1):
        x = np.ones(n)
        out = np.empty(n)
        PROJECT_ON_DEVICE.sign_bind(x, out, key=key)
        want = np.where(uniform_np(key, np.arange(n)) >= 0.5, -1.0, 1.0)
        bad = np.flatnonzero(out != want)
        assert bad.size == 0, f"key={key}: {bad.size} signs differ, first at {bad[:5]}"


# -- compressors natively on CuPy ------------------------------------------------------------------

NATIVE = {**test_compress.CONFIGS,
          "vsa": lambda **kw: C.VSA(0.3, block=256, **kw),
          "vsa_projection": lambda **kw: C.VSA(0.3, block=4096, unbiased=False, **kw),
          "powersgd": lambda **kw: C.PowerSGD(rank=2, **kw)}
TOLERANT = {"vsa", "vsa_projection", "powersgd"}  # float math in another order (butterflies, BLAS, QR)
SIGN_SCALES = {"sign", "sign_block"}  # float64 L1 sums added in another order: a float32 ulp or two


def _close_to_scale(actual, desired, what):
    """Within 1024 ulps of the dtype at the array's largest magnitude (float32: 1.2e-4 of it).

    For VSA's Hadamard butterflies and PowerSGD's GEMMs and QR, which add in another order on
    each device; a wrong kernel is off by the order of the values themselves.
    """
    eps = float(np.finfo(desired.dtype).eps)
    scale = float(np.max(np.abs(desired))) if desired.size else 0.0
    np.testing.assert_allclose(actual, desired, rtol=1024 * eps, atol=1024 * eps * scale, err_msg=what)


def _close_ulps(actual, desired, what):
    np.testing.assert_allclose(actual, desired, rtol=4 * float(np.finfo(np.float32).eps), atol=0, err_msg=what)


def _native_layout(n):
    return Layout({"e0": (0,), "w": (n // 40, 40), "s": (3,), "b": (4, 5), "e1": (0,)})


def _compare_payloads(a, b, cfg, step):
    assert sorted(a.arrays) == sorted(b.arrays), cfg
    assert a.meta == b.meta and a.nbytes == b.nbytes, (cfg, a.meta, b.meta, a.nbytes, b.nbytes)
    for name, arr in a.arrays.items():
        host, want = _host(arr), b.arrays[name]
        assert on_device(arr), f"{cfg} {name}: the payload array is not on the device"
        assert host.dtype == want.dtype and host.shape == want.shape, (cfg, name, host.dtype, host.shape)
        msg = f"{cfg} payload[{name!r}] at call {step}"
        if cfg in TOLERANT:
            _close_to_scale(host, want, msg)
        elif cfg in SIGN_SCALES and name == "scales":
            _close_ulps(host, want, msg)
        else:
            np.testing.assert_array_equal(host, want, err_msg=msg)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cfg", sorted(c for c in NATIVE if NATIVE[c]().contraction))  # under error feedback
def test_compressor_on_cupy_equals_numpy(cfg, dtype, rng):
    cp = _cp()
    layout = _native_layout(40_000)
    host = ErrorFeedback(NATIVE[cfg](min_size=4, warmup=1, seed=3)).bind(layout, dtype)
    dev = ErrorFeedback(NATIVE[cfg](min_size=4, warmup=1, seed=3)).bind(layout, dtype)
    for step in range(4):
        g = test_compress.flat_for(layout, dtype, rng, scale=10.0 ** (step - 1))
        x_host, x_dev = g.copy(), cp.asarray(g)
        ph, pd = host.roundtrip(x_host), dev.roundtrip(x_dev)
        assert dev.compressor.backend == "cupy" and on_device(dev.residual.flat)
        _compare_payloads(pd, ph, cfg, step)
        if cfg in TOLERANT:
            _close_to_scale(_host(x_dev), x_host, f"{cfg} decode at call {step}")
        elif cfg in SIGN_SCALES:
            _close_ulps(_host(x_dev), x_host, f"{cfg} decode at call {step}")
        else:
            np.testing.assert_array_equal(_host(x_dev), x_host, err_msg=f"{cfg} decode at call {step}")
            np.testing.assert_array_equal(_host(dev.residual.flat), host.residual.flat, err_msg=f"{cfg} residual")


# formats shared by both families: encode on one device, decode on the other
CROSS = {
    "randomk": lambda: C.RandomK(ratio=0.05, seed=4, min_size=4, ramp=0),
    "randomk_contract": lambda: C.RandomK(k=300, rescale=False, seed=4, ramp=0),
    "topk": lambda: C.TopK(ratio=0.05, min_size=4, ramp=0),
    "int8": lambda: C.Int8Block(block=100, min_size=4),
    "sign": lambda: C.Sign(block=1000, min_size=4),
    "ternary": lambda: C.Ternary(block=1000, seed=6, min_size=4),
    "vsa": lambda: C.VSA(dim=5000, block=1024, seed=7, min_size=4),
}


def _to(payload, convert):
    return Payload(payload.method, arrays={k: convert(v) for k, v in payload.arrays.items()},
                   raw=None if payload.raw is None else convert(payload.raw), meta=dict(payload.meta),
                   dense_nbytes=payload.dense_nbytes)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cfg", sorted(CROSS))
def test_payload_crosses_devices(cfg, dtype, rng):
    cp = _cp()
    layout = _native_layout(20_000)
    g = test_compress.flat_for(layout, dtype, rng)
    cpu_side, gpu_side = CROSS[cfg]().bind(layout, dtype), CROSS[cfg]().bind(layout, dtype)
    for call in range(2):
        # CPU encodes, the GPU decodes (a receiver with the same seed and call number)
        p = cpu_side.compress(g)
        want = cpu_side.decompress(p)
        got = gpu_side.decompress(_to(p, cp.asarray))
        assert on_device(got)
        check = assert_close if cfg == "vsa" else np.testing.assert_array_equal
        check(_host(got), want, err_msg=f"{cfg}: CPU payload decoded on the GPU, call {call}")
        # the GPU encodes, the CPU decodes
        q = gpu_side.compress(cp.asarray(g))
        assert q.meta == p.meta, (q.meta, p.meta)
        back = cpu_side.decompress(_to(q, _host))
        check(back, _host(gpu_side.decompress(q)), err_msg=f"{cfg}: GPU payload decoded on the CPU, call {call}")
        check(back, want, err_msg=f"{cfg}: the two devices' round trips differ, call {call}")
        cpu_side.step, gpu_side.step = call + 1, call + 1  # both sides at the next call number


def test_mixed_backends_are_refused_and_change_nothing(rng):
    cp = _cp()
    layout = _native_layout(4000)
    g = test_compress.flat_for(layout, np.float32, rng)
    ef = ErrorFeedback(TopK(ratio=0.1)).bind(layout, np.float32)
    ef.roundtrip(cp.asarray(g))
    before = (ef.step, _host(ef.residual.flat).copy())
    with pytest.raises(BackendError, match="numpy array was given to a compressor on cupy"):
        ef.roundtrip(g.copy())
    assert ef.step == before[0] and np.array_equal(_host(ef.residual.flat), before[1])
    p = ef.compressor.compress(cp.asarray(g))
    with pytest.raises(ArgumentTypeError, match="payload 'values'"):
        ef.compressor.decompress(_to(p, lambda a: a.get() if a is p.arrays["values"] else a))
    with pytest.raises(BackendUnavailableError, match="reference"):
        TopK(ratio=0.1, kernels="reference").bind(layout, np.float32).compress(cp.asarray(g))


def test_powersgd_on_the_device(rng):
    cp = _cp()
    layout = Layout({"w": (64, 48), "b": (64,)})
    host, dev = C.PowerSGD(rank=4, seed=2).bind(layout, np.float64), C.PowerSGD(rank=4, seed=2).bind(layout, np.float64)
    # a rank-3 matrix is reproduced exactly from the first call on, on both devices
    w = rng.standard_normal((64, 3)) @ rng.standard_normal((3, 48))
    x = np.zeros(layout.size)
    x[layout.slice("w")] = w.reshape(-1)
    x[layout.slice("b")] = rng.standard_normal(64)
    out = _host(dev.decompress(dev.compress(cp.asarray(x))))
    np.testing.assert_allclose(out, x, rtol=1e-9, atol=1e-9 * np.abs(x).max())
    np.testing.assert_allclose(out, host.decompress(host.compress(x)), rtol=1e-9, atol=1e-9 * np.abs(x).max())
    state = dev.state_dict()
    assert all(on_device(a) for a in state["arrays"].values())
    fresh = C.PowerSGD(rank=4, seed=2).bind(layout, np.float64)
    fresh.load_state_dict(state)  # a device state fixes a fresh compressor to the device
    assert fresh.backend == "cupy"
    y = cp.asarray(rng.standard_normal(layout.size))
    np.testing.assert_array_equal(_host(fresh.decompress(fresh.compress(y))), _host(dev.decompress(dev.compress(y))))


def test_predictor_on_the_device(rng):
    cp = _cp()
    layout = padded_layout(1037)
    host = GradientPredictor(layout, history=3, correction_beta=0.6)
    dev = GradientPredictor(at.FlatBuffer(layout, cp.zeros(layout.size, np.float32)), history=3,
                            correction_beta=0.6)
    assert dev.backend == "cupy"
    for t in range(10):
        g = random_flat(layout, np.float32, rng)
        if t % 3 == 2:
            assert host.correct(g, t) and dev.correct(cp.asarray(g), t)
        else:
            assert host.record(g, t) and dev.record(cp.asarray(g), t)
        assert_close(_host(dev.predict(t + 1)), host.predict(t + 1), err_msg=f"prediction after step {t}")
        assert_close(_host(dev.correction.flat), host.correction.flat, err_msg=f"correction after step {t}")
    bad = cp.asarray(random_flat(layout, np.float32, rng))
    bad[5] = np.nan
    assert not dev.record(bad, 20)
    with pytest.raises(BackendError, match="numpy array was given to a predictor on cupy"):
        dev.record(random_flat(layout, np.float32, rng), 21)
    with pytest.raises(BackendUnavailableError, match="reference"):
        GradientPredictor(layout, kernels="reference", device="cuda")


# -- the engine --------------------------------------------------------------------------------------

SHAPES = {"empty": (0,), "fc1.weight": (128, 65), "fc1.bias": (128,), "fc2.weight": (10, 128), "fc2.bias": (10,)}


def _cpu_and_cuda_engines(rng, make_compressor, **kw):
    """Twin Adam engines from the same random parameters (drawn from ``rng``), on the CPU and on the GPU."""
    p0 = random_params(SHAPES, rng, np.float32, scale=0.5)
    cpu = at.Engine(p0, at.optim.Adam(lr=1e-2), compressor=make_compressor(), **kw)
    gpu = at.Engine(p0, at.optim.Adam(lr=1e-2), compressor=make_compressor(), device="cuda", **kw)
    return cpu, gpu


def _close(actual, desired, what):
    """float32 tolerance with a floor of 8 ulps of the array's largest value (as test_cuda_engine)."""
    scale = float(np.max(np.abs(desired))) if desired.size else 0.0
    atol = max(5e-5, 8 * float(np.finfo(np.float32).eps) * scale)
    np.testing.assert_allclose(actual, desired, rtol=6.5e-6, atol=atol, err_msg=what)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_cuda_engine_with_error_feedback_topk_equals_cpu(accumulation, rng):
    cp = _cp()
    cpu, gpu = _cpu_and_cuda_engines(rng, lambda: ErrorFeedback(TopK(0.01)), accumulation_steps=accumulation)
    for i in range(20 * accumulation):
        g = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
        rc = cpu.step(g)
        rg = gpu.step({k: cp.asarray(v) for k, v in g.items()})
        assert (rc.applied, rc.skipped) == (rg.applied, rg.skipped), i
        assert rc.payload_bytes == rg.payload_bytes and rc.dense_bytes == rg.dense_bytes, i
    assert gpu.state.step == cpu.state.step == 20
    assert gpu.compressor.compressor.backend == "cupy"
    # the compressor sees bitwise-equal input on both devices (the optimizer never feeds it): the same
    # selection every step, so the residuals agree exactly
    np.testing.assert_array_equal(_host(gpu.compressor.residual.flat), cpu.compressor.residual.flat,
                                  err_msg="error-feedback residual")
    for name in SHAPES:
        _close(_host(gpu.params[name]), cpu.params[name], f"params[{name!r}]")
    for slot, buf in gpu.state.slots.items():
        for name, a in buf.as_dict().items():
            _close(_host(a), cpu.state.slots[slot][name], f"{slot}[{name!r}]")


@pytest.mark.parametrize("name", ["topk", "randomk", "int8", "sign", "ternary", "powersgd", "vsa"])
def test_cuda_engine_resumes_from_its_state_dict(name, rng):
    """A fresh CUDA engine loads a stepped CUDA engine's in-memory state (device residual) and continues equal."""
    cp = _cp()
    make = {"topk": lambda: C.TopK(ratio=0.05), "randomk": lambda: C.RandomK(ratio=0.1, seed=1, rescale=False),
            "int8": lambda: C.Int8Block(block=64, stochastic_rounding=True, seed=2), "sign": lambda: C.Sign(),
            "ternary": lambda: C.Ternary(seed=3), "powersgd": lambda: C.PowerSGD(rank=2, seed=4),
            "vsa": lambda: C.VSA(0.25, seed=5, unbiased=False)}[name]
    grads = [{k: cp.asarray(rng.standard_normal(s).astype(np.float32)) for k, s in SHAPES.items()} for _ in range(8)]
    _, a = _cpu_and_cuda_engines(rng, lambda: ErrorFeedback(make()))
    for g in grads[:4]:
        a.step(g)
    state = a.state_dict(copy=True)
    _, b = _cpu_and_cuda_engines(np.random.default_rng(0), lambda: ErrorFeedback(make()))
    b.load_state_dict(state)
    assert b.compressor.compressor.backend == "cupy"
    for g in grads[4:]:
        a.step(g)
        b.step(g)
    for k in SHAPES:
        np.testing.assert_array_equal(_host(b.params[k]), _host(a.params[k]), err_msg=f"{name}: params[{k!r}]")
    np.testing.assert_array_equal(_host(b.compressor.residual.flat), _host(a.compressor.residual.flat),
                                  err_msg=f"{name}: residual")
