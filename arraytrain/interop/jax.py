"""JAX pytrees and an arraytrain Engine: names from key paths, zero-copy views, one-call gradient intake.

``flatten(tree) -> {name: leaf}`` names every leaf by its key path (dict keys,
sequence indices and attribute names joined with ``"."``: ``{"enc": [{"w": a}]}``
gives ``"enc.0.w"``); ``unflatten(template, arrays)`` puts named arrays back
into the template's structure.

``engine = bind(params, optimizer, **engine_kwargs)`` builds a
:class:`JaxEngine` from a pytree of parameters (copied once into its flat
buffer, on the device of the leaves: NumPy on the CPU, CuPy on a GPU). Then:

* ``engine.tree()``: the parameters as a pytree of JAX arrays that *share* the
  engine's memory (``jax.dlpack.from_dlpack`` of each view: on the CPU XLA
  aliases a buffer that starts on a 64-byte boundary, which every FlatBuffer
  view does). JAX assumes its arrays never change, and these change at every
  step: take a fresh ``engine.tree()`` after each step and keep none across one.
* ``engine.step(grads)`` with a pytree of the parameters' structure (what
  ``jax.grad`` returns, jitted or not): the leaves are packed into one flat
  array of the engine's layout by a jitted function (shapes and dtypes checked
  when it is traced, once per structure), read through DLPack in one call and
  written with one kernel call, whatever the number of leaves. A mapping of
  names that is not the parameters' structure goes to the engine's dict path.
* ``engine.flat()`` and ``engine.unpack(flat)``: the whole parameter buffer as
  one zero-copy JAX array, and its split into the pytree *inside* a jitted
  function; the gradient with respect to ``flat`` then goes to
  ``engine.step_flat(g)``. No per-leaf work at all outside XLA.

The engine's dict-path guarantees hold on every route: each input is checked
before anything is written, and a refused call changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..backend import KERNEL_DTYPES, as_array, backend_of
from ..engine.guard import guarded
from ..engine import Engine
from ..errors import (
    AliasingError,
    ArgumentTypeError,
    DTypeError,
    HyperparameterError,
    LayoutError,
    MissingDependencyError,
    ShapeMismatchError,
    UnknownParameterError,
)

__all__ = ["JaxEngine", "bind", "flatten", "unflatten"]


def _jax():
    try:
        import jax
    except ImportError:
        raise MissingDependencyError("arraytrain.interop.jax needs JAX (pip install jax)") from None
    return jax


def _key_name(key) -> str:
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey / FlattenedIndexKey, GetAttrKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _names(paths) -> list[str]:
    names = [".".join(_key_name(k) for k in path) or "param" for path in paths]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise LayoutError(f"two leaves of the pytree get the same name {dup} "
                          "(keys that contain '.'?); rename them")
    return names


def _structure(tree):
    """``(names, leaves, treedef)`` of a pytree, names from its key paths."""
    jax = _jax()
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return _names([p for p, _ in pairs]), [leaf for _, leaf in pairs], treedef


def flatten(tree) -> dict:
    """``{name: leaf}`` in the pytree's leaf order, named by key path (see the module docstring)."""
    names, leaves, _ = _structure(tree)
    return dict(zip(names, leaves))


def unflatten(template, arrays: Mapping):
    """``arrays`` (``{name: array}``, names as :func:`flatten` gives them) in ``template``'s structure.

    ``template`` is a pytree or a ``jax.tree_util.PyTreeDef``. Every name must
    be present and no other.
    """
    jax = _jax()
    if not isinstance(arrays, Mapping):
        raise ArgumentTypeError(f"arrays: expected a mapping name -> array, got {type(arrays).__name__}")
    if isinstance(template, jax.tree_util.PyTreeDef):
        template = jax.tree_util.tree_unflatten(template, [0] * template.num_leaves)
    names, _, treedef = _structure(template)
    unknown = [n for n in arrays if n not in set(names)]
    if unknown:
        raise UnknownParameterError(f"{unknown[0]!r}: not a leaf of the template; leaves: {names}")
    missing = [n for n in names if n not in arrays]
    if missing:
        raise LayoutError(f"arrays: missing {missing}")
    return jax.tree_util.tree_unflatten(treedef, [arrays[n] for n in names])


def bind(params, optimizer, **engine_kwargs) -> "JaxEngine":
    """A :class:`JaxEngine` for the pytree ``params`` (see the module docstring)."""
    return JaxEngine(params, optimizer, **engine_kwargs)


class JaxEngine(Engine):
    """An :class:`Engine` built from a pytree (made by :func:`bind`); ``engine.treedef`` is its structure."""

    def __init__(self, params, optimizer, **engine_kwargs):
        jax = _jax()
        names, leaves, treedef = _structure(params)
        if not leaves:
            raise LayoutError("params: the pytree has no leaves")
        if engine_kwargs.get("shard_state") and engine_kwargs.get("working_dtype") is not None:
            raise HyperparameterError("shard_state with working_dtype: the JAX binding hands the model the float32 "
                                      "parameters, which sharded state splits over the ranks under a working copy; "
                                      "shard without working_dtype")
        super().__init__(dict(zip(names, leaves)), optimizer, **engine_kwargs)
        self.treedef = treedef
        self._jax = jax
        self._pack = jax.jit(self._packed)
        lay = self.layout
        ends = [o + s for o, s in zip(lay.offsets, lay.sizes)]
        pad = [np.arange(e, o) for e, o in zip(ends, lay.offsets[1:] + (lay.size,)) if o > e]
        self._padding = np.concatenate(pad) if pad else np.zeros(0, np.int64)
        if backend_of(self.params.flat) != "numpy":
            import cupy

            self._padding = cupy.asarray(self._padding)

    # -- parameters out ---------------------------------------------------------------------
    def _to_jax(self, arr):
        return self._jax.dlpack.from_dlpack(arr)

    def tree(self):
        """The parameters as a pytree of JAX arrays sharing the engine's memory (fresh after each step)."""
        return self._jax.tree_util.tree_unflatten(
            self.treedef, [self._to_jax(self.params[n]) for n in self.layout.names])

    def flat(self):
        """The whole parameter buffer as one JAX array sharing the engine's memory (padding included)."""
        return self._to_jax(self.params.flat)

    def unpack(self, flat):
        """``flat`` (``layout.size`` elements, e.g. :meth:`flat`) split into the pytree; works under ``jax.jit``."""
        lay = self.layout
        leaves = [flat[o:o + s].reshape(shape) for o, s, shape in zip(lay.offsets, lay.sizes, lay.shapes)]
        return self._jax.tree_util.tree_unflatten(self.treedef, leaves)

    # -- gradients in --------------------------------------------------------------------------
    def _packed(self, leaves):
        """Traced once per structure: check every leaf, then concatenate them in the layout (padding 0)."""
        jnp = self._jax.numpy
        lay = self.layout
        parts, end = [], 0
        for name, leaf, off, shape in zip(lay.names, leaves, lay.offsets, lay.shapes):
            if tuple(leaf.shape) != shape:
                raise ShapeMismatchError(name, shape, tuple(leaf.shape))
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                raise DTypeError(f"{name!r}: expected a floating dtype, got {leaf.dtype}")
            if off > end:
                parts.append(jnp.zeros(off - end, self.params.dtype))
            parts.append(leaf.reshape(-1).astype(self.params.dtype))
            end = off + leaf.size
        if lay.size > end:
            parts.append(jnp.zeros(lay.size - end, self.params.dtype))
        return jnp.concatenate(parts) if parts else jnp.zeros(0, self.params.dtype)

    @guarded
    def step(self, grads=None, *, weight: float | None = None):
        """:meth:`Engine.step`; a pytree of the parameters' structure takes the one-call path."""
        if grads is None:
            return super().step(None, weight=weight)
        try:
            leaves, treedef = self._jax.tree_util.tree_flatten(grads)
        except Exception:  # not a pytree JAX knows: the dict path says what is wrong
            treedef = None
        if treedef != self.treedef:
            if isinstance(grads, Mapping):
                return super().step(grads, weight=weight)
            raise ArgumentTypeError(f"grads: expected a pytree of the parameters' structure {self.treedef} "
                                    f"or a mapping name -> array, got {treedef or type(grads).__name__}")
        return self._step_packed(self._pack(leaves), weight)

    @guarded
    def step_flat(self, grad, *, weight: float | None = None):
        """``grad``: the gradient with respect to :meth:`flat` (``layout.size`` elements, padding ignored)."""
        arr = as_array(grad, "grad")
        if arr.shape != (self.layout.size,):
            raise ShapeMismatchError("grad", (self.layout.size,), arr.shape)
        return self._step_packed(arr, weight, padded=True)

    def _step_packed(self, packed, weight, padded: bool = False):
        w = self.check_weight(weight)
        arr = as_array(packed, "grads", backend_of(self.grads.flat))
        if isinstance(arr, np.ndarray) and any(np.may_share_memory(arr, f) for f in (self.params.flat,
                                                                                   self.grads.flat)):
            raise AliasingError("grads: the gradient shares memory with an engine buffer; write into "
                                "engine.grads and call step() with no argument instead")
        if arr.dtype not in KERNEL_DTYPES:
            arr = arr.astype(self.params.dtype)
        self.kernels.accumulate(self.grads.flat, arr, w=w, overwrite=self.micro_batches == 0)
        if padded and self._padding.size:  # padding of a gradient of flat() is no gradient: keep it 0
            self.grads.flat[self._padding] = 0
        return super().step(None, weight=w)
