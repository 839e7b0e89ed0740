"""The drop-in on a real GPU: its overhead against torch DDP, one GPU beside three CPU ranks, and every path checked.

Five launches, at most 10 minutes on one GPU and 16 cores:

* overhead: one rank on the GPU (NCCL), a CIFAR-sized ResNet-18 under bf16 autocast
  and channels_last, batch 256, the loader's workers enough to keep the GPU busy;
  torch DDP and ``hetdp.DDP`` alternate epochs on the same data, and the figure is
  the drop-in's samples/s against torch's. With ``--profile DIR``, one more epoch
  of each runs under torch.profiler, and DIR gets each one's table of host time.
* mixed: rank 0 on the GPU, ranks 1-3 on the CPU (4 threads each) over gloo, global
  batch 512, on a communication-heavy MLP (1.8M parameters) and a compute-heavy
  CNN; torch DDP (equal shares), hetdp equal, adaptive, adaptive + local:8, and the
  GPU alone (a plain loop on rank 0 on the same global batches).
* paths: every synchronization on the GPU beside three CPU ranks (gloo), and on
  the GPU alone (NCCL), checked as ``gpu_paths`` says.
* sharded: ``hetdp.fully_shard`` alone on the GPU against torch's ``fully_shard``, and
  on a card made small, as ``gpu_sharded`` says (not yet run on a GPU).

Without a GPU it says so in one line and exits 2. Run as a module under torchrun it
is the worker; imported, it is the benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hetdp.bench import gpu_paths, gpu_sharded
from hetdp.bench.workers import launch_workers
from hetdp.cluster.emulate import Emulation
from hetdp.ddp import model as hetdp_ddp
from hetdp.errors import ConfigError
from hetdp.launch import EventWriter
from hetdp.report import format_table
from hetdp.runtime import init_distributed, synchronize

OVERHEAD_SAMPLES, OVERHEAD_BATCH, OVERHEAD_WORKERS = 12_800, 256, 6
MIXED_SAMPLES, MIXED_BATCH = 8_192, 512
CPU_THREADS = 4
PAIRINGS = ("torch_ddp", "equal", "adaptive", "adaptive+local:8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, help="epochs per run (default 4, quick 3; the first is not timed); "
                                                   "the overhead runs twice as many, and two more")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="profile one more overhead epoch of each under torch.profiler; write the tables to DIR")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise ConfigError("hetdp bench gpu needs a CUDA GPU, and torch sees none here (torch.cuda.is_available() "
                          "is False)")
    epochs = args.epochs or (3 if args.quick else 4)
    if epochs < 2:
        raise ConfigError(f"--epochs must be >= 2 (the first is not timed), got {epochs}")
    common = ["--epochs", epochs, "--seed", args.seed]
    profile = ["--profile", args.profile.resolve()] if args.profile else []
    overhead = launch_workers("hetdp.bench.gpu", 1, ["--part", "overhead", *common, *profile],
                              total=2 * (2 * epochs + 2), description="overhead epochs", unit="epoch",
                              on_row=_print_row)
    mixed = launch_workers("hetdp.bench.gpu", 4, ["--part", "mixed", *common, *profile],
                           total=2 * (len(PAIRINGS) + 1) * epochs, description="mixed epochs", unit="epoch",
                           on_row=_print_row)
    paths = {backend: launch_workers("hetdp.bench.gpu_paths", ranks, ["--backend", backend],
                                     total=len(gpu_paths.runs_for(ranks)), description=f"paths over {backend}",
                                     unit="path", on_row=_print_row)
             for backend, ranks in (("gloo", 4), ("nccl", 1))}
    sharded = launch_workers("hetdp.bench.gpu_sharded", 1, common, total=2 * epochs + 1,
                             description="sharded epochs", unit="epoch", on_row=_print_row)
    return summarize(overhead, mixed, paths, sharded)


def _print_row(row: dict[str, Any]) -> None:
    """Each figure as it is measured: a run cut short still shows how far it got."""
    print(json.dumps(row), flush=True)


def summarize(overhead: dict[str, Any], mixed: dict[str, Any], paths: dict[str, Any],
              sharded: dict[str, Any] | None = None) -> dict[str, Any]:
    """The figures from the workers' per-epoch seconds (the first epoch of each run is warm-up)."""
    torch_sps = OVERHEAD_SAMPLES / statistics.median(overhead["torch_ddp"][1:])
    hetdp_sps = OVERHEAD_SAMPLES / statistics.median(overhead["hetdp"][1:])
    models: dict[str, Any] = {}
    for model, runs in mixed["runs"].items():
        alone_s = statistics.median(runs["gpu_alone"]["epoch_s"][1:])
        models[model] = {"parameters": mixed["parameters"][model], "gpu_alone_epoch_s": alone_s}
        for pairing in PAIRINGS:
            seconds = statistics.median(runs[pairing]["epoch_s"][1:])
            models[model][pairing] = {"epoch_s": seconds, "vs_gpu_alone": alone_s / seconds,
                                      "shares": runs[pairing]["shares"], "sat_out": runs[pairing]["sat_out"]}
    return {"device": overhead["device"], "torch": torch.__version__, "runs": mixed["runs"],
            "overhead": {"torch_ddp_samples_s": torch_sps, "hetdp_samples_s": hetdp_sps,
                         "overhead": torch_sps / hetdp_sps - 1.0, "epoch_s": overhead},
            "mixed": models, "global_batch": MIXED_BATCH, "cpu_threads": CPU_THREADS, "paths": paths,
            "sharded": None if sharded is None else gpu_sharded.summarize(sharded)}


def render(result: dict[str, Any]) -> str:
    head = result["overhead"]
    lines = [f"{result['device']}, torch {result['torch']}: ResNet-18 (CIFAR size, bf16, channels_last, batch "
             f"{OVERHEAD_BATCH}) on one GPU: torch DDP {head['torch_ddp_samples_s']:,.0f} samples/s, hetdp.DDP "
             f"{head['hetdp_samples_s']:,.0f} (overhead {100 * head['overhead']:+.1f}%)"]
    rows = []
    for model, figures in result["mixed"].items():
        row: dict[str, Any] = {"model": model, "parameters": figures["parameters"],
                               "GPU alone s": figures["gpu_alone_epoch_s"]}
        for pairing in PAIRINGS:
            row[f"{pairing} s"] = figures[pairing]["epoch_s"]
        row["adaptive vs alone"] = figures["adaptive"]["vs_gpu_alone"]
        row["adaptive shares"] = figures["adaptive"]["shares"]
        row["sat out"] = figures["adaptive"]["sat_out"]
        rows.append(row)
    lines.append(format_table(rows, title=f"GPU + 3 CPU ranks ({result['cpu_threads']} threads each), gloo, global "
                                          f"batch {result['global_batch']}: seconds per epoch"))
    for backend, checked in result["paths"].items():
        verdicts = [f"{name} {'ok' if run['ok'] else 'FAILED'}" for name, run in checked["runs"].items()]
        lines.append(f"paths checked on devices {','.join(checked['devices'])} over {backend}: {'; '.join(verdicts)}")
    sharded = result.get("sharded")
    if sharded is not None:
        small = sharded["small_card"]
        lines.append(f"sharded, one GPU ({sharded['parameters']:,}-parameter LM, bf16): torch fully_shard "
                     f"{sharded['torch_samples_s']:,.0f} samples/s, hetdp.fully_shard {sharded['hetdp_samples_s']:,.0f} "
                     f"(overhead {100 * sharded['overhead']:+.1f}%, target at most +3%); card at "
                     f"{small['fraction']:.3f} of its memory: cap {small['cap']} (expected {small['expected_cap']}), "
                     f"peak {small['peak_bytes'] / 1e9:.2f} of {small['limit_bytes'] / 1e9:.2f} GB, "
                     + ("trained without running out of memory" if small["out_of_memory"] is None
                        else f"OUT OF MEMORY: {small['out_of_memory']}"))
    return "\n".join(lines)


# --- the worker: runs under torchrun, one process per rank -------------------------------------------------------


class _Block(nn.Module):
    """ResNet's basic block: two 3x3 convolutions and a shortcut."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False), nn.BatchNorm2d(outputs), nn.ReLU(inplace=True),
            nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False), nn.BatchNorm2d(outputs))
        self.shortcut = (nn.Sequential() if stride == 1 and inputs == outputs else
                         nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet18(num_classes: int = 10) -> nn.Module:
    """ResNet-18 for 32x32 images (a 3x3 stem, no max-pool), as CIFAR benchmarks run it."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True)]
    width = 64
    for outputs, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_Block(width, outputs, stride), _Block(outputs, outputs, 1)]
        width = outputs
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


MODELS = {"mlp (communication-heavy)": _mlp, "cnn (compute-heavy)": _cnn}


def _images(count: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(count, 3, 32, 32, generator=generator),
                         torch.randint(0, 10, (count,), generator=generator))


def _epoch(model: nn.Module, loader: Any, optimizer: torch.optim.Optimizer, device: torch.device, *,
           bf16: bool = False) -> float:
    """One epoch of the user's loop; its seconds, the device synchronized at both ends (outside the steps)."""
    synchronize(device)
    started = time.perf_counter()
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext())
    for inputs, targets in loader:
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if bf16:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
    synchronize(device)
    return time.perf_counter() - started


def _overhead(args: argparse.Namespace, progress: EventWriter) -> dict[str, Any]:
    """torch DDP and hetdp.DDP on one GPU, alternate epochs on the same loader settings."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cudnn.benchmark = True
    data = _images(OVERHEAD_SAMPLES, args.seed)

    def loader() -> DataLoader:
        return DataLoader(data, batch_size=OVERHEAD_BATCH, sampler=DistributedSampler(data, seed=args.seed),
                          num_workers=OVERHEAD_WORKERS, pin_memory=True, persistent_workers=True)

    def network() -> nn.Module:
        torch.manual_seed(args.seed)
        return resnet18().to(device, memory_format=torch.channels_last)

    theirs = TorchDDP(network(), device_ids=[device.index])
    ours = hetdp_ddp.DistributedDataParallel(network(), "adaptive", device_ids=[device.index], emulation=Emulation())
    runs = {"torch_ddp": (theirs, loader()), "hetdp": (ours, ours.allocate(loader()))}
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) for name, (model, _) in
                  runs.items()}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    epochs = 2 * args.epochs + 2
    for epoch in range(epochs):
        for name, (model, data_loader) in runs.items():
            data_loader.sampler.set_epoch(epoch)
            seconds[name].append(_epoch(model, data_loader, optimizers[name], device, bf16=True))
            progress.update(row={"run": name, "epoch": epoch, "epoch_s": seconds[name][-1]})
    if args.profile is not None:
        for name, (model, data_loader) in runs.items():
            data_loader.sampler.set_epoch(epochs)
            _profile(name, functools.partial(_epoch, model, data_loader, optimizers[name], device, bf16=True),
                     args.profile)
    ours.close()
    return {**seconds, "device": torch.cuda.get_device_name(device)}


HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync")


def _profile(name: str, epoch: Any, folder: Path) -> None:
    """One epoch under torch.profiler: ``DIR/profile_NAME.txt``, its operators by host time, and the host's waits for
    the device (synchronizes, and copies that may wait) counted in ``DIR/profile_NAME.json``."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        seconds = epoch()
    averages = profiler.key_averages()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"profile_{name}.txt").write_text(averages.table(sort_by="cpu_time_total", row_limit=60))
    waits = {event.key: {"count": event.count, "cpu_us": event.cpu_time_total} for event in averages
             if event.key in HOST_WAITS}
    (folder / f"profile_{name}.json").write_text(json.dumps({"epoch_s": seconds, "host_waits": waits}))


def _mixed_run(pairing: str, make: Any, data: TensorDataset, device: torch.device, args: argparse.Namespace,
               progress: EventWriter) -> dict[str, Any]:
    """One pairing on every rank: its per-epoch seconds (rank 0's wall-clock), last shares and who sat out."""
    torch.manual_seed(args.seed)
    module = make().to(device)
    batch = MIXED_BATCH // dist.get_world_size()
    plain = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, seed=args.seed))
    if pairing == "torch_ddp":
        model: nn.Module = TorchDDP(module)
        loader: Any = plain
    else:
        allocation, _, sync = pairing.partition("+")
        model = hetdp_ddp.DistributedDataParallel(module, allocation, sync or "allreduce", emulation=Emulation())
        loader = model.allocate(plain)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    seconds = []
    for epoch in range(args.epochs):
        dist.barrier()
        loader.sampler.set_epoch(epoch)
        seconds.append(_epoch(model, loader, optimizer, device))
        progress.update(row={"run": pairing, "epoch": epoch, "epoch_s": seconds[-1]})
    if args.profile is not None and pairing != "torch_ddp":  # one more epoch, not timed: rank 0 profiles it
        dist.barrier()
        loader.sampler.set_epoch(args.epochs)
        with (_host_profile(args.profile / f"mixed{make.__name__}_{pairing}.txt") if dist.get_rank() == 0
              else contextlib.nullcontext()):
            _epoch(model, loader, optimizer, device)
    every_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, seconds)
    shares, sat_out = [batch] * dist.get_world_size(), []
    if isinstance(model, hetdp_ddp.DistributedDataParallel):
        shares, sat_out = model.shares, sorted(model.last_epoch.sat_out) if model.last_epoch else []
        model.close()
    return {"epoch_s": seconds, "shares": shares, "sat_out": sat_out, "rank_epoch_s": every_rank}


@contextlib.contextmanager
def _host_profile(path: Path) -> Any:
    """The host's Python time by function (cProfile) over the block, written to ``path``: where a rank's loop goes."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as handle:
            pstats.Stats(profiler, stream=handle).sort_stats("cumulative").print_stats(60)


def _gpu_alone(make: Any, data: TensorDataset, device: torch.device, args: argparse.Namespace,
               progress: EventWriter) -> dict[str, Any]:
    """Rank 0 alone on the same global batches (the CPU ranks wait)."""
    seconds: list[float] = []
    if dist.get_rank() == 0:
        torch.manual_seed(args.seed)
        module = make().to(device)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
        loader = DataLoader(data, batch_size=MIXED_BATCH, shuffle=True,
                            generator=torch.Generator().manual_seed(args.seed))
        for epoch in range(args.epochs):
            seconds.append(_epoch(module, loader, optimizer, device))
            progress.update(row={"run": "gpu alone", "epoch": epoch, "epoch_s": seconds[-1]})
    dist.barrier()
    return {"epoch_s": seconds}


def _mixed(args: argparse.Namespace, progress: EventWriter) -> dict[str, Any]:
    """Rank 0 on the GPU, the others on CPU threads, over gloo: every pairing, then the GPU alone, per model."""
    rank = dist.get_rank()
    device = torch.device("cuda", 0) if rank == 0 else torch.device("cpu")
    if rank != 0:
        torch.set_num_threads(CPU_THREADS)
    data = _images(MIXED_SAMPLES, args.seed)
    runs = {name: {pairing: _mixed_run(pairing, make, data, device, args, progress) for pairing in PAIRINGS}
            for name, make in MODELS.items()}
    for name, make in MODELS.items():
        runs[name]["gpu_alone"] = _gpu_alone(make, data, device, args, progress)
    return {"runs": runs, "parameters": {name: sum(p.numel() for p in make().parameters())
                                         for name, make in MODELS.items()}}


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hetdp.bench.gpu")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--part", choices=("overhead", "mixed"), required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=Path)
    args = parser.parse_args(argv)
    rank, _ = init_distributed("nccl" if args.part == "overhead" else "gloo")
    progress = EventWriter(enabled=rank == 0)
    result = _overhead(args, progress) if args.part == "overhead" else _mixed(args, progress)
    if rank == 0:
        args.out.write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
