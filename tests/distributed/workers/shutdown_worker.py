"""Worker for tests/distributed/test_shutdown.py: the threads left in a rank after its groups are destroyed."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hetdp


def thread_names() -> list[str]:
    tasks = Path("/proc/self/task")
    return sorted((tasks / task / "comm").read_text().strip() for task in os.listdir(tasks))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    rank, _ = hetdp.init_distributed()
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # the first optimizer imports torch._dynamo
    data = TensorDataset(torch.randn(12, 4), torch.randint(0, 2, (12,)))
    with hetdp.DDP(model, hetdp.Static((1.0, 2.0))) as ddp:  # on a group of its own
        for inputs, targets in ddp.allocate(DataLoader(data, batch_size=3, sampler=DistributedSampler(data))):
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(inputs), targets).backward()
            optimizer.step()
        during = thread_names()
    del ddp
    dist.destroy_process_group()
    (out / f"threads_{rank}.json").write_text(json.dumps({"during": during, "after": thread_names()}))


if __name__ == "__main__":
    main()
