"""arraytrain.interop.jax: pytree names, zero-copy parameter views, one-call gradient intake, optax trajectories."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
optax = pytest.importorskip("optax")

import arraytrain as at  # noqa: E402
from arraytrain.buffer import address  # noqa: E402
from arraytrain.errors import (  # noqa: E402
    AliasingError,
    ArgumentTypeError,
    DTypeError,
    LayoutError,
    ShapeMismatchError,
    UnknownParameterError,
)
from arraytrain.interop import jax as atj  # noqa: E402
from conftest import engine_snapshot  # noqa: E402
from cuda_family import require_cuda  # noqa: E402

LR, WD, MAX_NORM, STEPS = 3e-3, 1e-2, 1.0, 50


@pytest.fixture(autouse=True)
def on_the_cpu(request):
    """Every test but the GPU one builds its arrays on JAX's CPU device (on a machine with a GPU,
    JAX's default device is the GPU, and the binding would then rightly build a CUDA engine)."""
    if "gpu" in request.function.__name__:
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def nested(seed=0):
    """Nested dicts, lists and tuples, a scalar and a zero-size leaf."""
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.standard_normal(s).astype(np.float32))  # noqa: E731
    return {"enc": [{"w": f(5, 3), "b": f(3)}, {"w": f(3, 3), "b": f(3)}],
            "head": (f(3, 2), f(2)), "scale": f(), "empty": jnp.zeros((0, 4), jnp.float32)}


def mlp_params(seed=0, sizes=(6, 16, 3)):
    r = np.random.default_rng(seed)
    return [{"w": jnp.asarray((r.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)),
             "b": jnp.zeros(b, jnp.float32)} for a, b in zip(sizes[:-1], sizes[1:])]


def mlp_loss(params, x, y):
    h = x
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            h = jnp.tanh(h)
    logp = jax.nn.log_softmax(h)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def data(seed=0):
    r = np.random.default_rng(seed)
    return jnp.asarray(r.standard_normal((64, 6)).astype(np.float32)), jnp.asarray(r.integers(0, 3, 64))


def test_flatten_names_by_key_path_and_unflatten_inverts_it():
    tree = nested()
    flat = atj.flatten(tree)
    assert list(flat) == ["empty", "enc.0.b", "enc.0.w", "enc.1.b", "enc.1.w", "head.0", "head.1", "scale"]
    back = atj.unflatten(tree, flat)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
    assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(tree)))
    back = atj.unflatten(jax.tree_util.tree_structure(tree), flat)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
    with pytest.raises(UnknownParameterError):
        atj.unflatten(tree, {**flat, "nope": flat["scale"]})
    with pytest.raises(LayoutError):
        atj.unflatten(tree, {k: v for k, v in flat.items() if k != "scale"})
    with pytest.raises(ArgumentTypeError):
        atj.unflatten(tree, list(flat.values()))
    with pytest.raises(LayoutError, match="same name"):
        atj.flatten({"a.b": jnp.ones(1), "a": {"b": jnp.ones(1)}})


def test_parameter_view_shares_memory_with_the_engine():
    engine = atj.bind(nested(), at.optim.AdamW(lr=LR))
    tree = engine.tree()
    names = engine.layout.names
    for name, leaf in zip(names, jax.tree_util.tree_leaves(tree)):
        view = engine.params[name]
        if view.size:
            assert leaf.unsafe_buffer_pointer() == address(view), name  # XLA aliased it: no copy
        np.testing.assert_array_equal(np.asarray(leaf), view)
    flat = engine.flat()
    assert flat.unsafe_buffer_pointer() == address(engine.params.flat)


def _optax_run(params, x, y, steps):
    opt = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adamw(LR, weight_decay=WD))
    state = opt.init(params)
    vg = jax.jit(jax.value_and_grad(mlp_loss))
    losses = []
    for _ in range(steps):
        loss, g = vg(params, x, y)
        updates, state = opt.update(g, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return params, losses


@pytest.mark.parametrize("route", ["pytree", pytest.param("flat", marks=pytest.mark.slow),
                                   pytest.param("dict", marks=pytest.mark.slow)])
def test_trajectory_follows_optax(route):
    x, y = data()
    engine = atj.bind(mlp_params(), at.optim.AdamW(lr=LR, weight_decay=WD), max_grad_norm=MAX_NORM)
    vg = jax.jit(jax.value_and_grad(mlp_loss))
    vg_flat = jax.jit(jax.value_and_grad(lambda flat, x, y: mlp_loss(engine.unpack(flat), x, y)))
    losses = []
    for _ in range(STEPS):
        if route == "flat":
            loss, g = vg_flat(engine.flat(), x, y)
            jax.block_until_ready(g)  # computed from the buffer the step is about to update
            report = engine.step_flat(g)
        else:
            loss, g = vg(engine.tree(), x, y)
            jax.block_until_ready(g)
            report = engine.step(atj.flatten(g) if route == "dict" else g)
        assert report.applied
        losses.append(float(loss))
    want, want_losses = _optax_run(mlp_params(), x, y, STEPS)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    for name, leaf in atj.flatten(want).items():
        np.testing.assert_allclose(engine.params[name], np.asarray(leaf), rtol=1e-4, atol=1e-5, err_msg=name)
    assert losses[-1] < losses[0]


def test_nested_pytree_gradients_equal_the_dict_path_bitwise():
    tree = nested()
    a = atj.bind(tree, at.optim.AdamW(lr=LR), accumulation_steps=2)
    b = atj.bind(tree, at.optim.AdamW(lr=LR), accumulation_steps=2)
    for seed in range(6):
        g = nested(seed + 10)
        a.step(g, weight=1.0 + seed)
        b.step({k: np.asarray(v) for k, v in atj.flatten(g).items()}, weight=1.0 + seed)
        np.testing.assert_array_equal(a.grads.flat, b.grads.flat)
        np.testing.assert_array_equal(a.params.flat, b.params.flat)


def test_bad_gradients_are_refused_and_change_nothing():
    tree = nested()
    engine = atj.bind(tree, at.optim.AdamW(lr=LR), accumulation_steps=3)
    engine.step(nested(1))
    good = nested(2)
    bad_shape = dict(good, scale=jnp.ones((1,)))
    transposed = dict(good, enc=[{"w": good["enc"][0]["w"].T, "b": good["enc"][0]["b"]}, good["enc"][1]])
    integer = dict(good, scale=jnp.asarray(1, jnp.int32))
    other_structure = {"enc": good["enc"]}
    cases = [("wrong shape", bad_shape, ShapeMismatchError), ("transposed", transposed, ShapeMismatchError),
             ("integer", integer, DTypeError), ("another structure", other_structure, Exception),
             ("not a pytree of arrays", [1, 2], ArgumentTypeError),
             ("flat gradient of another size", None, ShapeMismatchError),
             ("a flat gradient aliasing the buffer", "alias", AliasingError)]
    for what, g, error in cases:
        snap = engine_snapshot(engine)
        with pytest.raises(error) as info:
            if g is None:
                engine.step_flat(jnp.zeros(engine.layout.size + 1))
            elif g == "alias":
                engine.step_flat(engine.params.flat)
            else:
                engine.step(g)
        assert isinstance(info.value, at.ArrayTrainError), what
        assert snap == engine_snapshot(engine), what
    print(f"{len(cases)} refused gradients, each changed nothing")


def test_flat_gradient_padding_is_ignored():
    engine = atj.bind(nested(), at.optim.SGD(lr=0.1))
    g = np.ones(engine.layout.size, np.float32)  # padding too: not a gradient of anything
    engine.step_flat(g)
    live = np.zeros(engine.layout.size, bool)
    for name in engine.layout.names:
        live[engine.layout.slice(name)] = True
    assert not engine.params.flat[~live].any()


def test_gpu_arrays_go_through_dlpack_without_copies():
    require_cuda()
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")
    import cupy

    params = jax.device_put(mlp_params(), gpu)
    engine = atj.bind(params, at.optim.AdamW(lr=LR, weight_decay=WD), max_grad_norm=MAX_NORM)
    assert isinstance(engine.params.flat, cupy.ndarray)
    for name, leaf in zip(engine.layout.names, jax.tree_util.tree_leaves(engine.tree())):
        assert leaf.unsafe_buffer_pointer() == engine.params[name].data.ptr, name
    x, y = jax.device_put(data(), gpu)
    vg = jax.jit(jax.value_and_grad(mlp_loss))
    for _ in range(20):
        _, g = vg(engine.tree(), x, y)
        assert engine.step(g).applied
    # optax on the same GPU, so that both sides' matmuls round alike (XLA may use TF32 there)
    want, _ = _optax_run(jax.device_put(mlp_params(), gpu), x, y, 20)
    for name, leaf in atj.flatten(want).items():
        np.testing.assert_allclose(cupy.asnumpy(engine.params[name]), np.asarray(leaf), rtol=1e-4, atol=1e-5,
                                   err_msg=name)


def test_bfloat16_reads_as_numpy_bfloat16_does():
    """NumPy's DLPack reader has no bfloat16: a JAX bfloat16 array is read through ``__array__``
    (no copy) and meets the same checks as a NumPy bfloat16 array, not DLPack's "Unsupported dtype"."""
    import ml_dtypes

    jnp = jax.numpy
    for params in ({"w": jnp.ones(3, jnp.bfloat16)}, {"w": np.ones(3, ml_dtypes.bfloat16)}):
        with pytest.raises(DTypeError, match="buffer dtype bfloat16: the kernels run on float32 or float64"):
            at.Engine(params, at.optim.SGD(lr=0.5))
    engines = [at.Engine({"w": np.zeros(3, np.float32)}, at.optim.SGD(lr=0.5)) for _ in range(2)]
    engines[0].step({"w": jnp.asarray([1.0, -2.0, 0.5], jnp.bfloat16)})
    engines[1].step({"w": np.asarray([1.0, -2.0, 0.5], ml_dtypes.bfloat16)})
    np.testing.assert_array_equal(engines[0].params["w"], [-0.5, 1.0, -0.25])
    np.testing.assert_array_equal(engines[0].params.flat, engines[1].params.flat)
