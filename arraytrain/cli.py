"""``arraytrain train``: train the built-in MLP end to end and report what happened.

With no arguments it trains on scikit-learn's handwritten digits (shipped with
scikit-learn, no download), split train / validation / test from the seed and
standardised with the training statistics. ``--data FILE.npz`` trains on the
arrays ``X``, ``y`` (and optionally ``X_test``, ``y_test``) instead.

The library's capabilities each have a flag: ``--compress``/``--error-feedback``
(the engine's compressor), ``--predict`` (the :class:`~arraytrain.nn.PhaseTrainer`),
``--prune``/``--prune-epochs`` (:class:`~arraytrain.nn.callbacks.MagnitudePruning`),
``--quantize-eval int8`` (:mod:`arraytrain.quantize`, evaluation only),
``--precision bf16|fp16`` (the engine's working copy, and a loss scaler for fp16),
``--device cuda`` and ``mpiexec -n K``.

Everything that can be checked without the data is checked before they are
loaded (flags and their combinations, that the files of ``--save``/``--json``/
``--plot`` can be created where they are named (each is created and removed
again, or an existing one opened for writing without truncating it), the plot
format, the input files, optional packages): bad arguments, bad data files and
missing optional packages end with one line on stderr and exit status 2 that
names the flag, before any training; nothing prints a traceback on purpose.
Every file written is announced on stdout (``saved``, ``wrote``, ``drew``).

The throughput is reported as the benchmarks report a time: per epoch over its
micro-batches after the warm-up, the fastest epoch and the median of the epochs
(:data:`THROUGHPUT_MEASURES` says what is in it).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import statistics
import sys

import numpy as np

from . import optim, precompile, schedules
from .engine import Engine
from .errors import ArrayTrainError, CheckpointError, DataError, NonFiniteError
from .nn.callbacks import MagnitudePruning

PROG = "arraytrain"
SCHEDULES = ("constant", "cosine", "step", "plateau")
ACTIVATIONS = ("relu", "gelu", "tanh", "sigmoid")


class UsageError(Exception):
    """A command-line problem, reported as one line."""


def _usage(message: str) -> UsageError:
    return UsageError(f"{PROG} train: error: {message}")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise UsageError(f"{self.prog}: error: {message}")


#: ``{name: class}`` of the optimizers ``--optimizer`` takes (:func:`arraytrain.optim.by_name`).
optimizers = optim.by_name


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {'number' if kind is float else 'whole number'}, "
                                             f"got {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected a value > 0, got {text!r}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _nonnegative(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"expected a value >= 0, got {text!r}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _fraction(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}")
    return value


def _hidden(text):
    try:
        sizes = [int(s) for s in text.split(",")] if text.strip() else []
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer widths such as 128,64, got {text!r}") from None
    if any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"layer widths must be >= 1, got {text!r}")
    return sizes


COMPRESSORS = {"topk": "TopK", "randomk": "RandomK", "int8": "Int8Block", "sign": "Sign", "ternary": "Ternary",
               "powersgd": "PowerSGD", "vsa": "VSA"}


def _compress_spec(text):
    """``METHOD[:key=value,...]`` -> (method, {key: value}); values parsed as int, float, bool or text."""
    method, _, rest = text.partition(":")
    method = method.strip().lower()
    if method not in COMPRESSORS:
        raise argparse.ArgumentTypeError(f"expected METHOD[:key=value,...] with METHOD one of "
                                         f"{', '.join(COMPRESSORS)}, got {text!r}")
    kwargs = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.isidentifier():
            raise argparse.ArgumentTypeError(f"expected key=value after {method}:, got {item!r}")
        kwargs[key] = _value(value)
    return method, kwargs


def _value(text: str):
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


PREDICT_KEYS = {"full": "full_steps", "predict": "predict_steps", "correct": "correct_every", "history": "history",
                "beta": "correction_beta", "adaptive": "adaptive"}
# --predict's PhaseTrainer arguments for the built-in MLP, measured on digits (python -m arraytrain.bench
# predict reads them as its defaults). Chosen by a sweep over 3 seeds at 20 epochs (cycles (2,6,3), (1,3,2),
# (1,3,3), (1,4,4); history 1, 2, 4, 8; correction_beta 0, 0.5, 0.9, 0.99, 1): history 2 was worst (up to -7
# points: a two-point line extrapolates minibatch noise), every correction_beta < 1 lost 0.4-1 point against
# beta = 1 (the residuals of minibatch gradients are noise, and their average is stale noise), and (2, 6, 3)
# with history 4 and beta 1 matched full training at 2.24x fewer backward passes.
PREDICT_DEFAULTS = {"full_steps": 2, "predict_steps": 6, "correct_every": 3, "history": 4, "correction_beta": 1.0,
                    "adaptive": False}


def _predict_spec(text):
    """``[full=F,predict=P,correct=C,history=H,beta=B,adaptive=true]`` -> PhaseTrainer's keyword arguments."""
    spec = dict(PREDICT_DEFAULTS)
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in PREDICT_KEYS:
            raise argparse.ArgumentTypeError(f"expected key=value with key one of {', '.join(PREDICT_KEYS)}, "
                                             f"got {item!r}")
        v = _value(value)
        if key == "adaptive":
            if not isinstance(v, bool):
                raise argparse.ArgumentTypeError(f"adaptive: expected true or false, got {value!r}")
        elif key == "beta":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise argparse.ArgumentTypeError(f"beta: expected a number in [0, 1], got {value!r}")
            v = float(v)
        elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise argparse.ArgumentTypeError(f"{key}: expected a whole number >= 1, got {value!r}")
        spec[PREDICT_KEYS[key]] = v
    return spec


def _epoch_range(text):
    """``N`` or ``N-M`` -> (N, M), 1 <= N <= M."""
    first, dash, last = text.partition("-")
    try:
        lo = int(first)
        hi = int(last) if dash else lo
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an epoch N or a range N-M, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= N <= M, got {text!r}")
    return lo, hi


PRECISIONS = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}
DESCRIPTION = ("Train the built-in MLP and report what happened. With no arguments it trains on scikit-learn's "
               "handwritten digits (shipped with scikit-learn, no download), split train / validation / test from "
               "the seed and standardised with the training statistics; --data FILE.npz trains on the arrays X, y "
               "(and optionally X_test, y_test) instead. Every option is checked before the first epoch: a bad "
               "one ends with one line on stderr and exit status 2.")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog=PROG, description="arraytrain: a training engine on flat NumPy buffers.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    t = sub.add_parser("train", help="train the built-in MLP (default: scikit-learn's digits)",
                       description=DESCRIPTION)
    opt_names = sorted(optimizers())
    t.add_argument("--optimizer", default="adamw", choices=opt_names, help="default: adamw")
    t.add_argument("--lr", type=_positive(float), help="learning rate (default: the optimizer's own; sgd 0.05)")
    t.add_argument("--weight-decay", type=_nonnegative(float), metavar="WD", help="weight decay (default: the optimizer's own)")
    t.add_argument("--momentum", type=_nonnegative(float), metavar="M",
                   help="momentum, for optimizers that have it (default: the optimizer's own)")
    t.add_argument("--state-dtype", choices=("float32", "bfloat16", "8bit"),
                   help="storage of the optimizer's element-wise state: bfloat16, or 8bit (bitsandbytes' blockwise "
                        "dynamic quantization, parameters under 4096 elements kept in float32); float32 parameters "
                        "only (default: the parameters' dtype)")
    t.add_argument("--batch-size", type=_positive(int), default=32, metavar="N", help="default: 32")
    t.add_argument("--hidden", type=_hidden, default=[128, 64], metavar="W1,W2,...", help="hidden layer widths (default: 128,64)")
    t.add_argument("--activation", default="relu", choices=ACTIVATIONS, help="default: relu")
    t.add_argument("--epochs", type=_positive(int), default=20, metavar="N", help="total epochs, resumed ones included (default: 20)")
    t.add_argument("--accumulation", type=_positive(int), default=1, metavar="K",
                   help="micro-batches per optimizer step (default: 1)")
    t.add_argument("--clip", type=_positive(float), metavar="NORM",
                   help="clip the global gradient L2 norm to NORM (default: no clipping)")
    t.add_argument("--schedule", default="constant", choices=SCHEDULES, help="lr schedule (default: constant)")
    t.add_argument("--warmup", type=_nonnegative(int), default=0, metavar="STEPS",
                   help="linear warm-up over this many optimizer steps (default: 0)")
    t.add_argument("--step-epochs", type=_positive(int), metavar="N", help="--schedule step: epochs between decays "
                   "(default: a third of --epochs)")
    t.add_argument("--gamma", type=_fraction, default=0.1, help="--schedule step: decay factor (default: 0.1)")
    t.add_argument("--plateau-patience", type=_nonnegative(int), default=2, metavar="N",
                   help="--schedule plateau: epochs without a better val_loss before the lr is cut 10x (default: 2)")
    t.add_argument("--patience", type=_positive(int), metavar="N",
                   help="stop early after N epochs without a better val_loss (default: never)")
    t.add_argument("--seed", type=_nonnegative(int), default=0,
                   help="seed of the split, weights and batch order (default: 0)")
    t.add_argument("--dtype", default="float32", choices=("float32", "float64"), help="default: float32")
    t.add_argument("--precision", default="fp32", choices=tuple(PRECISIONS),
                   help="bf16/fp16: the forward and backward passes read a bfloat16/float16 working copy of the "
                        "float32 master weights, and each micro-batch's weight gradient is rounded to it; fp16 "
                        "adds dynamic loss scaling (default: fp32)")
    t.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the model, the data and the engine live (cuda: CuPy, extra cuda12/cuda13; "
                        "default: cpu)")
    t.add_argument("--compress", type=_compress_spec, metavar="METHOD[:k=v,...]",
                   help=f"compress the gradient every step ({', '.join(COMPRESSORS)}), e.g. topk:ratio=0.01; "
                        "the keys are the compressor's arguments (arraytrain.compress)")
    t.add_argument("--shard-state", action="store_true",
                   help="under mpiexec -n K: each process keeps and updates 1/K of the optimizer state (and of "
                        "the float32 master weights with --precision bf16/fp16); element-wise optimizers only")
    t.add_argument("--overlap", action="store_true",
                   help="under mpiexec: exchange each layer's gradient while the earlier layers still "
                        "back-propagate (buckets of 25 MiB); off by default: on one machine's shared memory "
                        "it competes with the backward pass for the cores (docs/processes.md)")
    t.add_argument("--error-feedback", action="store_true",
                   help="with --compress: keep what was not sent and add it to the next step's gradient "
                        "(randomk and vsa then keep their values unscaled: rescale=False, unbiased=False)")
    t.add_argument("--predict", type=_predict_spec, nargs="?", const="", metavar="k=v,...",
                   help="gradient prediction (PhaseTrainer): cycles of 'full' steps with forward and backward, "
                        "then 'predict' steps on a gradient extrapolated from the last 'history' true ones, every "
                        "'correct'-th of them a true one; keys full, predict, correct, history, beta, adaptive "
                        "(default: " + ",".join(f"{k}={PREDICT_DEFAULTS[v]:g}" for k, v in PREDICT_KEYS.items()
                                                if k != "adaptive") + ")")
    t.add_argument("--prune", type=_fraction, metavar="RATIO",
                   help="magnitude pruning: zero this fraction of the weights (not the biases), one global cut, "
                        "kept at zero by every optimizer step")
    t.add_argument("--prune-epochs", type=_epoch_range, metavar="N[-M]",
                   help="with --prune: prune at the end of epoch N, or gradually (cubic schedule) at the end of "
                        "each epoch N..M (default: 1 to half of --epochs)")
    t.add_argument("--quantize-eval", choices=("int8",),
                   help="also report the test accuracy with the weights quantized to int8 (symmetric, per output "
                        "channel; biases and activations stay float)")
    t.add_argument("--data", metavar="FILE.npz", help="arrays X, y and optionally X_test, y_test")
    t.add_argument("--val-fraction", type=_fraction, default=0.15, metavar="F", help="default: 0.15")
    t.add_argument("--test-fraction", type=_fraction, default=0.2, metavar="F", help="without X_test (default: 0.2)")
    t.add_argument("--save", metavar="FILE", help="save the run (engine, epoch, history) at the end; "
                   "{epoch} in FILE is replaced by the epoch")
    t.add_argument("--checkpoint-every", type=_positive(int), metavar="N", help="with --save: also every N epochs")
    t.add_argument("--resume", metavar="FILE", help="continue from a checkpoint written by --save")
    t.add_argument("--json", metavar="FILE", help="write a JSON summary")
    t.add_argument("--plot", metavar="FILE.png", help="draw the loss and accuracy curves (matplotlib; the "
                   "extension picks the format)")
    t.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none anyway when stderr is not a terminal)")
    t.set_defaults(func=train)
    precompile.add_parser(sub)
    return parser


# -- building blocks ----------------------------------------------------------------------------
def _optimizer(args):
    cls = optimizers()[args.optimizer]
    params = inspect.signature(cls).parameters
    kwargs = {"lr": args.lr if args.lr is not None else (0.05 if args.optimizer == "sgd" else params["lr"].default)}
    for flag, key in (("weight_decay", "weight_decay"), ("momentum", "momentum")):
        value = getattr(args, flag)
        if value is None:
            continue
        if key not in params:
            raise _usage(f"--{flag.replace('_', '-')}: {args.optimizer} has no {key}")
        kwargs[key] = value
    if args.state_dtype is not None:
        if "state_dtype" not in params:
            raise _usage(f"--state-dtype: {args.optimizer} keeps no element-wise state to store in another dtype")
        kwargs["state_dtype"] = args.state_dtype
    if cls is optim.Muon:  # Muon takes the weight matrices; the biases go to AdamW (its defaults)
        kwargs["fallback"] = optim.AdamW()
    try:
        return cls(**kwargs)
    except ArrayTrainError as exc:
        given = " ".join(f"--{flag.replace('_', '-')} {getattr(args, flag):g}" for flag in ("lr", "weight_decay", "momentum")
                         if getattr(args, flag) is not None)
        raise _usage(f"--optimizer {args.optimizer}{' ' + given if given else ''}: {exc}") from None


def _schedule(args, steps_per_epoch: int):
    if args.schedule == "constant" and not args.warmup:
        return None
    total = max(1, steps_per_epoch * args.epochs - args.warmup)
    if args.schedule == "constant":
        sched = schedules.Constant()
    elif args.schedule == "cosine":
        sched = schedules.CosineAnnealingLR(total)
    elif args.schedule == "step":
        every = args.step_epochs or max(1, args.epochs // 3)
        sched = schedules.StepLR(max(1, every * steps_per_epoch), gamma=args.gamma)
    else:
        sched = schedules.ReduceLROnPlateau(schedules.Constant(), factor=0.1, patience=args.plateau_patience)
    return schedules.Warmup(args.warmup, then=sched) if args.warmup else sched


def _compressor(args):
    if args.compress is None:
        return None
    from . import compress

    method, kwargs = args.compress
    cls = getattr(compress, COMPRESSORS[method])
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise _usage(f"--compress {method}: {exc}") from None
    if args.error_feedback:
        # error feedback needs a contraction (ErrorFeedback refuses the rest): random-k and VSA send their
        # kept values unscaled unless told otherwise (rescaled by n/k, the random-k 5% run went to NaN)
        kwargs = {**{"randomk": {"rescale": False}, "vsa": {"unbiased": False}}.get(method, {}), **kwargs}
    try:
        comp = cls(**kwargs)
        return compress.ErrorFeedback(comp) if args.error_feedback else comp
    except ArrayTrainError as exc:
        raise _usage(f"--compress {_fmt_compress(args.compress)}{' --error-feedback' if args.error_feedback else ''}: "
                     f"{exc}") from None


def _fmt_compress(spec) -> str:
    method, kwargs = spec
    return method + (":" + ",".join(f"{k}={v}" for k, v in kwargs.items()) if kwargs else "")


def _from_launcher(keys: tuple, default: int) -> int:
    """The first of ``keys`` that the launcher (MPICH's Hydra, Open MPI) set, read without initialising MPI."""
    for key in keys:
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return default


def _launched_ranks() -> int:
    """The number of processes ``mpiexec`` started (1 when not under mpiexec)."""
    return _from_launcher(("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"), 1)


def _launched_rank() -> int:
    """This process's rank as ``mpiexec`` set it (0 when not under mpiexec)."""
    return _from_launcher(("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID"), 0)


def _comm():
    """An MPIComm when ``mpiexec`` started more than one process, else None (one process)."""
    if _launched_ranks() <= 1:
        return None
    from .distributed import MPIComm

    return MPIComm()


def _gpu_comm(comm):
    """``--device cuda`` under mpiexec: this process's GPU (its rank among the processes on its
    machine), then an NCCLComm over the same processes. Each rank's problem (no CuPy, fewer GPUs than
    processes on a machine, no NCCL) becomes one usage error on every rank."""
    from mpi4py import MPI

    local = comm.comm.Split_type(MPI.COMM_TYPE_SHARED)
    here, rank = local.Get_size(), local.Get_rank()
    local.Free()

    def select():
        from .backend import require_cuda

        try:
            require_cuda("--device cuda")
            import cupy

            gpus = cupy.cuda.runtime.getDeviceCount()
        except ArrayTrainError as exc:
            raise _usage(f"--device cuda under mpiexec: {exc}") from None
        if here > gpus:
            raise _usage(f"--device cuda under mpiexec: {here} processes on one machine, {gpus} GPU(s) there: "
                         "one GPU per process (mpiexec -n K with K at most the GPUs of each machine)")
        cupy.cuda.Device(rank).use()

    _agreed(comm, select)
    from .distributed import NCCLComm

    try:
        return NCCLComm(comm.comm)  # the same error on every rank when one cannot run NCCL
    except ArrayTrainError as exc:
        raise _usage(f"--device cuda under mpiexec: {exc}") from None


def _load_data(args):
    from .nn import load_digits, load_npz

    kw = dict(seed=args.seed, val_fraction=args.val_fraction, test_fraction=args.test_fraction, dtype=args.dtype)
    if args.data:
        try:
            return load_npz(args.data, **kw)
        except DataError as exc:
            text = str(exc)
            raise _usage(f"--data {text}" if text.startswith(f"{args.data}: ") else f"--data {args.data}: {text}") \
                from None
    return load_digits(**kw)


def _jsonable(v):
    """Plain JSON values: arrays as lists, NumPy scalars as Python ones, NaN/Inf as None."""
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, np.ndarray):
        return _jsonable(v.tolist())
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _history(history: list, batches_per_epoch: int) -> list:
    """The epochs' logs as JSON (confusion matrices left out), each with its running totals named
    by their unit: ``optimizer_steps`` and ``micro_batches``."""
    out = []
    for h in history:
        entry = {k: v for k, v in h.items() if not k.endswith("confusion_matrix") and k != "steps"}
        entry["micro_batches"] = h["epoch"] * batches_per_epoch
        out.append(_jsonable(entry))
    return out


def _plot(path, history, test_accuracy):
    from matplotlib.figure import Figure

    epochs = [h["epoch"] for h in history]
    fig = Figure(figsize=(10, 4))
    ax_loss, ax_acc = fig.subplots(1, 2)
    ax_loss.plot(epochs, [h["loss"] for h in history], label="train")
    if history and "val_loss" in history[0]:
        ax_loss.plot(epochs, [h["val_loss"] for h in history], label="validation")
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
    for key, label in (("accuracy", "train"), ("val_accuracy", "validation")):
        if history and key in history[0]:
            ax_acc.plot(epochs, [h[key] for h in history], label=label)
    ax_acc.axhline(test_accuracy, color="gray", linestyle="--", label=f"test {test_accuracy:.4f}")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _fmt_split(split: dict) -> str:
    total = sum(split.values())
    parts = [f"{k} {v:.2f} s ({100 * v / total:.0f}%)" for k, v in split.items() if v > 0] if total else []
    return ", ".join(parts)


def _to_cuda(data):
    """The data set's arrays on the current CUDA device (one explicit copy each)."""
    import dataclasses

    from .backend import require_cuda

    require_cuda("--device cuda")
    import cupy

    arrays = {f.name: cupy.asarray(getattr(data, f.name)) for f in dataclasses.fields(data)
              if f.name.startswith(("x_", "y_"))}
    return dataclasses.replace(data, **arrays)


# -- checks before anything runs ---------------------------------------------------------------------
def _check_output(flag: str, path: str) -> str:
    """``path`` can be written: its directory exists and is writable, it is not a directory, and the
    file itself can be created there (or opened for writing, if it exists)."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise _usage(f"{flag} {path}: is a directory")
    parent = os.path.dirname(full)
    if not os.path.isdir(parent):
        raise _usage(f"{flag} {path}: no such directory {parent}")
    # the second exists(): another rank's probe file (see _try_create) may vanish between the two calls
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(full) and not os.access(full, os.W_OK)
                                                     and os.path.exists(full)):
        raise _usage(f"{flag} {path}: not writable")
    _try_create(flag, path, full)
    return full


def _try_create(flag: str, path: str, full: str) -> None:
    """Create ``full`` and remove it again, or open an existing regular file for writing without
    truncating it: what the permission bits do not tell (/proc, a read-only mount, a name too long
    for the file system) fails here, before training, and nothing is left behind or changed."""
    if os.path.lexists(full):
        if not os.path.isfile(full):  # a device such as /dev/stdout, written in place: not probed
            return
        try:
            os.close(os.open(full, os.O_WRONLY))  # no O_TRUNC: the file keeps its bytes and its times
        except FileNotFoundError:  # another rank's probe file, removed meanwhile
            return
        except OSError as exc:
            raise _usage(f"{flag} {path}: cannot open the file for writing ({exc.strerror or exc})") from None
        return
    try:
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process (a rank of the same run) probes the same name now
        return
    except OSError as exc:
        raise _usage(f"{flag} {path}: cannot create the file there ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(full)


def _check_input(flag: str, path: str) -> str:
    full = os.path.abspath(path)
    if not os.path.exists(full):
        raise _usage(f"{flag} {path}: no such file")
    if os.path.isdir(full):
        raise _usage(f"{flag} {path}: is a directory")
    if not os.access(full, os.R_OK):
        raise _usage(f"{flag} {path}: not readable")
    return full


def _check_plot_format(path: str) -> None:
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in kinds:
        got = f"a .{ext} file" if ext else "a file name without an extension"
        raise _usage(f"--plot {path}: matplotlib cannot write {got}; use one of {', '.join(sorted(kinds))}")


def _validate(args, comm) -> bool:
    """Every check that needs no data: flags, their combinations, files and optional packages.

    Runs before the data are loaded, so a bad option costs no training. Returns
    whether the progress bar is shown.
    """
    from .nn.data import require

    _check_flags(args, comm)
    _check_files(args)
    show_bar = not args.no_progress and (comm is None or comm.rank == 0) and sys.stderr.isatty()
    if show_bar:
        require("tqdm", "train", "the progress bar")
    if args.plot:
        require("matplotlib", "plot", "--plot")
        _check_plot_format(args.plot)
    return show_bar


def _agreed(comm, check):
    """``check()``; under mpiexec every rank raises the first failing rank's usage error, so that no
    rank goes on to wait in a collective for one that stopped (a file probe can differ by rank)."""
    try:
        result, problem = check(), None
    except UsageError as exc:
        result, problem = None, exc
    if comm is not None:
        found = [p for p in comm.gather_objects(None if problem is None else str(problem)) if p is not None]
        if found:
            raise UsageError(found[0])
    if problem is not None:
        raise problem
    return result


def _check_flags(args, comm) -> None:
    """The flags' combinations."""
    if args.checkpoint_every and not args.save:
        raise _usage("--checkpoint-every needs --save FILE")
    if args.step_epochs and args.schedule != "step":
        raise _usage("--step-epochs applies to --schedule step only")
    if args.error_feedback and args.compress is None:
        raise _usage("--error-feedback needs --compress METHOD")
    if args.overlap:
        if comm is None:
            raise _usage("--overlap needs several processes: mpiexec -n K arraytrain train --overlap")
        if args.compress is not None:
            raise _usage("--overlap with --compress: a compressor's exchange needs the whole window's gradient")
    if args.shard_state:
        if comm is None:
            raise _usage("--shard-state needs several processes: mpiexec -n K arraytrain train --shard-state")
        if args.compress is not None:
            raise _usage("--shard-state with --compress: a compressor's exchange replaces the reduce-scatter; "
                         "use one or the other")
        why = optimizers()[args.optimizer].shard_refusal
        if why is not None:
            raise _usage(f"--shard-state with --optimizer {args.optimizer}: {why}")
    if args.state_dtype in ("bfloat16", "8bit") and args.dtype != "float32":
        raise _usage(f"--state-dtype {args.state_dtype} needs float32 parameters, got --dtype {args.dtype}")
    if args.prune_epochs is not None:
        if args.prune is None:
            raise _usage("--prune-epochs needs --prune RATIO")
        if args.prune_epochs[1] > args.epochs:
            raise _usage(f"--prune-epochs {_fmt_range(args.prune_epochs)}: past --epochs {args.epochs}")
    if args.predict is not None:
        if args.accumulation != 1:
            raise _usage(f"--predict needs one micro-batch per optimizer step (--accumulation 1), "
                         f"got --accumulation {args.accumulation}")
        if args.precision != "fp32":
            raise _usage("--predict with --precision: gradient prediction records the float32 gradient "
                         "buffer, which a working copy bypasses; use one or the other")
        if comm is not None:
            raise _usage("--predict runs in one process (the PhaseTrainer does not shard batches over mpiexec's "
                         "processes)")
        if args.predict["adaptive"]:
            from .phase import PhaseSchedule

            try:
                PhaseSchedule(args.predict["full_steps"], args.predict["predict_steps"],
                              args.predict["correct_every"], adaptive=True)
            except ArrayTrainError as exc:
                raise _usage(f"--predict: {exc}") from None
    if args.precision != "fp32":
        if args.dtype != "float32":
            raise _usage(f"--precision {args.precision} keeps float32 master weights: it needs --dtype float32")
    if not args.data:  # digits: the test split is cut from the data (see _check_files for --data)
        _check_fractions(args)


def _check_fractions(args) -> None:
    """The validation and test splits leave a training split."""
    if args.val_fraction + args.test_fraction >= 1:
        raise _usage(f"--val-fraction {args.val_fraction:g} and --test-fraction {args.test_fraction:g} leave no "
                     f"training data: together they must be < 1")


def _has_test_split(path: str) -> bool:
    """Whether the .npz at ``path`` names X_test (read from the archive's directory, not its arrays);
    an unreadable file says False and leaves the message to the loader."""
    try:
        with np.load(path, allow_pickle=False) as f:
            return "X_test" in f.files
    except Exception:
        return False


def _check_files(args) -> None:
    """The outputs can be written, the inputs read, and no file is named twice."""
    outputs = {}
    if args.save:
        try:
            first = args.save.format(epoch=1)
        except (KeyError, IndexError, ValueError):
            raise _usage(f"--save {args.save}: the only field a file name may hold is {{epoch}}") from None
        outputs["--save"] = _check_output("--save", first)
    if args.json:
        outputs["--json"] = _check_output("--json", args.json)
    if args.plot:
        outputs["--plot"] = _check_output("--plot", args.plot)
    inputs = {}
    if args.data:
        inputs["--data"] = _check_input("--data", args.data)
        if not _has_test_split(args.data):  # else --test-fraction is not used
            _check_fractions(args)
    if args.resume:
        inputs["--resume"] = _check_input("--resume", args.resume)
    seen = {}
    for flag, path in [*outputs.items(), *inputs.items()]:
        other = seen.setdefault(path, flag)
        if other != flag and {flag, other} != {"--save", "--resume"}:
            raise _usage(f"{other} and {flag} name the same file {path}")


def _prune_epochs(args) -> tuple[int, int]:
    """The first and last epoch at whose end --prune prunes (default: 1 to half of --epochs)."""
    return args.prune_epochs or (1, max(1, args.epochs // 2))


def _fmt_range(epochs: tuple) -> str:
    lo, hi = epochs
    return str(lo) if lo == hi else f"{lo}-{hi}"


# -- the command -----------------------------------------------------------------------------------
def train(args) -> int:
    from . import nn

    comm = _comm()
    lead = comm is None or comm.rank == 0  # only rank 0 prints and writes files
    out = sys.stdout if lead else open(os.devnull, "w")  # noqa: SIM115 - closed with the process
    show_bar = _agreed(comm, lambda: _validate(args, comm))
    if args.device == "cuda" and comm is not None:
        comm = _gpu_comm(comm)  # one GPU per process, NCCL for the exchange
    optimizer, compressor = _optimizer(args), _compressor(args)  # their argument checks, before the data

    data = _load_data(args)
    if args.device == "cuda":
        data = _to_cuda(data)
    model = nn.MLP([data.num_features, *args.hidden, data.num_classes], activation=args.activation,
                   dtype=np.dtype(args.dtype))
    params = model.init(seed=args.seed)  # NumPy: the engine moves them to the device once
    batches = math.ceil(len(data.y_train) / args.batch_size)
    sched = _schedule(args, max(1, batches // args.accumulation))
    extra_engine = {}
    if args.precision != "fp32":
        extra_engine["working_dtype"] = PRECISIONS[args.precision]
    if args.precision == "fp16":
        from .amp import LossScaler

        extra_engine["loss_scaler"] = LossScaler()
    engine = Engine(params, optimizer, accumulation_steps=args.accumulation, max_grad_norm=args.clip,
                    zero_grad_on_step=False, device=args.device, compressor=compressor, comm=comm, schedule=sched,
                    shard_state=args.shard_state, overlap=args.overlap, **extra_engine)
    if args.prune is not None:  # a mask from the start, so that every checkpoint of the run holds one
        from .prune import MaskBuffer

        engine.set_mask(MaskBuffer.ones(engine.layout))
    if engine.working is None:  # with a working copy the trainer binds the model to it
        model.bind(engine)
    config = {k: v for k, v in vars(args).items() if k != "func"}

    callbacks = []
    progress = nn.ProgressBar(disable=False) if show_bar else None
    if progress is not None:
        callbacks.append(progress)
    if args.prune is not None:
        lo, hi = _prune_epochs(args)
        callbacks.append(MagnitudePruning(args.prune, lo, hi))

    def say(line):  # a line on stdout that does not break the progress bar
        if progress is not None:
            progress.write(line, file=out)
        else:
            print(line, file=out, flush=True)

    def show(trainer, epoch, logs):
        line = f"epoch {epoch}/{args.epochs}  loss {logs['loss']:.4f}  lr {logs['lr']:.3g}"
        if "val_accuracy" in logs:
            line += f"  val_loss {logs['val_loss']:.4f}  val_accuracy {logs['val_accuracy']:.4f}"
        if "sparsity" in logs:
            line += f"  sparsity {logs['sparsity']:.3f}"
        if logs.get("skipped_steps"):
            line += f"  skipped {logs['skipped_steps']}"
        if "loss_scale" in logs:
            line += f"  loss_scale {logs['loss_scale']:g}"
        line += f"  ({logs['time']:.2f} s)"
        say(line)

    profiler = nn.Profiler()
    payload = _PayloadBytes()
    callbacks += [nn.LambdaCallback(on_epoch_end=show, on_batch_end=payload.add), profiler]
    if args.patience:
        callbacks.append(nn.EarlyStopping("val_loss", patience=args.patience))
    if args.schedule == "plateau":
        callbacks.append(nn.ReduceLROnPlateauCallback("val_loss"))

    def run_extra(trainer) -> dict:  # what a checkpoint keeps besides the engine (and the epoch)
        return {"config": _jsonable(config), "history": _history(trainer.history, batches)}

    if args.save and args.checkpoint_every:
        kind = nn.PhaseCheckpoint if args.predict is not None else nn.Checkpoint
        checkpoint = kind(args.save, every=args.checkpoint_every, extra=run_extra)
        told = []

        def tell_saved(trainer, *_):  # each save the callback made, with its epoch (after it, in the list)
            for path in checkpoint.saved[len(told):]:
                told.append(path)
                say(f"saved {path} (epoch {trainer.epoch})")

        callbacks += [checkpoint, nn.LambdaCallback(on_epoch_end=tell_saved, on_train_end=tell_saved)]
    common = dict(batch_size=args.batch_size, seed=args.seed, callbacks=callbacks)
    if args.predict is not None:
        trainer = nn.PhaseTrainer(model, engine, **args.predict, **common)
    else:
        trainer = nn.Trainer(model, engine, **common)

    start = _resume(args, trainer) if args.resume else 0
    print(_header(args, data, model, engine, comm, start), file=out)
    try:
        with _abort_on_error(comm):  # one rank failing mid-run must not leave the others waiting
            history = trainer.fit(data.x_train, data.y_train, epochs=args.epochs,
                                  validation=(data.x_val, data.y_val), initial_epoch=start)
    except NonFiniteError as exc:
        raise type(exc)(f"{exc}; the training diverged: try a smaller --lr (now {engine.optimizer.lr:g})") from None
    test = trainer.evaluate(data.x_test, data.y_test)
    quant = _int8_evaluation(trainer, model, engine, data) if args.quantize_eval else None
    split = profiler.summary(trainer)["seconds"]
    for line in _summary(args, trainer, test, quant, split, payload, len(data.y_test), start):
        print(line, file=out)
    if args.save and not args.checkpoint_every:  # else the Checkpoint callback has written the last epoch
        saved = args.save.format(epoch=trainer.epoch)
        _save(args, trainer, saved, {**run_extra(trainer), "epoch": trainer.epoch})
        print(f"saved {saved} (epoch {trainer.epoch})", file=out)
    if not lead:
        return 0
    if args.json:
        report = _report(args, trainer, test, quant, split, payload, batches, start)
        report.update(processes=1 if comm is None else comm.size, dataset=data.summary(),
                      parameters=model.num_params, config=config)
        with open(args.json, "w") as f:
            json.dump(_jsonable(report), f, indent=2)
        print(f"wrote the JSON summary to {args.json}", file=out)
    if args.plot:
        _plot(args.plot, _history(history, batches), test["accuracy"])
        print(f"drew the loss and accuracy curves to {args.plot}", file=out)
    return 0


# What the throughput figure measures, said with it (the README's and the JSON's wording too).
THROUGHPUT_MEASURES = ("training samples per second of an epoch's micro-batches after the warm-up: fetching "
                       "the batch, forward and loss, backward, the optimizer step and the per-batch callbacks; "
                       "not the evaluation, the epoch's metrics or the epoch-end callbacks")


def _throughput(trainer, start: int) -> dict:
    """The run's throughput as the benchmarks report a time: per timed epoch of this run (the warm-up
    micro-batches left out), the best epoch and the median of them; the mean over the run besides."""
    rates = [h["samples_per_second"] for h in trainer.history
             if h.get("epoch", 0) > start and isinstance(h.get("samples_per_second"), float)
             and math.isfinite(h["samples_per_second"])]
    return {"best": max(rates) if rates else None, "median": statistics.median(rates) if rates else None,
            "mean": trainer.samples_per_second if rates else None, "epochs": len(rates),
            "measures": THROUGHPUT_MEASURES}


def _summary(args, trainer, test, quant, split, payload, n_test, start) -> list[str]:
    """The lines after training: test figures, warm-up, throughput and time split, each capability's."""
    engine, ran = trainer.engine, trainer.steps
    lines = [f"test accuracy {test['accuracy']:.4f} ({n_test} samples), macro F1 {test['f1']:.4f}"]
    if quant is not None:
        lines.append(f"int8 weights (symmetric, per output channel): test accuracy {quant['test_accuracy']:.4f} "
                     f"({100 * (quant['test_accuracy'] - test['accuracy']):+.2f} points), weights "
                     f"{quant['int8_bytes']:,} bytes instead of {quant['float_bytes']:,}")
    if ran == 0:
        lines.append(f"nothing left to train: --resume {args.resume} is at epoch {start} of --epochs {args.epochs} "
                     f"({engine.state.step} optimizer steps); the test figures above are its weights'; raise "
                     "--epochs to train on")
        return lines
    lines.append(f"warm-up: {trainer.warmup_seconds:.2f} s in {trainer.warmup_batches} micro-batch"
                 f"{'es' if trainer.warmup_batches != 1 else ''} (the first of each kind: kernel compile or cache "
                 "load), left out of the figures below")
    tp = _throughput(trainer, start)
    timed = (f"{ran - trainer.warmup_batches} of the {ran} micro-batches of this run timed "
             f"({engine.state.step} optimizer steps in all)")
    if tp["epochs"]:
        lines.append(f"throughput: {tp['best']:,.0f} samples/s in the fastest epoch, {tp['median']:,.0f} the median "
                     f"of {tp['epochs']} epoch{'s' if tp['epochs'] != 1 else ''}; {timed}")
        lines.append(f"  (measures {THROUGHPUT_MEASURES})")
    else:
        lines.append(f"throughput: not measured, every micro-batch was a warm-up one; {timed}")
    lines.append(f"time split: {_fmt_split(split)}")
    if args.predict is not None:
        st = trainer.stats
        speed = "not measured" if st.wall_speedup is None else f"{st.wall_speedup:.2f}x"
        lines.append(f"gradient prediction: {st.steps} optimizer steps, {st.backward_passes} backward passes "
                     f"(step ratio {st.step_ratio:.2f}, a count); speedup by the per-phase wall clock {speed}")
    if args.prune is not None:
        lines.append(f"pruning: {100 * MagnitudePruning.sparsity(engine):.1f}% of the weights are zero")
    if args.precision != "fp32":
        skipped = sum(h.get("skipped_steps") or 0 for h in trainer.history)
        lines.append(f"precision {args.precision}: {skipped} optimizer steps skipped for a non-finite gradient"
                     + (f", loss scale now {engine.loss_scale:g}" if engine.loss_scaler is not None else ""))
    if payload.steps:
        lines.append(f"compression: {payload.sent / payload.steps:,.0f} bytes/step sent by each process vs "
                     f"{payload.dense / payload.steps:,.0f} dense ({payload.dense / payload.sent:.1f}x fewer)")
    return lines


def _report(args, trainer, test, quant, split, payload, batches, start) -> dict:
    """The JSON summary's figures (the caller adds the data set, model and config)."""
    engine, history = trainer.engine, trainer.history
    tp = _throughput(trainer, start) if trainer.steps else None
    return {
        "test_accuracy": test["accuracy"],
        "test_loss": test["loss"],
        "test_f1": test["f1"],
        "test_precision": test["precision"],
        "test_recall": test["recall"],
        "test_confusion_matrix": test["confusion_matrix"],
        "samples_per_second": tp["best"] if tp else None,  # the headline figure: the fastest epoch
        "throughput_samples_per_second": tp,
        "warmup_seconds": trainer.warmup_seconds,
        "warmup_micro_batches": trainer.warmup_batches,
        "epochs": trainer.epoch,
        "final_loss": history[-1]["loss"] if history else None,
        "final_val_accuracy": history[-1].get("val_accuracy") if history else None,
        "optimizer_steps": engine.state.step,
        "micro_batches": trainer.epoch * batches,
        "micro_batches_this_run": trainer.steps,
        "precision": args.precision,
        "loss_scale": engine.loss_scale if engine.loss_scaler is not None else None,
        "prediction": _prediction_report(trainer) if args.predict is not None else None,
        "sparsity": MagnitudePruning.sparsity(engine) if args.prune is not None else None,
        "quantized": quant,
        "payload_bytes_per_step": payload.sent / payload.steps if payload.steps else None,
        "dense_bytes_per_step": payload.dense / payload.steps if payload.steps else None,
        "time_split_seconds": split,
        "history": _history(history, batches),
    }


def _header(args, data, model, engine, comm, start) -> str:
    """The line that says what is about to run."""
    how = "" if comm is None else f", {comm.size} processes (each a shard of every batch)"
    if args.shard_state:
        mem = engine.memory()
        how += (f", optimizer state sharded ({mem['state'] / 2**20:.2f} MiB of it per process"
                + (f", float32 masters {mem['master'] / 2**20:.2f} MiB" if mem["master"] else "") + ")")
    if engine.compressor is not None:
        how += f", compressed: {engine.compressor!r}"
    if args.precision != "fp32":
        how += f", precision {args.precision} (float32 master weights"
        how += ", dynamic loss scaling)" if engine.loss_scaler is not None else ")"
    if args.predict is not None:
        p = args.predict
        how += (f", gradient prediction: full {p['full_steps']}, predict {p['predict_steps']}, correct every "
                f"{p['correct_every']}, history {p['history']}, beta {p['correction_beta']:g}"
                + (", adaptive" if p["adaptive"] else ""))
    if args.prune is not None:
        lo, hi = _prune_epochs(args)
        how += (f", pruning {100 * args.prune:g}% of the weights at the end of epoch{'s' if hi > lo else ''} "
                f"{_fmt_range((lo, hi))}")
    if args.quantize_eval:
        how += f", {args.quantize_eval} evaluation"
    return (f"{data.summary()}; model {list(model.sizes)} ({model.num_params} parameters), "
            f"{engine.optimizer!r}{how}" + (f", resumed at epoch {start}" if start else ""))


def _resume(args, trainer) -> int:
    """Load ``--resume`` into the trainer's engine (and phase controller); return its epoch."""
    _check_same_model(args)
    if args.predict is not None:
        from .phase import load
    else:
        from .checkpoint import load
    try:
        extra = load(args.resume, trainer.controller if args.predict is not None else trainer.engine)
    except CheckpointError as exc:
        hint = ""
        if "params:" in str(exc):
            hint = ("; the checkpoint holds another model: resume with the --hidden, --activation and --dtype "
                    "it was trained with")
        raise _usage(f"--resume {exc}{hint}") from None
    start = extra.get("epoch") if isinstance(extra, dict) else None
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise _usage(f"--resume {args.resume}: the checkpoint has no epoch count "
                     "(was it written by arraytrain train --save?)")
    if start > args.epochs:
        raise _usage(f"--resume {args.resume}: the checkpoint is at epoch {start}, past --epochs {args.epochs}")
    history = extra.get("history")
    if isinstance(history, list):  # the epochs before the checkpoint, so the JSON and the plot cover the run
        trainer.history = [h for h in history if isinstance(h, dict) and isinstance(h.get("epoch"), int)
                           and h["epoch"] <= start]
    return start


# the flags that shape the model: a resumed run must give the same ones
MODEL_FLAGS = ("hidden", "activation")


def _check_same_model(args) -> None:
    """Refuse ``--resume`` of a run whose model flags (``MODEL_FLAGS``) differ from this one's, naming them.

    They are read from the ``config`` that ``--save`` keeps in the checkpoint's ``extra`` (the JSON
    in the safetensors metadata, checkpoint format 1); a file without one is left to the loader.
    """
    try:
        from safetensors import safe_open

        with safe_open(args.resume, "np") as f:
            config = json.loads((f.metadata() or {}).get("extra", "{}")).get("config")
    except Exception:  # not a checkpoint of this command: the loader says what is wrong
        return
    if not isinstance(config, dict):
        return
    differ = [f for f in MODEL_FLAGS if f in config and config[f] != getattr(args, f)]
    if differ:
        def show(flag, value):
            return f"--{flag} " + (",".join(map(str, value)) if isinstance(value, list) else str(value))

        raise _usage(f"--resume {args.resume}: the checkpoint's model was trained with "
                     f"{' '.join(show(f, config[f]) for f in differ)}, this run asks for "
                     f"{' '.join(show(f, getattr(args, f)) for f in differ)}: the architecture differs; "
                     "give the flags it was trained with")


def _save(args, trainer, path, extra) -> None:
    if args.predict is not None:
        from .phase import save

        save(path, trainer.controller, extra=extra)
    else:
        from .checkpoint import save

        save(path, trainer.engine, extra=extra)


def _prediction_report(trainer) -> dict:
    st = trainer.stats
    return {"optimizer_steps": st.steps, "backward_passes": st.backward_passes, "step_ratio": st.step_ratio,
            "wall_speedup": st.wall_speedup, "full_steps": trainer.schedule.full_steps,
            "predict_steps": trainer.schedule.predict_steps}


def _int8_evaluation(trainer, model, engine, data) -> dict:
    """The test figures of the model with its weights quantized to int8 and back (the biases stay float)."""
    from . import nn
    from .buffer import FlatBuffer
    from .nn import array_namespace, to_numpy
    from .quantize import dequantize_params, quantize_params

    host = FlatBuffer(engine.layout, to_numpy(engine.gather_params().flat))  # a copy; sharded: gathered
    # Dense weights are (in, out): axis 1 is the output channel
    q = quantize_params(host, scheme="symmetric", granularity="channel", axis=1)
    float_bytes = sum(host[name].nbytes for name in q)
    dequantize_params(q, into=host)
    qmodel = nn.MLP(model.sizes, activation=model.activation, dtype=model.dtype)
    xp = array_namespace(data.x_test)
    qmodel.bind({name: xp.asarray(host[name]) for name in qmodel.shapes})
    test = trainer.evaluate(data.x_test, data.y_test, model=qmodel)
    return {"scheme": "int8, symmetric, per output channel", "test_accuracy": test["accuracy"],
            "test_loss": test["loss"], "test_f1": test["f1"], "int8_bytes": sum(t.nbytes for t in q.values()),
            "float_bytes": float_bytes}


class _PayloadBytes:
    """Adds up the measured payload bytes of every applied step (``add`` is an ``on_batch_end`` hook)."""

    sent = dense = steps = 0

    def add(self, trainer, step, logs):
        report = logs["report"]
        if report is not None and report.payload_bytes is not None:
            self.sent += report.payload_bytes
            self.dense += report.dense_bytes
            self.steps += 1


def _abort_on_error(comm):
    if comm is None:
        return contextlib.nullcontext()
    from .distributed import abort_on_error

    return abort_on_error()


def main(argv=None) -> int:
    """Entry point of the ``arraytrain`` console script and ``python -m arraytrain``."""
    parser = build_parser()
    try:
        args, rest = parser.parse_known_args(argv)
        if rest:
            where = f"{PROG} {args.command}" if args.command else PROG
            raise UsageError(f"{where}: error: unrecognized arguments: {' '.join(rest)}")
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        return args.func(args)
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
    except UsageError as exc:
        if _launched_rank() == 0:  # every rank read the same arguments: one line, not one per process
            print(str(exc), file=sys.stderr)
        return 2
    except (ArrayTrainError, OSError) as exc:
        where = f"{PROG} {args.command}" if "args" in locals() else PROG
        print(f"{where}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
