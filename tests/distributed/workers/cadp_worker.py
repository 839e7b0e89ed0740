"""Worker for tests/distributed/test_cadp.py: every C-ADP scenario on 3 ranks; each rank saves what it holds."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hetdp
from hetdp.allocate.planner import evaluate
from hetdp.data.distribute import distribute
from hetdp.sync.averaging import average_parameters, merge_weights
from hetdp.train.cadp import CadpConfig, train_cadp

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
        local = distribute(owned, plan.samples, transport=transport, seed=7)
        torch.save({"indices": local.indices, "tensors": local.data.tensors}, out / f"delivery_{transport}_{rank}.pt")

    # Weighted averaging of unequal models with weights D_i / D.
    model = make_model(10 + rank)
    average_parameters(model, merge_weights(AVERAGING_COUNTS)[rank])
    torch.save(model.state_dict(), out / f"averaged_{rank}.pt")

    # One planned C-ADP epoch, and two epochs of equal-split synchronous DDP, without emulation.
    for name, config, given in [
        ("cadp", CadpConfig(epochs=1, seed=3), plan),
        ("ddp", CadpConfig(epochs=2, seed=3, allocation="equal", sync="step", transport="indices"), None),
    ]:
        model = make_model(0 if rank == 0 else 99)  # rank 0's initial model must reach everyone
        owned = training_set if rank == 0 or config.transport == "indices" else None
        called = time.perf_counter()
        result = train_cadp(model, make_optimizer(model), owned, cluster, config, plan=given)
        wall_s = time.perf_counter() - called
        torch.save(model.state_dict(), out / f"{name}_{rank}.pt")
        report[name] = {
            "samples": result.samples,
            "plan": result.plan.samples,
            "batch_sizes": result.plan.batch_sizes,
            "send_s": result.send_s,
            "train_s": result.train_s,
            "wall_s": wall_s,
            "epochs": len(result.epochs),
        }

    # A device the plan gives no samples sits the training out; the others train and merge among themselves.
    model = make_model(0)
    result = train_cadp(model, make_optimizer(model), training_set if rank == 0 else None, cluster,
                        CadpConfig(epochs=2, seed=3), plan=evaluate(cluster, [20, SIZE - 20, 0], 2))
    report["sits_out"] = {"samples": result.samples, "epochs": len(result.epochs)}
    torch.save(model.state_dict(), out / f"sits_out_{rank}.pt")

    # A data owner that does not train holds no samples, and cannot train its own (none) in the drop-in.
    local = distribute(training_set if rank == 0 else None, [0, 20, SIZE - 20])
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
        train_cadp(model, make_optimizer(model), training_set if rank == 0 else None, cluster,
                         plan=evaluate(cluster, [10, 10, 10], 1))
        report["bad_plan"] = None
    except hetdp.ConfigError as error:
        report["bad_plan"] = str(error)

    (out / f"report_{rank}.json").write_text(json.dumps(report))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
