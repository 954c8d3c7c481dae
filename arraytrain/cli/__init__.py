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

The command's modules: :mod:`~arraytrain.cli.arguments` (the parser and the checks),
:mod:`~arraytrain.cli.run` (the training and its reports); ``arraytrain compile`` is
:mod:`arraytrain.precompile`'s.
"""

from __future__ import annotations

import argparse
import sys

from .. import precompile
from ..errors import ArrayTrainError
from .arguments import (COMPRESSORS, PREDICT_DEFAULTS, PROG, Parser, UsageError, add_train_parser, launched_rank,
                        optimizers)
from .run import THROUGHPUT_MEASURES, train

__all__ = ["COMPRESSORS", "PREDICT_DEFAULTS", "THROUGHPUT_MEASURES", "UsageError", "build_parser", "main",
           "optimizers", "train"]


def build_parser() -> argparse.ArgumentParser:
    """The ``arraytrain`` command line: ``train`` and ``compile``."""
    from .. import __version__

    parser = Parser(prog=PROG, description="arraytrain: a training engine on flat NumPy buffers.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_train_parser(sub).set_defaults(func=train)
    precompile.add_parser(sub)
    return parser


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
        if launched_rank() == 0:  # every rank read the same arguments: one line, not one per process
            print(str(exc), file=sys.stderr)
        return 2
    except (ArrayTrainError, OSError) as exc:
        where = f"{PROG} {args.command}" if "args" in locals() else PROG
        print(f"{where}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
