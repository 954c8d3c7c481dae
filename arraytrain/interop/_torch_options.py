"""The options every drop-in optimizer takes after torch's hyperparameters (:data:`OPTIONS`), checked
once at construction (:func:`check_options`), and the flags of torch's param groups that arraytrain
ignores or refuses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .. import optim
from ..optim import state8
from .._checks import check_int
from ..errors import HyperparameterError
from ..kernels.interface import family_name
from ..ops import CLIP_EPS
from ..parallel.communicator import check_parallel
from ..engine.stages import check_judging

# torch.optim's implementation switches: foreach and fused choose among torch's own kernels (the
# step here is always one fused kernel: accepted, kept in the groups as torch keeps them, and
# otherwise ignored); capturable (CUDA graphs) and differentiable (autograd through the step) are
# modes arraytrain does not have: True is refused
IGNORED_FLAGS = ("foreach", "fused")
REFUSED_FLAGS = {
    "capturable": "torch's CUDA-graph mode (step and lr kept on the device) is not built: arraytrain forms "
                  "its step-dependent scalars on the host",
    "differentiable": "autograd through the optimizer step is not built",
}
#: The group values that are the engine's per-parameter values (``engine.state.hp``), free to differ
#: between the groups of one engine.
PER_PARAM = ("lr", "weight_decay")
#: The options every drop-in takes after torch's hyperparameters, keyword-only, with their defaults
#: (:class:`~._torch_optim.TorchOptimizer` documents them).
OPTIONS = {"max_grad_norm": None, "clip_eps": CLIP_EPS, "state_dtype": None, "min_8bit_size": None,
           "kernels": "numba", "max_consecutive_skips": 50, "nonfinite": "skip", "comm": None, "shard_state": False,
           "overlap": None, "bucket_bytes": None}


@dataclass(frozen=True)
class Options:
    """:data:`OPTIONS` checked. ``overlap`` None: on where it can be (see
    :meth:`~._torch_cohorts.Cohorts.engine_parallel`); ``parallel``: the engines' ``comm``,
    ``bucket_bytes`` and ``shard_state``."""

    max_grad_norm: float | None
    clip_eps: float
    state_dtype: str | None
    min_8bit_size: int
    kernels: str
    max_consecutive_skips: int | None
    nonfinite: str
    overlap: bool | None
    parallel: dict


def check_options(options: Mapping, owner: str, takes_state_dtype: bool) -> Options:
    """The options (:data:`OPTIONS`, those not given at their defaults) checked, in this order, each refusal a
    :class:`~arraytrain.errors.HyperparameterError` naming the option; ``owner``: the class's name."""
    options = {**OPTIONS, **options}
    max_grad_norm, clip_eps, state_dtype = options["max_grad_norm"], options["clip_eps"], options["state_dtype"]
    min_8bit_size, kernels = options["min_8bit_size"], options["kernels"]
    max_consecutive_skips = options["max_consecutive_skips"]
    # the judge's settings, as the Engine checks them
    max_grad_norm, clip_eps, nonfinite, max_consecutive_skips = check_judging(max_grad_norm, clip_eps,
                                                                              options["nonfinite"], max_consecutive_skips)
    if state_dtype is not None and not takes_state_dtype:
        raise HyperparameterError(f"state_dtype: {owner} keeps its state in the parameters' "
                                  "dtype (its arraytrain optimizer takes no state_dtype), got "
                                  f"state_dtype={state_dtype!r}")
    if state_dtype is not None and state_dtype not in optim.Optimizer.STATE_DTYPES:  # (the optimizers' message)
        raise HyperparameterError(f"state_dtype: expected None or one of {optim.Optimizer.STATE_DTYPES}, got "
                                  f"{state_dtype!r}")
    if min_8bit_size is None:
        min_8bit_size = state8.DEFAULT_THRESHOLD
    elif state_dtype not in ("8bit", "float8"):
        raise HyperparameterError(f"min_8bit_size: the size under which a parameter keeps float32 state applies "
                                  f"with state_dtype='8bit' or 'float8' only, got min_8bit_size={min_8bit_size!r} with "
                                  f"state_dtype={state_dtype!r}")
    min_8bit_size = check_int("min_8bit_size", min_8bit_size, 0)
    family_name("numpy", kernels)  # (the engine's check of ``kernels``)
    overlap = options["overlap"]
    comm, shard_state, _, bucket_bytes = check_parallel(
        options["comm"], options["shard_state"], False if overlap is None else overlap, options["bucket_bytes"])
    if shard_state and state_dtype in ("8bit", "float8"):
        raise HyperparameterError(f"shard_state: sharded {state_dtype} state is not built for the drop-in optimizers "
                                  "(their state dicts show 8-bit slots by parameter); use bind(model, optimizer, "
                                  "comm=..., shard_state=True), or state_dtype='bfloat16'")
    if overlap and comm.is_local:
        raise HyperparameterError("overlap: the overlapped exchange needs a group of processes (comm=...)")
    return Options(max_grad_norm=max_grad_norm, clip_eps=clip_eps, state_dtype=state_dtype,
                   min_8bit_size=min_8bit_size, kernels=kernels, max_consecutive_skips=max_consecutive_skips,
                   nonfinite=nonfinite, overlap=overlap,
                   parallel={"comm": comm, "bucket_bytes": bucket_bytes, "shard_state": shard_state})
