"""A typical user's DDP script, adopted by hetdp: in the user's plain DDP loop, three lines replaced by five.

The loop body is the user's own: dict batches, a DataLoader with a worker, AdamW
with a per-step OneCycle schedule, autocast with a GradScaler, gradient clipping
and a partial last batch. hetdp wraps the model (``hetdp.DDP`` in place of torch's)
and re-cuts the loader so that each rank's batch is its share of the step, sized
to its measured speed; the gradient stays the mean over the step's samples.

    hetdp run -n 4 --speeds 1,1,2,4 --sample-cost-ms 4 examples/adopt_ddp.py --epochs 3
    hetdp run -n 4 --speeds 1,1,2,4 --sample-cost-ms 4 --allocation equal examples/adopt_ddp.py   # plain DDP's split
    torchrun --nproc-per-node 4 examples/adopt_ddp.py                                               # real devices

The adaptive run's shares reach 16, 16, 32, 64 in the first epoch; README.md and docs/guide/dropin.md show the
lines it prints.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hetdp import DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


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
    parser.add_argument("--size", type=int, default=4099)
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device))
    dataset = Regression(args.size)
    loader = model.allocate(
        DataLoader(dataset, batch_size=args.batch_size, sampler=DistributedSampler(dataset), num_workers=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=args.epochs * len(loader))
    scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda")

    started = time.perf_counter()
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            optimizer.zero_grad()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                output = model(batch["features"].to(device))
            loss = F.mse_loss(output.float(), batch["target"].to(device))
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}, shares {model.shares}", flush=True)
            print(model.last_epoch.diagnosis(), flush=True)
    if rank == 0:
        print(f"trained {args.epochs} epochs in {time.perf_counter() - started:.2f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
