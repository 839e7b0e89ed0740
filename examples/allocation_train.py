"""Adaptive task allocation in a plain training script: each rank computes a share sized to its speed.

Run on 4 local workers of emulated speeds 1, 1, 2, 4:
    hetdp run -n 4 --speeds 1,1,2,4 --sample-cost-ms 8 examples/allocation_train.py --epochs 5
or on GPUs, one rank per GPU, as with DDP (the model and batches go to the rank's GPU under NCCL, which
hetdp.init_distributed picks when every local rank has a GPU of its own; on the CPU otherwise):
    torchrun --nproc-per-node 4 examples/allocation_train.py
Across nodes, one command per node: docs/guide/several-machines.md (run there across emulated hosts, on CPU ranks;
not yet on GPUs or real machines: docs/status.md).

A fast rank's share may exceed what one forward should hold: the loop runs it as
micro-batches under ``no_sync`` (``allocate(..., accumulates=True)`` tells the
allocation so), and the gradient is still the mean over the step's samples.
``--checkpoint FOLDER`` saves every 100 steps and at each epoch's end, and a
second run resumes where the first stopped.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset

import hetdp
from hetdp.bench.datasets import load_digits
from hetdp.bench.models import ConvNet, accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=16, help="the most samples one forward holds")
    parser.add_argument("--checkpoint", default=None, help="folder to resume from and save to")
    parser.add_argument("--samples", type=int, default=None, help="train on the first SAMPLES training samples only "
                        "(a quick first run; default: all 1,437)")
    args = parser.parse_args()

    rank, _ = hetdp.init_distributed()
    # Under NCCL each rank trains on its own GPU (init_distributed made cuda:LOCAL_RANK current); under gloo, on the CPU.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    split = load_digits()
    train = split.train if args.samples is None else Subset(split.train, range(args.samples))
    torch.manual_seed(0)  # the same initial model on every rank
    model = hetdp.DDP(ConvNet().to(device), hetdp.Adaptive(replan_every=2))  # emulated by `hetdp run`, if asked
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = model.allocate(DataLoader(train, batch_size=32, sampler=DistributedSampler(train, seed=0)),
                            accumulates=True)
    checkpoint = model.checkpointer(args.checkpoint, optimizer) if args.checkpoint else None
    start = checkpoint.epoch if checkpoint is not None and checkpoint.resume() else 0
    with model:
        for epoch in range(start, args.epochs):
            loader.sampler.set_epoch(epoch)
            for images, labels in loader:  # this rank's share of the step
                images, labels = images.to(device), labels.to(device)
                optimizer.zero_grad()
                pieces = list(zip(images.split(args.micro_batch), labels.split(args.micro_batch)))
                for index, (x, y) in enumerate(pieces):
                    with model.no_sync() if index < len(pieces) - 1 else contextlib.nullcontext():
                        loss = nn.functional.cross_entropy(model(x), y)
                        (loss * len(x) / len(images)).backward()
                    model.record_loss(loss, len(x))
                optimizer.step()
            if checkpoint is not None:
                checkpoint.save()  # resumes at the next epoch
            report = model.last_epoch
            if rank == 0:
                print(f"epoch {epoch}: shares {report.shares}, epoch {report.epoch_s:.2f} s, "
                      f"compute {[round(s, 2) for s in report.compute_s]} s, "
                      f"wait {[round(s, 2) for s in report.wait_s]} s, loss {report.loss:.4f}, "
                      f"accuracy {accuracy(model.module, split.test):.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
