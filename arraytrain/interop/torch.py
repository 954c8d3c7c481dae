"""torch's doors to arraytrain: drop-in ``torch.optim.Optimizer`` classes, and ``bind(module, optimizer)``.

**Drop-in optimizers.** ``AdamW(model.parameters(), lr=1e-3, ...)`` and a class for every
arraytrain optimizer (``DROP_INS``): ``AdamW``, ``Adam``, ``SGD``, ``Adagrad``, ``RMSprop``,
``NAdam``, ``RAdam``, ``Adamax``, ``Adadelta``, ``Adafactor`` and ``Muon`` with torch.optim's
constructors, ``Lion``, ``LAMB``, ``Sophia`` and ``ScheduleFreeAdamW`` with arraytrain's, and
``SAM(params, base_optimizer, rho, adaptive, **base_hyperparameters)``. They are
``torch.optim.Optimizer`` subclasses (:class:`TorchOptimizer`), so torch's LR schedulers,
``torch.amp.GradScaler`` (``_step_supports_amp_scaling``: its scale and found_inf go into the
fused step), Hugging Face's ``Trainer(optimizers=(opt, sched))`` and Lightning's
``configure_optimizers`` take them unchanged. ``params`` are tensors, ``(name, tensor)`` pairs
(``model.named_parameters()``: state dicts then name them) or param-group dicts. Underneath,
the parameters and ``.grad`` tensors are views of engines' flat buffers, kept connected as
``bind`` keeps them (below); each group's ``lr`` and ``weight_decay`` become the engine's
per-parameter values at every step, read from the groups (floats or one-element tensors) with
no pass over any buffer. ``state_dict()`` has torch's structure and slot names; see
:class:`TorchOptimizer` and the guide for the rules. These classes are defined with torch,
so they are imported on first access: ``import arraytrain.interop.torch`` does not import torch.

**bind.** After ``engine = bind(model, at.optim.AdamW(...), max_grad_norm=1.0)`` the
model's trainable parameters are views of ``engine.params`` (or, for a
bfloat16/float16 model, of the engine's low-precision working copy of float32
master weights) and their ``.grad`` tensors views of the engine's gradient
buffer, so a training step is ``loss.backward(); engine.step()`` with nothing
copied. How it works, and what it guards against:

* **Trainable parameters** (``requires_grad=True``) go into the engine once
  each, tied parameters once (``named_parameters()`` order and names). Frozen
  parameters stay outside: never updated, never decayed; they and the module's
  persistent buffers (BatchNorm's running statistics) are saved and restored
  by name with ``at.save`` / ``at.load`` of the bound engine (state key
  ``"module"``), beside the engine's own state.
* **Staying connected.** Before every ``engine.step()`` (no argument) each
  parameter is checked (a pointer and an identity test per tensor):
  ``model.zero_grad()`` with ``set_to_none=True`` (torch's default) leaves
  ``.grad`` None, and the next ``backward()`` allocates a gradient outside the
  engine. When every gradient is such a tensor (or None) and the engine
  ``reads_in_place`` (one process, the CPU, one micro-batch per window), the
  step reads them where they lie; otherwise their values are copied into the
  engine's buffer first. Either way ``.grad`` then points at the buffer again
  (``zero_grad(set_to_none=False)``, or no ``zero_grad`` at all since the
  engine zeroes the buffer itself, keeps it there). A ``.grad`` still None at the step is a parameter without a gradient in
  that micro-batch, handled by the engine's ``missing`` policy (``step(absent=...)``):
  by default torch.optim's rule, ``missing="skip"`` (the step leaves it alone: weights,
  state and its own step count, see :mod:`arraytrain.param_steps`), or ``"zero"`` where
  the optimizer cannot step parameters alone (schedule-free AdamW, Adafactor, Muon, SAM)
  or when given; its ``.grad`` stays None. A step where every ``.grad`` is None raises
  :class:`NoGradientsError`. A
  parameter whose ``.data`` was replaced by a tensor of the same dtype, device
  and shape has its values taken into the engine and is re-pointed. What
  cannot be repaired raises before anything changes: a parameter moved to
  another dtype (:class:`DTypeError`) or device (:class:`BackendError`) after
  ``bind`` (``model.to(...)`` belongs before it), a trainable parameter frozen
  or a frozen one unfrozen after ``bind`` (:class:`LayoutError`): bind again.
* **bfloat16 / float16 models** (``model.to(torch.bfloat16)`` before ``bind``):
  the engine keeps float32 master weights and a working copy in the model's
  dtype (``working_dtype``), rewritten by the optimizer kernel; the model's
  parameters are views of the working copy. ``.grad`` tensors (the model's
  dtype, as torch requires) are views of a low-precision gradient buffer that
  each ``engine.step()`` adds into the float32 gradient buffer and zeroes, so
  micro-batches accumulate in float32. A float16 model gets a
  :class:`~arraytrain.LossScaler` unless ``loss_scaler=`` is given (None turns
  it off): multiply the loss by ``engine.loss_scale`` before ``backward()``;
  the engine unscales, skips overflowed steps and adapts the scale.
* **CUDA**: a module on the current CUDA device is bound to a CuPy engine; the
  views are ``torch.from_dlpack`` of the CuPy buffers (no copies). torch and
  CuPy both use the legacy default stream unless told otherwise: work queued
  on other torch streams must be synchronised before ``engine.step()``.

* **Processes** (``comm=``): as torch's DDP, the exchange overlaps the backward pass by
  default (``overlap=False`` turns it off, ``bucket_bytes=`` sets the bucket size: by
  default an eighth of the gradient, between 1 and 25 MiB):
  a ``register_post_accumulate_grad_hook`` on every bound parameter marks its gradient ready
  (:meth:`~arraytrain.Engine.mark_ready`) during the last micro-batch of a window, and the
  engine starts each bucket's all-reduce as soon as its gradients are final (see
  :mod:`arraytrain.parallel.sync`). A gradient torch allocated outside the buffer (after
  ``zero_grad(set_to_none=True)``) is not marked: it is copied in at ``step()``, and its
  bucket (with the later ones) is exchanged there. Accumulate micro-batches with
  ``accumulation_steps`` (one ``step()`` after each backward pass): a second backward pass into
  gradients already being exchanged raises :class:`~arraytrain.errors.ConcurrentUseError`
  from the hook. Not for a bfloat16/float16 module, whose gradients reach the float32 buffer at
  ``step()``, nor with a compressor or SAM.
* **Sharded weights gathered in the next forward pass** (``shard_state=True,
  gather_in_forward=True``; off by default): the all-gather that publishes each rank's updated
  partition is started in chunks after the update and left in flight, and a forward pre-hook on
  every module that holds bound parameters waits for the chunks they lie in (none where this
  rank owns them), so the gather moves while the forward pass computes (FSDP's forward
  prefetch). ``module.state_dict()`` and every engine call that reads the weights (``step``,
  ``state_dict``, ``at.save``, ``gather_params``, ...) wait for all of it; **a tensor read any
  other way between ``step()`` and the next forward pass may hold the previous step's values
  there: call** ``engine.wait_weights()`` first. The bits are those of the publish at the step.
  It pays where the link binds and the forward pass is long enough to cover it; on links that
  take the CPU the compute needs it costs (see docs/cluster.md).

``engine.step(grads)`` with a mapping still works (the engine's dict path);
``engine.zero_grad()`` also clears the low-precision gradient buffer.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import numpy as np

from .._checks import check_bool
from ..engine.guard import guarded
from ..amp import LossScaler
from ..engine import Engine
from ..errors import (
    ArgumentTypeError,
    BackendError,
    BackendUnavailableError,
    DTypeError,
    HyperparameterError,
    LayoutError,
    NoGradientsError,
    StateDictError,
)
from ._torch_views import DROP_INS, TensorBinding, check_cuda_device, host_array, numpy_dtype, torch_module

__all__ = sorted([*DROP_INS, "TorchEngine", "bind"])


def __getattr__(name: str):
    if name in DROP_INS:
        torch_module()  # the install hint when torch is missing
        from . import _torch_dropins

        return getattr(_torch_dropins, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(DROP_INS))

# engine arguments that bind takes from the module
_FROM_MODULE = ("dtype", "device", "working_dtype")


def bind(module, optimizer, **engine_kwargs) -> TorchEngine:
    """An :class:`Engine` training ``module``'s trainable parameters in place; see the module docstring.

    ``engine_kwargs`` are :class:`~arraytrain.Engine`'s (``max_grad_norm``,
    ``accumulation_steps``, ``schedule``, ``loss_scaler``, ``comm``, ``shard_state``, ...), except
    ``dtype``, ``device`` and ``working_dtype``, which come from the module. ``missing`` defaults
    to torch's rule, "skip", where the optimizer can step parameters alone (else "zero"). With ``comm``,
    ``overlap`` defaults to True (the backward pass's hooks start the exchange; see the
    module docstring) where the exchange can overlap: a float32/float64 module, no
    compressor, no SAM. ``gather_in_forward=True`` (with ``shard_state=True``) leaves the updated weights'
    all-gather to the next forward pass (see the module docstring).
    """
    return TorchEngine(module, optimizer, **engine_kwargs)


def _mark_ready(engine_ref, name: str, param, grad) -> None:
    """A bound parameter's post-accumulate-grad hook: its gradient is final for this backward pass."""
    engine = engine_ref()
    if engine is not None and param.grad is grad:  # a gradient in the engine's buffer (not one torch allocated)
        engine.mark_ready(name)


def _settle(engine_ref, need) -> None:
    """A module's forward pre-hook under ``gather_in_forward``: the chunks of the weights it reads have arrived."""
    engine = engine_ref()
    if engine is not None:
        engine.placement.settle(need)


class TorchEngine(Engine):
    """An :class:`Engine` bound to a torch module (made by :func:`bind`).

    ``engine.module`` is the module; ``engine.frozen`` and ``engine.buffers``
    map names to the module's frozen parameters and persistent buffers, which
    :meth:`state_dict` stores under ``"module"``.
    """

    def __init__(self, module, optimizer, **engine_kwargs):
        torch = torch_module()
        if not isinstance(module, torch.nn.Module):
            raise ArgumentTypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
        for key in _FROM_MODULE:
            if key in engine_kwargs:
                raise HyperparameterError(f"{key}: bind takes it from the module (convert the module with "
                                          f"module.to(...) before bind), got {key}={engine_kwargs[key]!r}")
        named = list(module.named_parameters())  # tied parameters once, under their first name
        trainable = [(n, p) for n, p in named if p.requires_grad]
        if not trainable:
            raise LayoutError("module: no trainable parameters (every parameter has requires_grad=False)")
        for n, p in named:
            if p.layout != torch.strided:
                raise BackendError(f"{n!r}: a {p.layout} parameter; bind needs dense (strided) tensors")
        dtypes = {p.dtype for _, p in trainable}
        if len(dtypes) != 1:
            raise DTypeError(f"module: trainable parameters of several dtypes {sorted(map(str, dtypes))}; "
                             "bind needs one (module.to(dtype) first)")
        dtype = dtypes.pop()
        if dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise DTypeError(f"module: parameters of dtype {dtype}; bind trains float32/float64 parameters, "
                             "or bfloat16/float16 ones on float32 master weights")
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise BackendError(f"module: parameters on several devices {sorted(map(str, devices))}; "
                               "bind needs one device")
        device = devices.pop()
        if device.type == "cuda":
            check_cuda_device(device, "module")
        elif device.type != "cpu":
            raise BackendUnavailableError(f"module: parameters on {device}; bind supports the CPU and CUDA")
        lowp = dtype in (torch.bfloat16, torch.float16)
        if engine_kwargs.get("overlap") and lowp:
            raise HyperparameterError("overlap: a bfloat16/float16 module's gradients reach the engine's float32 "
                                      "buffer at step(), not as the backward pass makes them; pass overlap=False")
        if "overlap" not in engine_kwargs:  # DDP's default, where the exchange can overlap
            engine_kwargs["overlap"] = (engine_kwargs.get("comm") is not None and not lowp
                                        and engine_kwargs.get("compressor") is None
                                        and not callable(getattr(optimizer, "perturb", None)))
        gather_in_forward = check_bool("gather_in_forward", engine_kwargs.pop("gather_in_forward", False))
        if gather_in_forward and not engine_kwargs.get("shard_state"):
            raise HyperparameterError("gather_in_forward: only sharded state's weights are gathered after the "
                                      "update (pass shard_state=True with a group of processes)")
        if "missing" not in engine_kwargs and hasattr(optimizer, "per_param_steps"):  # torch.optim's rule
            engine_kwargs["missing"] = "skip" if optimizer.per_param_steps else "zero"
        if lowp:
            engine_kwargs["working_dtype"] = "bfloat16" if dtype == torch.bfloat16 else "float16"
            if dtype == torch.float16 and "loss_scaler" not in engine_kwargs:
                engine_kwargs["loss_scaler"] = LossScaler()
        # the one copy: current values into the engine (float32 masters of a low-precision model)
        with torch.no_grad():
            if device.type == "cpu":
                params = {n: (p.detach().float() if lowp else p.detach()).contiguous().numpy() for n, p in trainable}
            else:
                params = {n: (p.detach().float() if lowp else p.detach()).contiguous() for n, p in trainable}
            super().__init__(params, optimizer, **engine_kwargs)
        self.module = module
        self._torch = torch
        self._binding = TensorBinding(self, trainable, torch, set_grad=True, holder="bind", before="before bind")
        bound = self._binding.bound
        self._hooks = []
        if self.overlapped:
            me = weakref.ref(self)  # the hooks do not keep the engine alive
            for name, p, _, grad, *_ in bound:
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda t, name=name, grad=grad: _mark_ready(me, name, t, grad)))
        if gather_in_forward:
            self._gather_in_forward(module, bound)
        self.frozen = {n: p for n, p in named if not p.requires_grad}
        param_names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        self.buffers = {n: t for n, t in module.state_dict(keep_vars=True).items() if n not in param_names}

    def _gather_in_forward(self, module, bound) -> None:
        """Leave the sharded weights' all-gather in flight after each update, and hook every module that holds
        bound parameters so that its forward pass (and its ``state_dict()``) first waits for the chunks
        they lie in; the root module's ``state_dict()`` waits for all."""
        place = self.placement
        place.defer_publish = True
        me = weakref.ref(self)
        names = {id(p): name for name, p, *_ in bound}
        lay = self.layout
        for mod in module.modules():
            own = [names[id(p)] for p in mod.parameters(recurse=False) if id(p) in names]
            if not own:
                continue
            spans = [(lay.offsets[lay.index(n)], lay.offsets[lay.index(n)] + lay.sizes[lay.index(n)]) for n in own]
            need = place.chunk_needed(spans)
            self._hooks.append(mod.register_forward_pre_hook(lambda m, args, need=need: _settle(me, need)))
            if mod is not module:
                self._hooks.append(mod.register_state_dict_pre_hook(lambda *a, need=need: _settle(me, need)))
        self._hooks.append(module.register_state_dict_pre_hook(lambda *a: _settle(me, None)))
        # what the last update left in flight completes before the engine's buffers go, and before MPI ends
        weakref.finalize(self, place.settle)

    # -- the step -------------------------------------------------------------------------
    @guarded
    def step(self, grads: Mapping | None = None, *, weight: float | None = None, absent=None):
        """:meth:`Engine.step`; with no ``grads``, first reconnect the module (see the module docstring):
        the parameters whose ``.grad`` is None are ``absent`` (with the names given, if any)."""
        if grads is None:
            self.check_weight(weight)  # refused before the gradients are touched
            none, fresh = self._connect(self.check_absent(absent))
            absent = none if absent is None else sorted(set(none) | set(absent), key=self.layout.index)
            if fresh:  # read where they lie; then .grad points at the (zeroed) buffer, as after a copy
                try:
                    return super().step(grads, weight=weight, absent=absent)
                finally:
                    for _, p, _, grad, *_ in fresh:
                        p.grad = grad
        return super().step(grads, weight=weight, absent=absent)

    def _connect(self, absent) -> tuple:
        """Check every parameter, then repair: nothing is written unless every check passes. Returns
        the names of the parameters whose ``.grad`` is None (they stay None), and the fresh gradients
        the step reads where they lie (their :attr:`TensorBinding.bound` entries; empty when copied in)."""
        bound = self._binding.bound
        for name, p, *_ in bound:
            if not p.requires_grad:
                raise LayoutError(f"{name!r}: requires_grad was turned off after bind, but the engine still "
                                  "trains it (and would decay it); bind the module again")
        data_fixes, grad_fixes, none, bases = self._binding.check(self)
        if len(none) == len(bound):
            raise NoGradientsError("no parameter has a gradient (every .grad is None, e.g. after "
                                   "model.zero_grad()): call loss.backward() before engine.step()")
        for name, p in self.frozen.items():
            if p.requires_grad:
                raise LayoutError(f"{name!r}: frozen at bind and now requires_grad=True; the engine does "
                                  "not hold it, so it would never be trained: bind the module again")
        none = [bound[i][0] for i in none]
        self.check_absent(none)  # the missing policy's error before any write
        fresh = []
        if bases is not None:  # every gradient a fresh .grad: the step reads them where they lie
            fresh, grad_fixes = [bound[i] for i in grad_fixes], []
        self._binding.repair(data_fixes, grad_fixes, overwrite=self.micro_batches == 0)
        if bases is not None:
            self.read_in_place(bases)
        return none, fresh

    @guarded
    def zero_grad(self) -> None:
        """:meth:`Engine.zero_grad`, and the low-precision gradient buffer of a bf16/fp16 module."""
        super().zero_grad()
        self._binding.zero_lowp()

    # -- state: the engine's, plus the module's frozen parameters and buffers ----------------
    @guarded
    def state_dict(self, copy: bool = True, *, root: int | None = None) -> dict | None:
        """:meth:`Engine.state_dict` plus ``"module"``: the module's frozen parameters and buffers
        (None on the ranks other than ``root``, see :meth:`Engine.state_dict`)."""
        tree = super().state_dict(copy, root=root)
        return None if tree is None else self._with_module(tree, copy)

    @guarded
    def state_template(self) -> dict:
        """:meth:`Engine.state_template` plus the module's part."""
        return self._with_module(super().state_template(), False)

    def _with_module(self, state: dict, copy: bool) -> dict:
        torch = self._torch
        state["module"] = {
            "buffers": {n: host_array(t, torch, copy) for n, t in self.buffers.items()},
            "frozen": {n: host_array(t, torch, copy) for n, t in self.frozen.items()},
        }
        return state

    @guarded
    def check_state(self, state: Mapping):
        """:meth:`Engine.check_state` plus the module's part; the writes load both."""
        module_writes = self._check_module_state(state)
        return super().check_state(state).extended(module_writes)

    def _check_module_state(self, state) -> list:
        torch = self._torch
        try:
            sub = state["module"]
        except (KeyError, TypeError):
            raise StateDictError("state dict lacks 'module' (the frozen parameters and buffers of a bound "
                                 "module); was it saved from an engine made by bind?") from None
        if not isinstance(sub, Mapping) or set(sub) != {"buffers", "frozen"}:
            raise StateDictError(f"module: expected a mapping with 'buffers' and 'frozen', got "
                                 f"{sorted(sub) if isinstance(sub, Mapping) else type(sub).__name__}")
        writes = []
        for part, tensors in (("buffers", self.buffers), ("frozen", self.frozen)):
            arrays = sub[part]
            if not isinstance(arrays, Mapping) or set(arrays) != set(tensors):
                got = sorted(arrays) if isinstance(arrays, Mapping) else type(arrays).__name__
                raise StateDictError(f"module {part}: expected {sorted(tensors)}, got {got}")
            for name, t in tensors.items():
                a = arrays[name]
                want = numpy_dtype(t, torch)
                if not isinstance(a, np.ndarray) or a.dtype != want or a.shape != tuple(t.shape):
                    raise StateDictError(
                        f"module {part}[{name!r}]: expected a NumPy {want} array of shape {tuple(t.shape)}, got "
                        f"{getattr(a, 'dtype', type(a).__name__)}{getattr(a, 'shape', '')}")
                src = np.array(a)  # a copy: the array may be a view of the tensor it is written to
                src_t = torch.from_numpy(src.view(np.int16)).view(torch.bfloat16) if t.dtype == torch.bfloat16 \
                    else torch.from_numpy(src)
                writes.append(lambda t=t, src_t=src_t: _copy_into(t, src_t, torch))
        return writes


def _copy_into(t, src, torch) -> None:
    with torch.no_grad():
        t.copy_(src)
