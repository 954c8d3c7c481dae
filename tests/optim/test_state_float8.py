"""float8 optimizer state (``state_dtype="float8"``, arraytrain.state8): the codec.

* The map is ml_dtypes' ``float8_e4m3fn``; the reference encoder's block exponent is the smallest
  that brings the block's largest magnitude to 464 or below (it rounds to e4m3's 448), its codes
  are ml_dtypes' cast of the exactly scaled values, and decoded blocks encode to themselves.
* The CPU family's per-element codec (``f8_code``, ``f8_value``) equals ml_dtypes over every class
  of float32 input: zeros, float32 subnormals, e4m3 subnormals, every binade up to 448, the
  rounding ties and their neighbours, random values (it was checked once over every float32 in
  [-448, 448], 2.1e9 values: no code differs); every code's value, plain and squared, times
  scales at both ends of the range.
* The fast block encoder equals the reference on blocks of every kind: NaN, infinity, zeros,
  negative values in the root form, the exponent's clamps, mixed magnitudes.
* Through the engine: the memory per parameter, conversions to and from float32, bfloat16 and
  8-bit state (in memory and through checkpoint files).

The kernels against the reference, training and bitwise resume run in test_state8.py's matrices.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from numba import njit

import arraytrain as at
from arraytrain import Engine, optim, state8
from arraytrain.kernels.cpu.codecs import f8_code, f8_encode_block, f8_value

E4M3 = ml_dtypes.float8_e4m3fn


def test_the_map_is_ml_dtypes_e4m3():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(E4M3).astype(np.float32)
    np.testing.assert_array_equal(state8.E4M3_MAP, want)
    assert np.isnan(state8.E4M3_MAP[[0x7F, 0xFF]]).all() and state8.E4M3_MAP[0x7E] == 448
    np.testing.assert_array_equal(state8.E4M3_SQUARES, (want.astype(np.float64) ** 2).astype(np.float32))
    assert np.array_equal(state8.E4M3_SQUARES.astype(np.float64), want.astype(np.float64) ** 2, equal_nan=True)


def _independent(x, root):
    """float8 blocks computed another way: float64 exponents from frexp, ml_dtypes' cast."""
    x = np.asarray(x, np.float32)
    y = np.sqrt(x.astype(np.float64)).astype(np.float32) if root else x
    codes, scales = [], []
    for a in range(0, y.size, state8.BLOCK):
        b = y[a : a + state8.BLOCK]
        m = np.abs(b.astype(np.float64)).max()
        if not np.isfinite(m):
            codes.append(np.full(b.size, 0x7F, np.uint8))
            scales.append(np.nan)
            continue
        k = 0 if m == 0 else int(np.ceil(np.log2(m / 464.0)))
        while m / 2.0 ** k > 464:
            k += 1
        while k > -200 and m / 2.0 ** (k - 1) <= 464:
            k -= 1
        lo, hi = (-63, 63) if root else (-126, 126)
        k = min(max(k, lo), hi)
        codes.append((b.astype(np.float64) / 2.0 ** k).astype(np.float32).astype(E4M3).view(np.uint8))
        scales.append(2.0 ** (2 * k if root else k))
    return np.concatenate(codes) if codes else np.zeros(0, np.uint8), np.asarray(scales, np.float32)


def _blocks():
    """Blocks of every kind (each BLOCK elements but the last)."""
    rng = np.random.default_rng(0)
    n = state8.BLOCK
    out = [
        rng.standard_normal(n),
        rng.standard_normal(n) * np.exp(rng.uniform(-40, 40, n)),  # magnitudes across 35 decades
        np.zeros(n), -np.zeros(n),
        np.full(n, 448.0), np.full(n, 449.0), np.full(n, 464.0), np.full(n, 1.75), np.full(n, 1.7500001),
        np.full(n, 3e38), np.full(n, 1e-38), np.full(n, 1e-44),  # the exponent's clamps
        np.r_[rng.standard_normal(n - 1), np.nan], np.r_[rng.standard_normal(n - 1), -np.inf],
        np.r_[rng.standard_normal(n - 1), 1e30], rng.standard_normal(37),
    ]
    return [np.asarray(b, np.float32) for b in out]


@pytest.mark.parametrize("root", [False, True], ids=["e4m3", "e4m3_sqrt"])
def test_reference_encoder_is_the_exactly_scaled_cast(root):
    for b in _blocks():
        x = np.abs(b) if root else b
        codes, scales = state8.float8_encode(x, root)
        want_codes, want_scales = _independent(x, root)
        np.testing.assert_array_equal(codes, want_codes)
        np.testing.assert_array_equal(scales, want_scales)
        finite = np.isfinite(scales)
        if finite.all() and np.abs(x).max() > 1e-30:  # the largest element lands in (232, 464]
            top = state8.decode(codes, scales, "e4m3_sqrt" if root else "e4m3")
            y = np.sqrt(np.abs(x).astype(np.float64)) if root else np.abs(x)
            assert 232 < y.max() / (np.sqrt(scales[0]) if root else scales[0]) <= 464
            np.testing.assert_allclose(top, x, rtol=2.0 ** -3 if root else 2.0 ** -4, atol=np.abs(x).max() * 1e-5)
            # decoded values encode to the very codes and scales again
            again = state8.float8_encode(top, root)
            np.testing.assert_array_equal(again[0], codes)
            np.testing.assert_array_equal(again[1], scales)


@njit(cache=False)
def _codes(x, inv, out):
    for i in range(x.size):
        out[i] = f8_code(x[i], inv)


@njit(cache=False)
def _values(c, scale, root, out):
    for i in range(c.size):
        out[i] = f8_value(c[i], scale, root)


@njit(cache=False)
def _encode_blocks(x, codes, scales, root):
    for j in range(scales.size):
        lo = j * 256
        hi = min(lo + 256, x.size)
        scales[j] = f8_encode_block(x[lo:hi].copy(), codes[lo:hi], root)


def _pattern_classes():
    """float32 inputs of every class in [-448, 448]: zeros, float32 subnormals, e4m3 subnormals and
    normals in every binade, each binade's rounding ties (the 4th mantissa bit's half) and their
    neighbours one and two ulps away, the largest values and random ones."""
    rng = np.random.default_rng(1)
    exps = np.arange(0, 136, dtype=np.uint32)  # biased float32 exponents up to 2**8
    top = np.arange(8, dtype=np.uint32) << 20  # the 3 mantissa bits e4m3 keeps
    half = np.uint32(1 << 19)
    low = np.array([0, 1, 2, half - 2, half - 1, half, half + 1, half + 2, (1 << 20) - 1], np.uint32)
    u = (exps[:, None, None] << 23 | top[None, :, None] | low[None, None, :]).ravel()
    u = np.r_[u, rng.integers(0, 1 << 31, 1_000_000, dtype=np.uint32), np.arange(0, 1 << 16, dtype=np.uint32)]
    x = u.view(np.float32)
    x = x[np.abs(x) <= 464]
    return np.r_[x, -x, np.float32(464), np.float32(463.99997), np.float32(448)].astype(np.float32)


def test_cpu_codes_equal_ml_dtypes_over_every_input_class():
    x = _pattern_classes()
    got = np.empty(x.size, np.uint8)
    _codes(x, np.float32(1.0), got)
    np.testing.assert_array_equal(got, x.astype(E4M3).view(np.uint8))
    # through a power-of-two scale, as the encoder multiplies: the product is exact
    for k in (-126, -20, 0, 17, 126):
        y = (x.astype(np.float64) * 2.0 ** k).astype(np.float32)
        exact = y.astype(np.float64) * 2.0 ** -k == x  # (not where x * 2**k falls below float32's range)
        part = np.empty(int(exact.sum()), np.uint8)
        _codes(y[exact], np.float32(2.0 ** -k), part)
        np.testing.assert_array_equal(part, x[exact].astype(E4M3).view(np.uint8), err_msg=f"k={k}")


@pytest.mark.parametrize("root", [False, True])
def test_cpu_values_equal_the_map_times_the_scale(root):
    codes = np.arange(256, dtype=np.uint8)
    qmap = state8.E4M3_SQUARES if root else state8.E4M3_MAP
    out = np.empty(256, np.float32)
    for scale in (1.0, 0.5, 2.0 ** -126, 2.0 ** 126, 3.0, 0.0):
        _values(codes, np.float32(scale), root, out)
        with np.errstate(over="ignore", invalid="ignore"):
            want = (qmap * np.float32(scale)).astype(np.float32)
        np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32), err_msg=f"scale {scale}")


@pytest.mark.parametrize("root", [False, True], ids=["e4m3", "e4m3_sqrt"])
def test_cpu_block_encoder_equals_the_reference(root):
    blocks = _blocks()
    if root:  # the root form's values are never negative, but for the one block that checks it
        blocks = [np.abs(b) for b in blocks] + [np.r_[np.ones(255, np.float32), np.float32(-1.0)]]
    for b in blocks:
        codes, scales = np.empty(b.size, np.uint8), np.empty(-(-b.size // 256), np.float32)
        _encode_blocks(b, codes, scales, root)
        want_codes, want_scales = state8.float8_encode(b, root)
        np.testing.assert_array_equal(codes, want_codes)
        np.testing.assert_array_equal(scales.view(np.uint32), want_scales.view(np.uint32))


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
    assert slots["exp_avg"].map_name == "e4m3" and slots["exp_avg_sq"].map_name == "e4m3_sqrt"
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
    # float32 -> float8: the very bytes again (a decoded block encodes to itself: see float8_encode)
    back = Engine(p0, optim.AdamW(lr=1e-2, state_dtype="float8"))
    back.load_state_dict(e32.state_dict())
    for slot in ("exp_avg", "exp_avg_sq"):
        assert back.state.slots[slot].flat.tobytes() == f8[slot].flat.tobytes(), slot
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
        if other == "float32":  # exact values: the very bytes
            for slot in ("exp_avg", "exp_avg_sq"):
                assert back.state.slots[slot].flat.tobytes() == e8.state.slots[slot].flat.tobytes()
