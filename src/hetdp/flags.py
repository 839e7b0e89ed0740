"""Value types of command-line flags, shared by the command line and the benchmarks it runs."""

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
