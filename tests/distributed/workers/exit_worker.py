"""Worker for tests/distributed/test_exit.py: a user's DDP script adopted by ``hetdp.DDP`` (hetdp imported first, the
group made by the script, the model and its optimizer built and trained inside ``main()``), its group destroyed;
the threads left in the rank once its exit handlers have run, where the interpreter's finalization begins."""

from __future__ import annotations

import argparse
import atexit
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hetdp


def save_threads(path: Path) -> None:
    tasks = Path("/proc/self/task")
    path.write_text(json.dumps(sorted((tasks / task / "comm").read_text().strip() for task in os.listdir(tasks))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    dist.init_process_group("gloo")
    # Registered before anything of hetdp's, so it runs after all of them (exit handlers run last-registered first).
    atexit.register(save_threads, out / f"threads_{dist.get_rank()}.json")
    torch.manual_seed(0)
    model = hetdp.DDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)), hetdp.Static((1.0, 2.0)))
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    loader = model.allocate(DataLoader(data, batch_size=4, sampler=DistributedSampler(data)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # the first optimizer imports torch._dynamo
    for x, y in loader:
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
