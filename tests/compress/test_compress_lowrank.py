"""PowerSGD and the VSA (randomized Hadamard) projection: kernels against their reference
twins, each compressor against an independent NumPy oracle, state resume, bytes, memory,
unbiasedness, error feedback and bad arguments."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
from conftest import DTYPES, SIZES, assert_close, live_mask, padded_layout, random_flat

from arraytrain import Layout
from arraytrain.compress import VSA, ErrorFeedback, Payload, PowerSGD
from arraytrain.errors import ArgumentTypeError, HyperparameterError, StateDictError
from arraytrain.kernels.cpu import projection as project
from arraytrain.kernels.reference import projection as project_reference
from arraytrain.kernels.counter_rng import step_key

IMPLS = ("numba", "reference")

# a conv kernel (viewed as 8 x 27), a matrix, a bias, a matrix too small to save bytes at rank 2
SHAPES = {"conv.weight": (8, 3, 3, 3), "fc.weight": (30, 20), "fc.bias": (30,), "tiny": (3, 3)}


def _flat(layout, dtype, rng, scale=1.0):
    return random_flat(layout, dtype, rng, scale)


def _live(x, layout):
    return x[live_mask(layout)]


# ---------------------------------------------------------------------------------------------
# PowerSGD
# ---------------------------------------------------------------------------------------------


def _gram_schmidt(p):
    """Classical Gram-Schmidt as in the paper / torch's hook (float64)."""
    p = p.copy()
    for i in range(p.shape[1]):
        p[:, i] -= p[:, :i] @ (p[:, :i].T @ p[:, i])
        p[:, i] /= np.linalg.norm(p[:, i])
    return p


def _oracle(grads, shape, rank, q0, warm_start=True):
    """Algorithm 1 of Vogels et al. (2019), one matrix, no communication: the decoded matrices and final Q."""
    n = shape[0]
    q, outs = q0.astype(np.float64), []
    for g in grads:
        m_ = g.astype(np.float64).reshape(n, -1)
        p = _gram_schmidt(m_ @ q)
        q_new = m_.T @ p
        outs.append((p @ q_new.T).reshape(shape))
        if warm_start:
            q = q_new
    return outs, q


@pytest.mark.parametrize("kernels", IMPLS)
def test_powersgd_matches_the_papers_algorithm(kernels, rng):
    layout = Layout(SHAPES)
    c = PowerSGD(rank=3, seed=5, kernels=kernels).bind(layout, np.float64)
    grads = [_flat(layout, np.float64, rng) for _ in range(5)]
    decoded = [c.decompress(c.compress(g)) for g in grads]
    for i, name in enumerate(["conv.weight", "fc.weight"]):
        shape = SHAPES[name]
        m = math.prod(shape[1:])
        q0 = np.random.default_rng([5, i]).standard_normal((m, 3))  # documented initial Q
        outs, q = _oracle([g[layout.slice(name)] for g in grads], shape, 3, q0)
        for k in range(5):
            assert_close(decoded[k][layout.slice(name)], outs[k].ravel(), err_msg=f"{name} call {k}")
        assert_close(c.state_dict()["arrays"][f"Q:{name}"], q)
    for name in ("fc.bias", "tiny"):  # 1-D, and (3 + 3) * 3 >= 9: no saving -> raw, bit for bit
        for g, d in zip(grads, decoded):
            assert np.array_equal(d[layout.slice(name)], g[layout.slice(name)])


def test_powersgd_against_torch_orthogonalisation(rng):
    """torch's own Gram-Schmidt piece of the hook gives the P our reference twin gives."""
    torch = pytest.importorskip("torch")
    hook = pytest.importorskip("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook")
    from arraytrain.compress._powersgd import orthonormalize_gram_schmidt, orthonormalize_qr

    gram_schmidt = getattr(hook, "_orthogonalize_gram_schmidt", None)
    if gram_schmidt is None:
        pytest.skip("this torch has no _orthogonalize_gram_schmidt")
    p = rng.standard_normal((40, 3))
    t = torch.from_numpy(p.copy())[None]
    gram_schmidt(t)
    assert_close(orthonormalize_gram_schmidt(p), t[0].numpy())
    assert_close(orthonormalize_qr(p), t[0].numpy())


@pytest.mark.parametrize("dtype", DTYPES)
def test_powersgd_numba_equals_reference(dtype, rng):
    layout = Layout(SHAPES)
    fast = PowerSGD(rank=2, seed=1).bind(layout, dtype)
    ref = PowerSGD(rank=2, seed=1, kernels="reference").bind(layout, dtype)
    for k in range(7):
        g = _flat(layout, dtype, rng)
        pf, pr = fast.compress(g), ref.compress(g)
        assert sorted(pf.arrays) == sorted(pr.arrays)
        assert_close(fast.decompress(pf), ref.decompress(pr), err_msg=f"call {k}")
        for key in pf.arrays:
            assert pf.arrays[key].dtype == np.dtype(dtype)
            assert_close(pf.arrays[key], pr.arrays[key], err_msg=f"{key} call {k}")


@pytest.mark.parametrize("kernels", IMPLS)
@pytest.mark.parametrize("true_rank", [1, 3])
def test_powersgd_exact_for_low_rank(kernels, true_rank, rng):
    layout = Layout({"w": (50, 40)})
    c = PowerSGD(rank=3, kernels=kernels).bind(layout, np.float64)
    x = (rng.standard_normal((50, true_rank)) @ rng.standard_normal((true_rank, 40))).ravel()
    for call in range(2):  # from the first call, and again with the warm-started Q
        out = c.decompress(c.compress(x))
        np.testing.assert_allclose(out, x, rtol=0, atol=1e-10 * np.abs(x).max(), err_msg=f"call {call}")


@pytest.mark.parametrize("kernels", IMPLS)
def test_powersgd_power_iteration_converges(kernels, rng):
    """Calls on a fixed matrix are subspace iteration: the error falls to the SVD's best rank-r error."""
    n, m, r = 60, 40, 2
    u, _ = np.linalg.qr(rng.standard_normal((n, m)))
    v, _ = np.linalg.qr(rng.standard_normal((m, m)))
    s = 0.7 ** np.arange(m)
    x = ((u * s) @ v.T).ravel()
    c = PowerSGD(rank=r, kernels=kernels).bind(Layout({"w": (n, m)}), np.float64)
    errs = [np.linalg.norm(c.decompress(c.compress(x)) - x) for _ in range(15)]
    best = np.sqrt(np.sum(s[r:] ** 2))  # Eckart-Young
    assert all(b <= a * (1 + 1e-9) for a, b in zip(errs, errs[1:])), errs
    assert errs[-1] < errs[0]
    assert errs[-1] <= best * (1 + 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_powersgd_payload_bytes_and_keys(dtype, rng):
    layout = Layout({**SHAPES, "norm": (5,)})
    c = PowerSGD(rank=2, min_size=6).bind(layout, dtype)  # "norm" (5 elements) goes to the base's raw
    p = c.compress(_flat(layout, dtype, rng))
    it = np.dtype(dtype).itemsize
    expect = ((8 + 27) * 2 + (30 + 20) * 2 + 30 + 9) * it + 5 * it
    assert p.nbytes == expect
    assert sorted(p.arrays) == ["M:fc.bias", "M:tiny", "P:conv.weight", "P:fc.weight", "Q:conv.weight", "Q:fc.weight"]
    assert p.arrays["P:fc.weight"].shape == (30, 2) and p.arrays["Q:conv.weight"].shape == (27, 2)
    pf = p.arrays["P:fc.weight"].astype(np.float64)
    np.testing.assert_allclose(pf.T @ pf, np.eye(2), atol=1e-5)


def test_powersgd_zero_matrix_keeps_previous_q(rng):
    layout = Layout({"w": (20, 10)})
    c = PowerSGD(rank=2).bind(layout, np.float64)
    q0 = c.state_dict()["arrays"]["Q:w"]
    out = c.decompress(c.compress(np.zeros(layout.size)))
    assert not np.any(out)
    assert np.array_equal(c.state_dict()["arrays"]["Q:w"], q0)
    x = _flat(layout, np.float64, rng)
    assert np.linalg.norm(c.decompress(c.compress(x)) - x) < np.linalg.norm(x)


def test_powersgd_cold_start_draws_q_each_call(rng):
    layout = Layout({"w": (20, 10)})
    c = PowerSGD(rank=2, warm_start=False, seed=3).bind(layout, np.float64)
    assert c.state_dict()["arrays"] == {}
    x = _flat(layout, np.float64, rng)
    q1 = np.random.default_rng([3, 1, 0]).standard_normal((10, 2))
    c.compress(x)
    p = c.compress(x)
    expect, _ = _oracle([x[:200]], (20, 10), 2, q1)
    assert_close(c.decompress(p)[:200], expect[0].ravel())


@pytest.mark.parametrize("compressor", [
    lambda: PowerSGD(rank=2, seed=7, warmup=1),
    lambda: ErrorFeedback(PowerSGD(rank=2, seed=7)),
    lambda: VSA(0.3, block=64, seed=7),
    lambda: ErrorFeedback(VSA(dim=40, block=64, unbiased=False, seed=7)),
])
def test_state_dict_round_trip_is_bitwise(compressor, rng):
    layout = Layout(SHAPES)
    grads = [_flat(layout, np.float32, rng) for _ in range(6)]

    def run(c, gs):
        outs = []
        for g in gs:
            x = g.copy()
            c.roundtrip(x)
            outs.append(x)
        return outs

    whole = run(compressor().bind(layout, np.float32), grads)
    first = compressor().bind(layout, np.float32)
    run(first, grads[:3])
    state = first.state_dict()
    resumed = compressor().bind(layout, np.float32)
    resumed.load_state_dict(state)
    for a, b in zip(whole[3:], run(resumed, grads[3:])):
        assert np.array_equal(a, b)


def test_powersgd_bad_state_changes_nothing(rng):
    layout = Layout(SHAPES)
    c = PowerSGD(rank=2).bind(layout, np.float32)
    c.compress(_flat(layout, np.float32, rng))
    good = c.state_dict()
    before = {k: v.copy() for k, v in good["arrays"].items()}
    bads = {
        "shape": {**good["arrays"], "Q:fc.weight": np.zeros((20, 3), np.float32)},
        "dtype": {**good["arrays"], "Q:fc.weight": good["arrays"]["Q:fc.weight"].astype(np.float64)},
        "missing": {"Q:fc.weight": good["arrays"]["Q:fc.weight"]},
        "extra": {**good["arrays"], "Q:fc.bias": np.zeros((30, 2), np.float32)},
    }
    for what, arrays in bads.items():
        with pytest.raises(StateDictError, match="Q:"):
            c.load_state_dict({**good, "arrays": arrays})
        assert c.step == 1, what
        for k, v in c.state_dict()["arrays"].items():
            assert np.array_equal(v, before[k]), what


# ---------------------------------------------------------------------------------------------
# projection kernels
# ---------------------------------------------------------------------------------------------

# (block, number of blocks): empty, one element, odd counts, and a buffer on the parallel path
FWHT_CASES = [(1, 0), (1, 1), (2, 7), (8, 129), (1024, 1), (1024, 70), (4096, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block,nb", FWHT_CASES)
def test_fwht_kernel_equals_reference_and_is_orthonormal(family, block, nb, dtype, rng):
    x = rng.standard_normal(block * nb).astype(dtype)
    a, b = x.copy(), x.copy()
    family.fwht(a, block=block)
    project_reference.fwht(b, block=block)
    assert_close(a, b)
    assert_close(np.linalg.norm(a.astype(np.float64)), np.linalg.norm(x.astype(np.float64)), dtype)
    family.fwht(a, block=block)  # H is symmetric and orthogonal: its own inverse
    assert_close(a, x)


@pytest.mark.parametrize("impl", [project, project_reference])
def test_fwht_non_finite_stays_in_its_block(impl, rng):
    x = rng.standard_normal(64 * 4)
    x[70], x[200] = np.nan, np.inf
    impl.fwht(x, block=64)
    finite = np.isfinite(x).reshape(4, 64)
    assert finite[0].all() and finite[2].all() and not finite[1].any() and not finite[3].any()


@pytest.mark.parametrize("block", [1, 2, 4, 16, 64])
def test_fwht_reference_equals_the_hadamard_matrix(block, rng):
    x = rng.standard_normal(block * 5)
    y = x.copy()
    project_reference.fwht(y, block=block)
    h = scipy.linalg.hadamard(block) / math.sqrt(block)
    np.testing.assert_allclose(y.reshape(5, block), x.reshape(5, block) @ h.T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_sign_bind_kernel_equals_reference(family, n, dtype, rng):
    x = rng.standard_normal(n).astype(dtype)
    x[3::97], x[5::97] = np.nan, -np.inf
    key = step_key(11, 4)
    a, b = np.empty_like(x), np.empty_like(x)
    family.sign_bind(x, a, key=key)
    project_reference.sign_bind(x, b, key=key)
    assert np.array_equal(a, b, equal_nan=True)
    assert np.array_equal(np.abs(a), np.abs(x), equal_nan=True)
    if n > 1000:
        assert abs(np.mean(a == x) - 0.5) < 0.05
    family.sign_bind(a, a, key=key)  # in place; binding twice with one key unbinds
    assert np.array_equal(a, x, equal_nan=True)


@pytest.mark.parametrize("block,nb,d", [(1, 1, 1), (4, 3, 12), (8, 5, 13), (16, 10, 3), (1024, 70, 7001)])
def test_selection_kernels_equal_reference(family, block, nb, d, rng):
    z = rng.standard_normal(block * nb)
    key = step_key(3, 9)
    ya, yb = np.empty(d), np.empty(d)
    family.select_gather(z, ya, key=key, block=block)
    project_reference.select_gather(z, yb, key=key, block=block)
    assert np.array_equal(ya, yb)
    za, zb = np.empty_like(z), np.empty_like(z)
    y = rng.standard_normal(d)
    family.select_scatter(y, za, key=key, block=block, factor=2.5)
    project_reference.select_scatter(y, zb, key=key, block=block, factor=2.5)
    assert np.array_equal(za, zb)
    assert np.count_nonzero(za) == d
    assert math.isclose(np.dot(ya, y) * 2.5, np.dot(z, za), rel_tol=1e-12)  # scatter = scale * gather^T


def test_selection_keeps_every_coordinate_with_probability_d_over_n(family):
    block, nb, d, trials = 8, 3, 5, 6000  # d % nb != 0: the extra slots rotate over the blocks
    hits = np.zeros(block * nb)
    for t in range(trials):
        z = np.zeros(block * nb)
        family.select_scatter(np.ones(d), z, key=step_key(0, t), block=block, factor=1.0)
        hits += z
    p = d / (block * nb)
    assert np.all(np.abs(hits / trials - p) < 4 * math.sqrt(p * (1 - p) / trials))


# ---------------------------------------------------------------------------------------------
# VSA
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.usefixtures("numba_family")
def test_vsa_numba_equals_reference(n, dtype, rng):
    layout = padded_layout(n)
    fast = VSA(0.3, block=256, seed=2).bind(layout, dtype)
    ref = VSA(0.3, block=256, seed=2, kernels="reference").bind(layout, dtype)
    for k in range(2):
        g = _flat(layout, dtype, rng)
        pf, pr = fast.compress(g), ref.compress(g)
        assert list(pf.arrays) == ["values"]
        assert_close(pf.arrays["values"], pr.arrays["values"], err_msg=f"call {k}")
        assert_close(fast.decompress(pf), ref.decompress(pr), err_msg=f"call {k}")


@pytest.mark.usefixtures("numba_family")
def test_vsa_receiver_rederives_key_and_positions(rng):
    layout = Layout({"w": (300, 7), "b": (300,)})
    sender = VSA(dim=500, block=128, seed=9).bind(layout, np.float32)
    receiver = VSA(dim=500, block=128, seed=9).bind(layout, np.float32)
    for _ in range(3):
        g = _flat(layout, np.float32, rng)
        p = sender.compress(g)
        wire = Payload("vsa", arrays={"values": p.arrays["values"].copy()}, meta={"key": step_key(9, p.meta["step"])})
        assert np.array_equal(receiver.decompress(wire), sender.decompress(p))


def test_vsa_is_unbiased(rng):
    layout = Layout({"w": (300,)})
    x = _flat(layout, np.float64, rng)
    trials = 1500
    for unbiased in (True, False):
        c = VSA(0.25, block=64, unbiased=unbiased).bind(layout, np.float64)
        outs = np.stack([c.decompress(c.compress(x)) for _ in range(trials)])
        mean, sq_err = outs.mean(axis=0), np.mean(np.sum((outs - x) ** 2, axis=1))
        ratio = c.padded / c.d
        x2 = float(x @ x)
        if unbiased:
            # E||x^ - x||^2 = (N/d - 1)||x||^2, and the mean of `trials` draws has 1/trials of it
            assert abs(sq_err / ((ratio - 1) * x2) - 1) < 0.1
            assert np.sum((mean - x) ** 2) < 3 * (ratio - 1) * x2 / trials
        else:  # the projection: E[x^] = (d/N) x, E||x^ - x||^2 = (1 - d/N)||x||^2
            assert abs(sq_err / ((1 - 1 / ratio) * x2) - 1) < 0.1
            assert np.sum((mean - x / ratio) ** 2) < 3 * (1 / ratio) * x2 / trials
            assert np.sum((mean - x) ** 2) > 0.3 * x2


def test_vsa_error_decreases_with_ratio(rng):
    layout = Layout({"w": (20000,)})
    x = _flat(layout, np.float32, rng)
    errs = []
    for ratio in (0.02, 0.05, 0.1, 0.25, 0.5, 1.0):
        c = VSA(ratio, block=1024).bind(layout, np.float32)
        err = np.linalg.norm(c.decompress(c.compress(x)) - x) / np.linalg.norm(x)
        assert abs(err / math.sqrt(c.padded / c.d - 1) - 1) < 0.1, ratio
        errs.append(err)
    assert all(b < a for a, b in zip(errs, errs[1:])), errs


def test_vsa_memory_is_linear(rng):
    n = 100_000
    layout = Layout({"a": (n // 2,), "b": (n // 2,)})
    c = VSA(0.1, block=4096).bind(layout, np.float32)
    x = _flat(layout, np.float32, rng)
    c.decompress(c.compress(x))

    def arrays(obj, seen):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from arrays(v, seen)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from arrays(v, seen)
        elif type(obj).__module__.startswith("arraytrain."):  # the compressor and its helpers, not modules
            yield from arrays(vars(obj), seen)

    sizes = [a.size for a in arrays(c, set())]
    assert sizes and max(sizes) <= 4 * n
    assert c.padded < n + 4096


@pytest.mark.parametrize("dtype", DTYPES)
def test_vsa_payload_bytes(dtype, rng):
    layout = Layout({"w": (1000,), "b": (10,)})
    c = VSA(dim=123, block=256, min_size=11).bind(layout, dtype)
    p = c.compress(_flat(layout, dtype, rng))
    assert p.nbytes == (123 + 10) * np.dtype(dtype).itemsize
    assert c.padded == 1024 and c.block_used == 256
    small = VSA(0.5, block=4096).bind(Layout({"w": (100,)}), dtype)  # block capped at 128 > 100
    assert small.block_used == 128 and small.d == 50


# ---------------------------------------------------------------------------------------------
# error feedback
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda: PowerSGD(rank=1),
    lambda: PowerSGD(rank=2, kernels="reference"),
    lambda: VSA(0.2, block=64, unbiased=False),
    lambda: VSA(0.2, block=64, unbiased=False, kernels="reference"),
])
def test_error_feedback_telescopes(make, rng):
    layout = Layout(SHAPES)
    ef = ErrorFeedback(make()).bind(layout, np.float64)
    sent, total = np.zeros(layout.size), np.zeros(layout.size)
    for _ in range(6):
        g = _flat(layout, np.float64, rng)
        total += g
        x = g.copy()
        ef.roundtrip(x)
        sent += x
    np.testing.assert_allclose(_live(sent + ef.residual.flat, layout), _live(total, layout), rtol=1e-10, atol=1e-10)
    assert np.any(ef.residual.flat != 0)


def test_error_feedback_with_projection_stays_bounded(rng):
    """The contractive decode keeps the residual bounded; the unbiased one (N/d = 5) would let it grow
    (the same recursion, r <- t - decode(t), run by hand), so ErrorFeedback refuses it."""
    layout = Layout({"w": (4096,)})
    ef = ErrorFeedback(VSA(0.2, block=256, unbiased=False)).bind(layout, np.float64)
    unbiased = VSA(0.2, block=256, unbiased=True).bind(layout, np.float64)
    r = np.zeros(layout.size)
    for _ in range(15):
        g = _flat(layout, np.float64, rng)
        ef.roundtrip(g.copy())
        t = g + r
        r = t - unbiased.decompress(unbiased.compress(t))
    bounded = np.linalg.norm(ef.residual.flat)
    assert bounded < 10 * math.sqrt(4096 / 0.2)
    assert np.linalg.norm(r) > 100 * bounded
    with pytest.raises(HyperparameterError, match="unbiased=False"):
        ErrorFeedback(VSA(0.2, block=256))


# ---------------------------------------------------------------------------------------------
# bad arguments
# ---------------------------------------------------------------------------------------------

BAD_ARGS = [
    (lambda: PowerSGD(rank=0), HyperparameterError, "rank:"),
    (lambda: PowerSGD(rank=2.0), HyperparameterError, "rank:"),
    (lambda: PowerSGD(rank=True), HyperparameterError, "rank:"),
    (lambda: PowerSGD(warm_start=1), HyperparameterError, "warm_start:"),
    (lambda: PowerSGD(kernels="cuda"), HyperparameterError, "kernels:"),
    (lambda: PowerSGD(min_size=-1), HyperparameterError, "min_size:"),
    (lambda: VSA(), HyperparameterError, "ratio, dim:"),
    (lambda: VSA(0.5, dim=3), HyperparameterError, "ratio, dim:"),
    (lambda: VSA(0.0), HyperparameterError, "ratio:"),
    (lambda: VSA(1.5), HyperparameterError, "ratio:"),
    (lambda: VSA(float("nan")), HyperparameterError, "ratio:"),
    (lambda: VSA(dim=0), HyperparameterError, "dim:"),
    (lambda: VSA(dim=2.5), HyperparameterError, "dim:"),
    (lambda: VSA(0.5, block=48), HyperparameterError, "block:"),
    (lambda: VSA(0.5, block=0), HyperparameterError, "block:"),
    (lambda: VSA(0.5, unbiased="yes"), HyperparameterError, "unbiased:"),
    (lambda: VSA(0.5, seed=-1), HyperparameterError, "seed:"),
    (lambda: VSA(dim=11).bind(Layout({"w": (10,)})), HyperparameterError, "dim:"),
]


@pytest.mark.parametrize("make,error,prefix", BAD_ARGS, ids=[f"{i}:{c[2]}" for i, c in enumerate(BAD_ARGS)])
def test_bad_arguments(make, error, prefix):
    with pytest.raises(error) as info:
        make()
    assert str(info.value).startswith(prefix)


def test_bad_payloads(rng):
    layout = Layout(SHAPES)
    g = _flat(layout, np.float32, rng)
    for c, key in ((PowerSGD(rank=2), "P:fc.weight"), (VSA(0.1), "values")):
        c.bind(layout, np.float32)
        p = c.compress(g)
        bad = Payload(p.method, arrays={**p.arrays, key: p.arrays[key][:-1]}, raw=p.raw, meta=p.meta)
        with pytest.raises(ArgumentTypeError, match=f"payload '{key}'"):
            c.decompress(bad)
        del bad.arrays[key]
        with pytest.raises(ArgumentTypeError, match=f"payload '{key}'"):
            c.decompress(bad)
