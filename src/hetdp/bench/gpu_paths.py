"""Every synchronization on a group that mixes devices, checked: rank 0 on the GPU, the other ranks on the CPU.

A mixed group's collective paths are agreed at construction (``collectives.paths``):
a GPU rank's buckets reach gloo's point-to-point sends through host copies, its
figures and meetings through the host. This worker runs each synchronization
through the drop-in for two epochs, with a stand-in step (the epoch's last step has
fewer samples than ranks), a step checkpoint, and a resume from it, and checks what
must hold on any devices:

* allreduce trains exactly as one process on the same global batches (to float tolerance), also while
  every rank but the GPU's sits out and after they rejoin (memberships forced, as a re-plan would set them);
* every synchronization ends with one finite replica on every rank (the epoch's meeting);
* the resumed model is the saved one.

``hetdp bench gpu`` runs it on the GPU with three CPU ranks over gloo, and on the GPU
alone over NCCL. Without a GPU every rank is on the CPU (the tests run it so).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hetdp
from hetdp.cluster.emulate import Emulation
from hetdp.data.steps import StepSampler
from hetdp.launch import EventWriter

SYNCS = ("allreduce", "solo", "majority", "quorum:2", "local:3", "local")
SIZE, GLOBAL_BATCH, EPOCHS, SEED = 97, 32, 2, 5
"""Steps of 32, 32, 32 and 1 sample: in each epoch's last, every rank but one stands in."""
FEATURES, CLASSES = 16, 4
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


RUNS = {**{sync: (sync, make_model, {}) for sync in SYNCS},
        "allreduce, buckets of 1 MiB": ("allreduce", make_wide_model, {"bucket_cap_mb": 1}),
        "allreduce, sit out and rejoin": ("allreduce", make_model, {})}
"""Name: (synchronization, model, torch DDP options)."""
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


def runs_for(world_size: int) -> dict[str, tuple[str, Any, dict[str, Any]]]:
    """The runs a group of ``world_size`` ranks can make (a quorum of K needs K ranks)."""
    return {name: run for name, run in RUNS.items()
            if not run[0].startswith("quorum:") or int(run[0].split(":")[1]) <= world_size}


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(SEED)
    return TensorDataset(torch.randn(SIZE, FEATURES, generator=generator),
                         torch.randint(0, CLASSES, (SIZE,), generator=generator))


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()]).double().cpu()


def reference(make: Any) -> torch.Tensor:
    """One process on the CPU, on the global batches the drop-in steps through: its final parameters."""
    model = make(SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = dataset().tensors
    sampler = StepSampler(SIZE, GLOBAL_BATCH, 0, shares_at=lambda _: [GLOBAL_BATCH], shuffle=True, seed=SEED,
                          drop_last=False)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        order = sampler.permutation()
        for first in range(0, SIZE, GLOBAL_BATCH):
            index = torch.tensor(order[first : first + GLOBAL_BATCH])
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[index]), y[index]).backward()
            optimizer.step()
    return flat(model)


def _drop_in(make: Any, seed: int, sync: str, device: torch.device, options: dict[str, Any]) -> hetdp.DDP:
    weights = (4.0, *([1.0] * (dist.get_world_size() - 1)))
    return hetdp.DDP(make(seed).to(device), hetdp.Static(weights), sync, step_timeout_s=TIMEOUT_S,
                     emulation=Emulation(), **options)


def _loader(model: hetdp.DDP, data: TensorDataset) -> Any:
    batch = GLOBAL_BATCH // dist.get_world_size()
    return model.allocate(DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, seed=SEED)))


def run_one(sync: str, make: Any, options: dict[str, Any], device: torch.device, folder: Path, *,
            sit_out: bool = False) -> dict[str, Any]:
    """Train, save, resume; this rank's final and resumed parameters, how many steps it stood in, and the members
    of each step (``sit_out``: forced by ``_forced_shares``)."""
    data = dataset()
    with _drop_in(make, SEED, sync, device, options) as model:
        loader = _loader(model, data)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model.checkpointer(folder, optimizer, every=4)  # steps 4 and 8: the last save holds the final model
        stood_in, members = 0, []
        for epoch in range(EPOCHS):
            loader.sampler.set_epoch(epoch)
            for x, y in loader:
                forced = _forced_shares(model.steps_done, model.world_size) if sit_out else None
                if forced is not None:
                    model.set_shares(forced[1], at_step=forced[0])
                if model._sitting is not None:
                    members.append(list(model._sitting.members_at(model.steps_done)))
                stood_in += int(model.step_samples == 0)
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
                optimizer.step()
        final = flat(model.module)
    with _drop_in(make, SEED + 1, sync, device, options) as again:
        _loader(again, data)
        resumed = again.checkpointer(folder, torch.optim.SGD(again.parameters(), lr=0.1), every=4).resume()
        restored = flat(again.module)
    return {"final": final, "restored": restored if resumed else None, "stood_in": stood_in, "members": members}


def check(name: str, make: Any, every_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """What must hold of one run, from every rank's outcome (rank 0's view)."""
    finals = [outcome["final"] for outcome in every_rank]
    figures: dict[str, Any] = {
        "finite": all(bool(torch.isfinite(final).all()) for final in finals),
        "replica_gap": max(float((final - finals[0]).abs().max()) for final in finals),
        "resume_gap": max((float((o["restored"] - finals[0]).abs().max()) if o["restored"] is not None
                           else float("inf")) for o in every_rank),
        "stand_ins": sum(outcome["stood_in"] for outcome in every_rank),
        "fewest_members": min((len(step) for step in every_rank[0]["members"]), default=len(every_rank)),
    }
    if name.startswith("allreduce"):
        figures["reference_gap"] = float((finals[0] - reference(make)).abs().max())
    figures["ok"] = (figures["finite"] and figures["replica_gap"] <= REPLICA_TOLERANCE
                     and figures["resume_gap"] <= REPLICA_TOLERANCE
                     and figures.get("reference_gap", 0.0) <= REFERENCE_TOLERANCE
                     and ("sit out" not in name or figures["fewest_members"] == 1))
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
    for name, (sync, make, options) in runs_for(world_size).items():
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as folder:
            try:
                outcome: dict[str, Any] | str = run_one(sync, make, options, device, Path(folder) / name,
                                                        sit_out="sit out" in name)
            except Exception as error:  # a path that fails is the finding: report it, try the next
                outcome = f"{type(error).__name__}: {error}"
        every_rank: list[Any] = [None] * world_size
        dist.all_gather_object(every_rank, outcome)
        errors = [f"rank {r}: {o}" for r, o in enumerate(every_rank) if isinstance(o, str)]
        figures = {"ok": False, "error": "; ".join(errors)} if errors else check(name, make, every_rank)
        results[name] = {**figures, "seconds": time.perf_counter() - started}
        progress.update(row={"path": name, **{k: v for k, v in results[name].items() if k != "error"}})
    if rank == 0:
        args.out.write_text(json.dumps({"backend": args.backend, "devices": devices, "runs": results}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
