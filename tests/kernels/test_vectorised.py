"""The low-precision CPU kernels are packed loops on AVX2 as well as on AVX-512.

(8-bit state too: every optimizer's kernel with 8-bit slots must hold the packed float loop and
the encoder's vector loop: the 8-lane ``vpgatherdd`` on AVX2, the arithmetic encoder's
exponent permute (``vpermi2d``/``vpermt2d``) and the decoder's two-table permutes (``vpermi2ps``/``vpermt2ps``) on
AVX-512; and the encoder's codes equal lowbit.nearest_codes on both. Float8 state: the packed
float loop, the decoder's packed float16 convert (``vcvtph2ps``: each code widened to a float16)
and the encoder's packed byte narrowing (``vpmovdb`` on AVX-512; on AVX2 a byte shuffle,
``vpshufb``, or ``vpackuswb``), and the codec equal to lowbit.float8_encode and the maps bit for
bit on both targets; the step's stochastic rounding of e5m2 slots packed too (its hash's
``vpmulld``, the narrowing) and equal to lowbit.sr_codes.)

Each kernel with bfloat16 state, each optimizer's working-copy writer (bfloat16 and float16)
and the cast that rebuilds a working copy is compiled in a subprocess for an AVX2 target
(``NUMBA_CPU_NAME=haswell`` with AVX2 and F16C, no AVX-512) and for an AVX-512 one
(``skylake-avx512``), each with its own ``NUMBA_CACHE_DIR``, and its machine code must hold
the packed instructions of its update loop: ``vsqrtps`` on ``ymm``/``zmm`` for the kernels
with a square root, packed float arithmetic for the others, a packed narrowing for each
16-bit store (``vpackusdw`` on AVX2, which has no 32-to-16-bit truncation, ``vpmovdw`` on
AVX-512) and F16C's ``vcvtps2ph`` on a whole vector for float16. A compile, not a timing: it
holds on any x86 machine, whatever its own CPU. The code compiled for each target also runs
here (both targets' instructions are a subset of any AVX-512 CPU's; the AVX-512 half is
skipped on a CPU without it), and its bfloat16/float16 encoders are checked bit for bit
against NumPy/ml_dtypes over every float32 exponent and sign with NaN, Inf, subnormals and
ties, through the serial and the parallel twin.

The inspected machine code is the serial twin's for bfloat16 state and working copies, and the
parallel twin's (numba's parfor function around the same ``prange`` body) for bfloat16 state and
for 8-bit state (which runs only that twin, see arraytrain.kernels.cpu._jit.pick).
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile

import pytest

# the slow tier: every kernel compiled for two other targets in subprocesses (a machine-code check)
pytestmark = pytest.mark.slow

AVX2 = {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx2,+avx,+fma,+f16c,+sse4.2,+bmi,+bmi2,+popcnt"}
AVX512 = {"NUMBA_CPU_NAME": "skylake-avx512",
          "NUMBA_CPU_FEATURES": AVX2["NUMBA_CPU_FEATURES"] + ",+avx512f,+avx512bw,+avx512vl,+avx512dq"}
TARGETS = {"avx2": AVX2, "avx512": AVX512}

PATTERNS = {
    "sqrt": r"vsqrtps\s[^\n]*%[yz]mm",
    "float": r"v(mul|add|sub|fn?m(add|sub)\d+)ps\s[^\n]*%[yz]mm",
    "narrow": r"vpackusdw\s|vpmovu?s?dw\s",
    "cvtph": r"vcvtps2ph\s+\$\w+,\s*%[yz]mm",
    "gather": r"vpgatherdd\s[^\n]*%ymm",
    "arith": r"vperm[it]2d\s[^\n]*%zmm",
    "decode": r"vperm[it]2ps\s[^\n]*%zmm",
    "widen8": r"vcvtph2ps\s[^\n]*%[yz]mm",
    "narrow8": r"vpmovdb\s|vpackuswb\s|vpshufb\s",
    "mul32": r"vpmulld\s[^\n]*%[yz]mm",
}
# float8 state's machine code on the kernels whose slots differ in kind (the codec is the same code in
# every kernel; each kernel compiled for a target costs seconds of CI)
FLOAT8_KERNELS = ("sgd", "adam", "rmsprop", ("lamb", "lamb_apply"))
# kernels whose update loop takes a square root
SQRT = {"adam", "adagrad", "lamb", "rmsprop", "lamb_apply", "nadam", "adadelta", "schedule_free_adamw"}


def _host_has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return all(re.search(rf"\b{x}\b", flags) for x in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))


def _kernels(state, working, kind, n=64):
    """(name, (parallel, serial) dispatchers, call) for every kernel that takes bfloat16 state or a
    working copy; ``n`` picks the twin the call runs (the serial one below SERIAL_BELOW)."""
    import numpy as np

    from arraytrain.kernels import cpu
    from arraytrain.kernels.cpu import optimizers as opt

    f32 = np.float32

    def a(dtype=f32):
        return np.zeros(n, dtype)

    pieces = np.array([[0, n, 0]], np.int64)
    one = np.ones(1, f32)
    w = dict(working=working, kind=kind)
    common = dict(gscale=1.0, **w)
    if state == "8bit":  # an 8-bit slot: every element in 8 bits (threshold 0)
        from arraytrain import Layout
        from arraytrain.optim import state8

        s = lambda: state8.Quant8Buffer(Layout({"w": (n,)}), True, 0).kernel_arg()  # noqa: E731
        e = np.zeros(0, f32)
    elif state == "float8":  # float8 slots, both formats in turn (e4m3, e5m2), every element
        from itertools import count

        from arraytrain import Layout
        from arraytrain.optim import state8

        turn = count()
        s = lambda: state8.Quant8Buffer(Layout({"w": (n,)}), next(turn) % 2 == 0, 0,  # noqa: E731
                                        codec="float8").kernel_arg()
        e = np.zeros(0, f32)
    else:
        s = lambda: a(state)  # noqa: E731
        e = np.zeros(0, state)
    yield "sgd", opt._SGD, lambda: cpu.sgd_step(
        a(), a(), s(), pieces, lr=one, l2=one, momentum=0.9, dampening=0.0, nesterov=False, first=False, **common)
    yield "adam", opt._ADAM, lambda: cpu.adam_step(
        a(), a(), s(), s(), e, pieces, step_size=one, beta1=0.9, beta2=0.999, eps=1e-8, inv_bc2_sqrt=1.0, l2=one,
        decay=one, amsgrad=False, **common)
    yield "adagrad", opt._ADAGRAD, lambda: cpu.adagrad_step(a(), a(), s(), pieces, lr=one, l2=one, eps=1e-10,
                                                               **common)
    yield "rmsprop", opt._RMSPROP, lambda: cpu.rmsprop_step(
        a(), a(), s(), s(), s(), pieces, lr=one, l2=one, alpha=0.99, eps=1e-8, momentum=0.9, centered=True, **common)
    yield "lion", opt._LION, lambda: cpu.lion_step(a(), a(), s(), pieces, lr=one, decay=one, beta1=0.9,
                                                      beta2=0.99, **common)
    # LAMB's two loops (moments with the norms' sums, then the step) are two kernels of one call
    yield ("lamb", "lamb_apply"), (opt._LAMB_MOMENTS, opt._LAMB_APPLY), lambda: cpu.lamb_step(
        a(), a(), s(), s(), pieces, lr=one, weight_decay=one, beta1=0.9, beta2=0.999, eps=1e-6, eps_root=0.0,
        inv_bc1=1.0, inv_bc2=1.0, **common)
    yield "nadam", opt._NADAM_RADAM, lambda: cpu.nadam_step(
        a(), a(), s(), s(), pieces, grad_step=one, moment_step=one, beta1=0.9, beta2=0.999, eps=1e-8,
        inv_bc2_sqrt=1.0, l2=one, decay=one, **common)
    yield "adamax", opt._ADAMAX, lambda: cpu.adamax_step(
        a(), a(), s(), s(), pieces, step_size=one, beta1=0.9, beta2=0.999, eps=1e-8, l2=one, **common)
    yield "adadelta", opt._ADADELTA, lambda: cpu.adadelta_step(
        a(), a(), s(), s(), pieces, lr=one, l2=one, rho=0.9, eps=1e-6, **common)
    yield "schedule_free_adamw", opt._SF_ADAMW, lambda: cpu.schedule_free_adamw_step(
        a(), a(), a(), s(), np.zeros(1), np.zeros(1), pieces, lr=one, weight_lr=one, weight_lr_power=2.0,
        weight_decay=one, beta1=0.9, beta2=0.999, eps=1e-8, inv_bc2_sqrt=1.0, **common)


def _bits_checks():
    """The float16/bfloat16 writers against NumPy/ml_dtypes over special and ordinary float32 bits."""
    import ml_dtypes
    import numpy as np

    from arraytrain.kernels import cpu
    from arraytrain.kernels.cpu import reductions

    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lo = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x3000, 0x7FFF, 0x8000, 0x8001, 0xE000, 0xFFFF], np.uint32)
    bits = (hi[:, None] | lo[None, :]).ravel()
    x = bits.view(np.float32)
    want16 = x.astype(np.float16).view(np.uint16)
    want_bf = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(x)
    want_bf[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)  # the codec's quiet NaN keeps the payload
    out = {}
    for size in (4099, x.size):  # serial twin, parallel twin
        pieces = np.array([[i, min(i + 16384, size), 0] for i in range(0, size, 16384)], np.int64)
        for name, kind, want in (("f16", cpu.LP_F16, want16), ("bf16", cpu.LP_BF16, want_bf)):
            w = np.zeros(size, np.uint16)
            reductions.cast_working(w, x[:size], pieces, kind=kind)
            out[f"{name}/{size}"] = int(np.count_nonzero(w != want[:size]))
    return out


#: The probe's parts, each compiled in a subprocess of its own (the tests' items, so the workers share them):
#: the bfloat16/float16 kernels and casts, the 8-bit ones, the float8 ones; each part with its codecs' checks.
PARTS = {"16bit": ("bf16-state", "working", "bf16-state-parallel"), "8bit": ("8bit-state-parallel",),
         "float8": ("float8-state-parallel",)}


def probe(part: str) -> dict:
    """Compile the low-precision kernels of ``part`` (:data:`PARTS`) for this process's target; counts of
    packed instructions per kernel, the codecs' mismatches (and LAMB's digest with the 16-bit part)."""
    import warnings

    global _sr_encode
    _sr_encode = _sr_encode_dispatcher()

    import numpy as np

    from arraytrain.kernels import cpu
    from arraytrain.kernels.cpu import reductions
    from arraytrain.kernels.cpu._jit import SERIAL_BELOW

    warnings.simplefilter("ignore")
    found = {}

    def count(disp, before):
        asm = "\n".join(disp.inspect_asm(s) for s in disp.signatures if s not in before)
        return {k: len(re.findall(p, asm)) for k, p in PATTERNS.items()}

    big = SERIAL_BELOW
    for tag, state, working, kind, n, twin in (
            ("bf16-state", np.uint16, None, cpu.LP_NONE, 64, 1),
            ("working", np.float32, np.zeros(64, np.uint16), cpu.LP_F16, 64, 1),
            # the parallel twin: the same source, but its loop is compiled inside numba's
            # parfor function, where LLVM speculates less (a load under a runtime flag kept
            # SGD's bfloat16 loop scalar there while the serial twin was packed)
            ("bf16-state-parallel", np.uint16, None, cpu.LP_NONE, big, 0),
            # 8-bit state: the decode, the float32 loop on the block and the encoder's gather; a
            # kernel with an 8-bit slot runs its parallel twin at every size (kernels.cpu._jit.pick)
            ("8bit-state-parallel", "8bit", None, cpu.LP_NONE, 64, 0),
            ("float8-state-parallel", "float8", None, cpu.LP_NONE, 64, 0)):
        if tag not in PARTS[part]:
            continue
        for names, pairs, call in _kernels(state, working, kind, n):
            if state == "float8" and names not in FLOAT8_KERNELS:
                continue
            if isinstance(names, str):
                names, pairs = (names,), (pairs,)
            disps = [pair[twin] for pair in pairs]
            befores = [set(d.signatures) for d in disps]
            call()
            for name, disp, before in zip(names, disps, befores):
                found[f"{name}/{tag}"] = count(disp, before)
    if part == "16bit":
        disp = reductions._CAST_WORKING[1]
        before = set(disp.signatures)
        reductions.cast_working(np.zeros(64, np.uint16), np.zeros(64, np.float32), np.array([[0, 64, 0]]),
                                kind=cpu.LP_F16)
        found["cast_working"] = count(disp, before)
        return {"asm": found, "bits": _bits_checks(), "lamb": _lamb_bits()}
    if part == "8bit":
        return {"asm": found, "bits": _q8_checks()}
    bits = _f8_checks()
    found["f8-sr-encode"] = count(_sr_encode, set())  # the step's stochastic rounding (e5m2 slots), run above
    return {"asm": found, "bits": bits}


def _lamb_bits() -> str:
    """A digest of two LAMB steps' parameters, moments and trust ratios (float32 and bfloat16 state,
    parameters whose lengths are no multiple of the sums' lanes, the serial and the parallel twin): its
    sums of squares run in the source's lanes (kernels.cpu.optimizers.SUM_LANES), not the vector
    width's, so the digest is the same for every target."""
    import hashlib

    import numpy as np

    from arraytrain import Layout
    from arraytrain.kernels import cpu
    from arraytrain.kernels.cpu._jit import SERIAL_BELOW

    digest = hashlib.sha1()
    rng = np.random.default_rng(3)
    for total in (1000, SERIAL_BELOW + 1001):
        layout = Layout({"a": (total - 333,), "b": (13,), "c": (40, 8)})
        for state in (np.float32, np.uint16):
            p = rng.standard_normal(layout.size).astype(np.float32)
            m, v = np.zeros(layout.size, state), np.zeros(layout.size, state)
            lr, wd = np.full(3, 1e-2, np.float32), np.array([0.0, 0.1, 0.01], np.float32)
            for t in (1, 2):
                g = (rng.standard_normal(layout.size) * np.exp(rng.uniform(-8, 4, layout.size))).astype(np.float32)
                ratio = cpu.lamb_step(p, g, m, v, layout.pieces, gscale=0.5, lr=lr, weight_decay=wd, beta1=0.9,
                                      beta2=0.999, eps=1e-6, eps_root=0.0, inv_bc1=1 / (1 - 0.9**t),
                                      inv_bc2=1 / (1 - 0.999**t))
                for a in (p, m, v, ratio):
                    digest.update(a.tobytes())
    return digest.hexdigest()


def _sr_encode_dispatcher():
    """The e5m2 slots' stochastically rounding block encoder over blocks of 256, compiled here."""
    from numba import njit

    from arraytrain.kernels.cpu.codecs import f8_encode_block_sr

    @njit
    def sr_blocks(x, codes, scales, pos, key):
        for k in range(0, x.size, 256):
            scales[k // 256] = f8_encode_block_sr(x[k : k + 256].copy(), codes[k : k + 256], pos + k, key)

    return sr_blocks


_sr_encode = None


def _f8_checks():
    """The float8 block encoder and decoder, compiled for this target, against lowbit (both formats)."""
    import numpy as np
    from numba import njit

    from arraytrain import lowbit
    from arraytrain.kernels.cpu.codecs import f8_decode_block, f8_encode_block

    @njit
    def roundtrip(x, codes, scales, out, wide):
        for k in range(0, x.size, 256):  # the format a constant, as the kernels compile it
            if wide:
                scales[k // 256] = f8_encode_block(x[k : k + 256].copy(), codes[k : k + 256], True)
                f8_decode_block(codes[k : k + 256], scales[k // 256], out[k : k + 256], True)
            else:
                scales[k // 256] = f8_encode_block(x[k : k + 256].copy(), codes[k : k + 256], False)
                f8_decode_block(codes[k : k + 256], scales[k // 256], out[k : k + 256], False)

    rng = np.random.default_rng(0)
    blocks = [rng.standard_normal(256) * np.exp(rng.uniform(-30, 30, 256)), rng.standard_normal(256),
              np.zeros(256), np.full(256, 3e38), np.r_[np.ones(255), np.nan], np.r_[np.ones(255), -np.inf],
              (np.arange(256) - 128) * 2.0 ** -12, rng.standard_normal(77)]
    out = {}
    for fmt in ("e4m3", "e5m2"):
        x = np.concatenate(blocks).astype(np.float32)
        codes, scales = np.zeros(x.size, np.uint8), np.zeros(-(-x.size // 256), np.float32)
        vals = np.zeros(x.size, np.float32)
        roundtrip(x, codes, scales, vals, fmt == "e5m2")
        want_codes, want_scales = lowbit.float8_encode(x, fmt)
        want = lowbit.decode(want_codes, want_scales, fmt)
        out[f"f8-encode/{fmt}"] = int(np.count_nonzero(codes != want_codes)
                                      + np.count_nonzero(scales.view(np.uint32) != want_scales.view(np.uint32)))
        out[f"f8-decode/{fmt}"] = int(np.count_nonzero(vals.view(np.uint32) != want.view(np.uint32)))
    # the step's stochastic rounding of e5m2 slots against lowbit.sr_codes
    x = np.abs(np.concatenate(blocks)).astype(np.float32)
    codes, scales = np.zeros(x.size, np.uint8), np.zeros(-(-x.size // 256), np.float32)
    _sr_encode(x, codes, scales, 2**32 + 5, 0x9E3779B9)
    bad = 0
    for k in range(0, x.size, 256):
        want_codes, want_scale = lowbit.sr_codes(x[k : k + 256], 2**32 + 5 + k + np.arange(x[k : k + 256].size),
                                                 0x9E3779B9)
        bad += int(np.count_nonzero(codes[k : k + 256] != want_codes) + (scales.view(np.uint32)[k // 256]
                                                                        != want_scale.view(np.uint32)[0]))
    out["f8-encode-sr/e5m2"] = bad
    return out


def _q8_checks():
    """The 8-bit encoder (vector lanes and scalar tail) against lowbit.nearest_codes, and the
    decoder bit for bit, both maps."""
    import numpy as np
    from numba import njit

    from arraytrain import lowbit
    from arraytrain.kernels.cpu.codecs import q8_decode_block, q8_encode_block

    @njit
    def decode(codes, scales, qmap, out, signed):
        for k in range(0, codes.size, 256):
            q8_decode_block(codes[k : k + 256], scales[k // 256], qmap, out[k : k + 256], signed)

    @njit
    def encode(x, codes, table, shift, bias, nb, signed):
        for k in range(0, x.size, 256):
            q8_encode_block(x[k : k + 256], codes[k : k + 256], table, shift, bias, nb, signed)

    out = {}
    rng = np.random.default_rng(0)
    for signed in (True, False):
        book = lowbit.codebook(signed)
        m = book.qmap
        # blocks of 256 holding 1.0 (absmax 1: q = x), then the map's values, every decision bound
        # with its 64 float32 neighbours on each side, both signs (the arithmetic encoder's
        # flagged lanes), uniform and log-uniform values, zeros and tiny values
        bounds = np.abs((m[1:] + m[:-1]) / np.float32(2)).astype(np.float32).view(np.int32)
        near = (bounds[:, None] + np.arange(-64, 65, dtype=np.int32)[None, :]).ravel().view(np.float32)
        q = np.concatenate([m, near, -near, rng.uniform(-1, 1, 4000), np.exp(rng.uniform(-40, 0, 4000)),
                            [0.0, -0.0, 1e-30, -1e-30, 1e-45, -1e-45, 2.0**-23, -(2.0**-23)]])
        q = np.abs(q) if not signed else q
        q = np.concatenate([q, np.zeros(-q.size % 256)]).astype(np.float32)
        q[::256] = 1.0
        codes = np.zeros(q.size, np.uint8)
        encode(q, codes, book.table, book.shift, book.bias, book.nb, signed)
        out[f"q8/{'signed' if signed else 'unsigned'}"] = int(np.count_nonzero(codes != lowbit.nearest_codes(q, m)))
        # the decoder (two-table permutes on this AVX-512 target, the numba loop on AVX2): every
        # code, scales with NaN, 0 and inf among them, a last block shorter than the lanes
        codes = np.concatenate([np.arange(256), rng.integers(0, 256, 256 * 5 + 77)]).astype(np.uint8)
        scales = np.concatenate([[1.0, np.nan, 0.0, np.inf], rng.random(3)]).astype(np.float32)
        vals = np.empty(codes.size, np.float32)
        decode(codes, scales, m, vals, signed)
        want = (m[codes] * np.repeat(scales, 256)[: codes.size]).astype(np.float32)
        out[f"q8-decode/{'signed' if signed else 'unsigned'}"] = int(np.count_nonzero(vals.view(np.uint32)
                                                                                      != want.view(np.uint32)))
    return out


def _run(target: str, part: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, **TARGETS[target], "NUMBA_CACHE_DIR": cache}
        out = subprocess.run([sys.executable, __file__, part], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=[(t, p) for t in sorted(TARGETS) for p in PARTS], ids="-".join)
def compiled(request):
    target, part = request.param
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 targets")
    if target == "avx512" and not _host_has_avx512():
        pytest.skip("the AVX-512 code is compiled and run here: this CPU has no AVX-512")
    return target, _run(target, part)


def test_update_loops_are_packed(compiled):
    target, found = compiled
    bad = []
    for key, c in found["asm"].items():
        name, tag = (key.split("/") + [""])[:2]
        if key == "f8-sr-encode":  # the stochastic rounding's hash (32-bit multiplies) and narrowing, packed
            need = ["mul32", "narrow8"]
        elif tag.startswith("float8-state"):  # the codec's packed byte widening and narrowing, the float loop
            need = ["widen8", "float"] + (["narrow8"] if name != "lamb_apply" else [])  # LAMB's 2nd loop decodes only
            if name in SQRT:
                need.append("sqrt")
        elif tag.startswith("8bit-state"):  # no narrowing store; the encoder (and on AVX-512 the decoder)
            encoder = ["gather"] if target == "avx2" else ["arith"]
            need = encoder if name != "lamb_apply" else []  # LAMB's second loop only decodes
            if target == "avx512":
                need.append("decode")
            need.append("float")
            if name in SQRT:
                need.append("sqrt")
        else:
            need = ["float"] if key != "cast_working" else []
            if name in SQRT:
                need.append("sqrt")
            working = (tag == "working" and name != "lamb") or key == "cast_working"  # (LAMB's first loop writes
            if (tag.startswith("bf16-state") and name != "lamb_apply") or working:   # no working copy)
                need.append("narrow")  # bfloat16 state slots; the bfloat16 working copy
            if working:
                need.append("cvtph")  # the float16 working copy
        missing = [k for k in need if not c[k]]
        if missing:
            bad.append(f"{key}: no packed {', '.join(missing)} ({c})")
    assert not bad, f"{target}: " + "; ".join(bad)


def test_lamb_sums_same_bits_on_every_target(compiled):
    """LAMB's trust ratios and step compiled for the target equal this process's own compile's (the host's)."""
    target, found = compiled
    if "lamb" not in found:
        pytest.skip("LAMB's digest is the 16-bit part's")
    assert found["lamb"] == _lamb_bits(), target


def test_codecs_bit_exact(compiled):
    target, found = compiled
    assert not any(found["bits"].values()), f"{target}: mismatching elements {found['bits']}"


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1])))
