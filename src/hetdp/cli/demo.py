"""``hetdp demo``: the whole effect on a laptop, equal vs adaptive allocation on 4 emulated unequal workers."""

from __future__ import annotations

import argparse
from pathlib import Path

from hetdp.bench.allocation import add_dataset_arguments, run_experiment, steady_epoch_s
from hetdp.cluster.emulate import parse_speeds
from hetdp.errors import ConfigError
from hetdp.files import write_json
from hetdp.report import format_table, write_allocation_plots
from hetdp.train.allocation import diagnose_straggler


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="train a ConvNet on digits with 4 unequal emulated workers: equal vs adaptive allocation",
        description="Train the digits ConvNet on local workers of unequal emulated speed, once with equal "
        "allocation (plain DDP) and once adaptive; print per-epoch rows and write PNG plots.",
    )
    parser.add_argument("--speeds", default="1,1,2,4", help="relative speed per worker (default 1,1,2,4)")
    parser.add_argument("--epochs", type=int, default=10, help="epochs per run (default 10)")
    parser.add_argument("--sample-cost-ms", type=float, default=8.0, help="emulated ms per sample at speed 1")
    parser.add_argument("--out", type=Path, default=Path("hetdp-out/demo"), help="folder for plots and figures")
    parser.add_argument("--seed", type=int, default=0)
    add_dataset_arguments(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    speeds = parse_speeds(args.speeds)
    if args.epochs < 2:
        raise ConfigError(f"--epochs must be >= 2, got {args.epochs}")
    if args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out must be a folder, got the file {args.out}")
    print(f"training on {len(speeds)} local workers at speeds {list(speeds)}: equal allocation, then adaptive")
    raw = run_experiment(
        speeds,
        policies=("equal", "adaptive"),
        epochs=args.epochs,
        sample_cost_ms=args.sample_cost_ms,
        global_batch=128,
        micro_batch=16,
        replan_every=2,
        seed=args.seed,
        lr=0.1,
        dataset=args.dataset,
        data_root=args.data_root,
    )
    runs = raw["runs"]
    rows = [
        {
            "policy": row["policy"],
            "epoch": row["epoch"],
            "shares": row["shares"],
            "compute s": [round(s, 2) for s in row["compute_s"]],
            "wait s": [round(s, 2) for s in row["wait_s"]],
            "epoch s": row["epoch_s"],
            "accuracy": row["accuracy"],
        }
        for policy_rows in runs.values()
        for row in policy_rows
    ]
    print(format_table(rows))
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

