"""``arraytrain train``'s arguments: the parser, its value types and every check that needs no data.

The checks run before the data are loaded (:func:`validate`): flags and their combinations,
the files of ``--save``/``--json``/``--plot`` (each created and removed again, or an existing
one opened for writing without truncating it), the plot format, the input files and the
optional packages. A failure is a :class:`UsageError`: one line on stderr, exit status 2.
Under ``mpiexec`` every rank raises the first failing rank's error (:func:`agreed`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

from .. import optim
from ..errors import ArrayTrainError

PROG = "arraytrain"


SCHEDULES = ("constant", "cosine", "step", "plateau")


ACTIVATIONS = ("relu", "gelu", "tanh", "sigmoid")


class UsageError(Exception):
    """A command-line problem, reported as one line."""


def usage(message: str) -> UsageError:
    return UsageError(f"{PROG} train: error: {message}")


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise UsageError(f"{self.prog}: error: {message}")


#: ``{name: class}`` of the optimizers ``--optimizer`` takes (:func:`arraytrain.optim.by_name`).
optimizers = optim.by_name


def positive(kind):
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


def nonnegative(kind):
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


def fraction(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}")
    return value


def hidden_widths(text):
    try:
        sizes = [int(s) for s in text.split(",")] if text.strip() else []
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer widths such as 128,64, got {text!r}") from None
    if any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"layer widths must be >= 1, got {text!r}")
    return sizes


COMPRESSORS = {"topk": "TopK", "randomk": "RandomK", "int8": "Int8Block", "sign": "Sign", "ternary": "Ternary",
               "powersgd": "PowerSGD", "vsa": "VSA", "auto": "Auto"}


#: The methods whose algorithm includes error feedback (PowerSGD's Algorithm 2, Vogels et al. 2019): the
#: CLI wraps them in ErrorFeedback unless told ``--no-error-feedback``.
FEEDBACK_BY_DEFAULT = frozenset({"powersgd"})


def error_feedback(args) -> bool:
    """Whether ``--compress`` runs with error feedback: the flag when given, else the method's default."""
    if args.error_feedback is not None:
        return args.error_feedback
    return args.compress is not None and args.compress[0] in FEEDBACK_BY_DEFAULT


def compress_spec(text):
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
        kwargs[key] = parse_value(value)
    return method, kwargs


def parse_value(text: str):
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


def predict_spec(text):
    """``[full=F,predict=P,correct=C,history=H,beta=B,adaptive=true]`` -> PhaseTrainer's keyword arguments."""
    spec = dict(PREDICT_DEFAULTS)
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in PREDICT_KEYS:
            raise argparse.ArgumentTypeError(f"expected key=value with key one of {', '.join(PREDICT_KEYS)}, "
                                             f"got {item!r}")
        v = parse_value(value)
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


def epoch_range(text):
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


def add_train_parser(sub) -> argparse.ArgumentParser:
    """The ``train`` subcommand's parser, added to ``sub`` (the parsers of the ``arraytrain`` command)."""
    t = sub.add_parser("train", help="train the built-in MLP (default: scikit-learn's digits)",
                       description=DESCRIPTION)
    opt_names = sorted(optimizers())
    t.add_argument("--optimizer", default="adamw", choices=opt_names, help="default: adamw")
    t.add_argument("--lr", type=positive(float), help="learning rate (default: the optimizer's own; sgd 0.05)")
    t.add_argument("--weight-decay", type=nonnegative(float), metavar="WD", help="weight decay (default: the optimizer's own)")
    t.add_argument("--momentum", type=nonnegative(float), metavar="M",
                   help="momentum, for optimizers that have it (default: the optimizer's own)")
    t.add_argument("--state-dtype", choices=("float32", "bfloat16", "8bit", "float8"),
                   help="storage of the optimizer's element-wise state: bfloat16, 8bit (bitsandbytes' blockwise "
                        "dynamic quantization) or float8 (e4m3 codes, a float32 scale per 256 elements); 8bit "
                        "and float8 keep parameters under 4096 elements in float32; float32 parameters "
                        "only (default: the parameters' dtype)")
    t.add_argument("--batch-size", type=positive(int), default=32, metavar="N", help="default: 32")
    t.add_argument("--hidden", type=hidden_widths, default=[128, 64], metavar="W1,W2,...", help="hidden layer widths (default: 128,64)")
    t.add_argument("--activation", default="relu", choices=ACTIVATIONS, help="default: relu")
    t.add_argument("--epochs", type=positive(int), default=20, metavar="N", help="total epochs, resumed ones included (default: 20)")
    t.add_argument("--accumulation", type=positive(int), default=1, metavar="K",
                   help="micro-batches per optimizer step (default: 1)")
    t.add_argument("--clip", type=positive(float), metavar="NORM",
                   help="clip the global gradient L2 norm to NORM (default: no clipping)")
    t.add_argument("--schedule", default="constant", choices=SCHEDULES, help="lr schedule (default: constant)")
    t.add_argument("--warmup", type=nonnegative(int), default=0, metavar="STEPS",
                   help="linear warm-up over this many optimizer steps (default: 0)")
    t.add_argument("--step-epochs", type=positive(int), metavar="N", help="--schedule step: epochs between decays "
                   "(default: a third of --epochs)")
    t.add_argument("--gamma", type=fraction, default=0.1, help="--schedule step: decay factor (default: 0.1)")
    t.add_argument("--plateau-patience", type=nonnegative(int), default=2, metavar="N",
                   help="--schedule plateau: epochs without a better val_loss before the lr is cut 10x (default: 2)")
    t.add_argument("--patience", type=positive(int), metavar="N",
                   help="stop early after N epochs without a better val_loss (default: never)")
    t.add_argument("--seed", type=nonnegative(int), default=0,
                   help="seed of the split, weights and batch order (default: 0)")
    t.add_argument("--dtype", default="float32", choices=("float32", "float64"), help="default: float32")
    t.add_argument("--precision", default="fp32", choices=tuple(PRECISIONS),
                   help="bf16/fp16: the forward and backward passes read a bfloat16/float16 working copy of the "
                        "float32 master weights, and each micro-batch's weight gradient is rounded to it; fp16 "
                        "adds dynamic loss scaling (default: fp32)")
    t.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the model, the data and the engine live (cuda: CuPy, extra cuda12/cuda13; "
                        "default: cpu)")
    t.add_argument("--compress", type=compress_spec, metavar="METHOD[:k=v,...]",
                   help=f"compress the gradient every step ({', '.join(COMPRESSORS)}), e.g. topk:ratio=0.01; "
                        "the keys are the compressor's arguments (arraytrain.compress)")
    t.add_argument("--shard-state", action="store_true",
                   help="under mpiexec -n K: each process keeps and updates 1/K of the optimizer state (and of "
                        "the float32 master weights with --precision bf16/fp16); element-wise optimizers only")
    t.add_argument("--overlap", action="store_true",
                   help="under mpiexec: exchange each layer's gradient while the earlier layers still "
                        "back-propagate (buckets of 25 MiB); off by default: on one machine's shared memory "
                        "it competes with the backward pass for the cores (docs/processes.md)")
    t.add_argument("--comm-timeout", type=nonnegative(float), metavar="SECONDS",
                   help="under mpiexec or torchrun: an exchange that waits longer than this for the other processes (one "
                        "died, or a link is down) ends this process with one line, and so every process (10 "
                        "times as long for the first two steps and for checkpoints; default: "
                        "$ARRAYTRAIN_COMM_TIMEOUT, else 60; 0: wait forever)")
    t.add_argument("--error-feedback", action=argparse.BooleanOptionalAction, default=None,
                   help="with --compress: keep what was not sent and add it to the next step's gradient "
                        "(randomk and vsa then keep their values unscaled: rescale=False, unbiased=False); "
                        f"default: on for {', '.join(sorted(FEEDBACK_BY_DEFAULT))} (part of the method), off for the rest")
    t.add_argument("--predict", type=predict_spec, nargs="?", const="", metavar="k=v,...",
                   help="gradient prediction (PhaseTrainer): cycles of 'full' steps with forward and backward, "
                        "then 'predict' steps on a gradient extrapolated from the last 'history' true ones, every "
                        "'correct'-th of them a true one; keys full, predict, correct, history, beta, adaptive "
                        "(default: " + ",".join(f"{k}={PREDICT_DEFAULTS[v]:g}" for k, v in PREDICT_KEYS.items()
                                                if k != "adaptive") + ")")
    t.add_argument("--prune", type=fraction, metavar="RATIO",
                   help="magnitude pruning: zero this fraction of the weights (not the biases), one global cut, "
                        "kept at zero by every optimizer step")
    t.add_argument("--prune-epochs", type=epoch_range, metavar="N[-M]",
                   help="with --prune: prune at the end of epoch N, or gradually (cubic schedule) at the end of "
                        "each epoch N..M (default: 1 to half of --epochs)")
    t.add_argument("--quantize-eval", choices=("int8",),
                   help="also report the test accuracy with the weights quantized to int8 (symmetric, per output "
                        "channel; biases and activations stay float)")
    t.add_argument("--data", metavar="FILE.npz", help="arrays X, y and optionally X_test, y_test")
    t.add_argument("--val-fraction", type=fraction, default=0.15, metavar="F", help="default: 0.15")
    t.add_argument("--test-fraction", type=fraction, default=0.2, metavar="F", help="without X_test (default: 0.2)")
    t.add_argument("--save", metavar="FILE", help="save the run (engine, epoch, history) at the end; "
                   "{epoch} in FILE is replaced by the epoch")
    t.add_argument("--checkpoint-every", type=positive(int), metavar="N", help="with --save: also every N epochs")
    t.add_argument("--resume", metavar="FILE", help="continue from a checkpoint written by --save")
    t.add_argument("--json", metavar="FILE", help="write a JSON summary")
    t.add_argument("--plot", metavar="FILE.png", help="draw the loss and accuracy curves (matplotlib; the "
                   "extension picks the format)")
    t.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none anyway when stderr is not a terminal)")
    return t


def fmt_compress(spec) -> str:
    method, kwargs = spec
    return method + (":" + ",".join(f"{k}={v}" for k, v in kwargs.items()) if kwargs else "")


def from_launcher(keys: tuple, default: int) -> int:
    """The first of ``keys`` that the launcher (MPICH's Hydra, Open MPI) set, read without initialising MPI."""
    for key in keys:
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return default


def under_torchrun() -> bool:
    """Whether ``torchrun`` started this process (its agent sets ``TORCHELASTIC_RUN_ID``, then ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` for torch.distributed)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def launched_ranks() -> int:
    """The number of processes ``mpiexec`` or ``torchrun`` started (1 under neither)."""
    if under_torchrun():
        return from_launcher(("WORLD_SIZE",), 1)
    return from_launcher(("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"), 1)


def launched_rank() -> int:
    """This process's rank as ``mpiexec`` or ``torchrun`` set it (0 under neither)."""
    if under_torchrun():
        return from_launcher(("RANK",), 0)
    return from_launcher(("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID"), 0)


# -- checks before anything runs ---------------------------------------------------------------------
def check_output(flag: str, path: str) -> str:
    """``path`` can be written: its directory exists and is writable, it is not a directory, and the
    file itself can be created there (or opened for writing, if it exists)."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise usage(f"{flag} {path}: is a directory")
    parent = os.path.dirname(full)
    if not os.path.isdir(parent):
        raise usage(f"{flag} {path}: no such directory {parent}")
    # the second exists(): another process's probe file (see try_create) may vanish between the two calls
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(full) and not os.access(full, os.W_OK)
                                                     and os.path.exists(full)):
        raise usage(f"{flag} {path}: not writable")
    try_create(flag, path, full)
    return full


def try_create(flag: str, path: str, full: str) -> None:
    """Create ``full`` and remove it again, or open an existing regular file for writing without
    truncating it: what the permission bits do not tell (/proc, a read-only mount, a name too long
    for the file system) fails here, before training, and nothing is left behind or changed."""
    if os.path.lexists(full):
        if not os.path.isfile(full):  # a device such as /dev/stdout, written in place: not probed
            return
        try:
            os.close(os.open(full, os.O_WRONLY))  # no O_TRUNC: the file keeps its bytes and its times
        except FileNotFoundError:  # another process's probe file, removed meanwhile
            return
        except OSError as exc:
            raise usage(f"{flag} {path}: cannot open the file for writing ({exc.strerror or exc})") from None
        return
    try:
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process probes the same name now
        return
    except OSError as exc:
        raise usage(f"{flag} {path}: cannot create the file there ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(full)


def check_input(flag: str, path: str) -> str:
    full = os.path.abspath(path)
    if not os.path.exists(full):
        raise usage(f"{flag} {path}: no such file")
    if os.path.isdir(full):
        raise usage(f"{flag} {path}: is a directory")
    if not os.access(full, os.R_OK):
        raise usage(f"{flag} {path}: not readable")
    return full


def check_plot_format(path: str) -> None:
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in kinds:
        got = f"a .{ext} file" if ext else "a file name without an extension"
        raise usage(f"--plot {path}: matplotlib cannot write {got}; use one of {', '.join(sorted(kinds))}")


def validate(args, comm) -> bool:
    """Every check that needs no data: flags, their combinations, files and optional packages.

    Runs before the data are loaded, so a bad option costs no training. Returns
    whether the progress bar is shown.
    """
    from ..nn.data import require

    check_flags(args, comm)
    check_files(args, writes=comm is None or comm.rank == 0)
    show_bar = not args.no_progress and (comm is None or comm.rank == 0) and sys.stderr.isatty()
    if show_bar:
        require("tqdm", "train", "the progress bar")
    if args.plot:
        require("matplotlib", "plot", "--plot")
        check_plot_format(args.plot)
    return show_bar


def agreed(comm, check):
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


def check_flags(args, comm) -> None:
    """The flags' combinations."""
    if args.checkpoint_every and not args.save:
        raise usage("--checkpoint-every needs --save FILE")
    if args.step_epochs and args.schedule != "step":
        raise usage("--step-epochs applies to --schedule step only")
    if args.error_feedback is not None and args.compress is None:
        raise usage(f"--{'' if args.error_feedback else 'no-'}error-feedback needs --compress METHOD")
    if args.error_feedback is not None and args.compress[0] == "auto":
        raise usage(f"--compress auto with --{'' if args.error_feedback else 'no-'}error-feedback: auto chooses "
                    "error feedback with its candidate (PowerSGD, with it)")
    if args.overlap:
        if comm is None:
            raise usage("--overlap needs several processes: mpiexec -n K arraytrain train --overlap")
        if args.compress is not None:
            raise usage("--overlap with --compress: a compressor's exchange needs the whole window's gradient")
    if args.comm_timeout is not None and comm is None:
        raise usage("--comm-timeout needs several processes: mpiexec -n K arraytrain train --comm-timeout S "
                    "(or torchrun)")
    if args.shard_state:
        if comm is None:
            raise usage("--shard-state needs several processes: mpiexec -n K arraytrain train --shard-state")
        if args.compress is not None:
            raise usage("--shard-state with --compress: a compressor's exchange replaces the reduce-scatter; "
                         "use one or the other")
        why = optimizers()[args.optimizer].shard_refusal
        if why is not None:
            raise usage(f"--shard-state with --optimizer {args.optimizer}: {why}")
    if args.state_dtype in ("bfloat16", "8bit", "float8") and args.dtype != "float32":
        raise usage(f"--state-dtype {args.state_dtype} needs float32 parameters, got --dtype {args.dtype}")
    if args.prune_epochs is not None:
        if args.prune is None:
            raise usage("--prune-epochs needs --prune RATIO")
        if args.prune_epochs[1] > args.epochs:
            raise usage(f"--prune-epochs {fmt_range(args.prune_epochs)}: past --epochs {args.epochs}")
    if args.predict is not None:
        if args.accumulation != 1:
            raise usage(f"--predict needs one micro-batch per optimizer step (--accumulation 1), "
                         f"got --accumulation {args.accumulation}")
        if args.precision != "fp32":
            raise usage("--predict with --precision: gradient prediction records the float32 gradient "
                         "buffer, which a working copy bypasses; use one or the other")
        if comm is not None:
            raise usage("--predict runs in one process (the PhaseTrainer does not shard batches over mpiexec's "
                         "processes)")
        if args.predict["adaptive"]:
            from ..phase import PhaseSchedule

            try:
                PhaseSchedule(args.predict["full_steps"], args.predict["predict_steps"],
                              args.predict["correct_every"], adaptive=True)
            except ArrayTrainError as exc:
                raise usage(f"--predict: {exc}") from None
    if args.precision != "fp32":
        if args.dtype != "float32":
            raise usage(f"--precision {args.precision} keeps float32 master weights: it needs --dtype float32")
    if not args.data:  # digits: the test split is cut from the data (see check_files for --data)
        check_fractions(args)


def check_fractions(args) -> None:
    """The validation and test splits leave a training split."""
    if args.val_fraction + args.test_fraction >= 1:
        raise usage(f"--val-fraction {args.val_fraction:g} and --test-fraction {args.test_fraction:g} leave no "
                     f"training data: together they must be < 1")


def has_test_split(path: str) -> bool:
    """Whether the .npz at ``path`` names X_test (read from the archive's directory, not its arrays);
    an unreadable file says False and leaves the message to the loader."""
    try:
        with np.load(path, allow_pickle=False) as f:
            return "X_test" in f.files
    except Exception:
        return False


def check_files(args, writes: bool = True) -> None:
    """The outputs can be written (probed only where ``writes``: the rank that writes them, rank 0; another
    node may not have their folder), the inputs read (every rank reads them), and no file is named twice."""
    output = check_output if writes else (lambda flag, path: os.path.abspath(path))
    outputs = {}
    if args.save:
        try:
            first = args.save.format(epoch=1)
        except (KeyError, IndexError, ValueError):
            raise usage(f"--save {args.save}: the only field a file name may hold is {{epoch}}") from None
        outputs["--save"] = output("--save", first)
    if args.json:
        outputs["--json"] = output("--json", args.json)
    if args.plot:
        outputs["--plot"] = output("--plot", args.plot)
    inputs = {}
    if args.data:
        inputs["--data"] = check_input("--data", args.data)
        if not has_test_split(args.data):  # else --test-fraction is not used
            check_fractions(args)
    if args.resume:
        inputs["--resume"] = check_input("--resume", args.resume)
    seen = {}
    for flag, path in [*outputs.items(), *inputs.items()]:
        other = seen.setdefault(path, flag)
        if other != flag and {flag, other} != {"--save", "--resume"}:
            raise usage(f"{other} and {flag} name the same file {path}")


def prune_epochs(args) -> tuple[int, int]:
    """The first and last epoch at whose end --prune prunes (default: 1 to half of --epochs)."""
    return args.prune_epochs or (1, max(1, args.epochs // 2))


def fmt_range(epochs: tuple) -> str:
    lo, hi = epochs
    return str(lo) if lo == hi else f"{lo}-{hi}"


# the flags that shape the model: a resumed run must give the same ones
MODEL_FLAGS = ("hidden", "activation")


def check_same_model(args) -> None:
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

        raise usage(f"--resume {args.resume}: the checkpoint's model was trained with "
                     f"{' '.join(show(f, config[f]) for f in differ)}, this run asks for "
                     f"{' '.join(show(f, getattr(args, f)) for f in differ)}: the architecture differs; "
                     "give the flags it was trained with")
