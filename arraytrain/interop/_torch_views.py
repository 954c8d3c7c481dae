"""torch tensors as views of arraytrain's flat buffers, and back: what both torch doors share.

:mod:`arraytrain.interop.torch`'s ``bind`` and its drop-in ``torch.optim.Optimizer`` classes
make a module's parameters and ``.grad`` tensors views of an engine's buffers through one
:class:`TensorBinding`. torch is imported by :func:`torch_module` only, when a caller needs it.
"""

from __future__ import annotations

import numpy as np

from ..backend import NUMPY, backend_of, bfloat16, is_bfloat16
from ..errors import BackendError, DTypeError, MissingDependencyError, ShapeMismatchError

#: The drop-in ``torch.optim.Optimizer`` classes of :mod:`arraytrain.interop.torch`, defined with torch in
#: ``_torch_dropins`` and loaded on first access: the one list of their names.
DROP_INS = (
    "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "LAMB", "Lion", "Muon", "NAdam", "RAdam",
    "RMSprop", "SAM", "SGD", "ScheduleFreeAdamW", "Sophia", "TorchOptimizer",
)


def torch_module():
    """The ``torch`` module, or :class:`MissingDependencyError` saying how to install it."""
    try:
        import torch
    except ImportError:
        raise MissingDependencyError("arraytrain.interop.torch needs PyTorch (pip install torch)") from None
    return torch


def tensor_view(arr, torch):
    """A torch tensor sharing ``arr``'s memory (NumPy or CuPy; bfloat16 through its int16 bits)."""
    bf16 = is_bfloat16(arr.dtype)
    if backend_of(arr) == NUMPY:
        t = torch.from_numpy(arr.view(np.int16) if bf16 else arr)
    else:
        t = torch.from_dlpack(arr.view(np.int16) if bf16 else arr)
    return t.view(torch.bfloat16) if bf16 else t


def host_array(t, torch, copy: bool) -> np.ndarray:
    """A NumPy array of a tensor's values (a view on the CPU unless ``copy``; bfloat16 as ml_dtypes')."""
    t = t.detach()
    if t.device.type != "cpu":
        t, copy = t.cpu(), False
    if not t.is_contiguous():
        t, copy = t.contiguous(), False
    a = t.view(torch.int16).numpy().view(bfloat16()) if t.dtype == torch.bfloat16 else t.numpy()
    return a.copy() if copy else a


def numpy_dtype(t, torch) -> np.dtype:
    """The NumPy dtype (ml_dtypes' bfloat16 for torch.bfloat16) of a tensor's elements."""
    if t.dtype == torch.bfloat16:
        return bfloat16()
    return torch.empty(0, dtype=t.dtype).numpy().dtype


def check_cuda_device(device, what: str = "module") -> None:
    """A CUDA tensor's device must be CuPy's current one (the engine's buffers are made there)."""
    from ..backend import require_cuda

    require_cuda(what)
    import cupy

    current = cupy.cuda.Device().id
    if device.index is not None and device.index != current:
        from ..errors import BackendError

        raise BackendError(f"{what}: on {device}, but CuPy's current device is cuda:{current}; "
                           f"build it under `with cupy.cuda.Device({device.index}):`")


def fresh_addresses(engine, fresh):
    """The addresses for :meth:`arraytrain.Engine.read_in_place` when a step's gradients are ``.grad``
    tensors torch allocated: ``fresh`` pairs each such parameter's segment with its tensor; the others
    read the engine's buffer. None when the engine cannot read in place or a tensor is not contiguous
    (then the step copies them in)."""
    base = engine.grad_addresses
    if base is None:
        return None
    out = base.tolist()  # (a list's item assignment costs a tenth of an array's)
    for seg, g in fresh:
        if not g.is_contiguous():
            return None
        out[seg] = g.data_ptr()
    return np.array(out, np.int64)


def check_kind(name: str, what: str, got, bound, *, holder: str, before: str) -> None:
    """A tensor put where ``holder`` (the drop-in optimizer, bind) holds ``bound``: the same dtype, device
    and shape, or a typed error saying to convert or move the model ``before`` that."""
    if got.dtype != bound.dtype:
        raise DTypeError(f"{name!r}: {what} dtype {got.dtype} != {bound.dtype}, which {holder} holds (convert the "
                         f"model {before})")
    if got.device != bound.device:
        raise BackendError(f"{name!r}: {what} on {got.device}, {holder} holds it on {bound.device} (move the model "
                           f"{before})")
    if tuple(got.shape) != tuple(bound.shape):
        raise ShapeMismatchError(name, tuple(bound.shape), tuple(got.shape), what=what)


class TensorBinding:
    """torch parameters re-pointed into an engine's buffers, as both torch engines hold them (``bind``'s
    and the drop-ins'): each ``.data`` a view of the engine's weights (of its working copy for a
    bfloat16/float16 model), each gradient's place a view of ``engine.grads``, or for a bfloat16/float16
    model of :attr:`lp_grads`, a buffer of the model's dtype that :meth:`repair` adds into the float32 one.

    ``entries``: ``(name, tensor)`` pairs of one dtype and device; ``set_grad``: point every ``.grad`` at
    its place now (else a step finds it, :meth:`check`). ``bound``: ``(name, param, data, grad, data_ptr,
    dtype, shape)`` per entry; ``holder`` and ``before`` name who holds the tensors in messages
    (:func:`check_kind`).
    """

    def __init__(self, engine, entries, torch, *, set_grad: bool, holder: str, before: str):
        self.torch, self.held = torch, {"holder": holder, "before": before}
        dtype, device = entries[0][1].dtype, entries[0][1].device
        self.lowp = dtype in (torch.bfloat16, torch.float16)
        self.on_cpu = device.type == "cpu"
        self.segments = [engine.layout.index(n) for n, _ in entries]  # (each entry's place in the engine's layout)
        weights = engine.working if self.lowp else engine.params
        if self.lowp:  # .grad must have the parameter's dtype: a low-precision buffer, added into the float32 one
            self.lp_grads = torch.zeros(engine.layout.size, dtype=dtype, device=device)
            self.grads_tensor = tensor_view(engine.grads.flat, torch)
        self.bound = []
        with torch.no_grad():
            for n, p in entries:
                data = tensor_view(weights[n], torch)
                grad = (self.lp_grads[engine.layout.slice(n)].view(p.shape) if self.lowp
                        else tensor_view(engine.grads[n], torch))
                p.data = data
                if set_grad:
                    p.grad = grad
                self.bound.append((n, p, data, grad, data.data_ptr(), p.dtype, tuple(p.shape)))

    def check(self, engine) -> tuple[list, list, list, np.ndarray | None]:
        """Find what a step must repair, changing nothing: ``(data_fixes, grad_fixes, absent, addresses)``,
        the first three indices into :attr:`bound`.

        ``.data`` replaced by a tensor of the same dtype, device and shape: its values are taken into
        the engine; ``.grad`` allocated by torch (after ``zero_grad(set_to_none=True)``): its values
        are copied into the buffer, or read where they lie; ``.grad`` None: the parameter is absent
        this step. ``addresses``: the gradients' addresses by segment for
        :meth:`~arraytrain.Engine.read_in_place` when the step can read them where they lie (the engine
        can, not a bfloat16/float16 model, every ``.grad`` a contiguous tensor torch allocated or None),
        else None (:meth:`repair` copies them in). Anything else raises before a write.
        """
        data_fixes, grad_fixes, absent, found = [], [], [], []
        on_cpu, strided, held, segments = self.on_cpu, self.torch.strided, self.held, self.segments
        fresh = not self.lowp  # every .grad a tensor torch allocated, or None: read where they lie
        for i, (n, p, data, grad, ptr, dtype, shape) in enumerate(self.bound):
            if p.data_ptr() != ptr or p.dtype is not dtype or p.shape != shape:
                check_kind(n, "parameter", p, data, **held)
                data_fixes.append(i)
            g = p.grad
            if g is grad:
                fresh = False  # a gradient in the buffer: the step reads the buffer (and zeroes it)
                continue
            if g is None:
                absent.append(i)
                continue
            # the common case in a few attribute reads: a dense CPU gradient of the parameter's kind
            if not (on_cpu and g.dtype is dtype and g.layout is strided and g.is_cpu and g.shape == shape):
                if g.is_sparse or g.layout != strided:
                    raise BackendError(f"{n!r}: a {g.layout} gradient; {held['holder']} takes dense gradients")
                check_kind(n, "gradient", g, grad, **held)
            grad_fixes.append(i)
            found.append((segments[i], g))
        return data_fixes, grad_fixes, absent, fresh_addresses(engine, found) if fresh and found else None

    def repair(self, data_fixes, grad_fixes, overwrite: bool) -> None:
        """Apply what :meth:`check` found: a replaced ``.data``'s values taken into the engine and the tensor
        re-pointed, an allocated ``.grad`` copied into its place and re-pointed; then a bfloat16/float16
        model's gradients added into the float32 buffer (``overwrite``: the window's first) and zeroed."""
        if not (data_fixes or grad_fixes or self.lowp):
            return
        with self.torch.no_grad():
            for i in data_fixes:
                _, p, data, *_ = self.bound[i]
                data.copy_(p.detach())
                p.data = data
            for i in grad_fixes:
                _, p, _, grad, *_ = self.bound[i]
                grad.copy_(p.grad)
                p.grad = grad
            if self.lowp:
                (self.grads_tensor.copy_ if overwrite else self.grads_tensor.add_)(self.lp_grads)
                self.lp_grads.zero_()

    def zero_lowp(self) -> None:
        """Zero the low-precision gradient buffer of a bfloat16/float16 model (else nothing)."""
        if self.lowp:
            self.lp_grads.zero_()
