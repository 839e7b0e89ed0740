"""Worker for tests/distributed/test_cadp.py: every C-ADP scenario on 3 ranks, each through ``hetdp.distribute`` and
the drop-in; each rank saves what it holds."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hetdp
from hetdp.sync.averaging import average_parameters, merge_weights

SIZE = 47
AVERAGING_COUNTS = (1, 2, 5)


def make_dataset() -> TensorDataset:
    """Inputs, labels and each sample's own position, so a received sample tells where it came from."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(SIZE, 6, generator=generator)
    return TensorDataset(inputs, (inputs.sum(1) > 0).long(), torch.arange(SIZE))


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def make_cluster(devices: int = 3) -> hetdp.ClusterSpec:
    """An owner that trains, a fast device behind a fast link, a slow one behind a slow link."""
    specs = (
        hetdp.DeviceSpec(name="owner", batch_size=4, batch_time_s=0.01, bandwidth_mbps=math.inf),
        hetdp.DeviceSpec(name="fast", batch_size=8, batch_time_s=0.01, bandwidth_mbps=100, latency_ms=2),
        hetdp.DeviceSpec(name="slow", batch_size=2, batch_time_s=0.05, bandwidth_mbps=10, latency_ms=20),
    )
    return hetdp.ClusterSpec(devices=specs[3 - devices :], sample_bytes=1000, model_bytes=1000)


def train_own(model: hetdp.DDP, data: TensorDataset, batch_size: int, epochs: int) -> int:
    """C-ADP's training through the drop-in: every epoch, this rank's own samples in batches of its own size, in an
    order seeded by 3, the epoch and the rank; return the epochs trained."""
    optimizer = make_optimizer(model)
    loader = model.allocate(DataLoader(data, batch_size=batch_size), shuffle=True, seed=3, own_data=True)
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
    return len(model.epoch_reports)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    rank, _ = hetdp.init_distributed()
    dataset = make_dataset()
    training_set = TensorDataset(*dataset.tensors[:2])
    cluster = make_cluster()
    plan = hetdp.plan(cluster, SIZE, epochs=1, min_samples=5)  # every device holds data
    report: dict[str, object] = {"plan": plan.samples}

    # Delivery: the samples themselves (only the owner has the dataset), then indices over shared storage.
    for transport in ("samples", "indices"):
        owned = dataset if rank == 0 or transport == "indices" else None
        local = hetdp.distribute(owned, plan.samples, transport=transport, seed=7)
        torch.save({"indices": local.indices, "tensors": local.data.tensors}, out / f"delivery_{transport}_{rank}.pt")

    # Weighted averaging of unequal models with weights D_i / D.
    model = make_model(10 + rank)
    average_parameters(model, merge_weights(AVERAGING_COUNTS)[rank])
    torch.save(model.state_dict(), out / f"averaged_{rank}.pt")

    # One planned C-ADP epoch, and two epochs of synchronous DDP over an equal split delivered as indices.
    equal = hetdp.apportion([1.0] * len(cluster.devices), SIZE, minimum=0)
    for name, samples, sync, epochs, transport in [("cadp", plan.samples, "local", 1, "samples"),
                                                   ("ddp", equal, "allreduce", 2, "indices")]:
        owned = training_set if rank == 0 or transport == "indices" else None
        local = hetdp.distribute(owned, samples, transport=transport, seed=3)
        model = make_model(0 if rank == 0 else 99)  # rank 0's initial model must reach everyone
        allocation = hetdp.Planned(cluster) if sync == "local" else "equal"
        with hetdp.DDP(model, allocation, sync, emulation=hetdp.Emulation()) as ddp:
            train_own(ddp, local.data, cluster.devices[rank].feasible_batch_size, epochs)
        torch.save(model.state_dict(), out / f"{name}_{rank}.pt")
        report[name] = {"samples": len(local.data), "plan": samples, "epochs": epochs,
                        "batch_sizes": [device.feasible_batch_size for device in cluster.devices]}

    # A device the plan gives no samples stays out of the drop-in's group; the others train and merge among
    # themselves.
    samples = [20, SIZE - 20, 0]
    local = hetdp.distribute(training_set if rank == 0 else None, samples, seed=3)
    trainers = dist.new_group([0, 1])
    model = make_model(0)
    epochs = 0
    if samples[rank]:
        members = replace(cluster, devices=cluster.devices[:2])
        with hetdp.DDP(model, hetdp.Planned(members), "local", emulation=hetdp.Emulation(),
                       process_group=trainers) as ddp:
            epochs = train_own(ddp, local.data, members.devices[rank].feasible_batch_size, 2)
        dist.destroy_process_group(trainers)
    report["sits_out"] = {"samples": len(local.data), "epochs": epochs}
    torch.save(model.state_dict(), out / f"sits_out_{rank}.pt")

    # A data owner that does not train holds no samples, and cannot train its own (none) in the drop-in.
    local = hetdp.distribute(training_set if rank == 0 else None, [0, 20, SIZE - 20])
    report["parameter_server"] = {"samples": len(local.data)}
    model = hetdp.DDP(make_model(0), "equal", "local")
    try:
        model.allocate(DataLoader(local.data, batch_size=4), own_data=True)
        report["parameter_server"]["error"] = None
    except hetdp.ConfigError as error:
        report["parameter_server"]["error"] = str(error)
    model.close()

    # A plan that does not fit the dataset fails on every rank, not only on the owner.
    try:
        hetdp.distribute(training_set if rank == 0 else None, [10, 10, 10])
        report["bad_plan"] = None
    except hetdp.ConfigError as error:
        report["bad_plan"] = str(error)

    (out / f"report_{rank}.json").write_text(json.dumps(report))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
