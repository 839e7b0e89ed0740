"""Worker for tests/distributed/test_shutdown.py: the threads left in a rank after its groups are destroyed."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import hetdp
from hetdp.train.allocation import AllocatedTrainer, AllocationConfig


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
    config = AllocationConfig(policy="static", weights=(1.0, 2.0), global_batch=6, micro_batch=2)
    with AllocatedTrainer(model, optimizer, data, config) as trainer:  # on a group of its own
        trainer.train_epoch(0)
        during = thread_names()
    del trainer
    dist.destroy_process_group()
    (out / f"threads_{rank}.json").write_text(json.dumps({"during": during, "after": thread_names()}))


if __name__ == "__main__":
    main()
