"""Command-line parsing shared by the ``hetdp`` command, the benchmarks it runs and ``python -m`` tools: a parser whose
errors are one line, and value types of flags."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse ``type=``): anything else is the parser's one-line error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``hetdp run: error: ...``) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")
