"""Worker for tests/distributed/test_partial.py: runs one scenario on every rank and saves what it saw.

``semantics`` (4 ranks): controlled arrival orders, random-delay runs in every
mode (round sequences, contributions, initiators), and EagerSGD against plain
synchronous SGD. ``dead`` (4 ranks): rank 3 exits mid-run; the others record the
errors they get and the threads left after ``close()``.
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

import hetdp
from hetdp.train.eager import EagerSGD

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


def new_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(16, 10, generator=generator)
    return inputs, inputs.sum(1, keepdim=True)


def eager_matches_sync(rank: int, group: dist.ProcessGroup, steps: int = 15) -> bool:
    """EagerSGD in full mode next to plain synchronous SGD (allreduce, divide by P) on the same batches."""
    eager_model, plain_model = new_model(), new_model()
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.05, momentum=0.9)
    with EagerSGD(torch.optim.SGD(eager_model.parameters(), lr=0.05, momentum=0.9), eager_model,
                        mode="full", group=group) as eager:
        for step in range(steps):
            inputs, targets = batch(step, rank)
            eager.zero_grad()
            nn.functional.mse_loss(eager_model(inputs), targets).backward()
            eager.step()
            plain.zero_grad()
            nn.functional.mse_loss(plain_model(inputs), targets).backward()
            for p in plain_model.parameters():
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(dist.get_world_size(group))
            plain.step()
    return all(torch.equal(a, b) for a, b in zip(eager_model.parameters(), plain_model.parameters()))


def eager_divergence(rank: int, mode: str, steps: int = 30) -> dict:
    """EagerSGD with random delays: the largest parameter gap between replicas after close()."""
    rng = np.random.default_rng([7, rank])
    model = new_model()
    eager = EagerSGD(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, mode=mode)
    for step in range(steps):
        time.sleep(rng.uniform(0.0, 0.02))
        inputs, targets = batch(step, rank)
        eager.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        eager.step()
    eager.close()
    return {"divergence": eager.divergence(), "rounds": eager.rounds, "applied": eager.applied,
            "gradients": eager.gradients, "steps": steps}


def unit_gradient_run(rank: int, *, divide_by: str, catch_up: bool, sync_every: int, steps: int = 20) -> dict:
    """One scalar parameter whose every gradient is 1, under solo rounds with rank-dependent delays: how far it moved
    tells how rounds were divided and applied. Ranks start from different values; construction must align them."""
    weight = nn.Parameter(torch.full((1,), 10.0 + rank, dtype=torch.float64))
    model = nn.Module()
    model.weight = weight
    eager = EagerSGD(torch.optim.SGD([weight], lr=1.0), model, mode="solo", divide_by=divide_by,
                           catch_up=catch_up, sync_every=sync_every)
    start = float(weight)
    for _ in range(steps):
        time.sleep(0.004 * rank)  # rank 3 lags most: it misses rounds
        eager.zero_grad()
        weight.sum().backward()
        eager.step()
    eager.close()
    return {"start": start, "moved": start - float(weight), "applied": eager.applied, "steps": steps,
            "divergence": eager.divergence(), "gradients": eager.gradients}


def semantics(rank: int, world_size: int) -> dict:
    record: dict = {"solo_controlled": controlled_solo(rank, world_size),
                    "quorum_controlled": controlled_quorum(rank, world_size, k=3)}
    for name, mode, quorum in [("solo", "solo", None), ("majority", "majority", None), ("quorum", "quorum", 3),
                               ("full", "full", None)]:
        record[name] = random_run(rank, mode, quorum, calls=30, seed=11)
    record["majority_graced"] = graced_majority(rank)
    record["majority_bypassed"] = bypassed_majority(rank, world_size)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    record["eager_full_equals_sync"] = eager_matches_sync(rank, pairs[rank // 2])
    record["eager_solo"] = eager_divergence(rank, "solo")
    record["eager_majority"] = eager_divergence(rank, "majority")
    record["unit_world"] = unit_gradient_run(rank, divide_by="world", catch_up=True, sync_every=0)
    record["unit_contributors"] = unit_gradient_run(rank, divide_by="contributors", catch_up=True, sync_every=0)
    record["unit_latest_only"] = unit_gradient_run(rank, divide_by="world", catch_up=False, sync_every=0)
    record["unit_latest_synced"] = unit_gradient_run(rank, divide_by="world", catch_up=False, sync_every=1)
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
