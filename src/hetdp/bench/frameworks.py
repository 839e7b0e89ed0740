"""``hetdp bench frameworks``: hetdp under Lightning, Accelerate and transformers' Trainer on emulated unequal devices.

Per framework, in one launch: the framework's own DDP path (Lightning's ``strategy="ddp"``, Accelerate's own
``prepare``, transformers' own ``Trainer``) against hetdp's adapter with adaptive shares, both on the same model,
data, batch size and emulated devices (``Paced``: each forward lasts its samples at the rank's speed, under either
path alike). Both are timed by the wall clock from one epoch's start to the next's (end work included, a barrier
at each mark); the two paths' fits run in turn, ``ROUNDS`` times in alternating order, and each fit's first epoch is
warm-up. The speed-up is read against its ideal (``bench.compare``): the framework's epoch less the compute that
balanced shares would save at the compute per sample the adaptive run measured. Then the parameter gap to one
process after an epoch of unequal static shares.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hetdp.allocate.policy import Static
from hetdp.bench.compare import EpochMarks, ideal, per_sample_s, plain_row, report_row, steady_s
from hetdp.cluster.emulate import Emulation
from hetdp.ddp.model import DistributedDataParallel
from hetdp.errors import ConfigError, HetDPError
from hetdp.launch import run_local
from hetdp.report import format_table
from hetdp.runtime import init_distributed

FRAMEWORKS = {"lightning": "lightning", "accelerate": "accelerate", "transformers": "transformers"}
"""Framework -> the package its adapter needs."""
BASELINES = {"lightning": 'Lightning Trainer(strategy="ddp")', "accelerate": "accelerate.Accelerator().prepare",
             "transformers": "transformers.Trainer"}
"""Framework -> its own DDP path, the baseline."""
SPEEDS = (1.0, 1.0, 2.0, 4.0)
STATIC = (1.0, 1.0, 2.0, 4.0)
"""The unequal static shares of the parameter-gap run."""
SIZES = {"quick": {"samples": 1536, "epochs": 3, "rounds": 2}, "full": {"samples": 8192, "epochs": 4, "rounds": 3}}
"""Samples, epochs of each fit (the first is warm-up), and rounds of the two fits in turn."""
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
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "frameworks.json"
        worker_args = ["--out", out, "--frameworks", ",".join(installed), "--samples", size["samples"],
                       "--epochs", size["epochs"], "--rounds", size["rounds"], "--batch-size", args.batch_size,
                       "--sample-cost-ms", args.sample_cost_ms, "--seed", args.seed]
        completed = run_local("hetdp.bench.frameworks", len(SPEEDS), worker_args, module=True)
        if completed.returncode != 0 or not out.is_file():
            raise HetDPError(f"frameworks workers failed (exit code {completed.returncode}); see their output above")
        raw = json.loads(out.read_text())
    return {"frameworks": {name: summarize(runs, args.batch_size) for name, runs in raw.items()}, "missing": missing,
            "settings": {**size, "speeds": list(SPEEDS), "sample_cost_ms": args.sample_cost_ms,
                         "batch_per_rank": args.batch_size, "static_shares": list(STATIC),
                         "baselines": {name: BASELINES[name] for name in installed}}}


def summarize(raw: dict[str, Any], batch_per_rank: int) -> dict[str, Any]:
    """One framework's figures from rank 0's rows: its own DDP against hetdp's adaptive shares, beside the ideal."""
    ddp, hetdp = raw["runs"]["framework_ddp"], raw["runs"]["hetdp_adaptive"]
    ddp_s, hetdp_s = steady_s(ddp), steady_s(hetdp)
    per_sample = per_sample_s(hetdp)
    samples = sum(hetdp[-1]["samples"])
    best = ideal(ddp_s, baseline_samples=[samples // len(SPEEDS)] * len(SPEEDS), per_sample=per_sample)
    speedup = ddp_s / hetdp_s
    return {"framework_ddp_epoch_s": ddp_s, "hetdp_epoch_s": hetdp_s, "speedup_vs_framework_ddp": speedup,
            "ideal_speedup": best.speedup, "efficiency": speedup / best.speedup, "ideal_epoch_s": best.epoch_s,
            "per_sample_ms": [None if s is None else 1000 * s for s in per_sample],
            "final_shares": hetdp[-1]["shares"], "sat_out": sorted(int(r) for r in hetdp[-1]["sat_out"]),
            "framework_shares": [batch_per_rank] * len(SPEEDS), "param_gap": raw["param_gap"], "runs": raw["runs"]}


def render(result: dict[str, Any]) -> str:
    rows = [{"framework": name, "own DDP epoch s": figures["framework_ddp_epoch_s"],
             "hetdp epoch s": figures["hetdp_epoch_s"], "speedup": figures["speedup_vs_framework_ddp"],
             "ideal": figures["ideal_speedup"], "efficiency": figures["efficiency"],
             "final shares": ",".join(map(str, figures["final_shares"])), "param gap": f"{figures['param_gap']:.2g}"}
            for name, figures in result["frameworks"].items()]
    s = result["settings"]
    title = (f"speeds {','.join(f'{v:g}' for v in s['speeds'])}, {s['sample_cost_ms']:g} ms/sample at speed 1, "
             f"{s['samples']} samples, {s['batch_per_rank']} a rank under DDP; each framework's own DDP path against "
             f"hetdp's adaptive shares: wall clock of whole epochs, medians of {s['rounds']} fits each in turn, after "
             "each fit's first epoch")
    lines = [format_table(rows, title=title),
             "baselines: " + "; ".join(f"{name}: {path}" for name, path in s["baselines"].items()),
             "ideal: the own DDP's epoch less the compute balanced shares save at hetdp's measured compute per sample; "
             f"param gap: one epoch of static shares {','.join(f'{v:g}' for v in s['static_shares'])} against one "
             "process"]
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


class Paced(nn.Module):
    """``Classifier`` on this rank's emulated device, under any trainer alike: each forward lasts as long as its
    samples take at the rank's speed (``Emulation.compute``: the real forward, then a sleep), so that torch's DDP
    and hetdp's see the same devices. The backward's real compute (a few microseconds here) is not padded."""

    def __init__(self, net: Classifier, emulation: Emulation, rank: int) -> None:
        super().__init__()
        self.net = net
        self.emulation = emulation
        self.rank = rank
        self.calls = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        with self.emulation.compute(self.rank, len(x), self.calls):
            output = self.net(x, labels)
        self.calls += 1
        return output


Runner = Callable[..., tuple[DistributedDataParallel | None, int]]
"""(net, allocation or None for the framework's own DDP, data, batch, epochs, seed, marks) -> (hetdp's model or
None, the seed of its sampler); ``marks`` is marked at each epoch's start and at the fit's end."""


def _lightning(net: nn.Module, allocation: Any, data: Dataset, batch: int, epochs: int, seed: int,
               marks: EpochMarks | None) -> tuple[DistributedDataParallel | None, int]:
    import lightning as L

    from hetdp.integrations.lightning import HetdpStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = net

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(**batch)["loss"]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    class Marks(L.Callback):
        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            marks.mark()  # type: ignore[union-attr]

        def on_train_end(self, trainer: Any, module: Any) -> None:
            marks.mark()  # type: ignore[union-attr]

    L.seed_everything(seed, verbose=False)  # the seed of Lightning's DistributedSampler
    strategy = "ddp" if allocation is None else HetdpStrategy(allocation)
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_epochs=epochs,
                        enable_checkpointing=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Marks()] if marks is not None else [])
    trainer.fit(Module(), DataLoader(data, batch_size=batch, shuffle=True))
    if allocation is None:
        return None, seed
    return strategy.loader.model, strategy.loader.sampler.seed  # type: ignore[union-attr]


def _accelerate(net: nn.Module, allocation: Any, data: Dataset, batch: int, epochs: int, seed: int,
                marks: EpochMarks | None) -> tuple[DistributedDataParallel | None, int]:
    if allocation is None:
        from accelerate import Accelerator as Plain

        accelerator = Plain(cpu=True)
    else:
        from hetdp.integrations.accelerate import Accelerator

        accelerator = Accelerator(cpu=True, allocation=allocation)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(net, optimizer, DataLoader(data, batch_size=batch, shuffle=True))
    for _ in range(epochs):
        if marks is not None:
            marks.mark()
        for step in loader:
            accelerator.backward(model(**step)["loss"])
            optimizer.step()
            optimizer.zero_grad()
    if marks is not None:
        marks.mark()
    if allocation is None:
        return None, seed
    ddp = accelerator.hetdp_model
    ddp.close()  # not end_training(): Accelerate's would end the process group too
    return ddp, loader.sampler.seed


def _transformers(net: nn.Module, allocation: Any, data: Dataset, batch: int, epochs: int, seed: int,
                  marks: EpochMarks | None) -> tuple[DistributedDataParallel | None, int]:
    from transformers import Trainer as Plain
    from transformers import TrainerCallback, TrainingArguments

    from hetdp.integrations.transformers import Trainer

    class Marks(TrainerCallback):
        def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marks.mark()  # type: ignore[union-attr]

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marks.mark()  # type: ignore[union-attr]

    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    constant = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    hetdp = {} if allocation is None else {"allocation": allocation}
    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(output_dir=folder, per_device_train_batch_size=batch, num_train_epochs=epochs,
                                 max_grad_norm=0.0, use_cpu=True, ddp_backend="gloo", report_to=[],
                                 ddp_find_unused_parameters=False,
                                 save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=seed)
        trainer = (Plain if allocation is None else Trainer)(
            model=net, args=args, train_dataset=data, optimizers=(optimizer, constant),
            callbacks=[Marks()] if marks is not None else [], **hetdp)
        trainer.train()
    if allocation is None:
        return None, seed
    loader = trainer.hetdp_loader
    return loader.model, loader.sampler.seed


RUNNERS: dict[str, Runner] = {"lightning": _lightning, "accelerate": _accelerate, "transformers": _transformers}


def reference(net: nn.Module, data: Points, global_batch: int, seed: int) -> nn.Module:
    """One process, one epoch of SGD on the global batches in ``DistributedSampler``'s order (``torch.randperm``
    seeded with the sampler's seed, epoch 0), a global batch at a time (mean loss per step)."""
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for first in range(0, len(data), global_batch):
        index = order[first : first + global_batch]
        optimizer.zero_grad()
        net(data.x[index], data.labels[index])["loss"].backward()
        optimizer.step()
    return net


SIDES = (("framework_ddp", None), ("hetdp_adaptive", "adaptive"))
"""The two paths each framework runs: its own DDP, hetdp's adapter with adaptive shares."""


def _measure(name: str, args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    runner = RUNNERS[name]
    data = Points(args.samples, args.seed)
    emulation = Emulation(speeds=SPEEDS, sample_cost_ms=args.sample_cost_ms, seed=args.seed)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side, _ in SIDES}
    for fit in range(args.rounds):
        for side, allocation in SIDES if fit % 2 == 0 else reversed(SIDES):
            marks = EpochMarks()
            model, _ = runner(Paced(Classifier(args.seed), emulation, rank), allocation, data, args.batch_size,
                              args.epochs, args.seed, marks)
            for epoch, seconds in enumerate(marks.epochs_s()):
                row = (plain_row([args.batch_size] * world) if model is None
                       else report_row(model.epoch_reports[epoch]))
                runs[side].append({"side": side, "fit": fit, "epoch": epoch, "epoch_s": seconds,
                                   "warmup": epoch == 0, **row})
    small = Points(GAP_SAMPLES, args.seed + 1)
    trained = Classifier(args.seed)
    _, seed = runner(trained, Static(STATIC), small, GAP_BATCH, 1, args.seed, None)
    expected = reference(Classifier(args.seed), small, GAP_BATCH * world, seed)
    gap = max((a - b).abs().max().item() for a, b in zip(trained.parameters(), expected.parameters()))
    return {"runs": runs, "param_gap": gap}


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hetdp.bench.frameworks")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--frameworks", required=True)
    for key in ("samples", "epochs", "rounds", "batch-size", "seed"):
        parser.add_argument(f"--{key}", type=int, required=True)
    parser.add_argument("--sample-cost-ms", type=float, required=True)
    args = parser.parse_args(argv)
    rank, world = init_distributed()
    torch.set_num_threads(1)
    figures = {}
    for name in args.frameworks.split(","):
        if rank == 0:
            print(f"[frameworks] {name}: its own DDP and hetdp's adaptive shares in turn, {args.rounds} fits each; "
                  "static shares against one process", file=sys.stderr, flush=True)
        figures[name] = _measure(name, args, rank, world)
    if rank == 0:
        args.out.write_text(json.dumps(figures))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
