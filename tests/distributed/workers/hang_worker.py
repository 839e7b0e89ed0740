"""Worker for test_liveness.py: rank ``--victim`` stops (SIGSTOP) or sleeps in its own code at step ``--at`` of the
drop-in; every other rank writes what it raised to ``--out/rank-R.json``. Launched by torchrun, or
(``--init-method``) as plain processes joining by ``tcp://`` or ``file://``, with no launcher variable set.

``--where`` picks the collective the survivors are left waiting in: the step's gradient allreduce, the forward's
broadcast of BatchNorm buffers, the random-state gather of a step checkpoint (the victim stops at the end of the
step before, and the checkpoint is due at ``--at``), under ``hetdp.fully_shard``, FSDP2's all-gather as the
forward starts, or the gather of figures at the epoch's end: the loop is then a trainer's (``LoopLoader``: a step
closed by the hook after the optimizer's step, the epoch by the epoch-end hook), and the victim sleeps between the
epoch's last step and its end, in a callback of its own."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hetdp
from hetdp.integrations.steps import LoopLoader


ASLEEP_S = 300.0
"""How long the victim sleeps: past the launch's deadline, so that the launch ends only if the survivors end it (their
exit must not wait for the victim, whatever its collectives' group is)."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--how", choices=("stop", "sleep"), required=True)
    parser.add_argument("--victim", type=int, default=2)
    parser.add_argument("--at", type=int, default=3)
    parser.add_argument("--where", choices=("gradients", "buffers", "checkpoint", "all-gather", "epoch-end"),
                        default="gradients")
    parser.add_argument("--init-method", metavar="URL", help="join by this tcp:// or file:// URL as --rank of "
                        "--world-size, as an engine that sets no torchrun variable would (a script of one's own)")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world-size", type=int)
    args = parser.parse_args()
    if args.init_method:
        torch.distributed.init_process_group("gloo", init_method=args.init_method, rank=args.rank,
                                             world_size=args.world_size)
        rank = args.rank
    else:
        rank, _ = hetdp.init_distributed("gloo")
    data = TensorDataset(torch.randn(240, 4), torch.randint(0, 2, (240,)))
    layers = [nn.BatchNorm1d(4)] if args.where == "buffers" else []
    module = nn.Sequential(*layers, nn.Linear(4, 2))
    model = (hetdp.fully_shard(module, allocation="equal", step_timeout_s=3.0) if args.where == "all-gather" else
             hetdp.DDP(module, "equal", step_timeout_s=3.0))
    loader = model.allocate(DataLoader(data, batch_size=4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if args.where == "checkpoint":
        model.checkpointer(args.out / "ckpt", optimizer, every=args.at)
    hang_at = {"checkpoint": (args.at - 1, "after"), "epoch-end": (len(loader) - 1, "after")}.get(
        args.where, (args.at, "before"))

    def hang(step: int, when: str) -> None:
        if (step, when) == hang_at and rank == args.victim:
            if args.how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(ASLEEP_S)

    trainer = LoopLoader(loader) if args.where == "epoch-end" else None
    try:
        for step, (x, y) in enumerate(loader if trainer is None else trainer):
            hang(step, "before")
            if trainer is not None:
                trainer.begin_batch()
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            if trainer is not None:
                trainer.end_batch()
            hang(step, "after")
        if trainer is not None:
            trainer.end_epoch()
    except hetdp.PeerTimeoutError as error:
        outcome = {"rank": error.rank, "message": str(error)}
        (args.out / f"rank-{rank}.json").write_text(json.dumps(outcome))
        raise


if __name__ == "__main__":
    main()
