"""``hetdp bench NAME``: run one reproducible experiment, print its table, optionally write its JSON."""

from __future__ import annotations

import argparse
import functools
import importlib
from types import ModuleType

from hetdp.bench import BENCHMARKS
from hetdp.cli import require_command
from hetdp.errors import ConfigError
from hetdp.files import write_json

COMMON_FLAGS = (
    "Every benchmark takes --quick (a run of under two minutes on 2 cores), --json PATH (write its figures as "
    "one JSON object to PATH) and --seed N (seed of every random choice, default 0), after its NAME: "
    "`hetdp bench collectives --quick --json out.json`. `hetdp bench NAME --help` lists its own flags."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="run a reproducible benchmark: prints a table, optionally writes JSON (see `hetdp bench --help`)",
        description="Run one reproducible experiment: a progress bar while it runs, then a table of its figures.",
        epilog=COMMON_FLAGS,
    )
    names = require_command(parser, "NAME", dest="benchmark")
    for name, description in BENCHMARKS.items():
        module = importlib.import_module(f"hetdp.bench.{name}")
        sub = names.add_parser(name, help=description, description=description)
        sub.add_argument("--quick", action="store_true", help="a run of under two minutes on 2 cores")
        sub.add_argument("--json", metavar="PATH", help="write the figures as one JSON object to PATH")
        sub.add_argument("--seed", type=int, default=0, help="seed of every random choice (default 0)")
        module.add_arguments(sub)
        sub.set_defaults(handler=functools.partial(_run, module))


def _run(module: ModuleType, args: argparse.Namespace) -> int:
    if args.json and args.json.endswith("/"):
        raise ConfigError(f"--json needs a file path, got the folder {args.json!r}")
    result = {"benchmark": args.benchmark, "quick": args.quick, "seed": args.seed, **module.run(args)}
    print(module.render(result))
    if args.json:
        write_json(args.json, result)
        print(f"figures written to {args.json}")
    return 0
