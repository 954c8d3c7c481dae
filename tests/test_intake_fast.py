"""The dict path's reused structure (arraytrain.engine.intake.Intake): same bits as the general path, same refusals."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

import arraytrain as at
from arraytrain.engine import intake as _intake
from arraytrain.buffer import ALIGN_BYTES, FlatBuffer, address
from arraytrain.errors import (
    AliasingError,
    ArrayTrainError,
    BackendError,
    DTypeError,
    MissingGradientError,
    ShapeMismatchError,
    UnknownParameterError,
)
from arraytrain.kernels import reference as ref
from arraytrain.layout import Layout
from builders import random_engine
from conftest import engine_snapshot

# sizes on both sides of the staging threshold, zero-size first, in the middle and last
SIZES = (0, 1, 7, 1037, _intake.STAGE_BELOW - 1, _intake.STAGE_BELOW, 0, 5000, 33, 0)


def _shapes(sizes=SIZES) -> dict:
    return {f"p{i}": ((s,) if i % 2 else (1, s)) for i, s in enumerate(sizes)}


def _grads(shapes, rng, dtype=np.float32, scale=1.0) -> dict:
    return {n: (rng.standard_normal(s) * scale).astype(dtype) for n, s in shapes.items()}


def _intake_engine(shapes, *, fast=True, dtype=np.float32, **kw):
    """An AdamW engine over random parameters (seed 7); its dict path the reused one (``fast``) or the general one."""
    e = random_engine(shapes, at.optim.AdamW(lr=1e-2, weight_decay=0.1), seed=7, param_dtype=dtype, **kw)
    e.intake.fast = fast
    return e


@pytest.mark.parametrize("gdtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("kernels", ["numba", "reference"])
@pytest.mark.parametrize("pdtype", [np.float32, np.float64])
def test_fast_path_equals_general_path_bitwise(gdtype, kernels, pdtype):
    shapes = _shapes()
    fast = _intake_engine(shapes, fast=True, dtype=pdtype, accumulation_steps=3, kernels=kernels, max_grad_norm=1.0)
    slow = _intake_engine(shapes, fast=False, dtype=pdtype, accumulation_steps=3, kernels=kernels, max_grad_norm=1.0)
    rng = np.random.default_rng(0)
    used = 0
    for i in range(9):
        g = _grads(shapes, rng, gdtype, scale=3.0)
        w = (1.0, 0.5, 3.0)[i % 3]
        before = fast.intake._plan
        fast.step(g, weight=w)
        slow.step(g, weight=w)
        used += before is not None and fast.intake._plan is before
        np.testing.assert_array_equal(fast.grads.flat, slow.grads.flat)
        np.testing.assert_array_equal(fast.params.flat, slow.params.flat)
    assert used == 8  # every call after the first went through the plan
    assert slow.intake._plan is None


def test_many_tensors_span_several_staging_groups():
    shapes = {f"t{i}": (3000,) for i in range(60)}  # 180000 staged elements
    fast, slow = _intake_engine(shapes, accumulation_steps=2), _intake_engine(shapes, fast=False, accumulation_steps=2)
    rng = np.random.default_rng(1)
    for _ in range(4):
        g = _grads(shapes, rng)
        fast.step(g), slow.step(g)
        np.testing.assert_array_equal(fast.grads.flat, slow.grads.flat)
    assert len(fast.intake._plan.groups) == 6  # 11 gradients (33,000 elements) fill a group of 32K; the last holds 5
    np.testing.assert_array_equal(fast.params.flat, slow.params.flat)


@pytest.mark.parametrize("n", [0, 1, 7, 1037, 278011])
def test_accumulate_packed_matches_reference(family, n):
    rng = np.random.default_rng(n)
    src = rng.standard_normal(3 * n).astype(np.float32)
    table = np.array([[0, 16 * 0, n], [n, -(-n // 16) * 16, n], [2 * n, 2 * -(-n // 16) * 16, n]], np.int64)
    for overwrite in (True, False):
        a = rng.standard_normal(3 * -(-n // 16) * 16 + 16).astype(np.float32)
        b = a.copy()
        family.accumulate_packed(a, src, table, w=0.37, overwrite=overwrite)
        ref.accumulate_packed(b, src, table, w=0.37, overwrite=overwrite)
        np.testing.assert_allclose(a, b, rtol=1.3e-6 * 5, atol=1e-5 * 5)


def test_plan_follows_structure_changes():
    shapes = {"a": (4, 3), "b": (5,)}
    e = _intake_engine(shapes, accumulation_steps=100, missing="zero")
    rng = np.random.default_rng(2)
    e.step(_grads(shapes, rng))
    plan = e.intake._plan
    e.step(_grads(shapes, rng))
    assert e.intake._plan is plan
    # another order, a subset, another dtype: the general path validates and learns the new structure
    for g in ({"b": rng.standard_normal(5).astype(np.float32), "a": rng.standard_normal((4, 3)).astype(np.float32)},
              {"a": rng.standard_normal((4, 3)).astype(np.float32)},
              _grads(shapes, rng, np.float64)):
        e.step(g)
        assert e.intake._plan is not plan and e.intake._plan.names == tuple(g)
        plan = e.intake._plan
    # mixed dtypes, non-dict mappings and non-NumPy values take the general path and keep no plan
    e.step({"a": np.ones((4, 3), np.float32), "b": np.ones(5, np.float64)})
    assert e.intake._plan is None
    e.step(OrderedDict(_grads(shapes, rng)))
    assert e.intake._plan is None
    e.step({"a": np.ones((4, 3)).tolist(), "b": np.ones(5)})
    assert e.intake._plan is None


def test_missing_zero_policy_zeroes_absent_names_through_the_plan():
    shapes = {"a": (3,), "b": (2,)}
    e = _intake_engine(shapes, accumulation_steps=2, missing="zero", zero_grad_on_step=False)
    for _ in range(3):
        e.step({"a": np.ones(3, np.float32)})
        e.grads["b"][...] = 5  # left over: the next window's first micro-batch zeroes it
        e.step({"a": np.ones(3, np.float32)})
    e.grads["b"][...] = 5
    e.step({"a": np.ones(3, np.float32)})
    assert e.intake._plan is not None and e.intake._plan.absent == ["b"]
    np.testing.assert_array_equal(e.grads["b"], 0)


def _refused(shapes, rng):
    """(what, grads, error) for bad micro-batches that look like the learned structure."""
    g = _grads(shapes, rng)
    cases = []

    def case(what, error, **change):
        bad = dict(g)
        for k, v in change.items():
            bad[k] = v
        cases.append((what, bad, error))

    case("wrong shape", ShapeMismatchError, a=np.ones((3, 4), np.float32))
    case("same size, other shape", ShapeMismatchError, a=np.ones(12, np.float32))
    case("integer", DTypeError, a=np.ones((4, 3), np.int32))
    case("bool", DTypeError, a=np.ones((4, 3), bool))
    case("complex", DTypeError, a=np.ones((4, 3), np.complex64))
    case("object", DTypeError, a=np.empty((4, 3), object))
    case("masked", BackendError, a=np.ma.masked_array(np.ones((4, 3), np.float32)))
    case("not an array", BackendError, a=object())
    case("unknown name", UnknownParameterError, zz=np.ones(3, np.float32))
    cases.append(("missing name", {"a": g["a"]}, MissingGradientError))
    cases.append(("not a mapping", list(g.values()), at.errors.ArgumentTypeError))
    return cases


def test_refused_micro_batches_change_nothing_after_a_plan_exists():
    shapes = {"a": (4, 3), "b": (5,), "c": (5000,)}
    e = _intake_engine(shapes, accumulation_steps=3)
    rng = np.random.default_rng(3)
    e.step(_grads(shapes, rng))
    plan = e.intake._plan
    assert plan is not None
    aliases = [("a view of params", "a", lambda: e.params["a"]), ("a view of grads", "b", lambda: e.grads["b"]),
               ("a large view of grads", "c", lambda: e.grads["c"]),
               ("a view through DLPack", "a", lambda: np.from_dlpack(e.params["a"])),
               ("a reshaped slice of the flat buffer", "b", lambda: e.grads.flat[:5])]
    cases = _refused(shapes, rng)
    for what, name, make in aliases:
        bad = dict(_grads(shapes, rng))
        bad[name] = make()
        cases.append((what, bad, AliasingError))
    for what, bad, error in cases:
        snap = engine_snapshot(e)
        with pytest.raises(error) as info:
            e.step(bad)
        assert isinstance(info.value, ArrayTrainError), what
        assert snap == engine_snapshot(e), what
    print(f"{len(cases)} refused micro-batches, each changed nothing")
    e.step(_grads(shapes, rng))  # the plan still serves well-formed micro-batches
    assert e.micro_batches == 2


def test_non_contiguous_and_fortran_gradients_are_read_in_c_order():
    shapes = {"a": (40, 30), "b": (100, 60)}
    fast, slow = _intake_engine(shapes, accumulation_steps=2), _intake_engine(shapes, fast=False, accumulation_steps=2)
    rng = np.random.default_rng(4)
    for _ in range(2):
        g = _grads(shapes, rng)
        fast.step(g), slow.step(g)
    g = {"a": np.asfortranarray(rng.standard_normal((40, 30)).astype(np.float32)),
         "b": np.asfortranarray(rng.standard_normal((100, 60)).astype(np.float32))}
    fast.step(g), slow.step(g)
    np.testing.assert_array_equal(fast.params.flat, slow.params.flat)


def test_every_flatbuffer_allocation_is_64_byte_aligned():
    lay = Layout({"a": (3,), "b": (5, 7), "c": (0,)})
    for dtype in (np.float32, np.float64, at.backend.bfloat16(), np.float16):
        bufs = [FlatBuffer.zeros(lay, dtype)]
        bufs += [bufs[0].zeros_like(), bufs[0].copy()]
        bufs.append(FlatBuffer.from_arrays({"x": np.ones(3, dtype)}))
        for b in bufs:
            assert address(b.flat) % ALIGN_BYTES == 0, dtype
    e = at.Engine({"a": np.ones(3, np.float32), "b": np.ones((5, 7), np.float32)}, at.optim.Adam(),
                  working_dtype="bfloat16")
    flats = [e.params.flat, e.grads.flat, e.working.flat, *(s.flat for s in e.state.slots.values())]
    assert all(address(f) % ALIGN_BYTES == 0 for f in flats)
    # with the default 16-element segment alignment every float32 view starts on a 64-byte boundary
    assert all(address(v) % ALIGN_BYTES == 0 for v in e.params.as_dict().values())
    # a buffer handed in by hand is used as it is
    raw = np.zeros(e.layout.size + 1, np.float32)[1:]
    assert FlatBuffer(e.layout, raw).flat is raw


def test_bench_intake_runs(tmp_path, capsys):
    from arraytrain.bench.__main__ import main

    out = tmp_path / "intake.json"
    assert main(["intake", "--tensors", "3", "7", "--elements", "300", "--calls", "1", "--repeats", "1",
                 "--json", str(out)]) == 0
    import json

    rows = json.loads(out.read_text())
    assert [r["tensors"] for r in rows] == [3, 7]
    assert {"before", "after", "floor"} <= set(rows[0]["micro_batch_s"])
    assert "per tensor" in capsys.readouterr().out
