"""``hetdp plan cluster.toml``: how much data each device should receive, and how long training will take (C-ADP)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hetdp.allocate.apportion import apportion
from hetdp.allocate.planner import METHODS, Plan, evaluate, plan
from hetdp.cluster.spec import ClusterSpec
from hetdp.errors import ConfigError
from hetdp.files import write_json
from hetdp.flags import positive_int
from hetdp.report import decimals_for, format_table

DEFAULT_EPOCHS = 10


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan each device's share of the data from its compute and its link (C-ADP)",
        description="Read a cluster file and print, per device, the samples it should receive, its batch size and "
        "its predicted send, compute and merge seconds; then the predicted total against an equal split.",
    )
    parser.add_argument("cluster", type=Path, help="cluster description (TOML; see examples/cluster.toml)")
    parser.add_argument(
        "--epochs", type=positive_int, default=DEFAULT_EPOCHS, help=f"training epochs (default {DEFAULT_EPOCHS})"
    )
    parser.add_argument(
        "--dataset-size", type=positive_int, metavar="D",
        help="samples to distribute (default: the file's dataset_size)",
    )
    parser.add_argument("--method", choices=METHODS, default="exact", help="solver (default exact)")
    parser.add_argument(
        "--min-samples", type=int, default=0, metavar="K", help="samples every device must receive (default 0)"
    )
    parser.add_argument("--json", metavar="PATH", help="write the plan as one JSON object to PATH")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.json and args.json.endswith("/"):
        raise ConfigError(f"--json needs a file path, got the folder {args.json!r}")
    cluster = ClusterSpec.from_toml(args.cluster)
    dataset_size = args.dataset_size or cluster.dataset_size
    if dataset_size is None:
        raise ConfigError(f"no dataset size: pass --dataset-size or set dataset_size in {args.cluster}")
    result = plan(cluster, dataset_size, args.epochs, method=args.method, min_samples=args.min_samples)
    equal = evaluate(cluster, apportion([1.0] * len(cluster.devices), dataset_size, minimum=0), args.epochs)
    print(render(result, equal))
    if args.json:
        write_json(args.json, {**result.to_dict(), "dataset_size": dataset_size, "equal_split": equal.to_dict()})
        print(f"plan written to {args.json}")
    return 0


def render(result: Plan, equal: Plan) -> str:
    """The per-device table and the summary lines below it."""
    total = result.dataset_size
    rows: list[dict[str, Any]] = [
        {
            "device": device.name,
            "samples": device.samples,
            "share_%": round(100.0 * device.samples / total, 2),
            "batch": device.batch_size,
            "batches": device.batches,
            "send_s": device.send_s,
            "compute_s": device.compute_s,
            "comm_s": device.comm_s,
            "epoch_s": device.epoch_s,
        }
        for device in result.devices
    ]
    title = f"C-ADP plan ({result.method}): {total} samples, {result.epochs} epochs, {len(rows)} devices"
    legend = ("samples: D_i, sent once; batch: local batch size (memory-capped); batches: local steps per epoch; "
              "send_s: seconds to receive the samples (eq. 2); compute_s: seconds of computation per epoch (eq. 5); "
              "comm_s: seconds of parameter exchange per epoch (eq. 6); epoch_s = compute_s + comm_s")
    lines = [format_table(rows, title=title), legend, ""]
    places = decimals_for([result.send_s, result.epoch_s, result.total_s, equal.total_s])
    lines.append(f"T_send  {result.send_s:12.{places}f} s   (once: the slowest device's data transfer, eq. 2)")
    lines.append(f"epoch   {result.epoch_s:12.{places}f} s   (slowest device's compute + merge, eqs. 5-6)")
    lines.append(f"T_total {result.total_s:12.{places}f} s   (T_send + {result.epochs} epochs, eq. 7)")
    gap = "proved optimal" if result.gap == 0 else f"gap {100 * result.gap:.3g}% to the exact optimum's bound"
    lines.append(f"solver  {result.method}: {gap}")
    saving = 100.0 * (1.0 - result.total_s / equal.total_s) if equal.total_s > 0 else 0.0
    lines.append(f"equal split: T_total {equal.total_s:.{places}f} s; this plan takes {saving:.1f}% less")
    return "\n".join(lines)
