"""Bits unchanged between two revisions: every buffer, slot and counter of a fixed set of engines.

    python tools/bitwise.py compare OLD [NEW]      # NEW: the working tree when left out

checks out each revision into a temporary ``git worktree`` (a revision that names a directory
is taken as a checkout as it is, with its warm numba cache), runs the configurations below
with that revision's ``arraytrain`` (one process; the 2-rank ones under ``mpiexec -n 2``),
and prints one row per configuration: equal or not, and which entries differ. Each run
takes six boundaries, saves a checkpoint after the third and hashes (SHA-256 of dtype,
shape and bytes) everything ``engine.state_dict()`` holds, the parameters the model reads,
the gradient buffer and the working copy. The new revision also resumes from the old
revision's checkpoints and steps the last three boundaries: its hashes must equal the old
revision's uninterrupted run too.

    python tools/bitwise.py run OUT [--only a,b] [--resume DIR]   # one revision, into OUT/

is what ``compare`` runs; ``run`` uses the ``arraytrain`` on ``sys.path`` and only public
names that every revision since sharded state has (``Engine``, ``optim``, ``compress``,
``schedules``, ``LossScaler``, ``save``/``load``, ``distributed.MPIComm``).

The gradients are a pure function of (configuration, boundary, micro-batch, rank), so two
revisions see the same inputs. Numba compiles each revision's kernels afresh (its cache is
keyed by source path): a run takes minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

STEPS, SAVE_AT = 6, 3
#: the optimizers that take nothing but an lr (named here, not read from the revision under test)
OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Lion", "LAMB", "Adafactor", "Sophia", "NAdam", "RAdam",
              "Adamax", "Adadelta", "Muon", "ScheduleFreeAdamW")
#: parameter shapes: small ones (the serial twin) and one over 65,536 elements (the parallel twin)
SHAPES = {"embed": (300, 256), "w1": (64, 48), "b1": (48,), "w2": (48, 10), "b2": (10,)}


def _configs() -> dict:
    """``{name: (ranks, build)}``; ``build(comm)`` returns ``(engine kwargs, feed)``."""
    import inspect

    import arraytrain.compress as compress
    import arraytrain.optim as optim
    import arraytrain.schedules as schedules
    from arraytrain import LossScaler

    out = {}
    # top-k from its first call: the revisions with a ramp are told ramp=0, those before it have none
    no_ramp = {"ramp": 0} if "ramp" in inspect.signature(compress.TopK).parameters else {}

    def add(name, ranks=1, feed="dict", **kw):
        out[name] = (ranks, feed, kw)

    for cls_name in OPTIMIZERS:  # every optimizer that needs only an lr, at its defaults
        cls = getattr(optim, cls_name)
        muon = cls_name == "Muon"  # Muon: the vectors to AdamW
        add(cls_name.lower(), optimizer=lambda cls=cls, muon=muon: cls(lr=1e-2, **(
            {"fallback": optim.AdamW(lr=1e-2)} if muon else {})))
    add("sam-adamw", optimizer=lambda: optim.SAM(optim.AdamW(lr=1e-2)))
    add("adamw-accum-clip-schedule-scaler", optimizer=lambda: optim.AdamW(lr=1e-2, weight_decay=0.01),
        accumulation_steps=2, max_grad_norm=1.0, schedule=lambda: schedules.OneCycleLR(total_steps=10),
        loss_scaler=lambda: LossScaler(init_scale=2.0**10, growth_interval=2), feed="scaled")
    add("adam-float64", optimizer=lambda: optim.Adam(lr=1e-2), dtype=np.float64)
    add("sgd-topk", optimizer=lambda: optim.SGD(lr=1e-2, momentum=0.9),
        compressor=lambda: compress.ErrorFeedback(compress.TopK(ratio=0.05, **no_ramp)))
    add("adam-powersgd", optimizer=lambda: optim.Adam(lr=1e-2),
        compressor=lambda: compress.ErrorFeedback(compress.PowerSGD(rank=2)))
    add("adamw-working-bf16", optimizer=lambda: optim.AdamW(lr=1e-2), working_dtype="bfloat16", max_grad_norm=1.0)
    add("adamw-state-bf16", optimizer=lambda: optim.AdamW(lr=1e-2, state_dtype="bfloat16"))
    add("adamw-state-8bit", optimizer=lambda: optim.AdamW(lr=1e-2, state_dtype="8bit"))
    add("adamw-state-float8", optimizer=lambda: optim.AdamW(lr=1e-2, state_dtype="float8"), max_grad_norm=1.0)
    add("lamb-state-bf16", optimizer=lambda: optim.LAMB(lr=1e-2, state_dtype="bfloat16"))
    # two ranks: replicated, sharded, overlapped, both; compressed
    add("2r-adamw", 2, optimizer=lambda: optim.AdamW(lr=1e-2), max_grad_norm=1.0)
    add("2r-adamw-overlap", 2, feed="marked", optimizer=lambda: optim.AdamW(lr=1e-2), max_grad_norm=1.0,
        overlap=True, bucket_bytes=4096)
    add("2r-adamw-sharded", 2, optimizer=lambda: optim.AdamW(lr=1e-2), max_grad_norm=1.0, shard_state=True)
    add("2r-adamw-sharded-overlap", 2, feed="marked", optimizer=lambda: optim.AdamW(lr=1e-2), max_grad_norm=1.0,
        shard_state=True, overlap=True, bucket_bytes=4096)
    add("2r-lamb-sharded-working-bf16", 2, optimizer=lambda: optim.LAMB(lr=1e-2), shard_state=True,
        working_dtype="bfloat16")
    add("2r-adamw-sharded-8bit", 2, optimizer=lambda: optim.AdamW(lr=1e-2, state_dtype="8bit"), shard_state=True)
    add("2r-adagrad-sharded-float8", 2, optimizer=lambda: optim.Adagrad(lr=1e-2, state_dtype="float8"),
        shard_state=True)
    add("2r-sgd-topk", 2, optimizer=lambda: optim.SGD(lr=1e-2, momentum=0.9),
        compressor=lambda: compress.ErrorFeedback(compress.TopK(ratio=0.05, **no_ramp)))
    return out


def _grad(config: str, boundary: int, micro: int, rank: int, name: str, shape, dtype):
    seed = [int.from_bytes(hashlib.sha256(f"{config}/{name}".encode()).digest()[:4], "little"), boundary, micro, rank]
    g = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    return g


def _engine(name: str, spec, comm):
    from arraytrain import Engine

    _, _, kw = spec
    kw = {k: (v() if callable(v) and k in ("optimizer", "schedule", "loss_scaler", "compressor") else v)
          for k, v in kw.items()}
    dtype = kw.pop("dtype", np.float32)
    rng = np.random.default_rng(0)
    params = {n: rng.standard_normal(s).astype(dtype) * 0.1 for n, s in SHAPES.items()}
    return Engine(params, kw.pop("optimizer"), dtype=dtype, comm=comm, **kw)


def _boundary(engine, config: str, spec, b: int, rank: int) -> None:
    """Boundary ``b``: its micro-batches fed as the configuration says (a dict; the zero-copy path with
    the gradients marked ready last-to-first; the loss scale's factor and one non-finite window)."""
    feed = spec[1]
    for m in range(engine.accumulation_steps):
        grads = {n: _grad(config, b, m, rank, n, s, engine.params.dtype) for n, s in SHAPES.items()}
        if feed == "scaled":
            grads = {n: g * np.asarray(engine.loss_scale, g.dtype) for n, g in grads.items()}
            if b == 2 and m == 0:
                grads["b2"][3] = np.inf
        if feed != "marked":
            engine.step(grads)
            continue
        last = m == engine.accumulation_steps - 1
        for n in reversed(list(SHAPES)):
            engine.grads[n][...] += grads[n]
            if last:
                engine.mark_ready(n)
        engine.step()


def _digest(a) -> str:
    a = np.ascontiguousarray(np.asarray(a))
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.view(np.uint8).reshape(-1).tobytes() if a.size else b"")
    return h.hexdigest()[:16]


def _hashes(tree, prefix: str, out: dict) -> None:
    if isinstance(tree, dict):
        for k in sorted(tree, key=str):
            _hashes(tree[k], f"{prefix}/{k}", out)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            _hashes(v, f"{prefix}/{i}", out)
    elif isinstance(tree, np.ndarray) or hasattr(tree, "__array_interface__"):
        out[prefix] = _digest(tree)
    else:
        out[prefix] = repr(tree)


def _fingerprint(engine) -> dict:
    out: dict = {}
    _hashes(engine.state_dict(), "state", out)
    out["params"] = _by_name(engine.gather_params())
    out["grads"] = _by_name(engine.grads)
    if engine.working is not None:
        out["working"] = _by_name(engine.working)
    return out


def _by_name(buf) -> str:
    """A buffer's digest in the configuration's order of names (an engine may lay them out otherwise)."""
    return _digest(np.concatenate([np.asarray(buf[n]).reshape(-1) for n in SHAPES]))


def run(out: Path, only=None, resume: Path | None = None) -> None:
    """Run the configurations (this process's ranks: 1 alone, 2 under mpiexec) into ``out``."""
    import arraytrain

    comm, rank, ranks = None, 0, 1
    if "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        from arraytrain.distributed import MPIComm

        comm = MPIComm()
        rank, ranks = comm.rank, comm.size
    out.mkdir(parents=True, exist_ok=True)
    result = {}
    for name, spec in _configs().items():
        if spec[0] != ranks or (only and name not in only):
            continue
        engine = _engine(name, spec, comm)
        ckpt = out / f"{name}.safetensors"
        for b in range(SAVE_AT):
            _boundary(engine, name, spec, b, rank)
        arraytrain.save(ckpt, engine)
        for b in range(SAVE_AT, STEPS):
            _boundary(engine, name, spec, b, rank)
        result[name] = {"run": _fingerprint(engine)}
        if resume is not None and (resume / ckpt.name).exists():
            again = _engine(name, spec, comm)
            arraytrain.load(resume / ckpt.name, again)
            for b in range(SAVE_AT, STEPS):
                _boundary(again, name, spec, b, rank)
            result[name]["resumed"] = _fingerprint(again)
        print(f"rank {rank}: {name}", file=sys.stderr, flush=True)
    (out / f"hashes.{ranks}.{rank}.json").write_text(json.dumps(result, indent=1, sort_keys=True))


def _run_revision(tree: Path, out: Path, only, resume) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree))
    args = [str(Path(__file__).resolve()), "run", str(out)]
    args += ["--only", ",".join(only)] if only else []
    args += ["--resume", str(resume)] if resume else []
    subprocess.run([sys.executable, *args], env=env, check=True)
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        sys.exit("mpiexec not found: pip install mpi4py mpich (the 2-rank configurations need it)")
    subprocess.run([mpiexec, "-n", "2", sys.executable, *args], env=env, check=True)


def _load(out: Path) -> dict:
    merged: dict = {}
    for f in sorted(out.glob("hashes.*.json")):
        _, ranks, rank, _ = f.name.split(".")
        for name, runs in json.loads(f.read_text()).items():
            for kind, h in runs.items():
                merged.setdefault(name, {}).setdefault(kind, {}).update({f"rank{rank}:{k}": v for k, v in h.items()})
    return merged


def compare(old: str, new: str | None, only) -> int:
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
    work = Path(tempfile.mkdtemp(prefix="bitwise-"))
    trees, added = {}, []
    try:
        for label, rev in (("old", old), ("new", new)):
            if rev is None or Path(rev).is_dir():
                trees[label] = root if rev is None else Path(rev).resolve()
                continue
            tree = work / f"tree-{label}"
            subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
            added.append(tree)
            trees[label] = tree
        _run_revision(trees["old"], work / "old", only, None)
        _run_revision(trees["new"], work / "new", only, work / "old")
        a, b = _load(work / "old"), _load(work / "new")
        bad = 0
        print(f"| configuration | entries | new = old | resumed from old's checkpoint = old |")
        print("|---|---:|---|---|")
        for name in a:
            ref = a[name]["run"]
            same = b.get(name, {}).get("run") == ref
            resumed = b.get(name, {}).get("resumed") == ref
            bad += not (same and resumed)
            print(f"| {name} | {len(ref)} | {'equal' if same else 'DIFFERS'} | {'equal' if resumed else 'DIFFERS'} |")
            for kind in ("run", "resumed"):
                got = b.get(name, {}).get(kind, {})
                diff = sorted(k for k in ref.keys() | got.keys() if ref.get(k) != got.get(k))
                if diff:
                    print(f"    {kind}: {diff[:8]}{' ...' if len(diff) > 8 else ''}")
        print(f"{len(a) - bad} of {len(a)} configurations equal bit for bit "
              f"({old} -> {new or 'the working tree'})")
        return 1 if bad or not a else 0
    finally:
        for tree in added:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare", help="two revisions (NEW: the working tree when left out)")
    c.add_argument("old")
    c.add_argument("new", nargs="?")
    c.add_argument("--only", type=lambda s: s.split(","), default=None)
    r = sub.add_parser("run", help="one revision (the arraytrain on sys.path) into OUT")
    r.add_argument("out", type=Path)
    r.add_argument("--only", type=lambda s: s.split(","), default=None)
    r.add_argument("--resume", type=Path, default=None)
    a = p.parse_args(argv)
    if a.cmd == "compare":
        return compare(a.old, a.new, a.only)
    run(a.out, a.only, a.resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
