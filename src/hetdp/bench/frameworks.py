"""``hetdp bench frameworks``: hetdp under Lightning, Accelerate and transformers' Trainer on emulated unequal devices.

Per framework: the epoch time of its DDP split (equal shares) against hetdp's adaptive shares under the same
emulation, the shares reached, and the parameter gap to one process after an epoch of unequal static shares.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hetdp.allocate.policy import Static
from hetdp.cluster.emulate import Emulation
from hetdp.data.steps import StepSampler
from hetdp.ddp.model import DistributedDataParallel
from hetdp.errors import ConfigError, HetDPError
from hetdp.launch import run_local
from hetdp.report import format_table
from hetdp.runtime import init_distributed

FRAMEWORKS = {"lightning": "lightning", "accelerate": "accelerate", "transformers": "transformers"}
"""Framework -> the package its adapter needs."""
SPEEDS = (1.0, 1.0, 2.0, 4.0)
STATIC = (1.0, 1.0, 2.0, 4.0)
"""The unequal static shares of the parameter-gap run."""
SIZES = {"quick": {"samples": 1536, "epochs": 2}, "full": {"samples": 8192, "epochs": 3}}
GAP_SAMPLES, GAP_BATCH = 200, 8
"""The parameter-gap run: one epoch of 200 samples, 8 a rank (a last step of 8 samples)."""
FEATURES, CLASSES, LR = 16, 4, 0.2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                        help=f"comma-separated, of {', '.join(FRAMEWORKS)} (default all installed)")
    parser.add_argument("--sample-cost-ms", type=float, default=4.0,
                        help="emulated cost of one sample at speed 1 (default 4)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step under DDP (default 32)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = [name.strip() for name in args.frameworks.split(",") if name.strip()]
    unknown = [name for name in names if name not in FRAMEWORKS]
    if unknown or not names:
        raise ConfigError(f"--frameworks takes names of {', '.join(FRAMEWORKS)}, got {args.frameworks!r}")
    if args.batch_size < 1 or not args.sample_cost_ms > 0:
        raise ConfigError(f"--batch-size must be >= 1 and --sample-cost-ms > 0, got {args.batch_size}, "
                          f"{args.sample_cost_ms}")
    missing = [name for name in names if importlib.util.find_spec(FRAMEWORKS[name]) is None]
    installed = [name for name in names if name not in missing]
    if not installed:
        raise ConfigError(f"none of {', '.join(names)} is installed: pip install 'hetdp[{names[0]}]'")
    size = SIZES["quick" if args.quick else "full"]
    emulation = Emulation(speeds=SPEEDS, sample_cost_ms=args.sample_cost_ms)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "frameworks.json"
        worker_args = ["--out", out, "--frameworks", ",".join(installed), "--samples", size["samples"],
                       "--epochs", size["epochs"], "--batch-size", args.batch_size, "--seed", args.seed]
        completed = run_local("hetdp.bench.frameworks", len(SPEEDS), worker_args, module=True, env=emulation.to_env())
        if completed.returncode != 0 or not out.is_file():
            raise HetDPError(f"frameworks workers failed (exit code {completed.returncode}); see their output above")
        frameworks = json.loads(out.read_text())
    return {"frameworks": frameworks, "missing": missing,
            "settings": {**size, "speeds": list(SPEEDS), "sample_cost_ms": args.sample_cost_ms,
                         "batch_per_rank": args.batch_size, "static_shares": list(STATIC),
                         "baseline": "the framework's DDP split (equal shares) under the same emulation"}}


def render(result: dict[str, Any]) -> str:
    rows = [{"framework": name, "DDP split epoch s": figures["equal_epoch_s"],
             "hetdp epoch s": figures["hetdp_epoch_s"], "speedup": figures["speedup_vs_framework_ddp"],
             "final shares": ",".join(map(str, figures["final_shares"])), "param gap": f"{figures['param_gap']:.2g}"}
            for name, figures in result["frameworks"].items()]
    s = result["settings"]
    title = (f"speeds {','.join(f'{v:g}' for v in s['speeds'])}, {s['sample_cost_ms']:g} ms/sample at speed 1, "
             f"{s['samples']} samples, {s['batch_per_rank']} a rank under DDP, last of {s['epochs']} epochs; "
             f"param gap: one epoch of static shares {','.join(f'{v:g}' for v in s['static_shares'])} "
             "against one process")
    lines = [format_table(rows, title=title)]
    if result["missing"]:
        lines.append("not installed, skipped: " + ", ".join(result["missing"]))
    return "\n".join(lines)


# --- the worker: runs under torchrun, one process per rank -------------------------------------------------------


class Points(Dataset):
    """Labelled points, items as dicts (``labels``: the key transformers' Trainer passes to the model)."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, FEATURES, generator=generator)
        self.labels = (self.x[:, :CLASSES] + 0.3 * torch.randn(size, CLASSES, generator=generator)).argmax(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "labels": self.labels[index]}


class Classifier(nn.Module):
    """A small MLP whose forward returns the mean loss too, as transformers' Trainer expects."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, CLASSES))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def _lightning(allocation: Any, data: Dataset, batch: int, epochs: int, seed: int
               ) -> tuple[nn.Module, DistributedDataParallel, int]:
    import lightning as L

    from hetdp.integrations.lightning import HetdpStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Classifier(seed)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(**batch)["loss"]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    L.seed_everything(seed, verbose=False)  # the seed of Lightning's DistributedSampler
    strategy = HetdpStrategy(allocation)
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_epochs=epochs,
                        enable_checkpointing=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    module = Module()
    trainer.fit(module, DataLoader(data, batch_size=batch, shuffle=True))
    return module.model, strategy.loader.model, strategy.loader.sampler.seed


def _accelerate(allocation: Any, data: Dataset, batch: int, epochs: int, seed: int
                ) -> tuple[nn.Module, DistributedDataParallel, int]:
    from hetdp.integrations.accelerate import Accelerator

    accelerator = Accelerator(cpu=True, allocation=allocation)
    net = Classifier(seed)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(net, optimizer, DataLoader(data, batch_size=batch, shuffle=True))
    for _ in range(epochs):
        for step in loader:
            accelerator.backward(model(**step)["loss"])
            optimizer.step()
            optimizer.zero_grad()
    ddp = accelerator.hetdp_model
    ddp.close()  # not end_training(): Accelerate's would end the process group too
    return net, ddp, loader.sampler.seed


def _transformers(allocation: Any, data: Dataset, batch: int, epochs: int, seed: int
                  ) -> tuple[nn.Module, DistributedDataParallel, int]:
    from transformers import TrainingArguments

    from hetdp.integrations.transformers import Trainer

    net = Classifier(seed)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    constant = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(output_dir=folder, per_device_train_batch_size=batch, num_train_epochs=epochs,
                                 max_grad_norm=0.0, use_cpu=True, ddp_backend="gloo", report_to=[],
                                 ddp_find_unused_parameters=False,
                                 save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=seed)
        trainer = Trainer(model=net, args=args, train_dataset=data, optimizers=(optimizer, constant),
                          allocation=allocation)
        trainer.train()
    loader = trainer.hetdp_loader
    return net, loader.model, loader.sampler.seed


RUNNERS = {"lightning": _lightning, "accelerate": _accelerate, "transformers": _transformers}


def reference(net: nn.Module, data: Points, global_batch: int, seed: int) -> nn.Module:
    """One process, one epoch of SGD on the global batches in the allocated loaders' order (mean loss per step)."""
    sampler = StepSampler(len(data), global_batch, 0, shares_at=lambda _: [global_batch], shuffle=True, seed=seed,
                          drop_last=False)
    order = sampler.permutation()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for first in range(0, len(data), global_batch):
        index = torch.tensor(order[first : first + global_batch])
        optimizer.zero_grad()
        net(data.x[index], data.labels[index])["loss"].backward()
        optimizer.step()
    return net


def _measure(name: str, args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    runner = RUNNERS[name]
    data = Points(args.samples, args.seed)
    equal = runner("equal", data, args.batch_size, args.epochs, args.seed)[1]
    adaptive = runner("adaptive", data, args.batch_size, args.epochs, args.seed)[1]
    small = Points(GAP_SAMPLES, args.seed + 1)
    trained, _, seed = runner(Static(STATIC), small, GAP_BATCH, 1, args.seed)
    expected = reference(Classifier(args.seed), small, GAP_BATCH * world, seed)
    gap = max((a - b).abs().max().item() for a, b in zip(trained.parameters(), expected.parameters()))
    equal_s, hetdp_s = equal.epoch_reports[-1].epoch_s, adaptive.epoch_reports[-1].epoch_s
    return {"equal_epoch_s": equal_s, "hetdp_epoch_s": hetdp_s, "speedup_vs_framework_ddp": equal_s / hetdp_s,
            "final_shares": adaptive.epoch_reports[-1].shares,
            "first_epoch_shares": adaptive.epoch_reports[0].shares, "param_gap": gap}


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hetdp.bench.frameworks")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--frameworks", required=True)
    for key in ("samples", "epochs", "batch-size", "seed"):
        parser.add_argument(f"--{key}", type=int, required=True)
    args = parser.parse_args(argv)
    rank, world = init_distributed()
    torch.set_num_threads(1)
    figures = {}
    for name in args.frameworks.split(","):
        if rank == 0:
            print(f"[frameworks] {name}: DDP split, adaptive shares, static shares against one process",
                  file=sys.stderr, flush=True)
        figures[name] = _measure(name, args, rank, world)
    if rank == 0:
        args.out.write_text(json.dumps(figures))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
