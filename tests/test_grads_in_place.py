"""Gradients read where they lie (``grad_ptrs``, :class:`arraytrain.buffer.GradsAt`): the kernels, the
engine's dict path and the torch drop-ins read each gradient in its own array instead of copying it into
the flat buffer first; the result is bitwise the copy path's, for every optimizer that reads in place,
both CPU families, float32 and float64, bfloat16 and 8-bit state, parameters over several pieces."""

import numpy as np
import pytest

import arraytrain as at
from arraytrain.buffer import GradsAt
from arraytrain.errors import ArgumentTypeError, BackendUnavailableError, HyperparameterError
from arraytrain.kernels import cpu, reference
from arraytrain.layout import REDUCE_CHUNK

# small (staged), large (read in its own array) and multi-piece parameters; sizes 0, 1, 7 and odd ones
SHAPES = {"emb": (3 * REDUCE_CHUNK // 64 + 5, 64), "w": (70, 90), "b": (90,), "empty": (0,), "one": (1,),
          "head": (12, 7), "seven": (7,), "odd": (4099,)}


def make(name, state_dtype=None):
    kw = {} if state_dtype is None else {"state_dtype": state_dtype}
    return {
        "AdamW": lambda: at.optim.AdamW(1e-2, weight_decay=0.1, **kw),
        "Adam": lambda: at.optim.Adam(1e-2, weight_decay=0.01, amsgrad=True, **kw),
        "SGD": lambda: at.optim.SGD(1e-2, momentum=0.9, nesterov=True, **kw),
        "Adagrad": lambda: at.optim.Adagrad(1e-2, **kw),
        "RMSprop": lambda: at.optim.RMSprop(1e-2, momentum=0.5, centered=True, **kw),
        "Lion": lambda: at.optim.Lion(1e-3, **kw),
        "LAMB": lambda: at.optim.LAMB(1e-2, **kw),
        "NAdam": lambda: at.optim.NAdam(1e-2, **kw),
        "RAdam": lambda: at.optim.RAdam(1e-2, **kw),
        "Adamax": lambda: at.optim.Adamax(1e-2, **kw),
        "Adadelta": lambda: at.optim.Adadelta(1.0, **kw),
    }[name]


def params(dtype=np.float32):
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}


def grads(t, dtype=np.float32):
    rng = np.random.default_rng(10 + t)
    return {n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}


def pair(optimizer, dtype=np.float32, **kw):
    """An engine that reads in place and one that copies (the path it had), same settings."""
    a = at.Engine(params(dtype), optimizer(), **kw)
    b = at.Engine(params(dtype), optimizer(), **kw)
    b.intake.in_place = False
    assert a.reads_in_place
    return a, b


def run_pair(a, b, steps=4, dtype=np.float32):
    seen = []
    real = a.read_in_place
    a.read_in_place = lambda bases: (seen.append(True), real(bases))[1]
    for t in range(steps):
        g = grads(t, dtype)
        ra, rb = a.step(g), b.step(g)
        assert ra.grad_norm == rb.grad_norm or (np.isnan(ra.grad_norm) and np.isnan(rb.grad_norm))
    assert len(seen) == steps  # every micro-batch, a structure's first too (validated by the general path)
    for n in SHAPES:
        assert np.array_equal(a.params[n], b.params[n]), n
    for k, slot in a.state.slots.items():
        assert np.array_equal(slot.flat if hasattr(slot, "flat") else slot, b.state.slots[k].flat), k
    assert not a.grads.flat.any()  # nothing was copied into the buffer


@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD", "Adagrad", "RMSprop", "Lion", "LAMB", "NAdam", "RAdam",
                                  "Adamax", "Adadelta"])
@pytest.mark.parametrize("kernels", ["numba", "reference"])
def test_dict_path_reads_in_place_bitwise_as_the_copy(name, kernels):
    run_pair(*pair(make(name), kernels=kernels, max_grad_norm=1.0))


@pytest.mark.parametrize("state_dtype", ["bfloat16", "8bit"])
def test_low_precision_state_reads_in_place_bitwise(state_dtype):
    run_pair(*pair(make("AdamW", state_dtype), max_grad_norm=1.0))


def test_float64_with_missing_skip_and_a_schedule():
    a, b = pair(make("AdamW"), np.float64, missing="zero", schedule=at.schedules.CosineAnnealingLR(10))
    run_pair(a, b, dtype=np.float64)


def test_float64_norm_overflow_is_resolved_in_place():
    a, b = pair(make("SGD"), np.float64, max_grad_norm=1.0)
    for t in range(3):
        g = grads(t, np.float64)
        g["w"] *= 1e160  # the sum of squares overflows: the overflow-safe passes read in place too
        ra, rb = a.step(g), b.step(g)
        assert np.isfinite(ra.grad_norm) and ra.grad_norm == rb.grad_norm
    assert all(np.array_equal(a.params[n], b.params[n]) for n in SHAPES)
    g = grads(9, np.float64)
    g["w"] *= 1e160
    g["emb"][5, 5] = np.nan
    before = a.params.flat.copy()
    assert a.step(g).skipped and np.array_equal(a.params.flat, before)


def test_a_weight_or_a_noncontiguous_gradient_takes_the_copy():
    a, b = pair(make("AdamW"))
    run_pair(a, b, steps=2)
    g = grads(5)
    a.step(g, weight=2.0), b.step(g, weight=2.0)
    g = {n: (np.asfortranarray(v) if v.ndim == 2 else v) for n, v in grads(6).items()}
    a.step(g), b.step(g)
    assert all(np.array_equal(a.params[n], b.params[n]) for n in SHAPES)


def test_engines_that_need_the_buffer_do_not_read_in_place():
    p = params()
    assert not at.Engine(p, make("AdamW")(), accumulation_steps=2).reads_in_place
    assert not at.Engine(p, at.optim.Adafactor()).reads_in_place
    assert not at.Engine(p, make("AdamW")(), zero_grad_on_step=False).reads_in_place
    e = at.Engine(p, make("AdamW")(), accumulation_steps=2)
    assert e.grad_addresses is None
    with pytest.raises(ArgumentTypeError, match="read_in_place"):
        e.read_in_place(np.zeros(len(SHAPES), np.int64))
    e, same = at.Engine(p, make("AdamW")()), at.Engine(p, make("AdamW")())
    for bad in (list(e.grad_addresses), e.grad_addresses[:-1], e.grad_addresses.astype(np.int32)):
        with pytest.raises(ArgumentTypeError, match="bases"):
            e.read_in_place(bad)
    e.step(), same.step()  # nothing was taken: both steps read engine.grads (zero)
    assert e.reads_in_place and not e.grad_addresses.flags.writeable
    assert np.array_equal(e.params.flat, same.params.flat)


@pytest.mark.parametrize("family", [cpu, reference], ids=["cpu", "reference"])
def test_norm_kernels_read_in_place(family):
    layout = at.Layout(SHAPES)
    g = grads(0, np.float64)
    flat = np.zeros(layout.size)
    for n in SHAPES:
        flat[layout.slice(n)] = g[n].ravel()
    bases = np.array([g[n].ctypes.data for n in SHAPES], np.int64)
    buf = at.FlatBuffer(layout, np.zeros_like(flat))
    ptrs = GradsAt(buf, bases, GradsAt.offsets_of(buf)).ptrs(layout.pieces)
    # the layout's own pieces (two array operations) and any other table of them (the general form)
    assert np.array_equal(ptrs, GradsAt(buf, bases, GradsAt.offsets_of(buf)).ptrs(layout.pieces.copy()))
    zeros = np.zeros_like(flat)  # the buffer itself is never read
    assert family.sumsq(zeros, layout.pieces, nseg=len(layout), grad_ptrs=ptrs)[0] == \
        family.sumsq(flat, layout.pieces, nseg=len(layout))[0]
    assert family.max_abs(zeros, layout.pieces, grad_ptrs=ptrs) == family.max_abs(flat, layout.pieces)
    assert np.array_equal(family.sumsq_scaled(zeros, layout.pieces, nseg=len(layout), inv=0.5, grad_ptrs=ptrs)[1],
                          family.sumsq_scaled(flat, layout.pieces, nseg=len(layout), inv=0.5)[1])


def test_nonfinite_apply_takes_the_step_as_torch():
    a = at.Engine(params(), make("AdamW")(), nonfinite="apply")
    g = grads(0)
    g["w"][1, 2] = np.nan
    report = a.step(g)
    assert report.applied and np.isnan(report.grad_norm)  # no norm pass: nothing needed one
    assert np.isnan(a.params["w"]).sum() == 1 and not np.isnan(a.params["emb"]).any()
    clipped = at.Engine(params(), make("AdamW")(), nonfinite="apply", max_grad_norm=1.0)
    assert clipped.step(g).applied and np.isnan(clipped.params["w"]).any()
    with pytest.raises(HyperparameterError, match="nonfinite"):
        at.Engine(params(), make("AdamW")(), nonfinite="ignore")
    with pytest.raises(HyperparameterError, match="loss scaler"):
        at.Engine(params(), make("AdamW")(), nonfinite="apply", loss_scaler=at.LossScaler())


def test_cuda_kernels_refuse_grad_ptrs():
    from arraytrain.kernels.cuda.core import refuse_grad_ptrs

    refuse_grad_ptrs(None)
    with pytest.raises(BackendUnavailableError, match="grad_ptrs"):
        refuse_grad_ptrs(np.zeros(1, np.int64))


def test_views_small_and_large_absent_names_and_a_strided_small_gradient():
    """Every gradient of the dict path is read in the caller's array, small ones too (views into one
    larger array, which own no memory); a parameter left out reads the buffer (``missing="zero"``);
    one C-contiguous failure anywhere, a small gradient's too, takes the copy, with the same bits."""
    a, b = pair(make("AdamW"), missing="zero", max_grad_norm=1.0)
    seen = []
    real = a.read_in_place
    a.read_in_place = lambda bases: (seen.append(bases.copy()), real(bases))[1]
    for t in range(5):
        g = grads(t)
        whole = np.concatenate([v.ravel() for v in g.values()])
        views, pos = {}, 0
        for n, v in g.items():  # each gradient a view into ``whole``
            views[n] = whole[pos:pos + v.size].reshape(v.shape)
            pos += v.size
        if t >= 2:  # another structure: its first micro-batch builds a plan and reads in place
            del views["seven"], views["one"]
        if t == 4:
            views["head"] = np.asfortranarray(views["head"])
        ra, rb = a.step(views), b.step(dict(views))
        assert ra.grad_norm == rb.grad_norm
    assert len(seen) == 4  # steps 0-3 (0 and 2 build plans), not 4 (a strided gradient)
    at_step3 = dict(zip(a.layout.names, seen[3]))
    buffer = dict(zip(a.layout.names, a.grad_addresses))
    assert at_step3["seven"] == buffer["seven"] and at_step3["one"] == buffer["one"]  # absent: the zeroed buffer
    assert all(at_step3[n] != buffer[n] for n in SHAPES if n not in ("seven", "one", "empty"))
    for n in SHAPES:
        assert np.array_equal(a.params[n], b.params[n]), n
    assert not a.grads.flat.any()


def test_addresses_in_one_call_as_the_arrays_say(monkeypatch):
    """The compiled address reader (each array object's data pointer) against ``__array_interface__``,
    on plain arrays, offset and strided views and an empty one; and the per-array reads it falls back on."""
    from arraytrain import _addresses

    x = np.arange(40, dtype=np.float32).reshape(5, 8)
    arrays = [x, x[1:], x[2, 3:], x.T, np.empty(0), np.ones(3, np.float64)]
    want = [v.__array_interface__["data"][0] for v in arrays]
    where = np.array([6, 0, 3, 2, 5, 7], np.int64)
    for reader in ("compiled", "per array"):
        if reader == "per array":
            monkeypatch.setattr(_addresses, "_reader", False)
        else:
            assert _addresses._read()  # the layout was confirmed on this interpreter and NumPy
        out = np.zeros(8, np.int64)
        _addresses.data_addresses(arrays, where, out)
        assert list(out[where]) == want and out[1] == out[4] == 0, reader
