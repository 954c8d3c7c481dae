"""8-bit and float8 optimizer state (``state_dtype="8bit"`` / ``"float8"``, arraytrain.optim.state8, arraytrain.lowbit).

The float8 codec's own checks (against ml_dtypes) are in test_state_float8.py; the kernel,
engine and CUDA matrices here run both codecs.

* The codebooks: bitsandbytes' dynamic maps; the bucket tables give the nearest code for
  every float32 (edge values, neighbours of every map value, random values of every scale),
  and the codes equal bitsandbytes' own blockwise quantization where it installs.
* Every optimizer with element-wise state, one step at a time from the same state: the numba
  kernels equal the reference on the parameters, the codes and the block scales, at sizes 0, 1,
  7, 1037 and 278011 with parameters under the threshold (float32 slots) mixed in.
* Through the engine: training, bitwise resume from a checkpoint, conversion to and from
  float32 state, memory per parameter, and the refusals.
* On a GPU (skipped without one): every optimizer's CUDA kernels against the numba ones, one
  step at a time from the same state; working copies and masks; slots allocated on the device.
"""

from __future__ import annotations

import numpy as np
import pytest

import arraytrain as at
from arraytrain import Engine, FlatBuffer, lowbit, optim
from arraytrain.optim import state8
from arraytrain.buffer import GradsAt, segment_addresses
from arraytrain.errors import HyperparameterError, StateDictError
from arraytrain.kernels import cpu
from arraytrain.kernels import reference as ref
from conftest import tiered
from cuda_family import on_device

SIZES = {"z0": (0,), "one": (1,), "seven": (7,), "small": (999,), "mid": (1037,), "mat": (40, 129),
         "empty2": (3, 0), "big": (278011,), "tiny_mat": (3, 5), "z1": (0,)}
THRESHOLD = 1000  # "small" (999), "one", "seven" and "tiny_mat" keep float32 slots

CASES = {
    "SGD": lambda sd: optim.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3, state_dtype=sd),
    "SGD-nesterov": lambda sd: optim.SGD(lr=0.05, momentum=0.9, nesterov=True, state_dtype=sd),
    "Adam": lambda sd: optim.Adam(lr=1e-2, weight_decay=1e-3, state_dtype=sd),
    "AdamW": lambda sd: optim.AdamW(lr=1e-2, state_dtype=sd),
    "AMSGrad": lambda sd: optim.AdamW(lr=1e-2, amsgrad=True, state_dtype=sd),
    "NAdam": lambda sd: optim.NAdam(lr=1e-2, state_dtype=sd),
    "RAdam": lambda sd: optim.RAdam(lr=1e-2, state_dtype=sd),
    "Adamax": lambda sd: optim.Adamax(lr=1e-2, state_dtype=sd),
    "Adagrad": lambda sd: optim.Adagrad(lr=1e-2, initial_accumulator_value=0.1, state_dtype=sd),
    "RMSprop": lambda sd: optim.RMSprop(lr=1e-3, state_dtype=sd),
    "RMSprop-centered-momentum": lambda sd: optim.RMSprop(lr=1e-3, centered=True, momentum=0.9, state_dtype=sd),
    "Lion": lambda sd: optim.Lion(lr=1e-3, weight_decay=0.1, state_dtype=sd),
    "LAMB": lambda sd: optim.LAMB(lr=1e-2, weight_decay=1e-2, state_dtype=sd),
    "Adadelta": lambda sd: optim.Adadelta(lr=1.0, state_dtype=sd),
    "ScheduleFreeAdamW": lambda sd: optim.ScheduleFreeAdamW(lr=1e-2, state_dtype=sd),
    "Muon": lambda sd: optim.Muon(lr=2e-2, fallback=optim.AdamW(lr=1e-2), state_dtype=sd),
}
STEPS = 7


#: The quantized state dtypes the matrices run (the default tier: AdamW in each).
QDTYPES = ("8bit", "float8")


def _make(name, sd="8bit"):
    opt = CASES[name](sd)
    opt.min_8bit_size = THRESHOLD
    return opt


def _q8(state):
    return {k: b for k, b in state.slots.items() if isinstance(b, state8.Quant8Buffer)}


# -- codebooks ----------------------------------------------------------------------------------


def _table_codes(q, book):
    """The fast kernels' encoder (codecs.q8_bucket/q8_pick) written with NumPy integers."""
    u = np.asarray(q, np.float32).view(np.uint32).astype(np.int64)
    sign, mag = u >> 31, u & 0x7FFFFFFF
    k = np.clip((mag >> book.shift) - book.bias, 0, book.nb - 1)
    e = book.table[sign * book.nb + k].astype(np.int64)
    return ((e & 255) + (1 - 2 * sign) * ((mag & ((1 << book.shift) - 1)) >= (e >> 8))).astype(np.uint8)


@pytest.mark.parametrize("signed", [True, False])
def test_bucket_table_gives_the_nearest_code(signed):
    book = lowbit.codebook(signed)
    rng = np.random.default_rng(0)
    m = book.qmap
    q = np.concatenate([
        rng.uniform(-1, 1, 200_000), rng.standard_normal(100_000) * np.exp(rng.uniform(-30, 1, 100_000)),
        m, np.nextafter(m, np.float32(2)), np.nextafter(m, np.float32(-2)), (m[1:] + m[:-1]) / 2,
        np.nextafter((m[1:] + m[:-1]) / 2, np.float32(2)), np.nextafter((m[1:] + m[:-1]) / 2, np.float32(-2)),
        [0.0, -0.0, 1.0, -1.0, 5.0, -5.0, np.inf, -np.inf, np.nan, 1e-30, -1e-30, 2.0**-23, 1e-7],
    ]).astype(np.float32)
    if not signed:
        q = np.abs(q)
    np.testing.assert_array_equal(_table_codes(q, book), lowbit.nearest_codes(q, m))
    # and the jitted encoder gives the table's codes
    got = np.empty(q.size, np.uint8)
    _encode_jitted(q, got, book)
    np.testing.assert_array_equal(got, _table_codes(q, book))


@pytest.mark.slow  # the slow tier: every exponent of both maps (the kernel checks meet the encoder in the default tier)
@pytest.mark.parametrize("signed", [True, False])
def test_block_encoder_gives_the_nearest_code_across_every_exponent(signed):
    """The block encoder this CPU's kernels run (arithmetic with flagged lanes on AVX-512, the
    gather on AVX2) over every 61st float32 bit pattern in [-1, 1] of both signs (all
    exponents, 35 million values), blocks of 255 values and 1.0, so that q is the value itself."""
    from numba import njit

    from arraytrain.kernels.cpu.codecs import q8_encode_block

    @njit
    def encode(x, codes, table, shift, bias, nb, signed):
        for k in range(0, x.size, 256):
            q8_encode_block(x[k : k + 256], codes[k : k + 256], table, shift, bias, nb, signed)

    book = lowbit.codebook(signed)
    u = np.arange(0, 0x3F800001, 61, dtype=np.uint32)
    q = np.concatenate([u, u | np.uint32(0x80000000)]).view(np.float32)
    q = np.concatenate([q, np.zeros(-q.size % 255, np.float32)])
    x = np.ones((q.size // 255, 256), np.float32)
    x[:, 1:] = q.reshape(-1, 255)
    codes = np.empty(x.size, np.uint8)
    encode(x.reshape(-1), codes, book.table, book.shift, book.bias, book.nb, signed)
    got = codes.reshape(-1, 256)
    assert np.all(got[:, 0] == 255)
    np.testing.assert_array_equal(got[:, 1:].reshape(-1), lowbit.nearest_codes(q, book.qmap))


@pytest.mark.parametrize("signed", [True, False])
def test_block_decoder_is_the_map_times_the_scale(signed):
    """Every code through the block decoder this CPU's kernels run (byte planes with AVX-512
    VBMI, two-table permutes with AVX-512, the numba loop elsewhere), bit for bit, with scales
    that are NaN, 0, inf and subnormal too, and a block shorter than its lanes."""
    from numba import njit

    from arraytrain.kernels.cpu.codecs import q8_decode_block

    @njit
    def decode(codes, scales, qmap, out, signed):
        for k in range(0, codes.size, 256):
            q8_decode_block(codes[k : k + 256], scales[k // 256], qmap, out[k : k + 256], signed)

    qmap = lowbit.codebook(signed).qmap
    rng = np.random.default_rng(0)
    codes = np.concatenate([np.arange(256), rng.integers(0, 256, 256 * 7 + 77)]).astype(np.uint8)
    scales = np.concatenate([[1.0, np.nan, 0.0, np.inf, 1e-40], rng.random(4)]).astype(np.float32)
    out = np.empty(codes.size, np.float32)
    decode(codes, scales, qmap, out, signed)
    want = (qmap[codes] * np.repeat(scales, 256)[: codes.size]).astype(np.float32)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


def _encode_jitted(q, out, book):
    from numba import njit

    from arraytrain.kernels.cpu.codecs import q8_bucket, q8_pick

    @njit
    def run(q, out, table, shift, bias, nb):
        for i in range(q.size):
            out[i] = q8_pick(q[i], table[q8_bucket(q[i], shift, bias, nb)], shift)

    run(q, out, book.table, book.shift, book.bias, book.nb)


def test_maps_and_codes_equal_bitsandbytes():
    torch = pytest.importorskip("torch")
    F = pytest.importorskip("bitsandbytes.functional")
    for signed in (True, False):
        theirs = F.create_dynamic_map(signed=signed).numpy()
        np.testing.assert_array_equal(theirs.view(np.uint32), lowbit.codebook(signed).qmap.view(np.uint32))
        rng = np.random.default_rng(1)
        x = (rng.standard_normal(256 * 40) * np.exp(rng.uniform(-12, 2, 256 * 40))).astype(np.float32)
        if not signed:
            x = x * x
        # bitsandbytes' PyTorch implementation (its "default" backend): clamp(x * (1/absmax), -1, 1),
        # then torch.bucketize on the map's midpoints. Whole blocks only: its last partial block
        # divides by absmax where every other multiplies by the reciprocal (here: every block does).
        out, absmax_b = _bnb_default_quantize(torch, x, theirs)
        codes, absmax = lowbit.quantize(x, signed)
        np.testing.assert_array_equal(absmax_b.numpy(), absmax)
        np.testing.assert_array_equal(out.numpy(), codes)
        assert np.unique(codes).size > 100  # the values span most of the map


def _bnb_default_quantize(torch, x, code):
    """bitsandbytes' "default" backend kernel of quantize_blockwise (its PyTorch implementation),
    taken from its source without the dispatcher (which sends CPU tensors to the C++ kernel)."""
    import ast
    import inspect

    from bitsandbytes.backends.default import ops

    for node in ast.parse(inspect.getsource(ops)).body:
        if isinstance(node, ast.FunctionDef) and any(
                "bitsandbytes::quantize_blockwise'" in ast.unparse(d) and "'default'" in ast.unparse(d)
                for d in node.decorator_list):
            node.decorator_list = []
            ns = dict(vars(ops))
            exec(compile(ast.Module([node], []), ops.__file__, "exec"), ns)
            return ns[node.name](torch.from_numpy(x), torch.from_numpy(code), 256)
    raise AssertionError("bitsandbytes' default quantize_blockwise not found")


# -- kernels against the reference, one step at a time --------------------------------------------


def _in_place(g):
    """``g`` as a gradient read where it lies (:class:`~arraytrain.buffer.GradsAt`, ``grad_ptrs``)."""
    return GradsAt(g, segment_addresses(g), GradsAt.offsets_of(g))


def _setup(name, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {k: rng.standard_normal(s).astype(np.float32) for k, s in SIZES.items()}
    params = FlatBuffer.from_arrays(arrays)
    return rng, params


# the default tier: AdamW (an 8-bit kernel signature compiles in ~10 s here), in each codec;
# the slow tier: every optimizer (tests/kernels/test_kernels_optim.py checks more kernels in 8 bits)
# float8 in the slow tier: the optimizers whose slots differ in kind (three slots of both formats,
# LAMB's read-back of the decoded moments, Muon's matrices); the codec is the same code in every
# kernel
FLOAT8_CASES = ("AdamW", "RMSprop-centered-momentum", "LAMB", "Muon")


# (the default tier's AdamW cases read their gradient where it lies, the kernel signature the engine's
# dict path and the drop-ins compile: one signature per codec for the default tier, 10-20 s each on a
# Zen 3; the slow tier reads the flat buffer, AdamW's too)
@pytest.mark.parametrize("name,sd,in_place", [
    (n, sd, True) if n == "AdamW" else pytest.param(n, sd, False, marks=pytest.mark.slow)
    for sd in QDTYPES for n in CASES if sd == "8bit" or n in FLOAT8_CASES
] + [pytest.param("AdamW", sd, False, marks=pytest.mark.slow) for sd in QDTYPES])
def test_kernels_equal_reference_every_step(name, sd, in_place):
    rng, pf = _setup(name)
    opt_f, opt_r = _make(name, sd), _make(name, sd)
    sf, pr = opt_f.init(pf), pf.copy()
    sr = opt_r.init(pr)
    q8 = _q8(sf)
    assert q8 and all(b.quant[pf.layout.index("big")] and not b.quant[pf.layout.index("small")] for b in q8.values())
    for step in range(STEPS):
        g = pf.zeros_like()
        g.flat[...] = (rng.standard_normal(g.flat.size) * (10.0 if step == 3 else 1.0)).astype(np.float32)
        gr = g.copy()
        # the same start: the fast run's state and parameters
        pr.flat[...] = pf.flat
        for k, b in sf.slots.items():
            sr.slots[k].flat[...] = b.flat
        sr.step, sr.scalars = sf.step, dict(sf.scalars)
        opt_f.update(cpu, pf, _in_place(g) if in_place else g, sf, gscale=0.5)
        opt_r.update(ref, pr, gr, sr, gscale=0.5)
        # LAMB's second pass reads the moments back decoded: where a code came out one off
        # (below), its parameter moves by that code's step too; compared elsewhere
        same = np.ones(pf.flat.size, bool)
        if name == "LAMB":
            for k, b in _q8(sf).items():
                same &= b.codes == sr.slots[k].codes
        np.testing.assert_allclose(pf.flat[same], pr.flat[same], rtol=1.3e-6 * 5, atol=1e-5 * 5,
                                   err_msg=f"{name} step {step}")
        for k, b in sf.slots.items():
            r = sr.slots[k]
            if not isinstance(b, state8.Quant8Buffer):
                np.testing.assert_allclose(b.flat, r.flat, rtol=1.3e-6 * 5, atol=1e-5 * 5, err_msg=k)
                continue
            # float32 slots of small parameters and the blocks' absmax: float32 tolerance
            np.testing.assert_allclose(b.aux, r.aux, rtol=1.3e-6 * 5, atol=1e-6, err_msg=f"{name} {k} step {step}")
            # codes: equal, but for a value within float32 rounding of a decision boundary
            # (the fast loop's float32 arithmetic and the reference's float64 differ in the last
            # bit): such a code is one off, and rare
            diff = b.codes.astype(np.int64) - r.codes
            assert np.abs(diff).max(initial=0) <= 1, (name, k, step)
            assert np.count_nonzero(diff) <= max(3, diff.size // 10_000), (name, k, step, np.count_nonzero(diff))


def test_blocks_start_at_each_parameters_start():
    """A parameter's codes and absmax are bitsandbytes' blockwise quantization of its values alone,
    wherever it sits in the flat buffer."""
    _, params = _setup("x")
    opt = _make("AdamW", "8bit")
    st = opt.init(params)
    grads = params.zeros_like()
    grads.flat[...] = np.random.default_rng(3).standard_normal(grads.flat.size).astype(np.float32)
    opt.update(cpu, params, _in_place(grads), st)  # (the default tier's one 8-bit AdamW signature)
    m = st.slots["exp_avg"]
    for name in ("mid", "mat", "big"):
        values = m.values(name).ravel()
        entry = m.as_dict()[name]
        codes, absmax = lowbit.quantize(values, True)
        # decoding then encoding again is the identity on codes whose block max is a map value
        assert entry["absmax"].shape == (-(-values.size // 256),)
        np.testing.assert_array_equal(lowbit.dequantize(entry["codes"], entry["absmax"], True), values)
        assert codes.shape == entry["codes"].ravel().shape


def test_kernels_with_an_8bit_slot_take_the_parallel_twin_at_every_size():
    """The serial twin refcounts the 8-bit slot's arrays at every block (2.4x slower), so a kernel
    with one runs the parallel twin even below SERIAL_BELOW; float state keeps the serial one."""
    from arraytrain.kernels.cpu._jit import SERIAL_BELOW, pick

    pair = ("parallel", "serial")
    q8 = state8.Quant8Buffer(at.Layout({"w": (300,)}), True, 0).kernel_arg()
    floats = np.zeros(300, np.float32)
    assert pick(pair, 300, floats, floats) == "serial"
    assert pick(pair, 300, floats, q8) == "parallel"
    assert pick(pair, 0, q8) == "parallel"
    assert pick(pair, SERIAL_BELOW, floats) == "parallel"


# -- through the engine --------------------------------------------------------------------------


def _quadratic(seed=5):
    rng = np.random.default_rng(seed)
    shapes = {"w": (80, 64), "b": (30,)}
    curv = {k: rng.uniform(0.5, 2.0, s).astype(np.float32) for k, s in shapes.items()}
    p0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    return shapes, curv, p0


TRAIN = {
    "AdamW": lambda: optim.AdamW(lr=0.03, state_dtype="8bit"),
    "SGD": lambda: optim.SGD(lr=0.05, momentum=0.9, state_dtype="8bit"),
    "Lion": lambda: optim.Lion(lr=0.03, state_dtype="8bit"),
    "RMSprop": lambda: optim.RMSprop(lr=0.03, centered=True, momentum=0.5, state_dtype="8bit"),
    "Muon": lambda: optim.Muon(lr=0.05, fallback=optim.AdamW(lr=0.03), state_dtype="8bit"),
    "AdamW-float8": lambda: optim.AdamW(lr=0.03, state_dtype="float8"),
}


@pytest.mark.parametrize("name", tiered(TRAIN, default=("AdamW", "AdamW-float8")))
def test_trains_and_resumes_bitwise(name, tmp_path):
    shapes, curv, p0 = _quadratic()
    e = Engine(p0, TRAIN[name]())
    assert isinstance(e.state.slots[next(iter(e.state.slots))], state8.Quant8Buffer)

    def loss(x):
        return sum(float(np.sum(curv[k] * x.params[k].astype(np.float64) ** 2)) for k in shapes)

    start = loss(e)
    for _ in range(40):
        e.step({k: curv[k] * e.params[k] for k in shapes})
    assert loss(e) < 0.7 * start
    at.save(tmp_path / "s.safetensors", e)
    back = Engine(p0, TRAIN[name]())
    at.load(tmp_path / "s.safetensors", back)
    for _ in range(3):
        for x in (e, back):
            x.step({k: curv[k] * x.params[k] for k in shapes})
    assert back.params.flat.tobytes() == e.params.flat.tobytes()
    for slot in e.state.slots:
        assert back.state.slots[slot].flat.tobytes() == e.state.slots[slot].flat.tobytes(), slot


def test_state_converts_between_float32_and_8bit():
    shapes, curv, p0 = _quadratic()
    e32 = Engine(p0, optim.AdamW(lr=1e-2))
    for _ in range(5):
        e32.step({k: curv[k] * e32.params[k] for k in shapes})
    e8 = Engine(p0, optim.AdamW(lr=1e-2, state_dtype="8bit"))
    e8.load_state_dict(e32.state_dict())  # float32 -> 8 bits: encoded
    m8 = e8.state.slots["exp_avg"]
    assert m8.is_quantized("w") and not m8.is_quantized("b")  # "b" (30 elements) stays float32
    np.testing.assert_array_equal(m8.values("b"), e32.state.slots["exp_avg"]["b"])
    w32 = e32.state.slots["exp_avg"]["w"]
    np.testing.assert_allclose(m8.values("w"), w32, atol=0.02 * np.abs(w32).max())
    back = Engine(p0, optim.AdamW(lr=1e-2))
    back.load_state_dict(e8.state_dict())  # 8 bits -> float32: decoded
    np.testing.assert_array_equal(back.state.slots["exp_avg"]["w"], m8.values("w"))
    bf = Engine(p0, optim.AdamW(lr=1e-2, state_dtype="bfloat16"))
    bf.load_state_dict(e8.state_dict())  # and into bfloat16 slots
    np.testing.assert_allclose(bf.state.slots["exp_avg"]["w"].astype(np.float32), m8.values("w"), rtol=1e-2)


def test_checkpoint_file_converts_too(tmp_path):
    shapes, curv, p0 = _quadratic()
    e8 = Engine(p0, optim.AdamW(lr=1e-2, state_dtype="8bit"))
    for _ in range(3):
        e8.step({k: curv[k] * e8.params[k] for k in shapes})
    at.save(tmp_path / "s.safetensors", e8)
    e32 = Engine(p0, optim.AdamW(lr=1e-2))
    at.load(tmp_path / "s.safetensors", e32)
    np.testing.assert_array_equal(e32.state.slots["exp_avg_sq"]["w"], e8.state.slots["exp_avg_sq"].values("w"))
    at.save(tmp_path / "f.safetensors", e32)
    again = Engine(p0, optim.AdamW(lr=1e-2, state_dtype="8bit"))
    at.load(tmp_path / "f.safetensors", again)
    np.testing.assert_array_equal(again.state.slots["exp_avg_sq"].values("w"), e8.state.slots["exp_avg_sq"].values("w"))


def test_adamw_state_bytes_per_parameter():
    rng = np.random.default_rng(0)
    p0 = {f"l{i}": rng.standard_normal((512, 512)).astype(np.float32) for i in range(4)}
    p0.update({f"bias{i}": np.zeros(512, np.float32) for i in range(4)})  # under the threshold: float32
    e = Engine(p0, optim.AdamW(state_dtype="8bit"))
    n = e.layout.num_elements
    per = e.memory()["state"] / n
    assert per <= 2.05, per
    assert Engine(p0, optim.AdamW()).memory()["state"] / n >= 8.0


def test_refusals_change_nothing():
    shapes, curv, p0 = _quadratic()
    with pytest.raises(HyperparameterError, match="state_dtype"):
        optim.AdamW(state_dtype="int8")
    with pytest.raises(HyperparameterError, match="float32"):
        Engine({k: v.astype(np.float64) for k, v in p0.items()}, optim.AdamW(state_dtype="8bit"))
    assert optim.AdamW(state_dtype="8bit").shard_refusal is None  # shards on blocks (tests/parallel/test_shard.py)
    assert optim.AdamW(state_dtype="8bit").shard_align == lowbit.BLOCK
    assert optim.AdamW(state_dtype="bfloat16").shard_align == 1
    e = Engine(p0, optim.AdamW(state_dtype="8bit"))
    e.step({k: curv[k] * e.params[k] for k in shapes})
    before = {k: b.flat.copy() for k, b in e.state.slots.items()}
    bad = e.state_dict(copy=True)
    bad["optimizer"]["slots"]["exp_avg"]["w"]["codes"] = bad["optimizer"]["slots"]["exp_avg"]["w"]["codes"][:5]
    with pytest.raises(StateDictError):
        e.load_state_dict(bad)
    for k, b in e.state.slots.items():
        assert np.array_equal(b.flat, before[k])


def _require_cuda():
    from cuda_family import device_cupy, require_cuda

    require_cuda()
    return device_cupy()


def test_cuda_8bit_state_lives_on_the_device_and_needs_float32():
    cp = _require_cuda()
    with pytest.raises(HyperparameterError, match="float32"):
        Engine({"w": cp.zeros((64, 64), cp.float64)}, optim.AdamW(state_dtype="8bit"))
    e = Engine({"w": cp.zeros((64, 64), cp.float32), "b": cp.zeros(8, cp.float32)}, optim.AdamW(state_dtype="8bit"))
    for b in e.state.slots.values():
        assert isinstance(b, state8.Quant8Buffer) and on_device(b.flat)
        assert all(on_device(a) for a in b.kernel_arg()[:7])
    assert int(e.state.slots["exp_avg"].codes[0]) == 127  # the signed map's zero


# -- the CUDA kernels against the numba ones, one step at a time -----------------------------------


def _to_device(cp, params_cpu, opt, state_cpu):
    """A CuPy twin of ``params_cpu`` and of ``opt``'s state for it (slots copied bitwise)."""
    pg = FlatBuffer(params_cpu.layout, cp.asarray(params_cpu.flat))
    sg = opt.init(pg)
    _copy_state(cp, state_cpu, sg)
    return pg, sg


def _copy_state(cp, src, dst):
    for k, b in src.slots.items():
        dst.slots[k].flat[...] = cp.asarray(b.flat)
    dst.step, dst.scalars = src.step, dict(src.scalars)


def _host_slot(b):
    """A slot's arrays on the host: (codes, aux) of an 8-bit slot, else (None, flat)."""
    if isinstance(b, state8.Quant8Buffer):
        return b.codes.get(), b.aux.get()
    return None, b.flat.get()


@pytest.mark.parametrize("sd", QDTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_kernels_equal_numba_every_step(name, sd):
    """Every optimizer with 8-bit state: the CUDA kernels against the numba ones over STEPS steps,
    each from the same state (the numba run's): params, the float32 side arrays and absmax at the
    float32 tolerance, codes equal but for a rare one-code-off (see above)."""
    cp = _require_cuda()
    from arraytrain.kernels.interface import family

    cuda = family("cupy")
    rng, pc = _setup(name)
    opt_c, opt_g = _make(name, sd), _make(name, sd)
    sc = opt_c.init(pc)
    pg, sg = _to_device(cp, pc, opt_g, sc)
    for step in range(STEPS):
        g = pc.zeros_like()
        g.flat[...] = (rng.standard_normal(g.flat.size) * (10.0 if step == 3 else 1.0)).astype(np.float32)
        gg = FlatBuffer(g.layout, cp.asarray(g.flat))
        pg.flat[...] = cp.asarray(pc.flat)
        _copy_state(cp, sc, sg)
        opt_c.update(cpu, pc, g, sc, gscale=0.5)
        opt_g.update(cuda, pg, gg, sg, gscale=0.5)
        same = np.ones(pc.flat.size, bool)
        if name == "LAMB":
            for k, b in _q8(sc).items():
                same &= b.codes == sg.slots[k].codes.get()
        got = pg.flat.get()
        # Muon's Newton-Schulz runs on cuBLAS: an absolute floor of 8 ulps of the largest weight
        atol = max(1e-5 * 5, 8 * float(np.finfo(np.float32).eps) * float(np.abs(pc.flat).max()))
        np.testing.assert_allclose(got[same], pc.flat[same], rtol=1.3e-6 * 5, atol=atol, err_msg=f"{name} step {step}")
        for k, b in sc.slots.items():
            codes, aux = _host_slot(sg.slots[k])
            if codes is None:
                np.testing.assert_allclose(aux, b.flat, rtol=1.3e-6 * 5, atol=1e-5 * 5, err_msg=k)
                continue
            np.testing.assert_allclose(aux, b.aux, rtol=1.3e-6 * 5, atol=1e-6, err_msg=f"{name} {k} step {step}")
            diff = codes.astype(np.int64) - b.codes
            assert np.abs(diff).max(initial=0) <= 1, (name, k, step)
            assert np.count_nonzero(diff) <= max(3, diff.size // 10_000), (name, k, step, np.count_nonzero(diff))


@pytest.mark.parametrize("sd", QDTYPES)
@pytest.mark.parametrize("name", ["AdamW", "SGD-nesterov", "NAdam", "RMSprop-centered-momentum"])
def test_cuda_working_copy_and_mask_under_8bit_state(name, sd):
    """The CUDA 8-bit kernels write the bfloat16 working copy of every weight and keep pruned weights 0,
    as the numba ones."""
    import ml_dtypes

    cp = _require_cuda()
    from arraytrain.kernels.interface import family

    rng, pc = _setup(name)
    opt_c, opt_g = _make(name, sd), _make(name, sd)
    sc = opt_c.init(pc)
    pg, sg = _to_device(cp, pc, opt_g, sc)
    mask = (rng.random(pc.flat.size) > 0.3).astype(np.uint8)
    wc, wg = np.zeros(pc.flat.size, np.uint16), cp.zeros(pc.flat.size, cp.uint16)
    from arraytrain.kernels.interface import LP_BF16

    for _ in range(3):
        g = pc.zeros_like()
        g.flat[...] = rng.standard_normal(g.flat.size).astype(np.float32)
        opt_c.update(cpu, pc, g, sc, working=(wc, LP_BF16), mask=mask)
        opt_g.update(family("cupy"), pg, FlatBuffer(g.layout, cp.asarray(g.flat)), sg, working=(wg, LP_BF16),
                     mask=cp.asarray(mask))
    got = pg.flat.get()
    live = np.zeros(pc.flat.size, bool)
    for off, n in zip(pc.layout.offsets, pc.layout.sizes):
        live[off : off + n] = True
    assert not np.any(got[live & (mask == 0)])
    np.testing.assert_array_equal(wg.get()[live], got[live].astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_allclose(got, pc.flat, rtol=1e-3, atol=1e-3)


# the slow tier: bind's gradients land in the engine's buffer, an 8-bit kernel signature of its own (10-20 s
# to compile on a Zen 3) that no default test needs; the drop-ins' 8-bit tests run in the default tier
@pytest.mark.slow
def test_torch_binding_takes_8bit():
    """bind(module, optimizer) runs 8-bit state."""
    torch = pytest.importorskip("torch")
    from arraytrain.interop import torch as att

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    b = att.bind(m, optim.AdamW(lr=1e-2, state_dtype="8bit"))
    assert isinstance(b.state.slots["exp_avg"], state8.Quant8Buffer)  # the binding is an Engine
    x = torch.randn(256, 64)
    y = x[:, :1] * 2
    losses = []
    for _ in range(40):
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        b.step()
        losses.append(float(loss))
    assert losses[-1] < 0.1 * losses[0]


def test_a_drop_in_without_elementwise_state_refuses_8bit():
    """A drop-in whose optimizer keeps no element-wise state refuses 8-bit state: a typed error at
    construction (tests/interop/test_torch_optim_8bit.py covers the drop-ins that take it)."""
    torch = pytest.importorskip("torch")
    from arraytrain.interop import torch as att

    m = torch.nn.Linear(64, 128)
    with pytest.raises(HyperparameterError, match="state_dtype"):
        att.Adafactor(m.parameters(), state_dtype="8bit")


@pytest.mark.slow  # the slow tier: 8-bit kernel signatures with a working copy (~15 s each to compile here)
@pytest.mark.parametrize("make", [lambda: at.optim.NAdam(lr=1e-2, state_dtype="8bit"),
                                  lambda: at.optim.AdamW(lr=1e-2, state_dtype="8bit"),
                                  lambda: at.optim.SGD(lr=1e-2, momentum=0.9, state_dtype="8bit")])
@pytest.mark.parametrize("working", ["bfloat16", "float16"])
def test_a_working_copy_under_8bit_state_is_the_whole_rounded_parameter(make, working):
    """The kernels walk a piece in 256-element blocks under 8-bit state; the working copy is still
    written for the whole piece, equal to the float32 masters rounded."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    sizes = {"a": (5000,), "b": (300, 70), "c": (7,)}
    eng = at.Engine({n: rng.standard_normal(s).astype(np.float32) for n, s in sizes.items()}, make(),
                    working_dtype=working)
    for _ in range(3):
        eng.step({n: rng.standard_normal(s) for n, s in sizes.items()})
    dt = ml_dtypes.bfloat16 if working == "bfloat16" else np.float16
    for n in sizes:
        np.testing.assert_array_equal(np.asarray(eng.working[n]), eng.params[n].astype(dt))


# -- a slot that holds one window of the layout (a rank's partition under sharded state) -----------


def test_a_windowed_slot_takes_its_part_of_full_entries_or_of_a_readers_parts():
    from arraytrain.errors import LayoutError
    from arraytrain.owned import Owned, OwnedRange

    lay = at.Layout({"a": (70, 300), "b": (7,), "c": (30000,), "d": (5000,)}, align=256)
    rng = np.random.default_rng(3)
    values = {n: rng.standard_normal(s).astype(np.float32) for n, s in zip(lay.names, lay.shapes)}
    whole = state8.Quant8Buffer(lay, signed=True)
    whole.load(values)
    full = whole.as_dict(copy=True)
    chunk = 16384
    for lo in range(0, lay.size, chunk):
        win = state8.Quant8Buffer(lay, signed=True, window=(lo, chunk))
        win.load(full)  # from the full entries
        held = slice(lo, min(lo + chunk, lay.size))
        for seg, name in enumerate(lay.names):
            off, n = lay.offsets[seg], lay.sizes[seg]
            a, b = min(max(off, lo), held.stop), min(max(off + n, lo), held.stop)
            if a == b:
                assert win.spans[seg] == (0, 0)
                continue
            assert win.spans[seg] == (a - off, b - off)
            codes, aux = win._parts(seg)
            if win.quant[seg]:
                np.testing.assert_array_equal(codes, whole.codes[a:b])
                np.testing.assert_array_equal(aux, full[name]["absmax"][(a - off) // 256 : -(-(b - off) // 256)])
            else:
                np.testing.assert_array_equal(aux, full[name].reshape(-1)[a - off : b - off])
        # from a reader's parts, as the template names them
        parts = {}
        for name, t in state8.window_template(win).items():
            src = full[name]
            if isinstance(t, Owned):
                parts[name] = OwnedRange(src.reshape(-1)[t.start : t.stop].copy(), t.start, t.shape)
                continue
            parts[name] = {k: OwnedRange(src[k].reshape(-1)[o.start : o.stop].copy(), o.start, o.shape)
                           for k, o in t.items() if k != "map"}
            parts[name]["map"] = t["map"]
        again = state8.Quant8Buffer(lay, signed=True, window=(lo, chunk))
        again.load(parts)
        np.testing.assert_array_equal(again.flat, win.flat)
        with pytest.raises(LayoutError, match="gather_window"):
            win.as_dict()
    # a part of another range, and a window that cuts a block, are refused
    win = state8.Quant8Buffer(lay, signed=True, window=(chunk, chunk))
    bad = dict(full, c={**full["c"], "codes": OwnedRange(full["c"]["codes"][:10], 0, (30000,))})
    before = win.flat.copy()
    with pytest.raises(LayoutError, match="holds elements"):
        win.load(bad)
    np.testing.assert_array_equal(win.flat, before)
    with pytest.raises(LayoutError, match="cuts an 8-bit block"):
        state8.Quant8Buffer(at.Layout({"c": (30000,)}), signed=True, window=(100, 16384))
