"""Worker for tests/distributed/test_faults.py: the drop-in with step checkpoints, killed once and resumed.

The model has dropout (``--dropout``, default 0.3), so each rank's random state must come back too; without it, the
model is one process's on the same global batches. Every rank logs the dataset indices of each step it runs
(``--record``); rank 0 saves the final parameters (``--out``). ``--die-at S`` sends rank ``--die-rank`` ``--signal``
(KILL: it dies; STOP: it hangs) after S steps on the first attempt. Each of the three takes a comma-separated list,
one fault per attempt: ``--die-at 8,14 --die-rank 1,2 --signal KILL,STOP`` kills rank 1 on the first attempt and
stops rank 2 on the second (the restart after the first).
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import hetdp


class Indexed(Dataset):
    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(size, 6, generator=generator)
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


def ints(text: str) -> list[int]:
    return [int(each) for each in text.split(",")]


def signals(text: str) -> list[str]:
    names = text.split(",")
    if not set(names) <= {"KILL", "STOP"}:
        raise argparse.ArgumentTypeError(f"signals are KILL or STOP, got {text!r}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--die-at", type=ints, default=[-1])
    parser.add_argument("--die-rank", type=ints, default=[1])
    parser.add_argument("--signal", type=signals, default=["KILL"])
    parser.add_argument("--step-timeout", type=float, default=60.0)
    parser.add_argument("--allocation", default="equal")
    parser.add_argument("--weights", default="")
    parser.add_argument("--dropout", type=float, default=0.3)
    args = parser.parse_args()

    hetdp.init_distributed("gloo")
    torch.manual_seed(0)
    allocation = hetdp.Static(tuple(float(w) for w in args.weights.split(","))) if args.weights else args.allocation
    # dropout draws from each rank's generator: a resume matches only if the checkpoint brought them back
    model = hetdp.DDP(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(args.dropout), nn.Linear(8, 2)), allocation,
                      step_timeout_s=args.step_timeout)
    loader = model.allocate(DataLoader(Indexed(96), batch_size=4), global_batch=12, shuffle=True, seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
    ckpt = model.checkpointer(args.ckpt, optimizer, scheduler=scheduler, every=args.every)
    ckpt.resume()
    attempt = int(os.environ.get("HETDP_RESTART", "0"))
    fault = (args.die_at[attempt], args.die_rank[attempt], args.signal[attempt]) if attempt < len(args.die_at) else None
    launch = os.environ["TORCHELASTIC_RUN_ID"]
    with args.record.open("a") as log:
        for epoch in range(ckpt.epoch, args.epochs):
            loader.sampler.set_epoch(epoch)
            for x, y, index in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                scheduler.step()
                if model.step_samples:  # a stand-in batch (a rank that sits out, a short last step) trains nothing
                    indices = " ".join(map(str, index.tolist()))
                    log.write(f"{launch} {epoch} {model.steps_done} {model.rank} {indices}\n")
                    log.flush()
                if fault is not None and model.rank == fault[1] and model.steps_done + 1 == fault[0]:
                    os.kill(os.getpid(), getattr(signal, f"SIG{fault[2]}"))
    if model.rank == 0:
        torch.save(model.module.state_dict(), args.out)
    model.close()
    dist.destroy_process_group()  # a gloo group left alive at exit can abort the process


if __name__ == "__main__":
    main()
