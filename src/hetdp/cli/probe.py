"""``hetdp probe -n N``: measure N local ranks, or the ranks of several nodes, as a C-ADP cluster and write the
cluster file.

The ranks train the reference ConvNet on digits samples. Each link from rank 0
is timed with real transfers between the ranks; across nodes (``--nnodes``, as
``hetdp run`` takes it) that is the network between them. On one machine,
``--speeds`` and the link flags make the ranks unequal, as ``hetdp run`` does,
so a one-machine probe yields a heterogeneous cluster file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
from pathlib import Path

from hetdp.cli.run import add_node_arguments, group_ranks, nodes_from_args
from hetdp.cluster.emulate import Emulation, parse_speeds
from hetdp.errors import ConfigError, HetDPError
from hetdp.flags import positive_int
from hetdp.launch import run_local
from hetdp.report import LaunchProgress, format_table


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "probe",
        help="measure N local ranks (batch time, memory, links from rank 0) and write a cluster file",
        description="Launch N local ranks (or this node's N ranks of a launch across several, --nnodes), time each "
        "one's batches and its link from rank 0 (the data owner) with real transfers, estimate its memory per "
        "sample, and write a cluster file that `hetdp plan` reads. Across nodes, node 0 writes the file, and the "
        "per-rank flags give one value per global rank, the same list on every node.",
    )
    parser.add_argument("-n", "--nproc", type=positive_int, required=True, help="number of local ranks")
    add_node_arguments(parser)
    parser.add_argument("--speeds", metavar="V1,V2,...", help="emulated relative speed of each rank, e.g. 4,4,1,1")
    parser.add_argument(
        "--sample-cost-ms", type=float, default=0.0, metavar="MS",
        help="synthetic cost of one sample at speed 1 (default 0: stretch measured time by --speeds instead)",
    )
    parser.add_argument("--batch-size", type=positive_int, default=32, metavar="B", help="batch size to time (default 32)")
    parser.add_argument(
        "--bandwidths-mbps", metavar="B0,B1,...",
        help="emulated link of each rank from rank 0, Mb/s (rank 0's: inf), added to the real one (default: the "
        "real links alone)"
    )
    parser.add_argument("--latencies-ms", metavar="L0,L1,...", help="emulated one-way latency of each link, ms")
    parser.add_argument("--sample-bytes", type=float, metavar="BYTES",
                        help="b, bytes per sample on the wire, to write (default: the bytes of one real sample)")
    parser.add_argument("--dataset-size", type=positive_int, metavar="D",
                        help="samples `hetdp plan` distributes by default (default: the digits training set it times)")
    parser.add_argument("--repeats", type=positive_int, default=5, metavar="N",
                        help="timed batches and round trips (default 5)")
    parser.add_argument("--payload-mb", type=float, default=4.0, metavar="MB",
                        help="size of the timed transfer, MB (default 4; larger is more precise on a fast link)")
    parser.add_argument("--out", default="cluster.toml", metavar="PATH", help="cluster file to write (default cluster.toml)")
    parser.set_defaults(handler=run)


def parse_per_rank(text: str | None, flag: str, nproc: int, *, positive: bool) -> list[float] | None:
    """Parse ``"inf,100,50"``: one non-negative (or positive) number per rank, ``inf`` allowed.

    Raises:
        ConfigError: a value is not a number, out of range, or the count differs from ``nproc``.
    """
    if text is None:
        return None
    values = []
    for rank, item in enumerate(text.split(",")):
        try:
            value = float(item)
        except ValueError:
            raise ConfigError(f"{flag} must be numbers, got {item.strip()!r} (rank {rank})") from None
        if math.isnan(value) or value < 0 or (positive and value == 0):
            raise ConfigError(f"{flag} must be {'> 0' if positive else '>= 0'}, got {item.strip()!r} (rank {rank})")
        values.append(value)
    if len(values) != nproc:
        raise ConfigError(f"{flag} gives {len(values)} values for {nproc} ranks; give one per rank")
    return values


def run(args: argparse.Namespace) -> int:
    nodes = nodes_from_args(args)
    texts = {"--speeds": args.speeds, "--bandwidths-mbps": args.bandwidths_mbps, "--latencies-ms": args.latencies_ms}
    nproc = group_ranks(args, nodes, {flag: len(text.split(",")) for flag, text in texts.items() if text})
    speeds = parse_speeds(args.speeds, nproc) if args.speeds else None
    emulation = Emulation(speeds=speeds, sample_cost_ms=args.sample_cost_ms)
    bandwidths = parse_per_rank(args.bandwidths_mbps, "--bandwidths-mbps", nproc, positive=True)
    latencies = parse_per_rank(args.latencies_ms, "--latencies-ms", nproc, positive=False)
    if latencies is not None and bandwidths is None:
        bandwidths = [math.inf] * nproc
    if args.sample_bytes is not None and not args.sample_bytes >= 0:
        raise ConfigError(f"--sample-bytes must be >= 0, got {args.sample_bytes!r}")
    if not args.payload_mb * 1e6 >= 4:
        raise ConfigError(f"--payload-mb must be at least 4 bytes' worth, got {args.payload_mb!r}")
    out = Path(args.out)
    if out.is_dir():
        raise ConfigError(f"--out needs a file path, got the folder {str(out)!r}")
    settings = {
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "bandwidths_mbps": bandwidths,
        "latencies_ms": latencies,
        "sample_bytes": args.sample_bytes,
        "payload_bytes": int(args.payload_mb * 1e6),
        "dataset_size": args.dataset_size,
        "out": str(out.resolve()),
    }
    with tempfile.TemporaryDirectory(prefix="hetdp-probe-") as folder:
        path = Path(folder) / "settings.json"
        path.write_text(json.dumps(settings))
        worker = ["--worker", str(path)]
        with LaunchProgress(1, "probing", nproc=args.nproc, unit="probe") as progress:
            done = run_local("hetdp.cli.probe", args.nproc, worker, module=True, env=emulation.to_env(),
                             timeout_s=600, follow=progress, report_errors=True, nodes=nodes)
    if done.returncode != 0:
        raise HetDPError(f"the probe workers exited with code {done.returncode} (their output is above)")
    if nodes is not None and nodes.rank != 0:
        print(f"node {nodes.rank}: probed; node 0 wrote the cluster file")
        return 0
    from hetdp.cluster.spec import ClusterSpec

    cluster = ClusterSpec.from_toml(out)
    rows = [
        {
            "device": d.name,
            "batch": d.batch_size,
            "batch s": d.batch_time_s,
            "Mb/s from rank 0": d.bandwidth_mbps,
            "latency ms": d.latency_ms,
            "memory MB": d.memory_mb if d.memory_mb is not None else "-",
            "fixed MB": d.fixed_memory_mb,
            "MB/sample": d.activation_mb_per_sample,
        }
        for d in cluster.devices
    ]
    title = (f"probed {len(cluster.devices)} ranks (b = {cluster.sample_bytes:g} B per sample, M_m = {cluster.model_bytes:g} B of "
             f"model, D = {cluster.dataset_size} samples)")
    print(format_table(rows, title=title))
    print("batch s: seconds per batch, forward and backward; Mb/s and latency ms: the link from rank 0, the data "
          "owner; memory MB: the device's (G_i), fixed MB: taken whatever the batch (S_m), MB/sample: activations "
          "per sample (Delta S_i)")
    print(f"cluster written to {out}; `hetdp plan {out}` plans it")
    return 0


def _worker(settings_path: Path) -> None:
    """One probing rank: measure, and on rank 0 write the cluster file."""
    import torch
    import torch.distributed as dist

    from hetdp.bench.datasets import load_digits
    from hetdp.bench.models import ConvNet
    from hetdp.cluster.emulate import Link
    from hetdp.cluster.probe import ProbeConfig, probe_cluster
    from hetdp.files import atomic_write
    from hetdp.launch import EventWriter
    from hetdp.runtime import init_distributed

    settings = json.loads(settings_path.read_text())
    rank, world_size = init_distributed()
    torch.set_num_threads(1)
    progress = EventWriter(enabled=rank == 0)
    links = None
    if settings["bandwidths_mbps"] is not None:
        latencies = settings["latencies_ms"] or [0.0] * world_size
        links = [Link(bandwidth_mbps=b, latency_ms=l) for b, l in zip(settings["bandwidths_mbps"], latencies)]
    train = load_digits().train
    inputs, targets = train.tensors
    torch.manual_seed(0)
    config = ProbeConfig(
        batch_size=settings["batch_size"],
        repeats=settings["repeats"],
        pings=settings["repeats"],
        sample_bytes=settings["sample_bytes"],
        payload_bytes=settings["payload_bytes"],
    )
    cluster = probe_cluster(ConvNet(), inputs[:256], targets[:256], config, links=links)
    cluster = dataclasses.replace(cluster, dataset_size=settings["dataset_size"] or len(train))
    if rank == 0:
        text = cluster.to_toml()
        atomic_write(settings["out"], lambda handle: handle.write(text.encode()))
    progress.update()
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--worker":
        sys.exit("usage: python -m hetdp.cli.probe --worker SETTINGS (started by `hetdp probe`)")
    _worker(Path(sys.argv[2]))
