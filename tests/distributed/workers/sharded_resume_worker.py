"""Worker for tests/distributed/test_sharded_resume.py: the sharded drop-in with step checkpoints through
torch.distributed.checkpoint, on torch's even shards or memory-sized ones (``--memories``, MB per rank, as
``hetdp run --devices`` gives them), killed once and restarted, stopped, then resumed on fewer ranks of another
layout.

Every rank logs each step it runs (``--record``: launch, step, rank); rank 0 saves the final parameters, whole
(``--out``), unless the run stopped, and appends a line to ``--out`` + ``.rows`` as each launch ends: whether its
shards were memory-sized and the elements of every rank's rows. ``--die-at S``: on the first attempt, rank 1 kills
itself in step S. ``--stop-at S``: the run stops once step S ended (and was saved).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from sharded_worker import loader_for, loss_of, make_model, make_optimizer, sequences, shard
from uneven_worker import every_rank, set_memories, whole

import hetdp
from hetdp.fsdp.uneven import UnevenModule


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--memories", help="MB per rank, comma-separated (none: torch's even shards)")
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--stop-at", type=int, default=-1)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    hetdp.init_distributed("gloo")
    torch.set_num_threads(1)
    set_memories(tuple(float(memory) for memory in args.memories.split(",")) if args.memories else None)
    model = shard(make_model(), allocation="equal")
    loader = model.allocate(loader_for(sequences()), global_batch=16)  # the same steps on any number of ranks
    optimizer = make_optimizer(model, "adamw")
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=args.epochs * len(loader))
    ckpt = model.checkpointer(args.ckpt, optimizer, scheduler=scheduler, every=args.every)
    ckpt.resume()
    first_attempt = os.environ.get("HETDP_RESTART", "0") == "0"
    rank, launch = dist.get_rank(), os.environ["TORCHELASTIC_RUN_ID"] + os.environ.get("HETDP_RESTART", "0")
    stopped = False
    with args.record.open("a") as log:
        for epoch in range(ckpt.epoch, args.epochs):
            loader.sampler.set_epoch(epoch)
            for (tokens,) in loader:
                step = model.drop_in.steps_done
                if step == args.stop_at:
                    stopped = True
                    break
                loss_of(model, tokens).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                log.write(f"{launch} {step} {rank}\n")
                log.flush()
                if first_attempt and rank == 1 and step == args.die_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            if stopped:
                break
    state = whole(model)
    rows = every_rank(sum(parameter.to_local().numel() for parameter in model.parameters()))
    if rank == 0:
        if not stopped:
            torch.save(state, args.out)
        with Path(f"{args.out}.rows").open("a") as held:
            held.write(json.dumps({"uneven": isinstance(model, UnevenModule), "elements": rows}) + "\n")
    model.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
