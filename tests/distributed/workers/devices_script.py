"""A user's drop-in script for test_devices.py: no emulation in its code; `hetdp run --devices` paces and caps it."""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hetdp


def main() -> None:
    rank, _ = hetdp.init_distributed()
    dataset = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    torch.manual_seed(0)
    with hetdp.DDP(nn.Linear(4, 2), "adaptive") as model:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = model.allocate(DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset)))
        for inputs, targets in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
        devices = model.emulation.devices
        line = (f"rank {rank}: caps {[d.max_batch for d in devices]} shares {model.shares} "
                f"schedule {[shares for _, shares in model._schedule]}")
        lines = [None] * dist.get_world_size()
        dist.all_gather_object(lines, line)  # one writer: two ranks' prints interleave on the shared pipe
        if rank == 0:
            sys.stdout.write("\n".join(lines) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
