"""Worker for test_allocation.py: one rank hangs for ten minutes at the first step; the others must not."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hetdp


def main() -> None:
    hetdp.init_distributed()
    dataset = TensorDataset(torch.randn(60, 4), torch.randint(0, 2, (60,)))
    hung_peer = hetdp.Emulation(straggler_count=1, straggler_delay_ms=600_000)
    model = hetdp.DDP(nn.Linear(4, 2), "equal", step_timeout_s=3.0, emulation=hung_peer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for inputs, targets in model.allocate(DataLoader(dataset, batch_size=4, shuffle=True)):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()


if __name__ == "__main__":
    main()
