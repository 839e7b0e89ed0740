"""Worker for tests/distributed/test_exit.py: a ``hetdp.DDP`` model trained and closed, then a second one whose loader
forks a worker process; the worker collects what it inherited (``worker_init_fn``) and must deliver its batches.

The collector is off in this process, so that the first model's destroyed group is still awaiting collection in
a reference cycle when the worker is forked, as it is wherever no full collection ran since the model was closed.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hetdp

TIMEOUT_S = 30.0
"""Seconds the loader waits for a batch from its worker (a hung worker: ``RuntimeError`` then)."""


def collect_in_worker(worker_id: int) -> None:
    gc.collect()


def train(data: TensorDataset, workers: int) -> None:
    model = hetdp.DDP(nn.Linear(8, 1), hetdp.Static((1.0, 2.0)))
    loader = model.allocate(DataLoader(data, batch_size=4, sampler=DistributedSampler(data), num_workers=workers,
                                       worker_init_fn=collect_in_worker if workers else None,
                                       timeout=TIMEOUT_S if workers else 0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.close()


def main() -> None:
    gc.disable()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
    train(data, workers=0)
    train(data, workers=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
