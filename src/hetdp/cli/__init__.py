"""The ``hetdp`` command line: one module per sub-command, each exposing ``register(subparsers)``.

A ``HetDPError`` becomes one line on stderr and exit code 2 (a launched worker's
failure: that worker's exit code); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import os
import sys
from collections.abc import Sequence

from hetdp.errors import HetDPError, WorkerError
from hetdp.flags import OneLineParser

COMMANDS = ("demo", "run", "plan", "probe", "bench", "simulate")
"""Sub-command modules under ``hetdp.cli``, in the order ``hetdp --help`` lists them."""


def require_command(parser: argparse.ArgumentParser, metavar: str, dest: str) -> argparse._SubParsersAction:
    """Sub-commands for ``parser``; without one, it prints its help (the list of them), then one error line."""
    subparsers = parser.add_subparsers(dest=dest, metavar=metavar)
    parser.set_defaults(handler=lambda args: _missing(parser, metavar, subparsers))
    return subparsers


def _missing(parser: argparse.ArgumentParser, metavar: str, subparsers: argparse._SubParsersAction) -> int:
    parser.print_help(sys.stderr)
    print(f"{parser.prog}: error: choose a {metavar}: {', '.join(subparsers.choices)}", file=sys.stderr)
    return 2


def version() -> str:
    """The installed package's version, for `hetdp --version`."""
    try:
        return importlib.metadata.version("hetdp")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="hetdp", description="Heterogeneity-aware data-parallel training for PyTorch.",
                           epilog="`hetdp COMMAND --help` describes each command and its flags.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action="version", version=f"hetdp {version()}")
    subparsers = require_command(parser, "COMMAND", dest="command")
    for name in COMMANDS:
        importlib.import_module(f"hetdp.cli.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args) or 0
    except BrokenPipeError:  # the reader left (`hetdp plan ... | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        return 1
    except HetDPError as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        command = " ".join(name for name in (args.command, getattr(args, "benchmark", None)) if name)
        print(f"hetdp {command}: error: {first_line}", file=sys.stderr)
        return error.exit_code if isinstance(error, WorkerError) else 2
