"""Top-k, random-k, int8 blockwise, sign and ternary compressors: kernels against their
reference twins, error bounds, unbiasedness, exact payload bytes, error feedback, bad arguments.

Kernel tests take the ``family`` fixture and compressor tests the ``numba_family`` fixture
(conftest.py): both run the numba family and, where a GPU is usable, the CUDA family."""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest
from conftest import DTYPES, parallel_dtypes

from arraytrain import Layout
from arraytrain.compress import ErrorFeedback, Int8Block, RandomK, Sign, Ternary, TopK
from arraytrain.errors import ArgumentTypeError, HyperparameterError
from arraytrain.kernels.reference import compression as ref

# One row per configuration: every generic test runs on every row.
CONFIGS = {
    "topk": lambda **kw: TopK(ratio=0.05, ramp=0, **kw),
    "topk_k": lambda **kw: TopK(k=3, ramp=0, **kw),
    "randomk": lambda **kw: RandomK(ratio=0.05, ramp=0, **kw),
    "randomk_contract": lambda **kw: RandomK(k=3, rescale=False, ramp=0, **kw),
    "int8": lambda **kw: Int8Block(**kw),
    "int8_stochastic": lambda **kw: Int8Block(block=64, stochastic_rounding=True, **kw),
    "sign": lambda **kw: Sign(**kw),
    "sign_block": lambda **kw: Sign(block=100, **kw),
    "ternary": lambda **kw: Ternary(**kw),
    "ternary_block": lambda **kw: Ternary(block=100, **kw),
}
SIZES = (0, 1, 7, 1037, 70001)  # 70001 > SERIAL_BELOW: the parallel twins
MIN_SIZE = 4


def layout_for(n: int) -> Layout:
    """``a`` (n elements) and ``b`` (20) are compressed, ``s`` (3 < MIN_SIZE) travels raw."""
    return Layout({"e0": (0,), "a": (n,), "s": (3,), "b": (4, 5), "e1": (0,)})


def flat_for(layout: Layout, dtype, rng, scale=1.0) -> np.ndarray:
    x = np.zeros(layout.size, dtype)
    for name in layout.names:
        s = layout.slice(name)
        x[s] = rng.standard_normal(s.stop - s.start) * scale
    return x


def domain_of(c, x: np.ndarray) -> np.ndarray:
    """The dense domain vector of a bound compressor (a copy)."""
    return c._big.pack(x).copy()


def decoded_domain(c, x: np.ndarray):
    """``(domain of x, domain of decompress(compress(x)), payload)``."""
    payload = c.compress(x)
    out = c.decompress(payload)
    return domain_of(c, x), domain_of(c, out), payload


def one_vector(c, x: np.ndarray):
    """Bind ``c`` to a single unpadded parameter holding ``x`` (the domain is ``x`` itself)."""
    return c.bind(Layout({"x": x.shape}, align=1), x.dtype)


# -- kernels against the reference ----------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
@pytest.mark.usefixtures("numba_family")
def test_kernels_match_reference(cfg, dtype, n, rng):
    layout = layout_for(n)
    fast, slow = (CONFIGS[cfg](min_size=MIN_SIZE, warmup=1, seed=5, kernels=k).bind(layout, dtype)
                  for k in ("numba", "reference"))
    for step in range(3):
        x = flat_for(layout, dtype, rng, scale=10.0 ** (step - 1))
        pf, ps = fast.compress(x), slow.compress(x)
        assert pf.meta == ps.meta and sorted(pf.arrays) == sorted(ps.arrays)
        assert step > 0 or (pf.meta["warmup"] and not pf.arrays)
        for name, a in pf.arrays.items():
            b = ps.arrays[name]
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(a, b, err_msg=f"{cfg} {name}")
        np.testing.assert_array_equal(pf.raw, ps.raw)
        of, os_ = fast.decompress(pf), slow.decompress(ps)
        np.testing.assert_array_equal(of, os_)
        np.testing.assert_array_equal(slow.decompress(pf), of)  # either side decodes the other's payload
        assert pf.nbytes == ps.nbytes


@parallel_dtypes
@pytest.mark.parametrize("cfg", ["topk", "sign", "ternary_block", "int8_stochastic"])
def test_thread_count_does_not_change_bits(cfg, dtype, rng):
    x = rng.standard_normal(200_003).astype(dtype)
    outs = []
    default = numba.get_num_threads()
    try:
        for threads in sorted({1, default}):
            numba.set_num_threads(threads)
            c = one_vector(CONFIGS[cfg](seed=3), x)
            outs.append(c.compress(x).arrays)
    finally:
        numba.set_num_threads(default)
    for name in outs[0]:
        np.testing.assert_array_equal(outs[0][name], outs[-1][name])


@pytest.mark.usefixtures("numba_family")
def test_empty_domain(rng):
    layout = Layout({"s": (3,), "e": (0,)})
    for cfg, make in CONFIGS.items():
        c = make(min_size=MIN_SIZE).bind(layout, np.float32)
        x = flat_for(layout, np.float32, rng)
        p = c.compress(x)
        assert p.arrays == {} and p.nbytes == 3 * 4, cfg
        np.testing.assert_array_equal(c.decompress(p), x)


# -- top-k ----------------------------------------------------------------------------------


def brute_topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |x|, ties to the lowest index, by a full Python sort."""
    order = sorted(range(x.size), key=lambda i: (-abs(float(x[i])), i))
    return np.sort(np.array(order[:k], dtype=np.int64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernels", ["numba", "reference"])
@pytest.mark.usefixtures("numba_family")
def test_topk_keeps_exactly_the_k_largest(kernels, dtype, rng):
    x = rng.standard_normal(2000).astype(dtype)
    x[100:300] = x[300:500]  # equal magnitudes at and around the threshold
    x[500:700] = -x[300:500]
    want = brute_topk(x, 150)
    c = one_vector(TopK(k=150, ramp=0, kernels=kernels), x)
    dom, dec, p = decoded_domain(c, x)
    np.testing.assert_array_equal(p.arrays["indices"], want)
    assert p.arrays["indices"].dtype == np.uint32
    np.testing.assert_array_equal(p.arrays["values"], x[want])
    expect = np.zeros_like(x)
    expect[want] = x[want]
    np.testing.assert_array_equal(dec, expect)


# uint32 indices, as TopK sends them (int64 above 2**32 elements: the slow tier)
@pytest.mark.parametrize("index", [np.uint32, pytest.param(np.int64, marks=pytest.mark.slow)], ids=["uint32", "int64"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_ties_and_edge_cases(family, dtype, index):
    idx, val = np.empty(3, index), np.empty(3, dtype)
    x = np.array([1, -2, 2, 1, -1, 2, 0], dtype)  # |2| three times: the lowest two of them, then ...
    for kern in (family, ref):
        kern.topk(x, idx, val, k=3)
        np.testing.assert_array_equal(idx, [1, 2, 5])
        kern.topk(np.ones(9, dtype), idx, val, k=3)  # all equal: the first three
        np.testing.assert_array_equal(idx, [0, 1, 2])
        y = np.array([1, np.nan, -np.inf, 5, -7, 0], dtype)  # NaN ranks above every number
        kern.topk(y, idx, val, k=3)
        np.testing.assert_array_equal(idx, [1, 2, 4])


@parallel_dtypes
def test_topk_heavy_ties_parallel_path(family, dtype, rng):
    # few distinct magnitudes over many chunks: the candidate bin holds most elements and
    # the selection among equal keys runs through every refinement level
    x = rng.choice(np.array([0.5, -0.5, 0.25, 1 + 2.0**-20, 1.0], dtype), size=300_000)
    for k in (1, 4_321, 150_000, 300_000):
        out = [(np.empty(k, np.uint32), np.empty(k, dtype)) for _ in range(2)]
        family.topk(x, *out[0], k=k)
        ref.topk(x, *out[1], k=k)
        np.testing.assert_array_equal(out[0][0], out[1][0])
        np.testing.assert_array_equal(out[0][1], out[1][1])


def test_topk_ratio_reads_decimal(rng):
    x = rng.standard_normal(100)
    assert one_vector(TopK(ratio=0.07), x).k_selected == 7  # ceil(0.07 * 100) in binary floats is 8
    assert one_vector(TopK(ratio=1e-9), x).k_selected == 1
    assert one_vector(TopK(ratio=1.0), x).k_selected == 100


# -- quantizer bounds ----------------------------------------------------------------------------


def per_element(scales, block, n):
    return np.repeat(np.asarray(scales, np.float64), block)[:n]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_shared_scales_kernel_matches_reference(family, dtype, n, rng):
    """Codes against given scales (a group's maximum): numba == reference; own scales == the plain encode."""
    block = 64
    x = (rng.standard_normal(n) * 3).astype(dtype)
    nb_ = -(-n // block)
    for stochastic in (False, True):
        codes, own = np.empty(n, np.int8), np.empty(nb_, dtype)
        family.int8_encode(x, codes, own, block=block, key=7, stochastic=stochastic)
        again = np.empty(n, np.int8)
        family.int8_encode(x, again, own.copy(), block=block, key=7, stochastic=stochastic, shared=True)
        np.testing.assert_array_equal(again, codes)  # the block's own scale: the same codes
        shared = own * dtype(rng.uniform(1, 4)) if n else own  # a larger scale, as another rank's
        got, want = np.empty(n, np.int8), np.empty(n, np.int8)
        given = shared.copy()
        family.int8_encode(x, got, given, block=block, key=7, stochastic=stochastic, shared=True)
        ref.int8_encode(x, want, shared.copy(), block=block, key=7, stochastic=stochastic, shared=True)
        np.testing.assert_array_equal(given, shared)  # read, not written
        np.testing.assert_array_equal(got, want)
        assert n == 0 or np.abs(got.astype(int)).max() < 127


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.usefixtures("numba_family")
def test_int8_error_bound(stochastic, dtype, rng):
    x = (rng.standard_normal(5000) * np.repeat(10.0 ** rng.integers(-3, 3, 20), 250)).astype(dtype)
    x[:256] = 0  # an all-zero block
    c = one_vector(Int8Block(block=256, stochastic_rounding=stochastic), x)
    dom, dec, p = decoded_domain(c, x)
    codes, scales = p.arrays["codes"], p.arrays["scales"]
    assert scales.dtype == dtype and codes.dtype == np.int8 and np.abs(codes.astype(int)).max() == 127
    blocks = np.pad(np.abs(dom), (0, -dom.size % 256)).reshape(-1, 256).max(axis=1).astype(np.float64)
    np.testing.assert_allclose(scales, blocks / 127, rtol=2 * np.finfo(dtype).eps)
    s = per_element(scales, 256, x.size)
    slack = 4 * np.finfo(dtype).eps * per_element(blocks, 256, x.size)  # rounding of s and 1/s
    err = np.abs(dom.astype(np.float64) - dec)
    bound = s if stochastic else s / 2
    assert np.all(err <= bound + slack) and not np.any(dec[:256])
    if stochastic:
        live = s > 0
        assert np.all(err[live] < s[live] + slack[live])
        np.testing.assert_array_equal(dec[256:], codes[256:].astype(dtype) * s[256:].astype(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [None, 300])
@pytest.mark.usefixtures("numba_family")
def test_sign_decodes_to_plus_minus_scale(block, dtype, rng):
    x = rng.standard_normal(1000).astype(dtype)
    x[[3, 10]] = [0.0, -0.0]  # sign(0) = +
    c = one_vector(Sign(block=block), x)
    dom, dec, p = decoded_domain(c, x)
    b = block or x.size
    l1 = [np.abs(dom[i:i + b].astype(np.float64)).mean() for i in range(0, x.size, b)]
    np.testing.assert_array_equal(p.arrays["scales"], np.float32(l1))
    s = per_element(p.arrays["scales"], b, x.size).astype(dtype)
    np.testing.assert_array_equal(dec, np.where(dom >= 0, s, -s))
    assert dec[3] > 0 and dec[10] > 0
    np.testing.assert_array_equal(p.arrays["bits"], np.packbits(dom >= 0, bitorder="little"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [None, 300])
@pytest.mark.usefixtures("numba_family")
def test_ternary_decodes_to_three_values(block, dtype, rng):
    x = rng.standard_normal(1000).astype(dtype)
    c = one_vector(Ternary(block=block), x)
    dom, dec, p = decoded_domain(c, x)
    b = block or x.size
    smax = np.array([np.abs(dom[i:i + b]).max() for i in range(0, x.size, b)], np.float64)
    scales = p.arrays["scales"]
    assert scales.dtype == np.float32 and np.all(scales >= smax)
    assert np.all(scales.astype(np.float64) <= np.nextafter(np.float32(smax), np.float32(np.inf)))
    s = per_element(scales, b, x.size).astype(dtype)
    assert np.all((dec == 0) | (dec == s) | (dec == -s))
    assert np.all(np.sign(dec) * np.sign(dom) >= 0)  # never the opposite sign
    assert np.count_nonzero(dec) > 0


# -- unbiasedness -----------------------------------------------------------------------------------


def assert_unbiased(make, x: np.ndarray, var: np.ndarray, draws: int) -> None:
    """The mean of ``draws`` decodes equals ``x`` within the variance of that mean.

    ``var``: the per-element variance of one decode. With z_i = (mean_i - x_i) / sqrt(var_i / T),
    each z_i is ~N(0, 1) for T draws, so max |z| < 6 and mean(z^2) < 1 + 6 sqrt(2 / m) hold
    except with negligible probability (the draws are fixed by the seed: no flakiness).
    """
    c = one_vector(make(), x)
    total = np.zeros_like(x)
    for _ in range(draws):
        total += c.decompress(c.compress(x))
    mean = total / draws
    det = var == 0
    np.testing.assert_allclose(mean[det], x[det], rtol=1e-12, atol=0)
    z = (mean[~det] - x[~det]) / np.sqrt(var[~det] / draws)
    assert np.abs(z).max() < 6
    assert np.mean(z**2) < 1 + 6 * math.sqrt(2 / z.size)


@pytest.mark.usefixtures("numba_family")
def test_randomk_unbiased(rng):
    x = rng.standard_normal(200)
    n, k = x.size, 50
    assert_unbiased(lambda: RandomK(k=k, ramp=0, seed=1), x, (n / k - 1) * x**2, 3000)


@pytest.mark.parametrize("block", [None, 64])
@pytest.mark.usefixtures("numba_family")
def test_ternary_unbiased(block, rng):
    x = rng.standard_normal(200)
    b = block or x.size
    s = per_element(ref.ternary_scales(x, b), b, x.size)  # max |x| per block, rounded up to float32
    assert_unbiased(lambda: Ternary(block=block, seed=2), x, s * np.abs(x) - x**2, 3000)


@pytest.mark.usefixtures("numba_family")
def test_int8_stochastic_rounding_unbiased(rng):
    x = rng.standard_normal(200)
    s = np.repeat([np.abs(x[i:i + 64]).max() / 127 for i in range(0, x.size, 64)], 64)[: x.size]
    t = x / s
    frac = t - np.floor(t)
    assert_unbiased(lambda: Int8Block(block=64, stochastic_rounding=True, seed=3), x,
                    s**2 * frac * (1 - frac), 3000)


@pytest.mark.usefixtures("numba_family")
def test_randomk_rescale(rng):
    x = rng.standard_normal(100)
    for rescale, factor in ((True, 100 / 7), (False, 1.0)):
        c = one_vector(RandomK(k=7, rescale=rescale, ramp=0), x)
        dom, dec, p = decoded_domain(c, x)
        idx = np.flatnonzero(dec)
        assert idx.size == 7
        np.testing.assert_array_equal(p.arrays["values"], x[idx])
        np.testing.assert_array_equal(dec[idx], x[idx] * factor)


# -- payload bytes ----------------------------------------------------------------------------------


def expected_nbytes(cfg: str, n: int, itemsize: int) -> int:
    """The wire bytes of the domain's arrays, from each method's formula."""
    k = max(1, math.ceil(0.05 * n))
    return {
        "topk": k * (4 + itemsize),
        "topk_k": 3 * (4 + itemsize),
        "randomk": k * itemsize,
        "randomk_contract": 3 * itemsize,
        "int8": n + -(-n // 256) * itemsize,
        "int8_stochastic": n + -(-n // 64) * itemsize,
        "sign": -(-n // 8) + 4,
        "sign_block": -(-n // 8) + 4 * -(-n // 100),
        "ternary": -(-n // 4) + 4,
        "ternary_block": -(-n // 4) + 4 * -(-n // 100),
    }[cfg]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
@pytest.mark.usefixtures("numba_family")
def test_payload_nbytes_exact(cfg, dtype, rng):
    n = 10_000
    layout = layout_for(n)
    itemsize = np.dtype(dtype).itemsize
    c = CONFIGS[cfg](min_size=MIN_SIZE).bind(layout, dtype)
    p = c.compress(flat_for(layout, dtype, rng))
    real = sum(a.nbytes for a in p.arrays.values()) + p.raw.nbytes
    assert p.nbytes == real == expected_nbytes(cfg, n + 20, itemsize) + 3 * itemsize
    assert p.dense_nbytes == (n + 23) * itemsize
    assert p.ratio > 3.5  # int8 with 64-element blocks on float32 is the least compression here


# -- error feedback -----------------------------------------------------------------------------------


def test_error_feedback_refuses_a_compressor_that_scales_up():
    """Rescaled random-k multiplies what it keeps by n/k: under error feedback the residual grows each call."""
    with pytest.raises(HyperparameterError, match="rescale=False"):
        ErrorFeedback(RandomK(ratio=0.05))
    assert not RandomK(ratio=0.05).contraction and RandomK(ratio=0.05, rescale=False).contraction
    assert ErrorFeedback(RandomK(ratio=0.05, rescale=False)).compressor.contraction


@pytest.mark.parametrize("cfg", sorted(c for c in CONFIGS if CONFIGS[c]().contraction))
@pytest.mark.usefixtures("numba_family")
def test_error_feedback_telescopes(cfg, rng):
    layout = layout_for(300)
    ef = ErrorFeedback(CONFIGS[cfg](min_size=MIN_SIZE, warmup=1, seed=9)).bind(layout, np.float64)
    sent, grads = np.zeros(layout.size), np.zeros(layout.size)
    for _ in range(8):
        g = flat_for(layout, np.float64, rng)
        grads += g
        x = g.copy()
        ef.roundtrip(x)
        sent += x
    np.testing.assert_allclose(sent + ef.residual.flat, grads, rtol=0, atol=1e-12 * np.abs(grads).max())
    assert np.any(ef.residual.flat)


# -- counter RNG ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(1, 1), (10, 10), (1037, 50), (70001, 7000)])
def test_randk_indices_numba_equals_reference(family, n, k):
    for key in (0, 123456789, 2**64 - 1):
        a, b = family.randk_indices(n=n, k=k, key=key), ref.randk_indices(n=n, k=k, key=key)
        np.testing.assert_array_equal(a, b)
        assert a.size == k and np.all(np.diff(a) > 0) and a[0] >= 0 and a[-1] < n


@pytest.mark.parametrize("cfg", ["randomk", "int8_stochastic", "ternary"])
@pytest.mark.usefixtures("numba_family")
def test_seeds_and_steps_draw_differently(cfg, rng):
    x = rng.standard_normal(5000)
    payloads = {}
    for seed in (0, 1):
        c = one_vector(CONFIGS[cfg](seed=seed), x)
        payloads[seed] = [c.compress(x), c.compress(x)]
    dec = one_vector(CONFIGS[cfg](seed=0), x)
    out = {(s, i): dec.decompress(p) for s, ps in payloads.items() for i, p in enumerate(ps)}
    assert not np.array_equal(out[0, 0], out[1, 0])  # seeds differ
    assert not np.array_equal(out[0, 0], out[0, 1])  # calls differ
    again = one_vector(CONFIGS[cfg](seed=0), x).compress(x)
    for name, a in again.arrays.items():
        np.testing.assert_array_equal(a, payloads[0][0].arrays[name])  # same seed and call: same draws


# -- bad arguments --------------------------------------------------------------------------------------

BAD = [
    (lambda: TopK(), HyperparameterError, "ratio, k"),
    (lambda: TopK(ratio=0.1, k=3), HyperparameterError, "ratio, k"),
    (lambda: TopK(ratio=0.0), HyperparameterError, "ratio"),
    (lambda: TopK(ratio=1.5), HyperparameterError, "ratio"),
    (lambda: TopK(ratio=float("nan")), HyperparameterError, "ratio"),
    (lambda: TopK(k=0), HyperparameterError, "k:"),
    (lambda: TopK(k=2.5), HyperparameterError, "k:"),
    (lambda: RandomK(k=True), HyperparameterError, "k:"),
    (lambda: RandomK(ratio=-0.1), HyperparameterError, "ratio"),
    (lambda: RandomK(k=3, rescale=1), HyperparameterError, "rescale"),
    (lambda: Int8Block(block=0), HyperparameterError, "block"),
    (lambda: Int8Block(block=None), HyperparameterError, "block"),
    (lambda: Int8Block(stochastic_rounding="yes"), HyperparameterError, "stochastic_rounding"),
    (lambda: Sign(block=0), HyperparameterError, "block"),
    (lambda: Sign(block=2.0), HyperparameterError, "block"),
    (lambda: Ternary(block=-1), HyperparameterError, "block"),
    (lambda: Ternary(kernels="cuda"), HyperparameterError, "kernels"),
    (lambda: TopK(k=21, min_size=MIN_SIZE).bind(layout_for(0)), HyperparameterError, "k:"),
    (lambda: RandomK(k=4).bind(Layout({"a": (3,)})), HyperparameterError, "k:"),
]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_arguments(i):
    make, error, name = BAD[i]
    with pytest.raises(error, match=name.replace("(", r"\(")):
        make()


def test_bad_payload(rng):
    x = rng.standard_normal(100)
    c = one_vector(TopK(k=5, ramp=0), x)
    p = c.compress(x)
    p.arrays["indices"] = p.arrays["indices"].astype(np.int64)
    with pytest.raises(ArgumentTypeError, match="indices"):
        c.decompress(p)
    p.arrays["indices"] = np.full(5, 100, np.uint32)
    with pytest.raises(ArgumentTypeError, match="indices"):
        c.decompress(p)
    s = one_vector(Sign(), x)
    q = s.compress(x)
    q.arrays["scales"] = q.arrays["scales"].astype(np.float64)
    with pytest.raises(ArgumentTypeError, match="scales"):
        s.decompress(q)


# -- the sparsifiers' ramp --------------------------------------------------------------------------


@pytest.mark.usefixtures("numba_family")
def test_the_ramp_quarters_the_kept_fraction_in_equal_stages_then_holds_the_target(rng):
    """DGC's exponential warm-up in calls: after 2 dense calls, 1/4, 1/16, 1/64 kept for 4 calls each
    (ratio 0.01 of 10,000: 2,500, 625, 157), then the target's 100; each call the exact top-k of its k."""
    x = rng.standard_normal(10_000)
    c = one_vector(TopK(ratio=0.01, warmup=2, ramp=12), x)
    assert c.schedule == "dense for 2 calls; 1/4, 1/16, 1/64 kept over the next 12 calls; then ratio 0.01"
    want = [None] * 2 + [2500] * 4 + [625] * 4 + [157] * 4 + [100] * 3
    for step, k in enumerate(want):
        assert c.step == step
        dom, dec, p = decoded_domain(c, x)
        if k is None:
            assert p.meta["phase"] == "dense" and p.raw.size == x.size and not p.arrays
            continue
        assert c.k_at(step) == k and p.meta["phase"] == ("ramp" if step < 14 else "compressed")
        keep = np.sort(np.argsort(-np.abs(x), kind="stable")[:k])
        np.testing.assert_array_equal(p.arrays["indices"], keep)
        np.testing.assert_array_equal(dec[keep], x[keep])
        assert np.count_nonzero(dec) == k and p.nbytes == (4 + 8) * k  # uint32 index, float64 value


@pytest.mark.usefixtures("numba_family")
def test_random_k_ramps_too_and_rescales_by_the_stages_k(rng):
    x = rng.standard_normal(1000)
    c = one_vector(RandomK(ratio=0.05, ramp=2, seed=4), x)
    for step, k in enumerate([250, 63, 50]):  # 1/4 and 1/16 of 1,000 (ceil), then 5%
        _, dec, p = decoded_domain(c, x)
        idx = np.flatnonzero(dec)
        assert p.arrays["values"].size == k and idx.size == k
        np.testing.assert_allclose(dec[idx], x[idx] * 1000 / k, rtol=1e-15)


def test_no_ramp_when_the_target_keeps_a_quarter_or_ramp_is_zero(rng):
    x = rng.standard_normal(400)
    for c in (one_vector(TopK(ratio=0.25), x), one_vector(TopK(ratio=0.01, ramp=0), x), one_vector(TopK(k=100), x)):
        assert c.k_at(0) == c.k_selected and c.phase(0) == "compressed"
    assert one_vector(TopK(k=100), x).schedule == "then k=100"
    assert TopK(ratio=0.01).ramp == 1000 and TopK(ratio=0.01).warmup == 0  # the library's defaults, in calls


@pytest.mark.usefixtures("numba_family")
def test_a_ramp_payload_decodes_by_its_own_call_number(rng):
    """A receiver takes the call's k from the payload's call number; a payload whose arrays do not have
    that call's k, or without a usable call number, is refused and ``out`` is left as it was."""
    x = rng.standard_normal(1000)
    c = one_vector(TopK(ratio=0.01, ramp=4), x)
    early = c.compress(x)  # call 0: 250 kept
    twin = one_vector(TopK(ratio=0.01, ramp=4), x)
    np.testing.assert_array_equal(twin.decompress(early), c.decompress(early))  # twin's own count is still 0
    late = dict(early.meta, step=9)
    out = np.full(1000, 7.0)
    for meta in (late, dict(early.meta, step=-1), dict(early.meta, step=True), {"phase": "ramp"}):
        bad = type(early)(early.method, arrays=dict(early.arrays), meta=meta)
        with pytest.raises(ArgumentTypeError, match="indices|step"):
            c.decompress(bad, out)
        assert (out == 7.0).all()


def test_bad_ramp_is_refused():
    for bad in (-1, 2.5, True, "10"):
        with pytest.raises(HyperparameterError, match="ramp"):
            TopK(ratio=0.1, ramp=bad)


def test_without_a_ramp_a_sparsifier_describes_itself_as_before_the_ramp():
    """A checkpoint's compressor type written before the ramp existed still matches ``ramp=0``."""
    assert TopK(ratio=0.05, ramp=0).describe() == "TopK(ratio=0.05, min_size=0, warmup=0, seed=0)"
    assert RandomK(k=3, ramp=0).describe() == "RandomK(k=3, rescale=True, min_size=0, warmup=0, seed=0)"
    assert TopK(ratio=0.05).describe() == repr(TopK(ratio=0.05)) == \
        "TopK(ratio=0.05, ramp=1000, min_size=0, warmup=0, seed=0)"
