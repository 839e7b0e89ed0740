"""Worker for test_allocation.py: one rank hangs for a minute at the first step; the others must not."""

import torch
from torch import nn
from torch.utils.data import TensorDataset

import hetdp
from hetdp.train.allocation import AllocatedTrainer, AllocationConfig


def main() -> None:
    hetdp.init_distributed()
    dataset = TensorDataset(torch.randn(60, 4), torch.randint(0, 2, (60,)))
    model = nn.Linear(4, 2)
    hung_peer = hetdp.Emulation(straggler_count=1, straggler_delay_ms=60_000)
    config = AllocationConfig(policy="equal", global_batch=12, step_timeout_s=3.0)
    trainer = AllocatedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset, config,
                                     emulation=hung_peer)
    trainer.train_epoch(0)


if __name__ == "__main__":
    main()
