"""float8 optimizer state (``state_dtype="float8"``, arraytrain.lowbit): the codec.

* The maps are ml_dtypes' ``float8_e4m3fn`` and ``float8_e5m2``; the reference encoder scales each
  block's largest magnitude to the format's largest value (its codes ml_dtypes' cast of the scaled
  float32 values), the largest value decodes to itself within float32 rounding, and decoded
  blocks encode to the same codes.
* The CPU family's per-element codec (``f8_code``, ``f8_value``) equals ml_dtypes over every class
  of float32 input, in both formats: zeros, float32 subnormals, the formats' subnormals, every
  binade up to the largest value, the rounding ties and their neighbours, random values (e4m3
  over every float32 in [-448, 448] and e5m2 over every float32 below 61440, about 2.1e9 values
  each, were checked once: no code differs); every
  code's value times scales at both ends of the range.
* The fast block encoder equals the reference on blocks of every kind: NaN, infinity, zeros,
  blocks near and below the smallest scaled one, mixed magnitudes.
* The step's stochastic rounding of e5m2 slots (``lowbit.sr_codes``): each code one of the two
  neighbours of the scaled value, unbiased over the noise, below e5m2's normal range too; the CPU
  family's block encoder equals it bit for bit.
* Through the engine: the memory per parameter, conversions to and from float32, bfloat16 and
  8-bit state (in memory and through checkpoint files); a second moment kept in float8 follows
  its float32 twin over 300 steps (rounded to nearest it falls a third behind).

The kernels against the reference, training and bitwise resume run in test_state8.py's matrices.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from numba import njit

import arraytrain as at
from arraytrain import Engine, lowbit, optim
from arraytrain.optim import state8
from arraytrain.kernels.cpu.codecs import f8_code, f8_encode_block, f8_encode_block_sr, f8_value

FORMATS = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
TOP = {"e4m3": 448.0, "e5m2": 57344.0}
OVERFLOW = {"e4m3": 464.0, "e5m2": 61440.0}  # the midpoints above the largest values: ties go down


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_maps_are_ml_dtypes(fmt):
    want = np.arange(256, dtype=np.uint8).view(FORMATS[fmt]).astype(np.float32)
    np.testing.assert_array_equal(lowbit.MAPS[fmt].view(np.uint32), want.view(np.uint32))  # NaNs bit for bit
    assert lowbit.MAPS[fmt][lowbit.F8_NAN_CODE] != lowbit.MAPS[fmt][lowbit.F8_NAN_CODE]  # NaN
    assert np.nanmax(lowbit.MAPS[fmt][np.isfinite(lowbit.MAPS[fmt])]) == TOP[fmt] == lowbit.F8_TOP[fmt]


def _independent(x, fmt):
    """float8 blocks computed another way: the largest magnitude from float64, ml_dtypes' cast."""
    y = np.asarray(x, np.float32)
    codes, scales = [], []
    for a in range(0, y.size, lowbit.BLOCK):
        b = y[a : a + lowbit.BLOCK]
        m = np.float32(np.abs(b.astype(np.float64)).max())
        if not np.isfinite(m):
            codes.append(np.full(b.size, 0x7F, np.uint8))
            scales.append(np.nan)
            continue
        if m < 2.0 ** -111:
            codes.append((b * np.float32(0)).astype(FORMATS[fmt]).view(np.uint8))
            scales.append(0.0)
            continue
        inv = np.float32(np.float64(TOP[fmt]) / np.float64(m))  # a float32 division: its one rounding
        codes.append((b * inv).astype(np.float32).astype(FORMATS[fmt]).view(np.uint8))
        scales.append(np.float32(np.float64(m) / TOP[fmt]))
    return np.concatenate(codes) if codes else np.zeros(0, np.uint8), np.asarray(scales, np.float32)


def _blocks():
    """Blocks of every kind (each BLOCK elements but the last)."""
    rng = np.random.default_rng(0)
    n = lowbit.BLOCK
    out = [
        rng.standard_normal(n),
        rng.standard_normal(n) * np.exp(rng.uniform(-40, 40, n)),  # magnitudes across 35 decades
        np.zeros(n), -np.zeros(n),
        np.full(n, 448.0), np.full(n, 449.0), np.full(n, 464.0), np.full(n, 1.75), np.full(n, 1.7500001),
        np.full(n, 3e38), np.full(n, 1e-33), np.full(n, 1e-34), np.full(n, 1e-44),  # near and below F8_TINY
        np.r_[rng.standard_normal(n - 1), np.nan], np.r_[rng.standard_normal(n - 1), -np.inf],
        np.r_[rng.standard_normal(n - 1), 1e30], rng.standard_normal(37),
    ]
    return [np.asarray(b, np.float32) for b in out]


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_encoder_is_the_scaled_cast(fmt):
    for b in _blocks():
        x = np.abs(b) if fmt == "e5m2" else b
        codes, scales = lowbit.float8_encode(x, fmt)
        want_codes, want_scales = _independent(x, fmt)
        np.testing.assert_array_equal(codes, want_codes)
        np.testing.assert_array_equal(scales, want_scales)
        if np.isfinite(scales).all() and np.abs(x).max() > 1e-30:  # the largest element decodes to itself
            top = lowbit.decode(codes, scales, fmt)
            for a in range(0, x.size, 256):
                np.testing.assert_allclose(np.abs(top[a : a + 256]).max(), np.abs(x[a : a + 256]).max(), rtol=4e-7)
            rtol = 2.0 ** -3 if fmt == "e5m2" else 2.0 ** -4
            np.testing.assert_allclose(top, x, rtol=rtol, atol=np.abs(x).max() * (2e-5 if fmt == "e4m3" else 3e-10))
            # decoded values encode to the same codes again (the scale within an ulp)
            again = lowbit.float8_encode(top, fmt)
            np.testing.assert_array_equal(again[0], codes)
            np.testing.assert_allclose(again[1], scales, rtol=3e-7)


@njit(cache=False)
def _codes(x, inv, wide, out):
    if wide:  # the format a constant, as the kernels compile it
        for i in range(x.size):
            out[i] = f8_code(x[i], inv, True)
    else:
        for i in range(x.size):
            out[i] = f8_code(x[i], inv, False)


@njit(cache=False)
def _values(c, scale, wide, constant, out):
    """``constant``: the format a compile-time constant, as the kernels have it (through float16
    where the target has F16C); else a runtime flag (the integer decode)."""
    for i in range(c.size):
        if not constant:
            out[i] = f8_value(c[i], scale, wide)
        elif wide:
            out[i] = f8_value(c[i], scale, True)
        else:
            out[i] = f8_value(c[i], scale, False)


@njit(cache=False)
def _encode_blocks(x, codes, scales, wide):
    for j in range(scales.size):
        lo = j * 256
        hi = min(lo + 256, x.size)
        if wide:
            scales[j] = f8_encode_block(x[lo:hi].copy(), codes[lo:hi], True)
        else:
            scales[j] = f8_encode_block(x[lo:hi].copy(), codes[lo:hi], False)


def _pattern_classes(fmt):
    """float32 inputs of every class below the format's overflow: zeros, float32 subnormals, the
    format's subnormals and normals in every binade, each binade's rounding ties (the first
    dropped mantissa bit's half) and their neighbours one and two ulps away, random values."""
    rng = np.random.default_rng(1)
    keep = 3 if fmt == "e4m3" else 2  # mantissa bits kept
    exps = np.arange(0, 143, dtype=np.uint32)  # biased float32 exponents up to 2**15
    top = np.arange(1 << keep, dtype=np.uint32) << (23 - keep)
    half = np.uint32(1 << (22 - keep))
    low = np.array([0, 1, 2, half - 2, half - 1, half, half + 1, half + 2, (1 << (23 - keep)) - 1], np.uint32)
    u = (exps[:, None, None] << 23 | top[None, :, None] | low[None, None, :]).ravel()
    u = np.r_[u, rng.integers(0, 1 << 31, 1_000_000, dtype=np.uint32), np.arange(0, 1 << 16, dtype=np.uint32)]
    x = u.view(np.float32)
    x = x[np.abs(x) < OVERFLOW[fmt]]
    return np.r_[x, -x, np.float32(TOP[fmt])].astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_codes_equal_ml_dtypes_over_every_input_class(fmt):
    wide = fmt == "e5m2"
    x = _pattern_classes(fmt)
    got = np.empty(x.size, np.uint8)
    _codes(x, np.float32(1.0), wide, got)
    np.testing.assert_array_equal(got, x.astype(FORMATS[fmt]).view(np.uint8))
    # through a scale, as the encoder multiplies: the code of the float32 product
    rng = np.random.default_rng(2)
    y = (rng.standard_normal(200_000) * np.exp(rng.uniform(-20, 20, 200_000))).astype(np.float32)
    for inv in (np.float32(TOP[fmt]) / np.abs(y).max(), np.float32(3.7), np.float32(2.0 ** -20)):
        q = (y * inv).astype(np.float32)
        keep = np.abs(q) < OVERFLOW[fmt]
        part = np.empty(int(keep.sum()), np.uint8)
        _codes(y[keep], inv, wide, part)
        np.testing.assert_array_equal(part, q[keep].astype(FORMATS[fmt]).view(np.uint8), err_msg=f"inv={inv}")


@pytest.mark.parametrize("constant", [True, False], ids=["compiled-format", "runtime-format"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_values_equal_the_map_times_the_scale(fmt, constant):
    codes = np.arange(256, dtype=np.uint8)
    out = np.empty(256, np.float32)
    # 2**119: about the largest scale an encoder gives (3.4e38 / 448); 3e38: one a hostile file may hold
    for scale in (1.0, 0.5, 2.0 ** -126, 2.0 ** -119, 2.0 ** 100, 2.0 ** 119, 3e38, 3.0, 0.0):
        _values(codes, np.float32(scale), fmt == "e5m2", constant, out)
        with np.errstate(over="ignore", invalid="ignore"):
            want = (lowbit.MAPS[fmt] * np.float32(scale)).astype(np.float32)
        np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32), err_msg=f"scale {scale}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_block_encoder_equals_the_reference(fmt):
    for b in _blocks():
        codes, scales = np.empty(b.size, np.uint8), np.empty(-(-b.size // 256), np.float32)
        _encode_blocks(b, codes, scales, fmt == "e5m2")
        want_codes, want_scales = lowbit.float8_encode(b, fmt)
        np.testing.assert_array_equal(codes, want_codes)
        np.testing.assert_array_equal(scales.view(np.uint32), want_scales.view(np.uint32))


# -- the step's stochastic rounding (e5m2 slots) --------------------------------------------------


def _sr_blocks():
    """Non-negative blocks (second moments): spreads of magnitude, zeros, the format's subnormal range,
    exact values, a NaN and an all-tiny block."""
    rng = np.random.default_rng(11)
    out = [np.abs(rng.standard_normal(256)) * np.exp(rng.normal(0, s, 256)) for s in (0.5, 3, 8)]
    out.append(np.r_[np.zeros(100), np.abs(rng.standard_normal(156))])
    out.append(np.r_[57344.0, 2.0 ** -14 * np.arange(1, 100), 2.0 ** -16 * np.arange(50)])  # subnormal range
    out.append(lowbit.MAPS["e5m2"][:0x7C].copy())  # every finite non-negative value: exact
    out.append(np.r_[1.0, np.nan, 2.0])
    out.append(np.full(7, 2.0 ** -120))
    return [np.asarray(b, np.float32) for b in out]


@njit
def _encode_sr(x, pos, key):
    codes = np.empty(x.size, np.uint8)
    scale = f8_encode_block_sr(x, codes, pos, key)
    return codes, scale


def test_stochastic_rounding_brackets_the_value_and_is_unbiased():
    finite = lowbit.MAPS["e5m2"][: lowbit.E5M2_TOP_CODE + 1]  # the non-negative finite values, increasing
    for b in _sr_blocks():
        near, scale = lowbit.float8_encode(b, "e5m2")
        normal = np.isfinite(scale[0]) and scale[0] > 0
        with np.errstate(over="ignore", invalid="ignore"):  # (the NaN and the all-tiny blocks: not used)
            q = (b * np.float32(np.float32(57344.0) / np.float32(np.nanmax(np.abs(b))))).astype(np.float32)
        k = np.clip(np.searchsorted(finite, q, "right") - 1, 0, lowbit.E5M2_TOP_CODE) if normal else None
        seen = np.zeros((b.size, 0), np.uint8)
        for key in range(64):
            codes, sc = lowbit.sr_codes(b, np.arange(b.size) + 7, key)
            assert sc.view(np.uint32)[0] == scale.view(np.uint32)[0]
            if not normal:  # a NaN block, an all-tiny block: float8_encode's codes
                np.testing.assert_array_equal(codes, near)
                continue
            # the code below the value, or the one above it (subnormal range included)
            assert np.all((codes == k) | (codes == np.minimum(k + 1, lowbit.E5M2_TOP_CODE))), key
            seen = np.c_[seen, codes]
        if normal:
            exact = finite[k] == q
            assert np.all(seen[exact] == near[exact, None])  # a representable value keeps its code
    # unbiased: the mean over keys of the values is the value (2.5% of a step's width at 4096 draws),
    # in the normal range and below it (3e-5: e5m2's subnormal step is 2**-16)
    x = np.array([57344.0, 1.3, 0.7, 123.4, 5e-4, 40000.0, 3e-5], np.float32)
    draws = np.array([lowbit.MAPS["e5m2"][lowbit.sr_codes(x, np.arange(7), k)[0]] for k in range(4096)])
    step = np.array([8192.0, 0.25, 0.125, 16.0, 2.0 ** -13, 8192.0, 2.0 ** -16])  # e5m2's spacing at each value
    np.testing.assert_array_less(np.abs(draws.mean(0) - x), 0.025 * step + 1e-12)
    assert np.all(draws.std(0)[1:] > 0.1 * step[1:])  # (and the draws do differ)


def test_cpu_stochastic_rounding_equals_the_reference():
    rng = np.random.default_rng(3)
    for b in _sr_blocks():
        for pos, key in ((0, 0), (5, 12345), (2**33 + 17, 0xFFFFFFFF), (int(rng.integers(2**40)), int(rng.integers(2**32)))):
            codes, scale = _encode_sr(b, pos, key)
            want, want_scale = lowbit.sr_codes(b, pos + np.arange(b.size), key)
            np.testing.assert_array_equal(codes, want, err_msg=f"pos {pos} key {key}")
            assert np.float32(scale).view(np.uint32) == want_scale.view(np.uint32)[0]


def test_stochastic_rounding_refuses_positions_of_another_shape():
    x = np.ones(5, np.float32)
    with pytest.raises(at.errors.LayoutError, match="pos"):
        lowbit.sr_codes(x, np.arange(4), 7)


def test_salts_differ_by_step_and_slot():
    salts = {lowbit.sr_salt(t, n) for t in range(1, 200) for n in ("exp_avg_sq", "max_exp_avg_sq", "sum")}
    assert len(salts) == 3 * 199 and all(0 <= s < 2**32 for s in salts)
    assert lowbit.sr_salt(5, "exp_avg_sq") == lowbit.sr_salt(5, "exp_avg_sq")


def test_a_float8_second_moment_follows_its_float32_twin():
    """Adam's v moves by 1 - beta2 = 0.1% a step, far below half an e5m2 step: rounded to nearest even
    its codes stop moving and the moment falls behind its float32 twin (here the update 5% larger by
    step 300, a quarter larger in the transformer of docs/guide.md#float8-state); stochastically
    rounded it follows. Gradients of a steady magnitude per element (10% noise), over 3 decades."""
    rng = np.random.default_rng(0)
    scale = np.exp(rng.normal(0, 1.5, 8192)).astype(np.float32)
    p0 = {"w": np.zeros(8192, np.float32)}
    engines = [Engine(p0, optim.Adam(lr=0.0, state_dtype=sd)) for sd in (None, "float8")]
    near = np.zeros(8192, np.float32)  # the same moment rounded to nearest even at every step
    for t in range(300):
        g = (scale * (1 + 0.1 * np.random.default_rng(t).standard_normal(8192))).astype(np.float32)
        for e in engines:
            e.step({"w": g})
        near = np.float32(0.999) * near + np.float32(0.001) * g * g
        near = lowbit.decode(*lowbit.float8_encode(near, "e5m2"), "e5m2")
    v32 = engines[0].state_dict()["optimizer"]["slots"]["exp_avg_sq"]["w"]
    entry = engines[1].state_dict()["optimizer"]["slots"]["exp_avg_sq"]["w"]
    v8 = lowbit.decode(entry["codes"].ravel(), entry["scale"], "e5m2")
    # the update's factor against float32 state's, sqrt(v32 / v): measured 1.0035 and 1.055
    assert abs(np.median(np.sqrt(v32 / v8)) - 1) < 0.015
    assert np.median(np.sqrt(v32 / near)) > 1.03


# -- through the engine --------------------------------------------------------------------------


def _model(seed=5):
    rng = np.random.default_rng(seed)
    shapes = {"w": (80, 64), "b": (30,)}
    curv = {k: rng.uniform(0.5, 2.0, s).astype(np.float32) for k, s in shapes.items()}
    return shapes, curv, {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def _trained(state_dtype, steps=5):
    shapes, curv, p0 = _model()
    e = Engine(p0, optim.AdamW(lr=1e-2, state_dtype=state_dtype))
    for _ in range(steps):
        e.step({k: curv[k] * e.params[k] for k in shapes})
    return p0, e


def test_adamw_state_bytes_per_parameter():
    rng = np.random.default_rng(0)
    p0 = {f"l{i}": rng.standard_normal((512, 512)).astype(np.float32) for i in range(4)}
    p0.update({f"bias{i}": np.zeros(512, np.float32) for i in range(4)})  # under the threshold: float32
    e = Engine(p0, optim.AdamW(state_dtype="float8"))
    assert e.memory()["state"] / e.layout.num_elements <= 2.05
    slots = e.state.slots
    assert slots["exp_avg"].map_name == "e4m3" and slots["exp_avg_sq"].map_name == "e5m2"
    entry = slots["exp_avg_sq"].as_dict()["l0"]
    assert set(entry) == {"codes", "scale", "map"} and entry["scale"].shape == (1024,)


def test_state_converts_between_float8_and_every_other_state_dtype():
    p0, e8 = _trained("float8")
    f8 = e8.state.slots
    assert f8["exp_avg"].is_quantized("w") and not f8["exp_avg"].is_quantized("b")
    # float8 -> float32: decoded exactly
    e32 = Engine(p0, optim.AdamW(lr=1e-2))
    e32.load_state_dict(e8.state_dict())
    for slot in ("exp_avg", "exp_avg_sq"):
        np.testing.assert_array_equal(e32.state.slots[slot]["w"], f8[slot].values("w"))
    # float32 -> float8: the same codes again, the scales within an ulp
    back = Engine(p0, optim.AdamW(lr=1e-2, state_dtype="float8"))
    back.load_state_dict(e32.state_dict())
    for slot in ("exp_avg", "exp_avg_sq"):
        np.testing.assert_array_equal(back.state.slots[slot].codes, f8[slot].codes, err_msg=slot)
        np.testing.assert_allclose(back.state.slots[slot].values("w"), f8[slot].values("w"), rtol=1e-6)
    # float8 -> 8-bit -> float8, and into bfloat16
    q8 = Engine(p0, optim.AdamW(lr=1e-2, state_dtype="8bit"))
    q8.load_state_dict(e8.state_dict())
    assert q8.state.slots["exp_avg"].map_name == "signed"
    w = f8["exp_avg"].values("w")
    np.testing.assert_allclose(q8.state.slots["exp_avg"].values("w"), w, atol=0.02 * np.abs(w).max())
    again = Engine(p0, optim.AdamW(lr=1e-2, state_dtype="float8"))
    again.load_state_dict(q8.state_dict())
    np.testing.assert_allclose(again.state.slots["exp_avg"].values("w"), w, rtol=0.07, atol=0.03 * np.abs(w).max())
    bf = Engine(p0, optim.AdamW(lr=1e-2, state_dtype="bfloat16"))
    bf.load_state_dict(e8.state_dict())
    np.testing.assert_allclose(bf.state.slots["exp_avg"]["w"].astype(np.float32), w, rtol=1e-2)


def test_checkpoint_files_convert_too(tmp_path):
    p0, e8 = _trained("float8", 3)
    at.save(tmp_path / "f8.safetensors", e8)
    # (a file's float32 arrays do not load into bfloat16 slots, whatever the state: load_state_dict converts)
    for other in ("float32", "8bit"):
        e = Engine(p0, optim.AdamW(lr=1e-2, state_dtype=other))
        at.load(tmp_path / "f8.safetensors", e)  # float8 entries into another state dtype
        got = e.state.slots["exp_avg_sq"]
        got = got.values("w") if isinstance(got, state8.Quant8Buffer) else got["w"].astype(np.float32)
        want = e8.state.slots["exp_avg_sq"].values("w")  # (the dynamic map is coarse far below a block's max)
        np.testing.assert_allclose(got, want, rtol=0.02, atol=0.01 * np.abs(want).max())
        at.save(tmp_path / f"{other}.safetensors", e)
        back = Engine(p0, optim.AdamW(lr=1e-2, state_dtype="float8"))
        at.load(tmp_path / f"{other}.safetensors", back)  # and back into float8
        if other == "float32":  # decoded values: the same codes again
            for slot in ("exp_avg", "exp_avg_sq"):
                np.testing.assert_array_equal(back.state.slots[slot].codes, e8.state.slots[slot].codes)


def test_refusals_change_nothing():
    from arraytrain.errors import HyperparameterError, StateDictError

    shapes, curv, p0 = _model()
    with pytest.raises(HyperparameterError, match="float8 state needs float32"):
        Engine({k: v.astype(np.float64) for k, v in p0.items()}, optim.AdamW(state_dtype="float8"))
    p0, e = _trained("float8", 2)
    before = {k: b.flat.copy() for k, b in e.state.slots.items()}
    for bad_entry in ({"codes": None, "absmax": None, "map": "e4m3"},  # a float8 map with 8-bit's key
                      {"codes": None, "scale": None, "map": "e3m4"}):  # no such map
        bad = e.state_dict(copy=True)
        good = bad["optimizer"]["slots"]["exp_avg"]["w"]
        bad["optimizer"]["slots"]["exp_avg"]["w"] = {k: (good["codes"] if k == "codes" else
                                                         good["scale"] if v is None else v)
                                                     for k, v in bad_entry.items()}
        with pytest.raises(StateDictError, match="map|scale"):
            e.load_state_dict(bad)
        for k, b in e.state.slots.items():
            assert np.array_equal(b.flat, before[k]), k
