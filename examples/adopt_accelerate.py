"""A typical user's Hugging Face Accelerate script, adopted by hetdp: tests/unit/adoption/plain_accelerate.py with
its ``Accelerator`` imported from hetdp.

The loop is Accelerate's: ``accelerator.prepare`` on the model, optimizer, DataLoader and LR schedule, gradient
accumulation through ``accelerator.accumulate``, ``accelerator.backward``, clipping when gradients sync. hetdp's
``Accelerator`` wraps the model in ``hetdp.DDP`` instead of torch's DDP and re-cuts the shuffling loader so that
each rank's batch is its share of the step, sized to its measured speed.

    hetdp run -n 4 --speeds 1,1,2,4 --sample-cost-ms 4 examples/adopt_accelerate.py --epochs 3
    hetdp run -n 4 --speeds 1,1,2,4 --sample-cost-ms 4 --allocation equal examples/adopt_accelerate.py  # DDP's split
    torchrun --nproc-per-node 4 examples/adopt_accelerate.py                                              # real devices
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F
from hetdp.integrations.accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset


class Regression(Dataset):
    """y = x @ w + noise, items as dicts."""

    def __init__(self, size: int, features: int = 32) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, features, generator=g)
        self.y = self.x @ torch.randn(features, 1, generator=g) + 0.1 * torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": self.x[i], "target": self.y[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--size", type=int, default=4099)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    accelerator = Accelerator(cpu=not cuda, gradient_accumulation_steps=args.accumulate,
                              mixed_precision="bf16" if cuda else "no")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(Regression(args.size), batch_size=args.batch_size, shuffle=True, num_workers=1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(  # sized on the whole loader, as Accelerate's examples do
        optimizer, max_lr=1e-2, total_steps=args.epochs * math.ceil(len(loader) / args.accumulate))
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)

    started = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        for batch in loader:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(batch["features"]), batch["target"])
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
        accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}")
    accelerator.print(f"trained {args.epochs} epochs in {time.perf_counter() - started:.2f} s")
    accelerator.end_training()


if __name__ == "__main__":
    main()
