"""torch tensors as views of arraytrain's flat buffers, and back: what both torch doors share.

:mod:`arraytrain.interop.torch`'s ``bind`` and its drop-in ``torch.optim.Optimizer`` classes
make a module's parameters and ``.grad`` tensors views of an engine's buffers with these
helpers. torch is imported by :func:`torch_module` only, when a caller needs it.
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
