"""Layout (alignment, offsets, pieces) and FlatBuffer (views, copies, validated loads)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arraytrain import (
    DTypeError,
    FlatBuffer,
    Layout,
    LayoutError,
    ReadOnlyError,
    ShapeMismatchError,
    UnknownParameterError,
)
from arraytrain.layout import DEFAULT_ALIGN, REDUCE_CHUNK

C = REDUCE_CHUNK
# sizes that sit on either side of alignment and reduction-chunk boundaries
EDGE_SIZES = [0, 1, 15, 16, 17, C - 17, C - 16, C - 1, C, C + 1, C + 15, 2 * C - 1, 2 * C + 3]


def _coverage(layout: Layout) -> np.ndarray:
    """How many pieces cover each flat element."""
    cover = np.zeros(layout.size, dtype=np.int64)
    for start, stop, _ in layout.pieces:
        cover[start:stop] += 1
    return cover


def _param_mask(layout: Layout) -> np.ndarray:
    mask = np.zeros(layout.size, dtype=bool)
    for name in layout:
        mask[layout.slice(name)] = True
    return mask


def _check_pieces(layout: Layout) -> None:
    pieces = layout.pieces
    assert pieces.dtype == np.int64 and pieces.ndim == 2 and pieces.shape[1] == 3
    cover = _coverage(layout)
    mask = _param_mask(layout)
    # every parameter element exactly once, padding never
    assert (cover[mask] == 1).all()
    assert (cover[~mask] == 0).all()
    assert cover.sum() == layout.num_elements
    for start, stop, seg in pieces:
        assert start < stop, "empty piece"
        # a piece never crosses a reduction-chunk boundary ...
        assert start // C == (stop - 1) // C
        # ... and lies inside the segment it names
        lo = layout.offsets[seg]
        assert lo <= start and stop <= lo + layout.sizes[seg]
    # pieces come in flat order (the fixed summation order)
    assert (np.diff(pieces[:, 0]) > 0).all() if len(pieces) > 1 else True
    # zero-size parameters own no piece
    owners = set(pieces[:, 2].tolist())
    for i, size in enumerate(layout.sizes):
        assert (i in owners) == (size > 0)


# -- Layout ------------------------------------------------------------------------------


def test_offsets_are_aligned_and_sizes_rounded_up():
    lay = Layout({"a": (3,), "b": (0,), "c": (2, 2), "d": (), "e": (16,), "f": (17,)})
    assert lay.align == DEFAULT_ALIGN == 16
    assert lay.names == ("a", "b", "c", "d", "e", "f")
    assert lay.shapes == ((3,), (0,), (2, 2), (), (16,), (17,))
    assert lay.sizes == (3, 0, 4, 1, 16, 17)
    assert lay.offsets == (0, 16, 16, 32, 48, 64)
    assert lay.size == 96
    assert lay.num_elements == 41
    assert all(off % 16 == 0 for off in lay.offsets)


@pytest.mark.parametrize("align", [1, 4, 16, 64])
@pytest.mark.parametrize("sizes", [[5, 0, 7], [0, 0, 1], [16, 16], [0], [1, 2, 3, 4, 5]])
def test_offsets_for_any_alignment(align, sizes):
    lay = Layout({f"p{i}": (s,) for i, s in enumerate(sizes)}, align=align)
    expected, off = [], 0
    for s in sizes:
        expected.append(off)
        off += -(-s // align) * align
    assert lay.offsets == tuple(expected)
    assert lay.size == off
    assert lay.size % align == 0
    # segments never overlap
    ends = np.add(lay.offsets, lay.sizes)
    assert (np.asarray(lay.offsets[1:]) >= ends[:-1]).all()


@pytest.mark.parametrize("position", ["first", "middle", "last", "only", "all"])
def test_zero_size_params_anywhere(position):
    shapes = {
        "first": {"z": (0,), "a": (5,), "b": (3, 2)},
        "middle": {"a": (5,), "z": (4, 0), "b": (3, 2)},
        "last": {"a": (5,), "b": (3, 2), "z": (0, 7)},
        "only": {"z": (0,)},
        "all": {"z0": (0,), "z1": (0, 3), "z2": (2, 0, 2)},
    }[position]
    lay = Layout(shapes)
    _check_pieces(lay)
    for name in lay:
        sl = lay.slice(name)
        assert sl.stop - sl.start == int(np.prod(lay.shape(name)))
    buf = FlatBuffer.zeros(lay)
    for name in lay:
        assert buf[name].shape == lay.shape(name)


def test_mapping_protocol_and_accessors():
    lay = Layout({"w": [2, 3], "b": (3,)})
    assert len(lay) == 2 and list(lay) == ["w", "b"]
    assert "w" in lay and "x" not in lay and 3 not in lay
    assert lay.index("b") == 1
    assert lay.shape("w") == (2, 3)  # list shapes become tuples
    assert lay.slice("b") == slice(16, 19)
    with pytest.raises(KeyError):
        lay.index("x")
    with pytest.raises(KeyError):
        lay.slice("x")
    assert "w: (2, 3)" in repr(lay) and "size=32" in repr(lay)


def test_from_arrays_takes_shapes():
    arrs = {"a": np.zeros((2, 3)), "s": np.float64(1.0), "l": [1.0, 2.0], "z": np.zeros((0, 2))}
    lay = Layout.from_arrays(arrs, align=8)
    assert lay == Layout({"a": (2, 3), "s": (), "l": (2,), "z": (0, 2)}, align=8)


def test_equality_and_hash():
    a = Layout({"w": (2, 3), "b": (3,)})
    same = Layout({"w": [2, 3], "b": (3,)})
    assert a == same and hash(a) == hash(same)
    assert len({a, same}) == 1
    assert a != Layout({"b": (3,), "w": (2, 3)})  # order matters
    assert a != Layout({"w": (3, 2), "b": (3,)})  # shape matters (same size)
    assert a != Layout({"w": (2, 3), "c": (3,)})  # names matter
    assert a != Layout({"w": (2, 3), "b": (3,)}, align=8)  # alignment matters
    assert a != ("w", "b") and a != None  # noqa: E711


def test_layout_is_immutable():
    lay = Layout({"w": (2,)})
    for attr in ("names", "shapes", "offsets", "sizes", "align", "size"):
        with pytest.raises(AttributeError):
            setattr(lay, attr, None)
    assert isinstance(lay.names, tuple) and isinstance(lay.offsets, tuple)


@pytest.mark.parametrize(
    "shapes, align, match",
    [
        ({"a": (-1,)}, 16, "negative"),
        ({"a": (2, -3)}, 16, "negative"),
        ({"a": 5}, 16, "sequence of ints"),
        ({"a": None}, 16, "sequence of ints"),
        ({"": (1,)}, 16, "non-empty"),
        ({3: (1,)}, 16, "non-empty strings"),
        ({"a": (1,)}, 0, "align"),
        ({"a": (1,)}, -16, "align"),
        ({"a": (1,)}, 16.0, "align"),
    ],
    ids=["neg", "neg2", "int-shape", "none-shape", "empty-name", "int-name", "align0", "align-neg", "align-float"],
)
def test_layout_rejects(shapes, align, match):
    with pytest.raises(LayoutError, match=match):
        Layout(shapes, align=align)


@pytest.mark.parametrize("size", EDGE_SIZES)
@pytest.mark.parametrize("lead", [0, 1, 16, C - 16, C - 1])
def test_pieces_around_reduction_chunk(size, lead):
    lay = Layout({"lead": (lead,), "x": (size,), "tail": (3,)})
    _check_pieces(lay)


@pytest.mark.parametrize("align", [1, 16])
def test_pieces_split_exactly_at_chunk_boundaries(align):
    lay = Layout({"a": (10,), "b": (2 * C,)}, align=align)
    b0 = lay.offsets[1]
    rows = lay.pieces[lay.pieces[:, 2] == 1]
    starts = [b0] + [k * C for k in range(b0 // C + 1, (b0 + 2 * C - 1) // C + 1)]
    assert rows[:, 0].tolist() == starts
    assert rows[-1, 1] == b0 + 2 * C


def test_pieces_of_empty_layout():
    lay = Layout({})
    assert lay.size == 0 and lay.num_elements == 0
    assert lay.pieces.shape == (0, 3)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.sampled_from(EDGE_SIZES) | st.integers(0, 40), min_size=1, max_size=6),
    align=st.sampled_from([1, 3, 16, 128]),
)
def test_pieces_property(sizes, align):
    lay = Layout({f"p{i}": (s,) for i, s in enumerate(sizes)}, align=align)
    _check_pieces(lay)


# -- FlatBuffer ---------------------------------------------------------------------------


def _padding(buf: FlatBuffer) -> np.ndarray:
    return buf.flat[~_param_mask(buf.layout)]


@pytest.fixture
def arrays():
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((3, 5)).astype(np.float32),
        "z": np.zeros((0, 4), dtype=np.float32),
        "b": rng.standard_normal(5).astype(np.float32),
        "s": np.array(2.5, dtype=np.float32),
    }


def test_from_arrays_copies(arrays):
    buf = FlatBuffer.from_arrays(arrays)
    assert buf.names == ("w", "z", "b", "s")
    assert buf.layout == Layout.from_arrays(arrays)
    for name, a in arrays.items():
        np.testing.assert_array_equal(buf[name], a)
        assert not np.shares_memory(buf[name], a)
    before = {k: v.copy() for k, v in arrays.items()}
    arrays["w"][...] = 99
    np.testing.assert_array_equal(buf["w"], before["w"])
    buf["b"][...] = -1
    np.testing.assert_array_equal(arrays["b"], before["b"])
    assert (_padding(buf) == 0).all()


@pytest.mark.parametrize(
    "dtypes, expected",
    [
        ((np.float32, np.float32), np.float32),
        ((np.float16, np.float32), np.float32),
        ((np.float32, np.float64), np.float64),
        ((np.float16, np.float16), np.float16),
        ((np.float64,), np.float64),
    ],
)
def test_from_arrays_dtype_none_picks_common_float(dtypes, expected):
    arrs = {f"p{i}": np.ones(3, dtype=dt) for i, dt in enumerate(dtypes)}
    buf = FlatBuffer.from_arrays(arrs)
    assert buf.dtype == expected
    assert FlatBuffer.from_arrays(arrs, dtype=np.float64).dtype == np.float64


def test_from_arrays_rejects_bad_input():
    with pytest.raises(DTypeError, match="'i'"):
        FlatBuffer.from_arrays({"f": np.ones(2), "i": np.ones(2, dtype=np.int32)})
    with pytest.raises(DTypeError):
        FlatBuffer.from_arrays({"f": np.ones(2)}, dtype=np.int64)
    with pytest.raises(TypeError, match="mapping"):
        FlatBuffer.from_arrays([np.ones(2)])


def test_from_arrays_empty_mapping():
    buf = FlatBuffer.from_arrays({})
    assert len(buf) == 0 and buf.flat.shape == (0,) and buf.dtype == np.float32


def test_getitem_is_writable_view(arrays):
    buf = FlatBuffer.from_arrays(arrays)
    lay = buf.layout
    for name in buf:
        view = buf[name]
        assert view.shape == lay.shape(name)
        assert view.flags.writeable
        if view.size:
            assert np.shares_memory(view, buf.flat)
        view[...] = 7.0 + lay.index(name)
        np.testing.assert_array_equal(buf.flat[lay.slice(name)], 7.0 + lay.index(name))
    assert buf["w"] is buf["w"]  # a stable view, not a fresh copy
    assert (_padding(buf) == 0).all()
    # writes through the flat buffer show up in the views
    buf.flat[lay.slice("b")] = np.arange(5)
    np.testing.assert_array_equal(buf["b"], np.arange(5))


def test_getitem_unknown_name(arrays):
    buf = FlatBuffer.from_arrays(arrays)
    with pytest.raises(UnknownParameterError, match="'nope'") as info:
        buf["nope"]
    assert isinstance(info.value, KeyError)


def test_mapping_protocol(arrays):
    buf = FlatBuffer.from_arrays(arrays)
    assert len(buf) == 4 and list(buf) == ["w", "z", "b", "s"]
    assert "w" in buf and "x" not in buf
    assert dict(buf.items()).keys() == arrays.keys()
    assert "4 params" in repr(buf) and "float32" in repr(buf)


def test_buffers_are_read_only_mappings(arrays):
    """params, grads, every optimizer slot and a mask are Mappings: dict(), values(), get() work; the
    names are fixed (assignment and deletion refused, nothing changed); the views still write."""
    from collections.abc import Mapping

    from arraytrain import Engine, optim
    from arraytrain.prune import MaskBuffer

    engine = Engine(arrays, optim.AdamW())
    buffers = {"params": engine.params, "grads": engine.grads, "mask": MaskBuffer.ones(engine.layout),
               **{f"slot {k}": v for k, v in engine.state.slots.items()}}
    assert len(buffers) == 5
    for what, buf in buffers.items():
        assert isinstance(buf, Mapping), what
        d = dict(buf)
        assert list(d) == list(buf.keys()) == ["w", "z", "b", "s"], what
        assert all(v is buf[k] for k, v in d.items()), what  # views, not copies
        assert [v.shape for v in buf.values()] == [a.shape for a in arrays.values()], what
        assert buf.get("nope") is None and buf.get("w") is buf["w"], what
        assert dict(buf.items()).keys() == d.keys() and {**buf}.keys() == d.keys(), what
        before = buf.flat.copy()
        with pytest.raises(ReadOnlyError, match=r"'w'.*buf\['w'\]\[\.\.\.\] = x"):
            buf["w"] = np.zeros((3, 5))
        with pytest.raises(ReadOnlyError, match="'b'"):
            del buf["b"]
        assert list(buf) == ["w", "z", "b", "s"] and np.array_equal(buf.flat, before), what
    engine.params["w"][...] = 3.0  # writing through a view keeps working
    assert (engine.params.flat[engine.layout.slice("w")] == 3.0).all()
    # equality stays identity (Mapping's value equality would ask arrays for one truth value)
    assert engine.params == engine.params and engine.params != engine.params.copy()
    assert len({engine.params, engine.grads}) == 2


@pytest.mark.parametrize("copy", [False, True])
def test_as_dict(arrays, copy):
    buf = FlatBuffer.from_arrays(arrays)
    d = buf.as_dict(copy=copy)
    assert list(d) == list(buf.names)
    for name, arr in d.items():
        np.testing.assert_array_equal(arr, arrays[name])
        if arr.size:
            assert np.shares_memory(arr, buf.flat) is (not copy)
    d["w"][...] = 123.0
    assert bool((buf["w"] == 123.0).all()) is (not copy)


@pytest.mark.parametrize("dtype", [None, np.float64, np.float16])
def test_zeros_like(arrays, dtype):
    buf = FlatBuffer.from_arrays(arrays)
    z = buf.zeros_like(dtype)
    assert z.layout == buf.layout
    assert z.dtype == (buf.dtype if dtype is None else dtype)
    assert z.flat.shape == buf.flat.shape and not z.flat.any()
    assert not np.shares_memory(z.flat, buf.flat)


def test_copy_is_independent(arrays):
    buf = FlatBuffer.from_arrays(arrays)
    c = buf.copy()
    assert c.layout == buf.layout
    np.testing.assert_array_equal(c.flat, buf.flat)
    c["w"][...] = 0
    np.testing.assert_array_equal(buf["w"], arrays["w"])


def test_load_strict_and_casting(arrays):
    buf = FlatBuffer.zeros(Layout.from_arrays(arrays), np.float32)
    src = {k: v.astype(np.float64) * 2 for k, v in arrays.items()}
    buf.load(src)
    for k in arrays:
        np.testing.assert_array_equal(buf[k], (arrays[k].astype(np.float64) * 2).astype(np.float32))
    assert (_padding(buf) == 0).all()


def test_load_non_strict_partial(arrays):
    buf = FlatBuffer.from_arrays(arrays)
    buf.load({"b": np.full(5, 3.0)}, strict=False)
    np.testing.assert_array_equal(buf["b"], 3.0)
    np.testing.assert_array_equal(buf["w"], arrays["w"])


def test_check_does_not_write(arrays):
    buf = FlatBuffer.from_arrays(arrays)
    before = buf.flat.copy()
    checked = buf.check({k: v + 1 for k, v in arrays.items()})
    assert set(checked) == set(arrays)
    np.testing.assert_array_equal(buf.flat, before)
    buf.assign(checked)
    np.testing.assert_array_equal(buf["b"], arrays["b"] + 1)


@pytest.mark.parametrize(
    "bad, strict, exc, match",
    [
        ({"b": np.ones(4)}, False, ShapeMismatchError, "'b'"),
        ({"w": np.ones((5, 3))}, False, ShapeMismatchError, "'w'"),
        ({"nope": np.ones(5)}, False, UnknownParameterError, "'nope'"),
        ({"b": np.ones(5, dtype=np.int64)}, False, DTypeError, "'b'"),
        ({"b": np.ones(5, dtype=bool)}, False, DTypeError, "'b'"),
        ({"b": np.ones(5, dtype=np.complex64)}, False, DTypeError, "'b'"),
        ({"b": object()}, False, Exception, "'b'"),
        ({"b": np.ones(5)}, True, LayoutError, "missing"),
        ([np.ones(5)], False, TypeError, "mapping"),
    ],
    ids=["shape-1d", "shape-2d", "unknown", "int", "bool", "complex", "object", "strict-missing", "not-mapping"],
)
def test_load_validates_everything_before_writing(arrays, bad, strict, exc, match):
    buf = FlatBuffer.from_arrays(arrays)
    before = buf.flat.copy()
    # good arrays come first, so a write-as-you-go loader would have changed them
    payload = {"w": np.full((3, 5), 42.0), "s": np.array(9.0)}
    if isinstance(bad, dict):
        payload.update(bad)
    else:
        payload = bad
    with pytest.raises(exc, match=match):
        buf.load(payload, strict=strict)
    with pytest.raises(exc, match=match):
        buf.check(payload, strict=strict)
    np.testing.assert_array_equal(buf.flat, before)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda lay: np.zeros(lay.size + 1, np.float32), LayoutError, "expected a 1-D array"),
        (lambda lay: np.zeros((1, lay.size), np.float32), LayoutError, "expected a 1-D array"),
        (lambda lay: np.zeros(2 * lay.size, np.float32)[::2], LayoutError, "contiguous"),
        (lambda lay: np.zeros(lay.size, np.int32), DTypeError, "flat"),
        (lambda lay: [0.0] * lay.size, Exception, "list"),
    ],
    ids=["long", "2d", "strided", "int", "list"],
)
def test_constructor_rejects_bad_flat(make, exc, match):
    lay = Layout({"a": (3,), "b": (2, 2)})
    with pytest.raises(exc, match=match):
        FlatBuffer(lay, make(lay))


def test_constructor_rejects_read_only_flat():
    lay = Layout({"a": (3,)})
    flat = np.zeros(lay.size, np.float32)
    flat.flags.writeable = False
    with pytest.raises(ReadOnlyError, match="writable"):
        FlatBuffer(lay, flat)


def test_constructor_uses_given_array_in_place():
    lay = Layout({"a": (3,), "b": (2,)})
    flat = np.zeros(lay.size, np.float64)
    buf = FlatBuffer(lay, flat)
    assert buf.flat is flat
    buf["b"][...] = 5
    assert flat[16:18].tolist() == [5.0, 5.0]
    with pytest.raises(TypeError, match="Layout"):
        FlatBuffer({"a": (3,)}, flat)


@pytest.mark.parametrize("size", [C - 1, C, C + 1])
def test_padding_stays_zero_around_chunk(size):
    rng = np.random.default_rng(size)
    arrs = {"a": rng.standard_normal(size), "b": rng.standard_normal(7), "c": np.zeros(0)}
    buf = FlatBuffer.from_arrays(arrs)
    assert buf.dtype == np.float64
    for name in buf:
        buf[name][...] = rng.standard_normal(buf[name].shape)
    buf.load({k: v * 3 for k, v in arrs.items()})
    assert (_padding(buf) == 0).all()
    np.testing.assert_array_equal(buf["a"], arrs["a"] * 3)
