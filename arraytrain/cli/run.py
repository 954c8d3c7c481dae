"""``arraytrain train``'s run: the model, data, optimizer, engine and trainer built from the checked
arguments, the training, and what it reports (progress, summary, JSON, plot, checkpoints).

The throughput is reported as the benchmarks report a time: per epoch over its micro-batches
after the warm-up, the fastest epoch and the median of the epochs (:data:`THROUGHPUT_MEASURES`).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import statistics
import sys

import numpy as np

from .. import optim, schedules
from ..engine import Engine
from ..errors import ArrayTrainError, CheckpointError, DataError, NonFiniteError
from ..nn.callbacks import MagnitudePruning
from .arguments import (COMPRESSORS, PRECISIONS, agreed, check_same_model, error_feedback, fmt_compress, fmt_range,
                        launched_ranks, optimizers, prune_epochs, under_torchrun, usage, validate)

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
            raise usage(f"--{flag.replace('_', '-')}: {args.optimizer} has no {key}")
        kwargs[key] = value
    if args.state_dtype is not None:
        if "state_dtype" not in params:
            raise usage(f"--state-dtype: {args.optimizer} keeps no element-wise state to store in another dtype")
        kwargs["state_dtype"] = args.state_dtype
    if cls is optim.Muon:  # Muon takes the weight matrices; the biases go to AdamW (its defaults)
        kwargs["fallback"] = optim.AdamW()
    try:
        return cls(**kwargs)
    except ArrayTrainError as exc:
        given = " ".join(f"--{flag.replace('_', '-')} {getattr(args, flag):g}" for flag in ("lr", "weight_decay", "momentum")
                         if getattr(args, flag) is not None)
        raise usage(f"--optimizer {args.optimizer}{' ' + given if given else ''}: {exc}") from None


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


#: The warm-up where ``--compress`` sets neither ``warmup`` nor ``ramp``, in this run's epochs (the
#: library's own is in calls, which the CLI can put in the run's unit, as DGC does: 4 of its 90-164
#: epochs). Measured on the digits MLP widened to 2048,2048, 2 processes at 1 Gbit/s, AdamW, 8 epochs,
#: seeds 0-2 (test accuracy against dense): top-k 1% -0.47 pt without a ramp, 0.00 with one over 2
#: epochs; sign -0.56 pt, -0.19 with a dense first epoch. A dense start cost accuracy with error
#: feedback (PowerSGD rank 4 -1.39 pt, sign -1.02 pt against none) and did not help ternary (-0.37):
#: those start compressed.
RAMP_EPOCHS = 2
DENSE_EPOCHS = {"sign": 1}


def _run_schedule(method: str, kwargs: dict, feedback: bool, steps_per_epoch: int | None) -> dict:
    """The warm-up in this run's steps for a ``--compress`` that set neither ``warmup`` nor ``ramp``."""
    if steps_per_epoch is None or "warmup" in kwargs or "ramp" in kwargs:
        return {}
    if method in ("topk", "randomk"):
        return {"ramp": RAMP_EPOCHS * steps_per_epoch}
    if method in DENSE_EPOCHS and not feedback:
        return {"warmup": DENSE_EPOCHS[method] * steps_per_epoch}
    return {}


def _schedule_of(compressor) -> str:
    """What the compressor sends when, in words (an Auto: its candidates')."""
    from ..compress import Auto

    if isinstance(compressor, Auto):
        return "; ".join(f"{n}: {_schedule_of(c)}" for n, c in compressor.candidates.items())
    return getattr(compressor, "compressor", compressor).schedule


def compressor_from(args, steps_per_epoch: int | None = None):
    """The ``--compress`` compressor; with ``steps_per_epoch``, its warm-up in the run's epochs (see
    :data:`RAMP_EPOCHS`) unless the spec sets one (without: the arguments' check, before the data)."""
    if args.compress is None:
        return None
    from .. import compress

    method, kwargs = args.compress
    cls = getattr(compress, COMPRESSORS[method])
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise usage(f"--compress {method}: {exc}") from None
    if method == "auto":
        try:
            return compress.Auto(**kwargs)
        except ArrayTrainError as exc:
            raise usage(f"--compress {fmt_compress(args.compress)}: {exc}") from None
    feedback = error_feedback(args)
    kwargs = {**_run_schedule(method, kwargs, feedback, steps_per_epoch), **kwargs}
    if feedback:
        # error feedback needs a contraction (ErrorFeedback refuses the rest): random-k and VSA send their
        # kept values unscaled unless told otherwise (rescaled by n/k, the random-k 5% run went to NaN)
        kwargs = {**{"randomk": {"rescale": False}, "vsa": {"unbiased": False}}.get(method, {}), **kwargs}
    try:
        comp = cls(**kwargs)
        return compress.ErrorFeedback(comp) if feedback else comp
    except ArrayTrainError as exc:
        raise usage(f"--compress {fmt_compress(args.compress)}{' --error-feedback' if feedback else ''}: "
                     f"{exc}") from None


def _comm(args):
    """The processes' communicator (its waits held to ``--comm-timeout``): a TorchComm over gloo when
    ``torchrun`` started more than one process, an MPIComm when ``mpiexec`` did; None for one process."""
    if launched_ranks() <= 1:
        return None
    timeout = "default" if args.comm_timeout is None else args.comm_timeout
    if not under_torchrun():
        from ..distributed import MPIComm

        return MPIComm(timeout=timeout)
    if args.device == "cuda":  # before the group: every rank refuses alike, none waits
        raise usage("--device cuda under torchrun: not built (one GPU per process over NCCL is "
                    "mpiexec -n K arraytrain train --device cuda)")
    import atexit

    import torch.distributed as dist  # torchrun came with torch

    from ..distributed import TorchComm

    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from torchrun
    atexit.register(dist.destroy_process_group)  # gloo's threads end before the interpreter's teardown
    return TorchComm(timeout=timeout)


def _gpu_comm(comm):
    """``--device cuda`` under mpiexec: this process's GPU (its rank among the processes on its
    machine), then an NCCLComm over the same processes. Each rank's problem (no CuPy, fewer GPUs than
    processes on a machine, no NCCL) becomes one usage error on every rank."""
    from mpi4py import MPI

    local = comm.comm.Split_type(MPI.COMM_TYPE_SHARED)
    here, rank = local.Get_size(), local.Get_rank()
    local.Free()

    def select():
        from ..backend import cupy, require_cuda

        try:
            require_cuda("--device cuda")
            gpus = cupy().cuda.runtime.getDeviceCount()
        except ArrayTrainError as exc:
            raise usage(f"--device cuda under mpiexec: {exc}") from None
        if here > gpus:
            raise usage(f"--device cuda under mpiexec: {here} processes on one machine, {gpus} GPU(s) there: "
                         "one GPU per process (mpiexec -n K with K at most the GPUs of each machine)")
        cupy.cuda.Device(rank).use()

    agreed(comm, select)
    from ..distributed import NCCLComm

    try:
        return NCCLComm(comm.comm, timeout=comm.deadline.timeout)  # the same error on every rank when one cannot run NCCL
    except ArrayTrainError as exc:
        raise usage(f"--device cuda under mpiexec: {exc}") from None


def _load_data(args):
    from ..nn import load_digits, load_npz

    kw = dict(seed=args.seed, val_fraction=args.val_fraction, test_fraction=args.test_fraction, dtype=args.dtype)
    if args.data:
        try:
            return load_npz(args.data, **kw)
        except DataError as exc:
            text = str(exc)
            raise usage(f"--data {text}" if text.startswith(f"{args.data}: ") else f"--data {args.data}: {text}") \
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

    from ..backend import cupy, require_cuda

    require_cuda("--device cuda")
    arrays = {f.name: cupy().asarray(getattr(data, f.name)) for f in dataclasses.fields(data)
              if f.name.startswith(("x_", "y_"))}
    return dataclasses.replace(data, **arrays)


# -- the command -----------------------------------------------------------------------------------
def train(args) -> int:
    from .. import nn

    comm = _comm(args)
    lead = comm is None or comm.rank == 0  # only rank 0 prints and writes files
    out = sys.stdout if lead else open(os.devnull, "w")  # noqa: SIM115 - closed with the process
    show_bar = agreed(comm, lambda: validate(args, comm))
    if args.device == "cuda" and comm is not None:
        comm = _gpu_comm(comm)  # one GPU per process, NCCL for the exchange
    optimizer, compressor = _optimizer(args), compressor_from(args)  # their argument checks, before the data

    data = _load_data(args)
    if args.device == "cuda":
        data = _to_cuda(data)
    model = nn.MLP([data.num_features, *args.hidden, data.num_classes], activation=args.activation,
                   dtype=np.dtype(args.dtype))
    params = model.init(seed=args.seed)  # NumPy: the engine moves them to the device once
    batches = math.ceil(len(data.y_train) / args.batch_size)
    sched = _schedule(args, max(1, batches // args.accumulation))
    compressor = compressor_from(args, max(1, batches // args.accumulation))  # its warm-up in this run's epochs
    extra_engine = {}
    if args.precision != "fp32":
        extra_engine["working_dtype"] = PRECISIONS[args.precision]
    if args.precision == "fp16":
        from ..amp import LossScaler

        extra_engine["loss_scaler"] = LossScaler()
    engine = Engine(params, optimizer, accumulation_steps=args.accumulation, max_grad_norm=args.clip,
                    zero_grad_on_step=False, device=args.device, compressor=compressor, comm=comm, schedule=sched,
                    shard_state=args.shard_state, overlap=args.overlap, **extra_engine)
    if args.prune is not None:  # a mask from the start, so that every checkpoint of the run holds one
        from ..prune import MaskBuffer

        engine.set_mask(MaskBuffer.ones(engine.layout))
    if engine.working is None:  # with a working copy the trainer binds the model to it
        model.bind(engine)
    config = {k: v for k, v in vars(args).items() if k != "func"}

    callbacks = []
    progress = nn.ProgressBar(disable=False) if show_bar else None
    if progress is not None:
        callbacks.append(progress)
    if args.prune is not None:
        lo, hi = prune_epochs(args)
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
    for d in getattr(trainer.engine.compressor, "decisions", ()):
        lines.append(f"compression auto, step {d['step']}: {d['choice']}" + (f" ({d['said']})" if "said" in d else ""))
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
        "compression_schedule": None if engine.compressor is None else _schedule_of(engine.compressor),
        "compression_decisions": getattr(engine.compressor, "decisions", None),
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
        how += f", compressed: {engine.compressor!r} ({_schedule_of(engine.compressor)})"
    if args.precision != "fp32":
        how += f", precision {args.precision} (float32 master weights"
        how += ", dynamic loss scaling)" if engine.loss_scaler is not None else ")"
    if args.predict is not None:
        p = args.predict
        how += (f", gradient prediction: full {p['full_steps']}, predict {p['predict_steps']}, correct every "
                f"{p['correct_every']}, history {p['history']}, beta {p['correction_beta']:g}"
                + (", adaptive" if p["adaptive"] else ""))
    if args.prune is not None:
        lo, hi = prune_epochs(args)
        how += (f", pruning {100 * args.prune:g}% of the weights at the end of epoch{'s' if hi > lo else ''} "
                f"{fmt_range((lo, hi))}")
    if args.quantize_eval:
        how += f", {args.quantize_eval} evaluation"
    return (f"{data.summary()}; model {list(model.sizes)} ({model.num_params} parameters), "
            f"{engine.optimizer!r}{how}" + (f", resumed at epoch {start}" if start else ""))


def _resume(args, trainer) -> int:
    """Load ``--resume`` into the trainer's engine (and phase controller); return its epoch."""
    check_same_model(args)
    if args.predict is not None:
        from ..phase import load
    else:
        from ..checkpoint import load
    try:
        extra = load(args.resume, trainer.controller if args.predict is not None else trainer.engine)
    except CheckpointError as exc:
        hint = ""
        if "params:" in str(exc):
            hint = ("; the checkpoint holds another model: resume with the --hidden, --activation and --dtype "
                    "it was trained with")
        raise usage(f"--resume {exc}{hint}") from None
    start = extra.get("epoch") if isinstance(extra, dict) else None
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise usage(f"--resume {args.resume}: the checkpoint has no epoch count "
                     "(was it written by arraytrain train --save?)")
    if start > args.epochs:
        raise usage(f"--resume {args.resume}: the checkpoint is at epoch {start}, past --epochs {args.epochs}")
    history = extra.get("history")
    if isinstance(history, list):  # the epochs before the checkpoint, so the JSON and the plot cover the run
        trainer.history = [h for h in history if isinstance(h, dict) and isinstance(h.get("epoch"), int)
                           and h["epoch"] <= start]
    return start


def _save(args, trainer, path, extra) -> None:
    if args.predict is not None:
        from ..phase import save

        save(path, trainer.controller, extra=extra)
    else:
        from ..checkpoint import save

        save(path, trainer.engine, extra=extra)


def _prediction_report(trainer) -> dict:
    st = trainer.stats
    return {"optimizer_steps": st.steps, "backward_passes": st.backward_passes, "step_ratio": st.step_ratio,
            "wall_speedup": st.wall_speedup, "full_steps": trainer.schedule.full_steps,
            "predict_steps": trainer.schedule.predict_steps}


def _int8_evaluation(trainer, model, engine, data) -> dict:
    """The test figures of the model with its weights quantized to int8 and back (the biases stay float)."""
    from .. import nn
    from ..buffer import FlatBuffer
    from ..nn import array_namespace, to_numpy
    from ..quantize import dequantize_params, quantize_params

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
    from ..distributed import abort_on_error

    return abort_on_error()
