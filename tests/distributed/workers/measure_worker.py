"""Worker for tests/distributed/test_memory_caps.py: ``allocate(loader, max_batch="measure")`` on CPU ranks."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hetdp
from hetdp.cluster.devices import DeviceModel

FEATURES = 4


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 2))


def train(max_batch: object, emulation: hetdp.Emulation | None = None) -> dict:
    """One epoch of steps of 8 samples, equal shares under the ranks' caps; or the error of a bad ``max_batch``."""
    inputs = torch.randn(32, FEATURES, generator=torch.Generator().manual_seed(1))
    dataset = TensorDataset(inputs, (inputs.sum(1) > 0).long())
    model = hetdp.DDP(make_model(), "equal", emulation=emulation)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with model:
        try:
            loader = model.allocate(DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset)),
                                    max_batch=max_batch)
        except hetdp.ConfigError as error:
            return {"error": str(error)}
        for inputs, targets in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
        state = [tensor.tolist() for tensor in model.module.state_dict().values()]
        return {"caps": model.allocator.caps, "shares": model.shares, "state": state}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    rank, _ = hetdp.init_distributed()
    capped = hetdp.Emulation(sample_cost_ms=0.05, devices=(DeviceModel(max_batch=3), DeviceModel()))
    results = {"measured": train("measure"), "uncapped": train(None), "emulated": train("measure", capped),
               "bad": train("auto")}
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
