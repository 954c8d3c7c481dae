"""``python -m arraytrain.bench [compare|threads|mlp|predict|compression|compress|intake|dropin|distributed|state8|cluster|tta] ...``

``compare`` (the default): one clipped optimizer step, arraytrain beside
torch.optim (foreach and fused), hand-written NumPy and optax, with the
machine's triad bandwidth; see :mod:`arraytrain.bench.compare`.
``threads``: the threading policy measured on a NumPy MLP; see
:mod:`arraytrain.bench.threads`.
``mlp``: MLP training throughput, arraytrain beside torch, with the BLAS
matmul roof; see :mod:`arraytrain.bench.mlp`.
``predict``: gradient prediction (PhaseTrainer) against full training on the
digits MLP; see :mod:`arraytrain.bench.predict`.
``compression``: the digits MLP trained with every compressor, with and
without error feedback; see :mod:`arraytrain.bench.compression`.
``compress``: compressor throughput (GB/s, % of triad); see
:mod:`arraytrain.bench.compression` too.
``intake``: the dict path's cost per tensor, before and after the structure
cache, beside the zero-copy path and torch's fused AdamW; see
:mod:`arraytrain.bench.intake`.
``dropin``: the drop-in ``arraytrain.interop.torch.AdamW`` step beside torch's
fused AdamW at 1e6/1e7/1e8 parameters, and the cost of reading the param groups;
see :mod:`arraytrain.bench.dropin`.
``distributed``: processes over MPI (it launches mpiexec itself): MPIComm's
all-reduce beside mpi4py's, engine step time at 1/2/4 processes, each
compressor's bytes and projected step time at 1/10/100 Gb/s, and digits
accuracy with 4 processes; see :mod:`arraytrain.bench.distributed`.
``state8``: 8-bit optimizer state against float32 state, a TransformerEncoder's losses (and
bitsandbytes' AdamW8bit's) and the digits' accuracy; see :mod:`arraytrain.bench.state8`.
``cluster``: a cluster of network namespaces on this machine, links shaped with ``tc``, and the
torch binding against DDP measured on it (needs root); see :mod:`arraytrain.bench.cluster`.
``tta``: ``arraytrain train`` across that cluster's nodes with each ``--compress`` setting: samples/s
over the whole run, bytes and test accuracy against dense (needs root); see :mod:`arraytrain.bench.tta`.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in ("compare", "threads", "mlp", "predict", "compression", "compress", "intake",
                                                 "dropin", "distributed", "state8", "cluster", "tta") else "compare"
    if command == "threads":
        from .threads import main as run
    elif command == "mlp":
        from .mlp import main as run
    elif command == "predict":
        from .predict import main as run
    elif command == "compression":
        from .compression import main as run
    elif command == "compress":
        from .compression import throughput_main as run
    elif command == "intake":
        from .intake import main as run
    elif command == "dropin":
        from .dropin import main as run
    elif command == "distributed":
        from .distributed import main as run
    elif command == "state8":
        from .state8 import main as run
    elif command == "cluster":
        from .cluster import main as run
    elif command == "tta":
        from .tta import main as run
    else:
        from .compare import main as run
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
