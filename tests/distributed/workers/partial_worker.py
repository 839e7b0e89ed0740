"""Worker for tests/distributed/test_partial.py: runs one scenario on every rank and saves what it saw.

``semantics`` (4 ranks): controlled arrival orders, random-delay runs in every
mode (round sequences, contributions, initiators), and the drop-in's solo and
majority synchronization on gradients of 1. ``dead`` (4 ranks): rank 3 exits
mid-run; the others record the errors they get and the threads left after
``close()``.
Each surviving rank writes ``rank<R>.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hetdp

WIDTH = 6


def one_hot(rank: int, world_size: int) -> torch.Tensor:
    tensor = torch.zeros(world_size, dtype=torch.float64)
    tensor[rank] = rank + 1
    return tensor


def describe(result: hetdp.PartialResult) -> dict:
    return {"round": result.round, "sum": result.tensor.tolist(), "contributors": result.contributors,
            "parts": result.parts, "fresh": result.fresh}


def controlled_solo(rank: int, world_size: int) -> dict:
    """Rank 0 calls at once, the others half a second later: rank 0 alone fires round 0."""
    with hetdp.PartialAllreduce(one_hot(rank, world_size), mode="solo", timeout=30.0) as partial:
        dist.barrier()
        if rank != 0:
            time.sleep(0.5)
        first = partial.allreduce(one_hot(rank, world_size))
        rest = partial.close()
    return {"first": describe(first), "rest": [describe(r) for r in rest]}


def controlled_quorum(rank: int, world_size: int, k: int) -> dict:
    """Ranks 0 and 1 call at once, the others half a second later: the round must wait for a third arrival."""
    with hetdp.PartialAllreduce(one_hot(rank, world_size), mode="quorum", quorum=k, timeout=30.0) as partial:
        dist.barrier()
        if rank >= 2:
            time.sleep(0.5)
        first = partial.allreduce(one_hot(rank, world_size))
        rest = partial.close()
    return {"first": describe(first), "rest": [describe(r) for r in rest]}


def random_run(rank: int, mode: str, quorum: int | None, calls: int, seed: int) -> dict:
    """Two phases of ``calls // 2`` calls (random integer tensors after random sleeps of 0-8 ms, a ``poll`` before
    some of them), a flush and a barrier between them; every round this rank saw."""
    rng = np.random.default_rng([seed, rank])
    contributed = torch.zeros(WIDTH, dtype=torch.float64)
    rounds, phases = [], []
    with hetdp.PartialAllreduce(contributed, mode=mode, quorum=quorum, timeout=30.0, seed=seed) as partial:
        for phase in range(2):
            first = len(rounds)
            for _ in range(calls // 2):
                time.sleep(rng.uniform(0.0, 0.008))
                if rng.random() < 0.3:
                    rounds += [describe(r) for r in partial.poll()]
                tensor = torch.from_numpy(rng.integers(0, 10, WIDTH).astype(np.float64))
                contributed += tensor
                result = partial.allreduce(tensor)
                rounds += [describe(r) for r in result.rounds]
            phases.append([first, rounds[-1]["round"]])  # rounds a call returned, before anyone flushed
            ending = partial.flush() if phase == 0 else partial.close()
            rounds += [describe(r) for r in ending]
            if phase == 0:
                dist.barrier()  # safe only after a flush: nobody is left waiting for a round
        initiators = [partial.initiator(r) for r in range(200)]
    return {"rounds": rounds, "contributed": contributed.tolist(), "calls": calls // 2 * 2, "phases": phases,
            "initiators": initiators}


def graced_majority(rank: int, calls: int = 12) -> list[int]:
    """Majority rounds with a grace of most of a step, the ranks arriving 10 ms apart: the contributors of every
    round a call returned."""
    contributors = []
    with hetdp.PartialAllreduce(1, mode="majority", timeout=30.0, seed=11, grace=0.9) as partial:
        for _ in range(calls):
            time.sleep(0.1 + 0.01 * rank)
            contributors += [result.contributors for result in partial.allreduce(torch.ones(1)).rounds]
    return contributors


def bypassed_majority(rank: int, world_size: int, calls: int = 16) -> list[dict]:
    """Majority rounds with bypass, the last rank late for good (200 ms a call, the others 20 ms): every round this
    rank saw, the closing ones included."""
    rounds = []
    with hetdp.PartialAllreduce(1, mode="majority", timeout=30.0, seed=11, bypass=True) as partial:
        for _ in range(calls):
            time.sleep(0.2 if rank == world_size - 1 else 0.02)
            rounds += [describe(result) for result in partial.allreduce(torch.ones(1)).rounds]
        rounds += [describe(result) for result in partial.close()]
    return rounds


class Scalar(nn.Module):
    """One float64 weight, the same output for every sample: the mean loss ``model(x).mean()`` has gradient 1."""

    def __init__(self, start: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((1,), start, dtype=torch.float64))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.weight.expand(len(inputs))


def unit_gradient_run(rank: int, sync: str, steps: int = 20) -> dict:
    """The drop-in under ``sync``, every gradient 1, rank-dependent delays (rank 3 lags most: it misses rounds), one
    epoch of equal shares and plain SGD at lr 1: how far the weight moved tells how the rounds were weighed and
    applied. Ranks start from different values; construction must align them."""
    net = Scalar(10.0 + rank)
    model = hetdp.DDP(net, "equal", sync, emulation=hetdp.Emulation())
    start = float(net.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    optimizer_steps = [0]
    optimizer.register_step_post_hook(lambda *_: optimizer_steps.__setitem__(0, optimizer_steps[0] + 1))
    data = TensorDataset(torch.zeros(steps * 2 * dist.get_world_size()))
    loader = model.allocate(DataLoader(data, batch_size=2, sampler=DistributedSampler(data, seed=3)))
    for (inputs,) in loader:  # the last step meets: every rank applies every round, then they average
        time.sleep(0.004 * rank)
        optimizer.zero_grad()
        model(inputs).mean().backward()
        optimizer.step()
    record = {"start": start, "moved": start - float(net.weight), "steps": model.steps_done,
              "optimizer_steps": optimizer_steps[0], "divergence": divergence(net)}
    model.close()
    return record


def divergence(model: nn.Module) -> float:
    """The largest absolute difference between a parameter here and on rank 0, over all ranks (collective)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    gap = (flat - reference).abs().max().reshape(1)
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    return float(gap.item())


def semantics(rank: int, world_size: int) -> dict:
    record: dict = {"solo_controlled": controlled_solo(rank, world_size),
                    "quorum_controlled": controlled_quorum(rank, world_size, k=3)}
    for name, mode, quorum in [("solo", "solo", None), ("majority", "majority", None), ("quorum", "quorum", 3),
                               ("full", "full", None)]:
        record[name] = random_run(rank, mode, quorum, calls=30, seed=11)
    record["majority_graced"] = graced_majority(rank)
    record["majority_bypassed"] = bypassed_majority(rank, world_size)
    record["unit_solo"] = unit_gradient_run(rank, "solo")
    record["unit_majority"] = unit_gradient_run(rank, "majority")
    return record


def dead_peer(rank: int, round_s: float) -> dict:
    """Rank 3 exits after a few rounds; every other rank must get a PeerTimeoutError naming it, then close cleanly."""
    timeouts = hetdp.Timeouts(round_s=round_s, shutdown_s=10.0)
    solo = hetdp.PartialAllreduce(WIDTH, mode="solo", timeout=timeouts)
    full = hetdp.PartialAllreduce(WIDTH, mode="full", timeout=timeouts)
    for _ in range(5):
        solo.allreduce(torch.ones(WIDTH))
        full.allreduce(torch.ones(WIDTH))
    dist.barrier()
    if rank == 3:
        os._exit(0)  # an abrupt death: sockets close, nothing is said (exit code 0 keeps torchrun from killing us)
    time.sleep(0.2)
    record: dict = {}
    # full needs rank 3 to fire a round: the round stalls, and the caller names whoever is missing.
    # solo fires without it: the reduction breaks, and the roll call names whoever stopped answering.
    for name, partial in (("full", full), ("solo", solo)):
        started = time.monotonic()
        try:
            for _ in range(100):
                partial.allreduce(torch.ones(WIDTH))
                time.sleep(0.01)
            record[name] = {"error": None}
        except hetdp.PeerTimeoutError as error:
            record[name] = {"error": type(error).__name__, "rank": error.rank, "message": str(error),
                            "seconds": time.monotonic() - started}
        try:
            partial.allreduce(torch.ones(WIDTH))
            record[name]["again"] = None
        except hetdp.PeerTimeoutError as error:
            record[name]["again"] = error.rank
        partial.close()
        partial.close()
    record["threads"] = [thread.name for thread in threading.enumerate()]
    record["round_s"] = round_s
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=("semantics", "dead"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--round-s", type=float, default=3.0)
    args = parser.parse_args()
    rank, world_size = hetdp.init_distributed()
    record = semantics(rank, world_size) if args.scenario == "semantics" else dead_peer(rank, args.round_s)
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    if args.scenario == "semantics":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
