"""Adaptive task allocation in a plain training script: each rank computes a share sized to its speed.

Run on 4 local workers of emulated speeds 1, 1, 2, 4:
    hetdp run -n 4 --speeds 1,1,2,4 --sample-cost-ms 8 examples/allocation_train.py --epochs 5
or on real machines, with torchrun as usual:
    torchrun --nnodes 2 --nproc-per-node 4 ... examples/allocation_train.py
"""

from __future__ import annotations

import argparse

import torch

import hetdp
from hetdp.datasets import load_digits
from hetdp.models import ConvNet, accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--checkpoint", default=None, help="resume from / save to this file each epoch")
    args = parser.parse_args()

    rank, _ = hetdp.init_distributed()
    split = load_digits()
    torch.manual_seed(0)  # the same initial model on every rank
    model = ConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = hetdp.AllocationConfig(policy="adaptive", global_batch=128, micro_batch=16, replan_every=2)
    trainer = hetdp.AllocatedTrainer(model, optimizer, split.train, config)  # emulated by `hetdp run`, if asked
    if args.checkpoint:
        trainer.load_checkpoint(args.checkpoint, missing_ok=True)  # rank 0 reads; any other mismatch is an error
    with trainer:
        for epoch in range(trainer.start_epoch, args.epochs):
            report = trainer.train_epoch(epoch)
            if args.checkpoint:
                trainer.save_checkpoint(args.checkpoint)
            if rank == 0:
                print(f"epoch {epoch}: shares {report.shares}, epoch {report.epoch_s:.2f} s, "
                      f"compute {[round(s, 2) for s in report.compute_s]} s, "
                      f"wait {[round(s, 2) for s in report.wait_s]} s, accuracy {accuracy(model, split.test):.3f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
