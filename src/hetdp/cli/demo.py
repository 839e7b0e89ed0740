"""``hetdp demo``: the whole effect on a laptop, equal vs adaptive allocation on 4 emulated unequal workers."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hetdp.bench.allocation import add_dataset_arguments, run_experiment, steady_epoch_s
from hetdp.bench.datasets import load_dataset
from hetdp.bench.plots import write_allocation_plots
from hetdp.cluster.emulate import Emulation, parse_speeds
from hetdp.errors import ConfigError
from hetdp.figures.metrics import diagnose_straggler
from hetdp.files import write_json
from hetdp.report import StreamingTable, print_above_progress

GLOBAL_BATCH = 128
COLUMNS = ("policy", "epoch", "shares", "compute s", "wait s", "epoch s", "accuracy")
LEGEND = (
    f"shares: samples each rank computes per step (global batch {GLOBAL_BATCH}); compute s: seconds each rank "
    "computed; wait s: seconds each rank waited for the others and the allreduce; epoch s: the epoch's wall-clock; "
    "accuracy: on the test split after the epoch"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="train a ConvNet on digits with 4 unequal emulated workers: equal vs adaptive allocation",
        description="Train the digits ConvNet on local workers of unequal emulated speed, once with equal "
        "allocation (plain DDP) and once adaptive; print a row per epoch as it ends and write PNG plots.",
    )
    parser.add_argument("--speeds", default="1,1,2,4", help="relative speed per worker (default 1,1,2,4)")
    parser.add_argument("--epochs", type=int, default=10, help="epochs per run (default 10)")
    parser.add_argument("--sample-cost-ms", type=float, default=8.0, metavar="MS",
                        help="emulated milliseconds per sample at speed 1 (default 8)")
    parser.add_argument("--out", type=Path, default=Path("hetdp-out/demo"),
                        help="folder for plots and figures (default hetdp-out/demo)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the data order (default 0)")
    add_dataset_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    speeds = parse_speeds(args.speeds)
    if args.epochs < 2:
        raise ConfigError(f"--epochs must be >= 2, got {args.epochs}")
    if args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out must be a folder, got the file {args.out}")
    Emulation(speeds=speeds, sample_cost_ms=args.sample_cost_ms)  # bad settings fail before anything is printed
    load_dataset(args.dataset, args.data_root)
    print(f"training on {len(speeds)} local workers at speeds {list(speeds)}: equal and adaptive allocation, an epoch "
          "of each in turn")
    print(LEGEND, flush=True)
    policies = ("equal", "adaptive")
    table = StreamingTable(COLUMNS, widths={"policy": max(map(len, policies))})
    raw = run_experiment(
        speeds,
        policies=policies,
        epochs=args.epochs,
        sample_cost_ms=args.sample_cost_ms,
        global_batch=GLOBAL_BATCH,
        micro_batch=16,
        replan_every=2,
        seed=args.seed,
        lr=0.1,
        dataset=args.dataset,
        data_root=args.data_root,
        on_row=lambda row: print_above_progress(table.format(table_row(row))),
    )
    runs = raw["runs"]
    equal_s, adaptive_s = steady_epoch_s(runs["equal"]), steady_epoch_s(runs["adaptive"])
    ideal = sum(speeds) / (len(speeds) * min(speeds))
    print(
        f"\nsteady epoch: equal {equal_s:.2f} s, adaptive {adaptive_s:.2f} s: speedup {equal_s / adaptive_s:.2f}x "
        f"of an ideal {ideal:.2f}x; accuracy {runs['equal'][-1]['accuracy']:.3f} vs {runs['adaptive'][-1]['accuracy']:.3f}"
    )
    for policy, policy_rows in runs.items():
        print(f"{policy}, last epoch: {diagnose_straggler(policy_rows[-1]['compute_s'], policy_rows[-1]['wait_s'])}")
    paths = write_allocation_plots(runs, args.out)
    write_json(args.out / "demo.json", raw)
    print(f"plots and figures in {args.out}/: {', '.join(path.name for path in paths)}, demo.json")
    return 0


def table_row(row: dict[str, Any]) -> dict[str, Any]:
    """One epoch of one policy as the demo prints it: per-rank seconds to two decimals."""
    return {
        "policy": row["policy"],
        "epoch": row["epoch"],
        "shares": row["shares"],
        "compute s": ",".join(f"{s:.2f}" for s in row["compute_s"]),
        "wait s": ",".join(f"{s:.2f}" for s in row["wait_s"]),
        "epoch s": round(row["epoch_s"], 3),
        "accuracy": round(row["accuracy"], 4),
    }
