"""Gradient intake: arrays from any framework, read without importing it; device mix-ups refused."""

from __future__ import annotations

import numpy as np
import pytest

from arraytrain import (
    BackendError,
    BackendUnavailableError,
    DTypeError,
    Engine,
    FlatBuffer,
    GradientAccumulator,
)
from arraytrain.backend import as_array
from conftest import engine_snapshot

from arraytrain.optim import SGD

SHAPE = (3, 4)
G = np.arange(12, dtype=np.float64).reshape(SHAPE) / 4 - 1


class ArrayInterface:
    """Exposes only ``__array_interface__`` (keeps its array alive)."""

    def __init__(self, arr):
        self._arr = arr

    @property
    def __array_interface__(self):
        return self._arr.__array_interface__


class CpuDLPack:
    """Exposes only the DLPack protocol, for a CPU array."""

    def __init__(self, arr):
        self._arr = arr

    def __dlpack__(self, **kwargs):
        return self._arr.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


class CudaDLPack:
    """Claims to live on CUDA device 0; must never be read on the host."""

    def __init__(self):
        self.exported = False

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, **kwargs):
        self.exported = True
        raise AssertionError("a CUDA object must not be exported to a CPU engine")


def _torch(g):
    torch = pytest.importorskip("torch")
    return torch.from_numpy(g.copy())


def _jax(g):
    jax = pytest.importorskip("jax")
    return jax.device_put(g, jax.devices("cpu")[0])  # JAX's default device is a GPU where there is one


SOURCES = {
    "numpy": lambda g: g.copy(),
    "numpy-float32": lambda g: g.astype(np.float32),
    "memoryview": lambda g: memoryview(g.copy()),
    "array_interface": lambda g: ArrayInterface(g.copy()),
    "dlpack-cpu": lambda g: CpuDLPack(g.copy()),
    "torch": _torch,
    "jax": _jax,
}


def _accumulating_engine(**kw):
    # accumulation_steps=2 keeps the first micro-batch visible in engine.grads
    return Engine({"w": np.zeros(SHAPE), "b": np.zeros(4)}, SGD(lr=0.1), accumulation_steps=2, **kw)


@pytest.mark.parametrize("source", list(SOURCES))
def test_engine_accepts(source):
    grad = SOURCES[source](G)
    engine = _accumulating_engine()
    report = engine.step({"w": grad, "b": np.ones(4)})
    assert report.accumulated and engine.micro_batches == 1
    expected = G.astype(np.float32).astype(np.float64) if source == "numpy-float32" else G
    np.testing.assert_array_equal(engine.grads["w"], expected)
    np.testing.assert_array_equal(engine.grads["b"], 1.0)
    report = engine.step({"w": SOURCES[source](G), "b": np.ones(4)})
    assert report.applied
    np.testing.assert_allclose(engine.params["w"], -0.1 * expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("source", list(SOURCES))
def test_as_array_reads_without_copying_numpy_like(source):
    grad = SOURCES[source](G)
    arr = as_array(grad, "w")
    assert isinstance(arr, np.ndarray)
    assert arr.shape == SHAPE and arr.dtype.kind == "f"
    np.testing.assert_array_equal(arr, G.astype(arr.dtype))


@pytest.mark.parametrize("source", ["numpy", "memoryview", "array_interface", "dlpack-cpu", "torch", "jax"])
def test_flatbuffer_from_arrays_accepts(source):
    grad = SOURCES[source](G)
    buf = FlatBuffer.from_arrays({"w": grad})
    # the source's own dtype is kept (JAX computes in float32 unless x64 is enabled)
    expected = as_array(grad, "w").dtype
    assert buf.dtype == expected
    np.testing.assert_array_equal(buf["w"], G.astype(expected))


@pytest.mark.parametrize("source", ["numpy", "memoryview", "dlpack-cpu", "torch"])
def test_accumulator_accepts(source):
    acc = GradientAccumulator()
    acc.register("w", SHAPE)
    acc.accumulate("w", SOURCES[source](G))
    acc.step({"w": SOURCES[source](3 * G)})
    np.testing.assert_array_equal(acc.get_gradients()["w"], 2 * G)


def _noncontig_numpy():
    big = np.zeros((SHAPE[0] * 2, SHAPE[1] * 3))
    view = big[::2, 1::3]
    view[...] = G
    return view


def _noncontig_transposed():
    return np.ascontiguousarray(G.T).T


def _noncontig_torch():
    torch = pytest.importorskip("torch")
    return torch.from_numpy(np.ascontiguousarray(G.T)).t()


@pytest.mark.parametrize("make", [_noncontig_numpy, _noncontig_transposed, _noncontig_torch],
                         ids=["strided", "fortran", "torch-transposed"])
def test_non_contiguous_accepted_and_copied(make):
    grad = make()
    view = as_array(grad, "w")
    assert not view.flags.c_contiguous
    before = view.copy()
    engine = _accumulating_engine()
    engine.step({"w": grad, "b": np.zeros(4)})
    np.testing.assert_array_equal(engine.grads["w"], G)
    # the source was read, never written, and the engine keeps no reference to it
    np.testing.assert_array_equal(view, before)
    assert not np.shares_memory(engine.grads.flat, view)
    view[...] = 1e6
    np.testing.assert_array_equal(engine.grads["w"], G)


def test_non_contiguous_into_flatbuffer():
    buf = FlatBuffer.from_arrays({"w": _noncontig_numpy()})
    np.testing.assert_array_equal(buf["w"], G)
    buf.load({"w": _noncontig_transposed() * 2})
    np.testing.assert_array_equal(buf["w"], 2 * G)


def test_cuda_dlpack_refused_and_nothing_changes():
    engine = _accumulating_engine()
    engine.step({"w": G, "b": np.ones(4)})
    snap = engine_snapshot(engine)
    fake = CudaDLPack()
    with pytest.raises((BackendError, BackendUnavailableError), match="'w'"):
        engine.step({"b": np.ones(4), "w": fake})
    assert not fake.exported
    assert engine_snapshot(engine) == snap


def test_cuda_dlpack_without_cupy_is_backend_unavailable(monkeypatch):
    from arraytrain.kernels.cuda import core

    monkeypatch.delenv("ARRAYTRAIN_CUDA", raising=False)  # not the CPU executor standing for CuPy
    monkeypatch.setattr(core, "_cupy", None)
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailableError, match="CuPy") as info:
            as_array(CudaDLPack(), "w")
        assert isinstance(info.value, ImportError)
    else:  # pragma: no cover - only on a CUDA machine
        pytest.skip("CuPy is installed")


def test_cuda_dlpack_refused_by_flatbuffer_and_accumulator():
    with pytest.raises((BackendError, BackendUnavailableError), match="'w'"):
        FlatBuffer.from_arrays({"b": np.ones(2), "w": CudaDLPack()})
    acc = GradientAccumulator()
    acc.register("w", SHAPE)
    with pytest.raises((BackendError, BackendUnavailableError), match="'w'"):
        acc.step({"w": CudaDLPack()})
    assert acc.stats().total_micro_batches == 0


class BrokenDevice(CudaDLPack):
    def __dlpack_device__(self):
        raise RuntimeError("boom")


class OddDevice(CudaDLPack):
    def __dlpack_device__(self):
        return (99, 0)


@pytest.mark.parametrize("obj, match", [(BrokenDevice(), "boom"), (OddDevice(), "device type 99"),
                                        (object(), "'w'"), ({"a": 1}, "'w'")],
                         ids=["broken-device", "odd-device", "object", "dict"])
def test_unreadable_objects_are_backend_errors(obj, match):
    engine = _accumulating_engine()
    snap = engine_snapshot(engine)
    with pytest.raises(BackendError, match=match):
        engine.step({"w": obj, "b": np.ones(4)})
    assert engine_snapshot(engine) == snap


def test_torch_tensor_requiring_grad_refused():
    torch = pytest.importorskip("torch")
    engine = _accumulating_engine()
    engine.step({"w": G, "b": np.ones(4)})
    snap = engine_snapshot(engine)
    t = torch.ones(4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(BackendError, match="'b'") as info:
        engine.step({"w": G, "b": t})
    assert "detach" in str(info.value)
    assert engine_snapshot(engine) == snap
    # detached, it is accepted
    engine.step({"w": G, "b": t.detach()})
    assert engine.state.step == 1


@pytest.mark.parametrize("dtype", ["int32", "int64", "uint8", "bool", "complex64", "complex128"])
def test_torch_non_float_tensor_refused(dtype):
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, dtype=getattr(torch, dtype))
    engine = _accumulating_engine()
    snap = engine_snapshot(engine)
    with pytest.raises((DTypeError, BackendError), match="'b'"):
        engine.step({"w": G, "b": t})
    assert engine_snapshot(engine) == snap


def test_torch_zero_copy_reads_live_memory():
    torch = pytest.importorskip("torch")
    t = torch.zeros(SHAPE, dtype=torch.float64)
    arr = as_array(t, "w")
    t.add_(5)
    assert (arr == 5).all()  # a view of the tensor's memory, not a copy


# -- float16 gradients: accepted and cast during validation (numba cannot read float16) ----------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float16_gradient_accepted(dtype):
    engine = Engine({"x": np.zeros(3, dtype)}, SGD(lr=1.0), accumulation_steps=2)
    engine.step({"x": np.array([0.5, -1.0, 2.0], np.float16)})
    np.testing.assert_array_equal(engine.grads["x"], [0.5, -1.0, 2.0])


def test_float16_buffer_refused_with_dtype_error():
    with pytest.raises(DTypeError, match="float16"):
        Engine({"x": np.zeros(3, np.float16)}, SGD(lr=1.0))


def test_float16_gradient_among_others_is_cast_with_them():
    engine = Engine({"a": np.zeros(3, np.float32), "b": np.zeros(3, np.float32)}, SGD(lr=1.0),
                    accumulation_steps=3)
    engine.step({"a": np.ones(3), "b": np.ones(3)})
    engine.step({"a": np.ones(3), "b": np.ones(3, np.float16)})
    np.testing.assert_array_equal(engine.grads["a"], 2.0)
    np.testing.assert_array_equal(engine.grads["b"], 2.0)
    assert engine.micro_batches == 2
