"""``hetdp bench links``: C-ADP and the drop-in over real rate-limited links, between emulated hosts.

Four hosts (network namespaces, ``hetdp.hosts``) in two sites: hosts 0 and 1
at a fast site, hosts 2 and 3 at a site behind an uplink of ``--uplink-mbit``,
each host behind a ``--rate-mbit`` link; every rate is a kernel token bucket, so
every transfer is real packets and no sleep stands for the network. Compute is
paced to emulated speeds (``--speeds``, ``--sample-cost-ms``), as everywhere.

One launch across the four hosts (``hetdp.launch`` with ``Nodes``, one rank per
host) probes the cluster (``hetdp.probe_cluster``: batch times and each
link from rank 0, by real transfers), plans C-ADP from the probe, delivers each
device's samples over the links (``hetdp.distribute``) and builds four runs on
the same model, all through ``hetdp.DDP``: C-ADP (``hetdp.Planned(cluster)``,
``"local"``), DDP's equal split with an allreduce every step, and the drop-in's
adaptive allocation with an allreduce every step and with local SGD (one merge
per epoch). The runs train an epoch each in turn, each epoch timed whole on one
clock (``bench.compare``), as many epochs each, the first of each warm-up; every
run's test accuracy stands beside its time. Each speed-up over DDP is read against
its ideal, from DDP's own measured compute: for the allreduce, DDP's epoch less
the compute balanced shares save; for one merge an epoch, the balanced compute
of the epoch's samples plus C-ADP's measured merge.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetdp.cluster.emulate import parse_speeds
from hetdp.errors import ConfigError, HetDPError
from hetdp.report import LaunchProgress, format_table

if TYPE_CHECKING:
    from torch import nn

    from hetdp.hosts import Topology

METHODS = ("cadp", "ddp", "adaptive", "local_sgd")
"""The compared runs, in the order they run."""
LABELS = {"cadp": "C-ADP (planned, local, merge per epoch)", "ddp": "DDP (equal, allreduce per step)",
          "adaptive": "drop-in (adaptive, allreduce per step)", "local_sgd": "drop-in (adaptive, local SGD)"}
PORT = 29500
"""The rendezvous port on host 0 (each set of hosts has a network of its own)."""
TARGETS = {"prediction_error": 0.15}
"""Upper limits: |measured - predicted| / predicted for C-ADP's epoch."""
BATCH_SIZE = 32
"""Samples per step and rank (DDP, the drop-in) and per batch of a C-ADP device."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--uplink-mbit", type=float, default=50.0, metavar="MBIT",
                        help="the slow site's uplink (hosts 2 and 3), Mbit/s (default 50)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0, metavar="MBIT",
                        help="every host's own link, Mbit/s (default 1000)")
    parser.add_argument("--speeds", default="1,1,2,2", metavar="V1,V2,V3,V4",
                        help="emulated speed of each host's rank (default 1,1,2,2: the far site computes faster)")
    parser.add_argument("--sample-cost-ms", type=float, default=8.0, metavar="MS",
                        help="emulated cost of one sample at speed 1 (default 8)")
    parser.add_argument("--hidden", type=int, default=256, metavar="H",
                        help="width of the MLP's two hidden layers (default 256: 84k parameters, 0.34 MB)")
    parser.add_argument("--epochs", type=int, default=None, metavar="E",
                        help="epochs of every run (default 4; 2 with --quick); the first of each is warm-up")


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings, checked; raises ConfigError naming the bad flag."""
    speeds = parse_speeds(args.speeds, 4)
    epochs = args.epochs or (2 if args.quick else 4)
    for flag, value in (("--uplink-mbit", args.uplink_mbit), ("--rate-mbit", args.rate_mbit),
                        ("--sample-cost-ms", args.sample_cost_ms)):
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{flag} must be a positive number, got {value!r}")
    if args.hidden < 1 or epochs < 2:
        raise ConfigError(f"--hidden must be >= 1 and --epochs >= 2, got {args.hidden} and {epochs}")
    return {"uplink_mbit": args.uplink_mbit, "rate_mbit": args.rate_mbit, "speeds": list(speeds),
            "sample_cost_ms": args.sample_cost_ms, "hidden": args.hidden, "epochs": epochs, "seed": args.seed}


def topology(settings: dict[str, Any]) -> Topology:
    """Hosts 0 and 1 at the fast site; hosts 2 and 3 behind the slow uplink; every host behind its own link."""
    from hetdp.hosts import Site, Topology

    return Topology(sites=(Site(hosts=2, rate_mbit=settings["rate_mbit"]),
                           Site(hosts=2, rate_mbit=settings["rate_mbit"], uplink_rate_mbit=settings["uplink_mbit"])))


def link_rates_mbit(settings: dict[str, Any]) -> list[float | None]:
    """The token-bucket rate on the way from host 0 to each host: the slowest link the packets cross."""
    near, far = settings["rate_mbit"], min(settings["rate_mbit"], settings["uplink_mbit"])
    return [None, near, far, far]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hetdp.hosts import EmulatedHosts, check_available
    from hetdp.launch import EventReader

    settings = settings_from_args(args)
    check_available()
    total = 1 + len(METHODS) * settings["epochs"]  # the probe, then each method's epochs
    with tempfile.TemporaryDirectory(prefix="hetdp-bench-links-") as folder:
        work = Path(folder)
        (work / "settings.json").write_text(json.dumps({**settings, "events": str(work / "events.jsonl")}))
        events = EventReader(work / "events.jsonl")
        commands = [[sys.executable, "-m", "hetdp.bench.links", "--node", str(host), str(work)] for host in range(4)]
        with EmulatedHosts(topology(settings)) as hosts, \
                LaunchProgress(total, "bench links", nproc=4, unit="epoch") as progress:
            done = hosts.run(commands, timeout_s=900, poll=lambda: progress(events.read()))
        failed = [(host, result) for host, result in enumerate(done) if result.returncode != 0]
        if failed:
            host, result = failed[0]
            lines = [line for line in result.stdout.splitlines() if line.strip()]
            raise HetDPError(f"host {host} failed (exit code {result.returncode}): "
                             f"{lines[-1] if lines else 'no output'}")
        runs = json.loads((work / "results.json").read_text())
    return figures(runs, settings)


def figures(runs: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """The JSON figures from the workers' rows: C-ADP's prediction against its measured epoch, each method's steady
    epoch against DDP's beside its ideal, each method's accuracy, and each probed link against its token bucket."""
    from hetdp.bench.compare import sat_out, steady_s

    rows = runs["rows"]
    epoch_s = {method: steady_s(rows[method]) for method in METHODS}
    predicted_s = runs["cadp"]["predicted_epoch_s"]
    probed = [None if mbit is None or math.isinf(mbit) else mbit for mbit in runs["probed_mbit"]]
    rates = link_rates_mbit(settings)
    merge_s = statistics.median(min(row["tail_s"]) for row in rows["cadp"] if not row["warmup"])
    ideals = ideal_speedups(rows, merge_s)
    speedups = {method: epoch_s["ddp"] / epoch_s[method] for method in METHODS if method != "ddp"}
    result = {
        **{key: settings[key] for key in ("uplink_mbit", "rate_mbit", "speeds", "sample_cost_ms", "hidden", "epochs")},
        "warmup_epochs": sum(row["warmup"] for row in rows["ddp"]),
        "model_bytes": runs["model_bytes"],
        "tbf_mbit": rates,
        "probed_mbit": probed,
        "probe_error": [None if mbit is None else abs(mbit - rate) / rate for mbit, rate in zip(probed, rates)],
        "probed_latency_ms": runs["probed_latency_ms"],
        "samples": runs["cadp"]["samples"],
        "predicted_epoch_s": predicted_s,
        "predicted_comm_s": runs["cadp"]["predicted_comm_s"],
        "predicted_compute_s": runs["cadp"]["predicted_compute_s"],
        "epoch_s": epoch_s,
        "epochs_s": {method: [row["epoch_s"] for row in rows[method]] for method in METHODS},
        "prediction_error": abs(epoch_s["cadp"] - predicted_s) / predicted_s,
        "merge_s": merge_s,
        "send_s": runs["cadp"]["send_s"],
        "predicted_send_s": runs["cadp"]["predicted_send_s"],
        "speedup_vs_ddp": speedups,
        "ideal_speedup": ideals,
        "efficiency": {method: speedups[method] / ideals[method] for method in speedups},
        "accuracy": {method: rows[method][-1]["accuracy"] for method in METHODS},
        "shares": {method: rows[method][-1]["shares"] for method in ("ddp", "adaptive", "local_sgd")},
        "sat_out": {method: sat_out(rows[method]) for method in METHODS},
        "diagnosis": {method: rows[method][-1]["diagnosis"] for method in METHODS},
        "tail_s": {method: rows[method][-1]["tail_s"] for method in METHODS},
        "rows": rows,
    }
    result["targets"] = {key: {"limit": limit, "met": result[key] <= limit} for key, limit in TARGETS.items()}
    return result


def ideal_speedups(rows: dict[str, list[dict[str, Any]]], merge_s: float) -> dict[str, float]:
    """Each method's ideal speed-up over DDP, from DDP's own measured epochs: with an allreduce every step, DDP's
    epoch less the compute balanced shares would save (``compare.ideal``); with one merge an epoch, the compute of
    the epoch's samples split by the ranks' measured speeds, plus the merge C-ADP measured."""
    from hetdp.bench.compare import ideal, per_sample_s, steady_s

    ddp = rows["ddp"]
    ddp_s = steady_s(ddp)
    per_sample = per_sample_s(ddp)
    allreduce = ideal(ddp_s, baseline_samples=ddp[-1]["samples"], per_sample=per_sample)
    balanced_s = sum(ddp[-1]["samples"]) / sum(1.0 / seconds for seconds in per_sample if seconds)
    once_an_epoch = ddp_s / (balanced_s + merge_s)
    return {"cadp": once_an_epoch, "adaptive": allreduce.speedup, "local_sgd": once_an_epoch}


def render(result: dict[str, Any]) -> str:
    links = [{"link": f"rank 0 -> {rank}", "tbf Mb/s": rate, "probed Mb/s": probed,
              "error": f"{100 * error:.1f}%", "latency ms": latency}
             for rank, (rate, probed, error, latency) in enumerate(zip(result["tbf_mbit"], result["probed_mbit"],
                                                                       result["probe_error"],
                                                                       result["probed_latency_ms"]))
             if rate is not None]
    lines = [format_table(links, title=f"links probed between 4 emulated hosts (uplink {result['uplink_mbit']:g} "
                                        f"Mb/s, hosts {result['rate_mbit']:g} Mb/s)"), ""]
    rows = [{"method": LABELS[method], "epoch s": result["epoch_s"][method],
             "vs DDP": "1.00x" if method == "ddp" else f"{result['speedup_vs_ddp'][method]:.2f}x",
             "ideal": "" if method == "ddp" else f"{result['ideal_speedup'][method]:.2f}x",
             "accuracy": result["accuracy"][method],
             "shares": result["samples"] if method == "cadp" else result["shares"][method]}
            for method in METHODS]
    steady = result["epochs"] - result["warmup_epochs"]
    speeds = ",".join(f"{v:g}" for v in result["speeds"])
    lines.append(format_table(rows, title=f"an epoch of digits, MLP of {result['model_bytes'] / 1e6:.2f} MB, speeds "
                                          f"{speeds} (C-ADP: samples per device); "
                                          f"the wall clock of whole epochs, median of {steady} after "
                                          f"{result['warmup_epochs']} of warm-up, runs in turn; accuracy on the test "
                                          f"split after {result['epochs']} epochs"))
    lines.append("ideal: allreduce per step, DDP's epoch less the compute balanced shares save; one merge an epoch, "
                 "the balanced compute of DDP's samples plus C-ADP's measured merge")
    lines.append("")
    lines.append(f"C-ADP predicted {result['predicted_epoch_s']:.3f} s per epoch (longest compute "
                 f"{result['predicted_compute_s']:.3f} s; slowest link's exchange {result['predicted_comm_s']:.3f} s, "
                 f"priced as overlapping the others' compute), measured {result['epoch_s']['cadp']:.3f} s, of which "
                 f"{result['merge_s']:.3f} s after the last device's compute (the merge, an allreduce after all)")
    for key, target in result["targets"].items():
        verdict = "met" if target["met"] else "MISSED"
        lines.append(f"  {key:<18} {result[key]:8.3f}   target <= {target['limit']:<5g} {verdict}")
    lines += ["", "drop-in diagnosis:"] + [f"  {LABELS[method]}: {result['diagnosis'][method]}"
                                           for method in ("adaptive", "local_sgd")]
    return "\n".join(lines)


# --- on the hosts -----------------------------------------------------------------------------------------------


def _node(host: int, folder: Path) -> int:
    """One host's part: its rank of the launch across the four hosts, its failure in one line."""
    from hetdp.hosts import address
    from hetdp.launch import run_local
    from hetdp.launch.nodes import Nodes

    nodes = Nodes(count=4, rank=host, master_addr=address(0), master_port=PORT, join_timeout_s=120)
    try:
        done = run_local("hetdp.bench.links", 1, ["--worker", str(folder)], module=True, report_errors=True,
                         nodes=nodes, timeout_s=600)
    except HetDPError as error:
        print(f"host {host}: {str(error).splitlines()[0]}", file=sys.stderr, flush=True)
        return 2
    return done.returncode


def mlp(hidden: int, seed: int) -> nn.Module:
    """The benchmark's model: digits (8x8) through two hidden layers of ``hidden`` units; the same on every rank."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


class _Method:
    """One method's model and loader: the user's loop, an epoch at a time; each rank's seconds from its last step to
    the epoch's end (the wait for the others and the epoch's merge), and the test accuracy after it."""

    def __init__(self, name: str, model: Any, loader: Any, test: Any) -> None:
        import torch

        self.name = name
        self.model = model
        self.loader = loader
        self.test = test
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        self.tail_s = 0.0

    def train_epoch(self, epoch: int) -> None:
        from torch import nn

        last_step = time.perf_counter()
        self.loader.sampler.set_epoch(epoch)
        for inputs, targets in self.loader:
            self.optimizer.zero_grad()
            nn.functional.cross_entropy(self.model(inputs), targets).backward()
            self.optimizer.step()
            last_step = time.perf_counter()
        self.tail_s = time.perf_counter() - last_step

    def describe(self) -> dict[str, Any]:
        import torch.distributed as dist

        from hetdp.bench.compare import report_row
        from hetdp.bench.models import accuracy

        tails_s = [0.0] * dist.get_world_size()
        dist.all_gather_object(tails_s, self.tail_s)
        report = self.model.last_epoch
        return {**report_row(report), "diagnosis": report.diagnosis(), "tail_s": tails_s,
                "accuracy": accuracy(self.model.module, self.test)}

    def close(self) -> None:
        self.model.close()


def _worker(folder: Path) -> None:
    """One rank: probe, plan, then every method in turn; rank 0 writes ``results.json``."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    import hetdp
    from hetdp.bench.compare import alternate
    from hetdp.bench.datasets import load_digits
    from hetdp.launch import EventWriter

    settings = json.loads((folder / "settings.json").read_text())
    rank, _ = hetdp.init_distributed()
    torch.set_num_threads(1)
    progress = EventWriter(enabled=rank == 0, path=settings["events"])
    emulation = hetdp.Emulation(speeds=tuple(settings["speeds"]), sample_cost_ms=settings["sample_cost_ms"])
    seed, hidden, epochs = settings["seed"], settings["hidden"], settings["epochs"]
    split = load_digits(seed=seed)
    train = split.train  # DDP and the drop-in read shared storage; C-ADP's owner sends its own
    inputs, targets = train.tensors

    cluster = hetdp.probe_cluster(mlp(hidden, seed), inputs[:256], targets[:256],
                                  hetdp.ProbeConfig(batch_size=BATCH_SIZE, repeats=3, pings=3), emulation=emulation)
    progress.update()
    plan = hetdp.plan(cluster, len(train), epochs, min_samples=1)
    dist.barrier()
    started = time.perf_counter()
    local = hetdp.distribute(train if rank == 0 else None, plan.samples)  # over the real links
    dist.barrier()
    send_s = time.perf_counter() - started
    cadp = hetdp.DDP(mlp(hidden, seed), hetdp.Planned(cluster, epochs=epochs), "local", emulation=emulation)
    methods = [_Method("cadp", cadp, cadp.allocate(DataLoader(local.data, shuffle=True), own_data=True), split.test)]
    for method, allocation, sync in (("ddp", "equal", "allreduce"), ("adaptive", "adaptive", "allreduce"),
                                     ("local_sgd", "adaptive", "local")):
        model = hetdp.DDP(mlp(hidden, seed), allocation, sync, emulation=emulation)
        loader = model.allocate(DataLoader(train, batch_size=BATCH_SIZE, sampler=DistributedSampler(train, seed=seed)))
        methods.append(_Method(method, model, loader, split.test))
    results: dict[str, Any] = {"rows": alternate(methods, epochs, warmup=1, progress=progress)}
    for method in methods:
        method.close()
    results["cadp"] = {"samples": plan.samples, "predicted_epoch_s": plan.epoch_s, "send_s": send_s,
                       "predicted_send_s": plan.send_s,
                       "predicted_comm_s": max(device.comm_s for device in plan.devices),
                       "predicted_compute_s": max(device.compute_s for device in plan.devices)}
    if rank == 0:
        results.update(probed_mbit=[device.bandwidth_mbps for device in cluster.devices],
                       probed_latency_ms=[device.latency_ms for device in cluster.devices],
                       model_bytes=cluster.model_bytes)
        (folder / "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--node":
        sys.exit(_node(int(sys.argv[2]), Path(sys.argv[3])))
    if len(sys.argv) != 3 or sys.argv[1] != "--worker":
        sys.exit("usage: python -m hetdp.bench.links --worker FOLDER | --node HOST FOLDER (started by `hetdp bench "
                 "links`)")
    _worker(Path(sys.argv[2]))
