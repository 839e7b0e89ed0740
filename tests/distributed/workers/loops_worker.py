"""Worker for tests/distributed/test_loops.py: loop shapes and loss conventions of real training scripts, one launch.

Scenarios: a loop that fetches batches ahead (a generator ``depth`` batches ahead, as timm's ``PrefetchLoader`` and
CUDA prefetchers are, copying each batch as a device move does), under static shares that change inside the epoch
and adaptive ones; and losses that are not a per-rank mean (a sum, a mean over the global step's tokens) through
``hetdp.DDP`` and ``hetdp.fully_shard``. Rank 0 saves the parameters; every rank saves its figures and the warnings.
"""

from __future__ import annotations

import argparse
import collections
import json
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import hetdp
from dropin_worker import Pairs, make_model

SEED = 3
LR_SUM = 0.02
"""SGD's rate for a summed loss (its gradient is a step's samples over the ranks times a mean's)."""


def tokens_of(index: torch.Tensor) -> torch.Tensor:
    """Each sample's token count (1 to 3, by dataset index): what a global token mean weighs it by."""
    return (index % 3 + 1).double()


class Indexed(Pairs):
    """``Pairs`` whose items carry their dataset index (their token count follows from it)."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {**super().__getitem__(index), "i": torch.tensor(index)}


def ahead(loader: Iterable, depth: int) -> Iterator[dict[str, torch.Tensor]]:
    """Yield ``loader``'s batches, each fetched ``depth`` batches before it trains and copied (a device move)."""
    waiting: collections.deque = collections.deque()
    for batch in loader:
        waiting.append({key: value.clone() for key, value in batch.items()})
        if len(waiting) > depth:
            yield waiting.popleft()
    while waiting:
        yield waiting.popleft()


def loss_of(model: nn.Module, batch: dict[str, torch.Tensor], convention: str, samples: int | None) -> torch.Tensor:
    """The loop's loss under ``convention``; a global token mean all-reduces the step's tokens, counting none of a
    stand-in batch (``samples`` 0)."""
    if convention == "mean":
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    each = nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="none")
    if convention == "sum":
        return each.sum()
    tokens = tokens_of(batch["i"])
    count = (tokens.sum() if samples else torch.zeros((), dtype=torch.float64)).reshape(1)
    dist.all_reduce(count)
    return (each.double() * tokens).sum().float() / count.float()


def train(model: nn.Module, loader, optimizer: torch.optim.Optimizer, *, epochs: int = 2, depth: int = 0,
          convention: str = "mean", schedule: bool = False, seen: list | None = None) -> list[int]:
    """The user's loop; returns the count of epoch reports right after each epoch's for loop. ``seen`` gets each
    batch's size and ``model.step_samples`` as the loop body reads it, before the forward."""
    scheduler = (torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=epochs * len(loader))
                 if schedule else None)
    reports = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for batch in ahead(loader, depth) if depth else loader:
            optimizer.zero_grad()
            if seen is not None:
                seen.append([len(batch["y"]), model.step_samples])
            loss_of(model, batch, convention, model.step_samples).backward()
            if schedule:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        reports.append(len(model.epoch_reports))
    return reports


def loader_for(size: int, batch_size: int) -> DataLoader:
    data = Indexed(size)
    return DataLoader(data, batch_size=batch_size, sampler=DistributedSampler(data, seed=SEED), num_workers=1)


def trained(model, loader, optimizer: torch.optim.Optimizer, **options) -> dict:
    """``train``, and what the test checks: the steps' blocks, what the loop body saw of each batch, the epochs'
    samples and hetdp's warnings."""
    seen: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reports = train(model, loader, optimizer, seen=seen, **options)
    return {"reports": reports, "blocks": [f.shares for f in model.step_figures], "seen": seen,
            "samples": [r.samples for r in model.epoch_reports], "steps": len(model.step_figures),
            "warnings": [str(w.message) for w in caught if "hetdp" in str(w.message)]}


def run(scenario: str, out: Path, rank: int) -> dict:
    result: dict = {}
    if scenario == "prefetch":
        # Static unequal shares that change at step 1 (as a re-plan does) and at step 5 (inside the second epoch),
        # a last step of 2 samples for 4 ranks (two stand-ins); AdamW, a per-step schedule and clipping.
        for depth in (0, 1, 2, 3):
            model = hetdp.DDP(make_model(7 + rank), hetdp.Static((1.0, 2.0, 3.0, 2.0)))
            loader = model.allocate(loader_for(50, 4))
            model.set_shares([4, 2, 6, 4], at_step=1)
            model.set_shares([2, 6, 4, 4], at_step=5)
            result[f"depth{depth}"] = trained(model, loader, torch.optim.AdamW(model.parameters(), lr=0.05),
                                              depth=depth, schedule=True)
            if rank == 0:
                torch.save(model.module.state_dict(), out / f"prefetch_{depth}.pt")
            model.close()
    elif scenario == "prefetch_adaptive":
        # Adaptive shares on emulated devices (speeds 1, 1, 2, 4), one batch ahead: re-plans land inside epochs.
        emulation = hetdp.Emulation(speeds=(1.0, 1.0, 2.0, 4.0), sample_cost_ms=2.0)
        model = hetdp.DDP(make_model(7 + rank), "adaptive", emulation=emulation)
        loader = model.allocate(loader_for(400, 4))
        result = {**trained(model, loader, torch.optim.SGD(model.parameters(), lr=0.3), depth=1),
                  "replans": model.allocator.replans, "shares": model.shares}
        if rank == 0:
            torch.save(model.module.state_dict(), out / "prefetch_adaptive.pt")
        model.close()
    elif scenario == "losses":
        # A summed loss and a global token mean under unequal static shares, and a short last step with stand-ins.
        for convention in ("sum", "global_mean"):
            model = hetdp.DDP(make_model(7 + rank), hetdp.Static((1.0, 2.0, 3.0, 2.0)), loss=convention)
            loader = model.allocate(loader_for(50, 4))
            lr = LR_SUM if convention == "sum" else 0.3
            result[convention] = trained(model, loader, torch.optim.SGD(model.parameters(), lr=lr),
                                         convention=convention)
            if rank == 0:
                torch.save(model.module.state_dict(), out / f"losses_{convention}.pt")
            model.close()
    elif scenario == "losses_sharded":
        # The same through hetdp.fully_shard (each layer a unit, then the root), one batch ahead.
        for convention in ("sum", "global_mean"):
            net = make_model(7)  # FSDP2 shards what each rank holds: every rank starts from the same model
            for layer in (net[0], net[2]):
                hetdp.fully_shard(layer)
            hetdp.fully_shard(net, allocation=hetdp.Static((1.0, 2.0, 3.0, 2.0)), loss=convention)
            loader = net.allocate(loader_for(50, 4))
            lr = LR_SUM if convention == "sum" else 0.3
            result[convention] = trained(net, loader, torch.optim.SGD(net.parameters(), lr=lr),
                                         convention=convention, depth=1)
            state = {name: tensor.full_tensor() for name, tensor in net.state_dict().items()}
            if rank == 0:
                torch.save(state, out / f"losses_sharded_{convention}.pt")
            net.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenarios", required=True, help="comma-separated")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for scenario in args.scenarios.split(","):
        (args.out / f"{scenario}_{rank}.json").write_text(json.dumps(run(scenario, args.out, rank)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
