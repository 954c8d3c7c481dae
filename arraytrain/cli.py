"""``arraytrain train``: train the built-in MLP end to end and report what happened.

With no arguments it trains on scikit-learn's handwritten digits (shipped with
scikit-learn, no download), split train / validation / test from the seed and
standardised with the training statistics. ``--data FILE.npz`` trains on the
arrays ``X``, ``y`` (and optionally ``X_test``, ``y_test``) instead.

Bad arguments, bad data files and missing optional packages end with one line
on stderr and exit status 2; nothing prints a traceback on purpose.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import sys

import numpy as np

from . import optim
from .engine import Engine
from .errors import ArrayTrainError

PROG = "arraytrain"
SCHEDULES = ("constant", "cosine", "step", "plateau")
ACTIVATIONS = ("relu", "gelu", "tanh", "sigmoid")


class UsageError(Exception):
    """A command-line problem, reported as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise UsageError(f"{self.prog}: error: {message}")


def optimizers() -> dict:
    """``{name: class}`` of the optimizers in ``arraytrain.optim`` that need nothing but an lr."""
    out = {}
    for name in getattr(optim, "__all__", dir(optim)):
        cls = getattr(optim, name)
        if not (isinstance(cls, type) and issubclass(cls, optim.Optimizer)) or inspect.isabstract(cls):
            continue
        params = inspect.signature(cls).parameters
        if "lr" in params and all(p.default is not p.empty or n == "lr" for n, p in params.items()
                                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)):
            out[name.lower()] = cls
    return out


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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="arraytrain: a training engine on flat NumPy buffers.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    t = sub.add_parser("train", help="train the built-in MLP (default: scikit-learn's digits)",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    opt_names = sorted(optimizers())
    t.add_argument("--optimizer", default="adamw", choices=opt_names, help="default: adamw")
    t.add_argument("--lr", type=_positive(float), help="learning rate (default: the optimizer's own; sgd 0.05)")
    t.add_argument("--weight-decay", type=_nonnegative(float), help="weight decay (default: the optimizer's own)")
    t.add_argument("--momentum", type=_nonnegative(float), help="momentum, for optimizers that have it")
    t.add_argument("--batch-size", type=_positive(int), default=32, help="default: 32")
    t.add_argument("--hidden", type=_hidden, default=[128, 64], help="hidden layer widths (default: 128,64)")
    t.add_argument("--activation", default="relu", choices=ACTIVATIONS, help="default: relu")
    t.add_argument("--epochs", type=_positive(int), default=20, help="total epochs, resumed ones included (default: 20)")
    t.add_argument("--accumulation", type=_positive(int), default=1, help="micro-batches per optimizer step")
    t.add_argument("--clip", type=_positive(float), help="clip the global gradient L2 norm to this value")
    t.add_argument("--schedule", default="constant", choices=SCHEDULES, help="lr schedule (default: constant)")
    t.add_argument("--warmup", type=_nonnegative(int), default=0, help="linear warm-up optimizer steps in front")
    t.add_argument("--step-epochs", type=_positive(int), help="--schedule step: epochs between decays "
                   "(default: a third of --epochs)")
    t.add_argument("--gamma", type=_fraction, default=0.1, help="--schedule step: decay factor (default: 0.1)")
    t.add_argument("--plateau-patience", type=_nonnegative(int), default=2,
                   help="--schedule plateau: epochs without a better val_loss before the lr is cut 10x")
    t.add_argument("--patience", type=_positive(int), help="early stopping on val_loss after this many epochs")
    t.add_argument("--seed", type=_nonnegative(int), default=0, help="seed of the split, weights and batch order")
    t.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    t.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the model, the data and the engine live (cuda: CuPy, extra cuda12/cuda13)")
    t.add_argument("--compress", type=_compress_spec, metavar="METHOD[:k=v,...]",
                   help=f"compress the gradient every step ({', '.join(COMPRESSORS)}), e.g. topk:ratio=0.01; "
                        "the keys are the compressor's arguments (arraytrain.compress)")
    t.add_argument("--error-feedback", action="store_true", help="with --compress: keep what was not sent")
    t.add_argument("--data", metavar="FILE.npz", help="arrays X, y and optionally X_test, y_test")
    t.add_argument("--val-fraction", type=_fraction, default=0.15, help="default: 0.15")
    t.add_argument("--test-fraction", type=_fraction, default=0.2, help="without X_test (default: 0.2)")
    t.add_argument("--save", metavar="FILE", help="save the engine (and the epoch) at the end")
    t.add_argument("--checkpoint-every", type=_positive(int), metavar="N", help="with --save: also every N epochs")
    t.add_argument("--resume", metavar="FILE", help="continue from a checkpoint written by --save")
    t.add_argument("--json", metavar="FILE", help="write a JSON summary")
    t.add_argument("--plot", metavar="FILE.png", help="draw the loss and accuracy curves (matplotlib)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=train)
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
            raise UsageError(f"{PROG} train: error: --{flag.replace('_', '-')}: {args.optimizer} has no {key}")
        kwargs[key] = value
    if cls is optim.Muon:  # Muon takes the weight matrices; the biases go to AdamW (its defaults)
        kwargs["fallback"] = optim.AdamW()
    return cls(**kwargs)


def _schedule(args, steps_per_epoch: int):
    if args.schedule == "constant" and not args.warmup:
        return None
    try:
        from . import schedules
    except ImportError:
        raise UsageError(f"{PROG} train: error: --schedule/--warmup need arraytrain.schedules, "
                         "which this build of arraytrain does not have") from None
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
        if args.error_feedback:
            raise UsageError(f"{PROG} train: error: --error-feedback needs --compress METHOD")
        return None
    from . import compress

    method, kwargs = args.compress
    cls = getattr(compress, COMPRESSORS[method])
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise UsageError(f"{PROG} train: error: --compress {method}: {exc}") from None
    comp = cls(**kwargs)
    return compress.ErrorFeedback(comp) if args.error_feedback else comp


def _launched_ranks() -> int:
    """The number of processes ``mpiexec`` started (1 when not under mpiexec)."""
    for key in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"):
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return 1


def _comm():
    """An MPIComm when ``mpiexec`` started more than one process, else None (one process)."""
    if _launched_ranks() <= 1:
        return None
    from .distributed import MPIComm

    return MPIComm()


def _load_data(args):
    from .nn import load_digits, load_npz

    kw = dict(seed=args.seed, val_fraction=args.val_fraction, test_fraction=args.test_fraction, dtype=args.dtype)
    if args.data:
        return load_npz(args.data, **kw)
    return load_digits(**kw)


def _jsonable(v):
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


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


# -- the command -----------------------------------------------------------------------------------
def train(args) -> int:
    from . import nn
    from .nn.data import require

    comm = _comm()
    lead = comm is None or comm.rank == 0  # only rank 0 prints and writes files
    out = sys.stdout if lead else open(os.devnull, "w")  # noqa: SIM115 - closed with the process
    if not args.no_progress:
        require("tqdm", "train", "the progress bar")
    if args.plot:
        require("matplotlib", "plot", "--plot")
    if args.checkpoint_every and not args.save:
        raise UsageError(f"{PROG} train: error: --checkpoint-every needs --save FILE")
    if args.step_epochs and args.schedule != "step":
        raise UsageError(f"{PROG} train: error: --step-epochs applies to --schedule step only")

    data = _load_data(args)
    if args.device == "cuda":
        data = _to_cuda(data)
    model = nn.MLP([data.num_features, *args.hidden, data.num_classes], activation=args.activation,
                   dtype=np.dtype(args.dtype))
    params = model.init(seed=args.seed)  # NumPy: the engine moves them to the device once
    batches = math.ceil(len(data.y_train) / args.batch_size)
    sched = _schedule(args, max(1, batches // args.accumulation))
    extra_engine = {"schedule": sched} if sched is not None else {}
    try:
        engine = Engine(params, _optimizer(args), accumulation_steps=args.accumulation, max_grad_norm=args.clip,
                        zero_grad_on_step=False, device=args.device, compressor=_compressor(args), comm=comm,
                        **extra_engine)
    except TypeError as exc:
        if "schedule" in str(exc):
            raise UsageError(f"{PROG} train: error: --schedule/--warmup: this build's Engine takes no schedule") from None
        raise
    model.bind(engine)
    config = {k: v for k, v in vars(args).items() if k != "func"}

    start = 0
    if args.resume:
        from .nn.callbacks import _checkpoint_io

        _, load = _checkpoint_io()
        extra = load(args.resume, engine)
        start = extra.get("epoch") if isinstance(extra, dict) else None
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise UsageError(f"{PROG} train: error: --resume {args.resume}: the checkpoint has no epoch count "
                             "(was it written by arraytrain train --save?)")
        if start > args.epochs:
            raise UsageError(f"{PROG} train: error: --resume {args.resume}: the checkpoint is at epoch {start}, "
                             f"past --epochs {args.epochs}")

    def show(trainer, epoch, logs):
        line = f"epoch {epoch}/{args.epochs}  loss {logs['loss']:.4f}  lr {logs['lr']:.3g}"
        if "val_accuracy" in logs:
            line += f"  val_loss {logs['val_loss']:.4f}  val_accuracy {logs['val_accuracy']:.4f}"
        print(line + f"  ({logs['time']:.2f} s)", file=out, flush=True)

    profiler = nn.Profiler()
    callbacks = [] if args.no_progress or not lead else [nn.ProgressBar()]
    payload = _PayloadBytes()
    callbacks += [nn.LambdaCallback(on_epoch_end=show, on_batch_end=payload.add), profiler]
    if args.patience:
        callbacks.append(nn.EarlyStopping("val_loss", patience=args.patience))
    if args.schedule == "plateau":
        callbacks.append(nn.ReduceLROnPlateau("val_loss"))
    if args.save and args.checkpoint_every:
        callbacks.append(nn.Checkpoint(args.save, every=args.checkpoint_every, extra={"config": _jsonable(config)}))
    trainer = nn.Trainer(model, engine, batch_size=args.batch_size, seed=args.seed, callbacks=callbacks)

    how = "" if comm is None else f", {comm.size} processes (each a shard of every batch)"
    if engine.compressor is not None:
        how += f", compressed: {engine.compressor!r}"
    print(f"{data.summary()}; model {list(model.sizes)} ({model.num_params} parameters), "
          f"{engine.optimizer!r}{how}" + (f", resumed at epoch {start}" if start else ""), file=out)
    with _abort_on_error(comm):  # one rank failing mid-run must not leave the others waiting
        history = trainer.fit(data.x_train, data.y_train, epochs=args.epochs, validation=(data.x_val, data.y_val),
                              initial_epoch=start)
    test = trainer.evaluate(data.x_test, data.y_test)
    summary = profiler.summary(trainer)["seconds"]
    print(f"test accuracy {test['accuracy']:.4f} ({len(data.y_test)} samples), macro F1 {test['f1']:.4f}", file=out)
    print(f"{trainer.samples_per_second:,.0f} samples/s over {max(trainer.steps - 1, 0)} steps after the first; "
          f"time split: {_fmt_split(summary)}", file=out)
    if payload.steps:
        print(f"compression: {payload.sent / payload.steps:,.0f} bytes/step sent by each process vs "
              f"{payload.dense / payload.steps:,.0f} dense ({payload.dense / payload.sent:.1f}x fewer)", file=out)

    if args.save:
        if not args.checkpoint_every:  # else the Checkpoint callback has written the last epoch
            from .nn.callbacks import _checkpoint_io

            save, _ = _checkpoint_io()
            save(args.save, engine, extra={"epoch": trainer.epoch, "config": _jsonable(config)})
        print(f"saved {args.save} (epoch {trainer.epoch})", file=out)
    if not lead:
        return 0
    if args.json:
        report = {
            "test_accuracy": test["accuracy"],
            "test_loss": test["loss"],
            "test_f1": test["f1"],
            "test_precision": test["precision"],
            "test_recall": test["recall"],
            "test_confusion_matrix": test["confusion_matrix"],
            "samples_per_second": trainer.samples_per_second,
            "epochs": trainer.epoch,
            "final_loss": history[-1]["loss"] if history else None,
            "final_val_accuracy": history[-1].get("val_accuracy") if history else None,
            "optimizer_steps": engine.state.step,
            "processes": 1 if comm is None else comm.size,
            "payload_bytes_per_step": payload.sent / payload.steps if payload.steps else None,
            "dense_bytes_per_step": payload.dense / payload.steps if payload.steps else None,
            "time_split_seconds": summary,
            "dataset": data.summary(),
            "parameters": model.num_params,
            "history": [{k: v for k, v in h.items() if not k.endswith("confusion_matrix")} for h in history],
            "config": config,
        }
        with open(args.json, "w") as f:
            json.dump(_jsonable(report), f, indent=2)
    if args.plot:
        _plot(args.plot, history, test["accuracy"])
    return 0


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
