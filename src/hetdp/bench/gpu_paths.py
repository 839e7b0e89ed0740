"""Every synchronization on a group that mixes devices, checked against one process: rank 0 on the GPU, the others
on the CPU.

A mixed group's collective paths are agreed at construction (``collectives.paths``):
a GPU rank's buckets reach gloo's point-to-point sends through host copies, its
figures and meetings through the host. This worker runs each synchronization
through the drop-in for two epochs, with a stand-in step (the epoch's last step has
fewer samples than ranks), a step checkpoint, and a resume from it. Each rank records
the samples it trained in each step (an index travels with every sample), and every
run's final parameters are compared with one process (``reference_gap``), so that
"ok" means exact to float rounding:

* allreduce, also in buckets of 1 MiB and while every rank but the GPU's sits out and
  after they rejoin: one process on the global batches, in ``DistributedSampler``'s
  order (``torch.randperm`` seeded with seed + epoch), SGD with momentum;
* local SGD (``local:3``, ``local``): one process keeps every rank's replica and
  optimizer, trains each on the samples that rank recorded, and merges them by their
  samples since the last merge where the drop-in says it merges (every K steps, at
  each epoch's end, and where a checkpoint saves);
* partial allreduce (solo, majority, quorum): which round a gradient lands in depends
  on timing, so these train a linear model whose loss has a gradient that does not
  depend on the parameters, under plain SGD: whatever the rounds, every contribution
  applied once on every rank gives exactly one process's parameters on the global
  batches, and a contribution lost or counted twice does not.

Each run also checks that every sample trained once an epoch, that the ranks end with
one finite replica, and that the resumed model is the saved one. ``hetdp bench gpu``
runs it on the GPU with three CPU ranks over gloo, and on the GPU alone over NCCL.
Without a GPU every rank is on the CPU (the tests run it so).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hetdp
from hetdp.cluster.emulate import Emulation
from hetdp.launch import EventWriter

SYNCS = ("allreduce", "solo", "majority", "quorum:2", "local:3", "local")
SIZE, GLOBAL_BATCH, EPOCHS, SEED = 97, 32, 2, 5
"""Steps of 32, 32, 32 and 1 sample: in each epoch's last, every rank but one stands in."""
FEATURES, CLASSES = 16, 4
LR, MOMENTUM = 0.1, 0.9
CHECKPOINT_EVERY = 4
"""Steps between step checkpoints: steps 4 and 8, where a meeting precedes each save."""
TIMEOUT_S = 60.0
REFERENCE_TOLERANCE = 1e-4
"""Largest parameter gap to the one-process reference: a GPU's float32 kernels round unlike the CPU's."""
REPLICA_TOLERANCE = 1e-6


def make_model(seed: int) -> nn.Module:
    """Small (one gradient bucket under 1 MiB: the point-to-point path of gloo), with a LayerNorm."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.LayerNorm(64), nn.Tanh(), nn.Linear(64, CLASSES))


def make_wide_model(seed: int) -> nn.Module:
    """Several gradient buckets (``bucket_cap_mb=1``): ring allreduces, then the small last one."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 512), nn.Tanh(), nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, CLASSES))


def make_linear_model(seed: int) -> nn.Module:
    """One linear layer: under ``linear_loss`` its gradient is the same at any parameters."""
    torch.manual_seed(seed)
    return nn.Linear(FEATURES, CLASSES)


def cross_entropy(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, labels)


def linear_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Minus the mean of the labels' outputs: linear in the outputs, so a linear model's gradient is a function of
    the batch alone (a stale gradient equals a fresh one)."""
    return -output.gather(1, labels[:, None]).mean()


@dataclass(frozen=True)
class PathRun:
    """One run of the check: a synchronization, a model, the loss and optimizer it trains with, and its reference."""

    sync: str
    make: Callable[[int], nn.Module] = make_model
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    momentum: float = MOMENTUM
    options: dict[str, Any] = field(default_factory=dict)
    """torch DDP's options (``bucket_cap_mb``)."""
    sit_out: bool = False
    """Force every rank but rank 0 out from step ``SIT_OUT_AT``, back in from ``REJOIN_AT``."""

    @property
    def reference(self) -> str:
        """How one process reproduces it: ``global_batches``, ``replicas`` (local SGD) or, for partial allreduce,
        ``global_batches`` on a linear model whose gradients do not go stale."""
        return "replicas" if self.sync.startswith("local") else "global_batches"


PARTIAL = {"loss": linear_loss, "make": make_linear_model, "momentum": 0.0}
RUNS: dict[str, PathRun] = {
    **{sync: PathRun(sync, **(PARTIAL if sync in ("solo", "majority", "quorum:2") else {})) for sync in SYNCS},
    "allreduce, buckets of 1 MiB": PathRun("allreduce", make_wide_model, options={"bucket_cap_mb": 1}),
    "allreduce, sit out and rejoin": PathRun("allreduce", sit_out=True),
}
SIT_OUT_AT, REJOIN_AT = 2, 5
"""The sit-out run: from global step 2 rank 0 computes every sample and the others sit out; from step 5 (the
second epoch) all rejoin, brought current with the optimizer's state."""


def _forced_shares(step: int, world_size: int) -> tuple[int, list[int]] | None:
    """The sit-out run's re-plan made at loop step ``step``, if one: (first step, shares)."""
    if step == SIT_OUT_AT - 1:
        return SIT_OUT_AT, [GLOBAL_BATCH] + [0] * (world_size - 1)
    if step == REJOIN_AT - 1:
        return REJOIN_AT, [GLOBAL_BATCH // world_size] * world_size
    return None


def runs_for(world_size: int) -> dict[str, PathRun]:
    """The runs a group of ``world_size`` ranks can make (a quorum of K needs K ranks)."""
    return {name: run for name, run in RUNS.items()
            if not run.sync.startswith("quorum:") or int(run.sync.split(":")[1]) <= world_size}


def dataset() -> TensorDataset:
    """Points, labels, and each sample's index (which the loop records, and the model never sees)."""
    generator = torch.Generator().manual_seed(SEED)
    return TensorDataset(torch.randn(SIZE, FEATURES, generator=generator),
                         torch.randint(0, CLASSES, (SIZE,), generator=generator), torch.arange(SIZE))


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()]).double().cpu()


def global_batches(epoch: int) -> list[torch.Tensor]:
    """The epoch's global batches as ``DistributedSampler`` orders the dataset (``torch.randperm`` seeded with seed +
    epoch), ``GLOBAL_BATCH`` at a time, the last one short."""
    order = torch.randperm(SIZE, generator=torch.Generator().manual_seed(SEED + epoch))
    return [order[first : first + GLOBAL_BATCH] for first in range(0, SIZE, GLOBAL_BATCH)]


def reference(run: PathRun) -> torch.Tensor:
    """One process on the CPU on the global batches: its final parameters."""
    model = run.make(SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=run.momentum)
    x, y, _ = dataset().tensors
    for epoch in range(EPOCHS):
        for index in global_batches(epoch):
            optimizer.zero_grad()
            run.loss(model(x[index]), y[index]).backward()
            optimizer.step()
    return flat(model)


def replicas_reference(run: PathRun, trained: list[list[list[int]]]) -> torch.Tensor:
    """One process keeping every rank's replica of a local SGD run: each trains on the samples its rank recorded
    (``trained[rank][step]``; none: a stand-in, which leaves its replica and optimizer as they were), and the
    replicas merge, weighed by their samples since the last merge, where the drop-in merges: after each epoch's last
    step, before each step checkpoint, and ``every`` steps after the last merge (``local:every``)."""
    every = int(run.sync.split(":")[1]) if ":" in run.sync else 0
    world = len(trained)
    models = [run.make(SEED) for _ in range(world)]
    optimizers = [torch.optim.SGD(model.parameters(), lr=LR, momentum=run.momentum) for model in models]
    x, y, _ = dataset().tensors
    steps_per_epoch = len(global_batches(0))
    since, samples = 0, [0] * world
    for step in range(len(trained[0])):
        for rank, (model, optimizer) in enumerate(zip(models, optimizers)):
            index = torch.tensor(trained[rank][step], dtype=torch.long)
            optimizer.zero_grad()
            if len(index):  # a stand-in weighs nothing: no gradient, its replica and momentum stay as they are
                run.loss(model(x[index]), y[index]).backward()
            optimizer.step()
            samples[rank] += len(index)
        since += 1
        done = step + 1
        if done % steps_per_epoch == 0 or done % CHECKPOINT_EVERY == 0 or (every and since >= every):
            total = sum(samples)
            with torch.no_grad():
                merged = [sum(p * (n / total) for p, n in zip(group, samples))
                          for group in zip(*(model.parameters() for model in models))]
                for model in models:
                    for parameter, value in zip(model.parameters(), merged):
                        parameter.copy_(value)
            since, samples = 0, [0] * world
    return flat(models[0])


def _drop_in(run: PathRun, seed: int, device: torch.device) -> hetdp.DDP:
    weights = (4.0, *([1.0] * (dist.get_world_size() - 1)))
    return hetdp.DDP(run.make(seed).to(device), hetdp.Static(weights), run.sync, step_timeout_s=TIMEOUT_S,
                     emulation=Emulation(), **run.options)


def _loader(model: hetdp.DDP, data: TensorDataset) -> Any:
    batch = GLOBAL_BATCH // dist.get_world_size()
    return model.allocate(DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, seed=SEED)))


def run_one(run: PathRun, device: torch.device, folder: Path) -> dict[str, Any]:
    """Train, save, resume; this rank's final and resumed parameters, the samples it trained in each step (none:
    a stand-in), and the members of each step (forced where ``run.sit_out``)."""
    data = dataset()
    with _drop_in(run, SEED, device) as model:
        loader = _loader(model, data)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=run.momentum)
        model.checkpointer(folder, optimizer, every=CHECKPOINT_EVERY)  # steps 4 and 8: the last holds the final model
        trained: list[list[int]] = []
        members: list[list[int]] = []
        for epoch in range(EPOCHS):
            loader.sampler.set_epoch(epoch)
            for x, y, index in loader:
                forced = _forced_shares(model.steps_done, model.world_size) if run.sit_out else None
                if forced is not None:
                    model.set_shares(forced[1], at_step=forced[0])
                if model._sitting is not None:
                    members.append(list(model._sitting.members_at(model.steps_done)))
                trained.append([] if model.step_samples == 0 else index.tolist())
                optimizer.zero_grad()
                run.loss(model(x.to(device)), y.to(device)).backward()
                optimizer.step()
        final = flat(model.module)
    with _drop_in(run, SEED + 1, device) as again:
        _loader(again, data)
        resumed = again.checkpointer(folder, torch.optim.SGD(again.parameters(), lr=LR),
                                     every=CHECKPOINT_EVERY).resume()
        restored = flat(again.module)
    return {"final": final, "restored": restored if resumed else None, "trained": trained, "members": members}


def each_sample_once(trained: list[list[list[int]]]) -> bool:
    """Whether the ranks' steps hold each epoch's global batches in ``DistributedSampler``'s order, every sample of
    the epoch once."""
    steps_per_epoch = len(global_batches(0))
    if any(len(steps) != EPOCHS * steps_per_epoch for steps in trained):
        return False
    for epoch in range(EPOCHS):
        for step, batch in enumerate(global_batches(epoch)):
            held = sorted(i for steps in trained for i in steps[epoch * steps_per_epoch + step])
            if held != sorted(batch.tolist()):
                return False
    return True


def check(name: str, run: PathRun, every_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """What must hold of one run, from every rank's outcome (rank 0's view)."""
    finals = [outcome["final"] for outcome in every_rank]
    trained = [outcome["trained"] for outcome in every_rank]
    expected = replicas_reference(run, trained) if run.reference == "replicas" else reference(run)
    figures: dict[str, Any] = {
        "reference": run.reference,
        "finite": all(bool(torch.isfinite(final).all()) for final in finals),
        "replica_gap": max(float((final - finals[0]).abs().max()) for final in finals),
        "reference_gap": float((finals[0] - expected).abs().max()),
        "each_sample_once": each_sample_once(trained),
        "resume_gap": max((float((o["restored"] - finals[0]).abs().max()) if o["restored"] is not None
                           else float("inf")) for o in every_rank),
        "stand_ins": sum(not step for steps in trained for step in steps),
        "fewest_members": min((len(step) for step in every_rank[0]["members"]), default=len(every_rank)),
    }
    figures["ok"] = (figures["finite"] and figures["replica_gap"] <= REPLICA_TOLERANCE
                     and figures["reference_gap"] <= REFERENCE_TOLERANCE and figures["each_sample_once"]
                     and figures["resume_gap"] <= REPLICA_TOLERANCE
                     and (not run.sit_out or figures["fewest_members"] == 1))
    return figures


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hetdp.bench.gpu_paths")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = parser.parse_args(argv)
    rank, world_size = hetdp.init_distributed(args.backend)
    on_gpu = torch.cuda.is_available() and (rank == 0 or args.backend == "nccl")
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    devices: list[str | None] = [None] * world_size
    dist.all_gather_object(devices, device.type)
    progress = EventWriter(enabled=rank == 0)
    results: dict[str, Any] = {}
    for name, run in runs_for(world_size).items():
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as folder:
            try:
                outcome: dict[str, Any] | str = run_one(run, device, Path(folder) / name)
            except Exception as error:  # a path that fails is the finding: report it, try the next
                outcome = f"{type(error).__name__}: {error}"
        every_rank: list[Any] = [None] * world_size
        dist.all_gather_object(every_rank, outcome)
        errors = [f"rank {r}: {o}" for r, o in enumerate(every_rank) if isinstance(o, str)]
        figures = {"ok": False, "error": "; ".join(errors)} if errors else check(name, run, every_rank)
        results[name] = {**figures, "seconds": time.perf_counter() - started}
        progress.update(row={"path": name, **{k: v for k, v in results[name].items() if k != "error"}})
    if rank == 0:
        args.out.write_text(json.dumps({"backend": args.backend, "devices": devices, "runs": results}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
