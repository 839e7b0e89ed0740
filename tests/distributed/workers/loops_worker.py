"""Worker for tests/distributed/test_loops.py: loop shapes and loss conventions of real training scripts, one launch.

Scenarios: a loop that fetches batches ahead (a generator ``depth`` batches ahead, as timm's ``PrefetchLoader`` and
CUDA prefetchers are, copying each batch as a device move does), under static shares that change inside the epoch
and adaptive ones; and losses that are not a per-rank mean (a sum, a mean over the global step's tokens) through
``hetdp.DDP`` and ``hetdp.fully_shard``; a loop that fetches a window of batches and then trains them with no fetch
between, through both drop-ins, a batch a forward or several (``accumulates=True``). Rank 0 saves the parameters;
every rank saves its figures and the warnings.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
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
GLOBAL_BATCH = 16
"""Samples a step on 3 ranks (batches of 4 a rank would make 12): a step of 2 samples ends each epoch of 50."""
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


def in_windows(loader: Iterable, size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Yield ``loader``'s batches a window at a time: ``size`` fetched (``itertools.islice``), then each trained with
    no fetch between them, as ``window = [next(it) for _ in range(size)]; for batch in window: ...`` does."""
    batches = iter(loader)
    while window := list(itertools.islice(batches, size)):
        yield from window


@contextlib.contextmanager
def gradients_wait(model: nn.Module) -> Iterator[None]:
    """Let the backwards inside wait to reduce their gradients: ``no_sync`` (hetdp.DDP), FSDP2's sync off."""
    if isinstance(model, hetdp.DDP):
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def train_in_windows(model: nn.Module, loader, optimizer: torch.optim.Optimizer, *, window: int, epochs: int = 2,
                     schedule: bool = False, micro: int = 1, twice: bool = False, seen: list) -> list[int]:
    """The user's loop over windows of ``window`` batches (0: a prefetcher one batch ahead instead): each batch one
    forward and backward, or ``micro`` micro-batches (the first ones under ``gradients_wait``, as many on every rank,
    each loss the sum over its samples over the batch's, so that they add up to the batch's mean), or with ``twice``
    a second forward and backward (the batch mirrored: -x, 1 - y) before the optimizer step, as a step of two losses
    has. ``seen`` gets each batch's size and ``model.step_samples`` as the loop reads it, before its first forward."""
    scheduler = (torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=epochs * len(loader))
                 if schedule else None)
    reports = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for batch in in_windows(loader, window) if window else ahead(loader, 1):
            optimizer.zero_grad()
            seen.append([len(batch["y"]), model.step_samples])
            parts = list(zip(torch.tensor_split(batch["x"], micro), torch.tensor_split(batch["y"], micro)))
            for i, (x, y) in enumerate(parts):
                with gradients_wait(model) if i < len(parts) - 1 else contextlib.nullcontext():
                    (nn.functional.cross_entropy(model(x), y, reduction="sum") / len(batch["y"])).backward()
            if twice:
                nn.functional.cross_entropy(model(-batch["x"]), 1 - batch["y"]).backward()
            if schedule:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        reports.append(len(model.epoch_reports))
    return reports


def trained_in_windows(model, loader, optimizer: torch.optim.Optimizer, **options) -> dict:
    """``train_in_windows``, and what the test checks (as ``trained``)."""
    seen: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reports = train_in_windows(model, loader, optimizer, seen=seen, **options)
    return {"reports": reports, "blocks": [f.shares for f in model.step_figures], "seen": seen,
            "samples": [r.samples for r in model.epoch_reports], "steps": len(model.step_figures),
            "warnings": [str(w.message) for w in caught if "hetdp" in str(w.message)]}


def sharded_model(**settings) -> nn.Module:
    """``make_model(7)`` under ``hetdp.fully_shard``: each layer a unit, then the root with ``settings``."""
    net = make_model(7)  # FSDP2 shards what each rank holds: every rank starts from the same model
    for layer in (net[0], net[2]):
        hetdp.fully_shard(layer)
    return hetdp.fully_shard(net, **settings)


def save_parameters(model: nn.Module, path: Path, rank: int) -> None:
    """Rank 0 saves the parameters (collective under FSDP2: the shards are gathered)."""
    state = model.module.state_dict() if isinstance(model, hetdp.DDP) else {
        name: tensor.full_tensor() for name, tensor in model.state_dict().items()}
    if rank == 0:
        torch.save(state, path)


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
        # a last step of 2 samples for 3 ranks (a stand-in); AdamW, a per-step schedule and clipping.
        for depth in (0, 1, 2, 3):
            model = hetdp.DDP(make_model(7 + rank), hetdp.Static((1.0, 2.0, 5.0)))
            loader = model.allocate(loader_for(50, 4), global_batch=GLOBAL_BATCH)
            model.set_shares([4, 2, 10], at_step=1)
            model.set_shares([2, 6, 8], at_step=5)
            result[f"depth{depth}"] = trained(model, loader, torch.optim.AdamW(model.parameters(), lr=0.05),
                                              depth=depth, schedule=True)
            if rank == 0:
                torch.save(model.module.state_dict(), out / f"prefetch_{depth}.pt")
            model.close()
    elif scenario == "prefetch_adaptive":
        # Adaptive shares on emulated devices (speeds 1, 2, 4), one batch ahead: re-plans land inside epochs.
        emulation = hetdp.Emulation(speeds=(1.0, 2.0, 4.0), sample_cost_ms=2.0)
        model = hetdp.DDP(make_model(7 + rank), "adaptive", emulation=emulation)
        loader = model.allocate(loader_for(400, 4), global_batch=GLOBAL_BATCH)
        result = {**trained(model, loader, torch.optim.SGD(model.parameters(), lr=0.3), depth=1),
                  "replans": model.allocator.replans, "shares": model.shares}
        if rank == 0:
            torch.save(model.module.state_dict(), out / "prefetch_adaptive.pt")
        model.close()
    elif scenario == "losses":
        # A summed loss and a global token mean under unequal static shares, and a short last step with stand-ins.
        for convention in ("sum", "global_mean"):
            model = hetdp.DDP(make_model(7 + rank), hetdp.Static((1.0, 2.0, 5.0)), loss=convention)
            loader = model.allocate(loader_for(50, 4), global_batch=GLOBAL_BATCH)
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
            hetdp.fully_shard(net, allocation=hetdp.Static((1.0, 2.0, 5.0)), loss=convention)
            loader = net.allocate(loader_for(50, 4), global_batch=GLOBAL_BATCH)
            lr = LR_SUM if convention == "sum" else 0.3
            result[convention] = trained(net, loader, torch.optim.SGD(net.parameters(), lr=lr),
                                         convention=convention, depth=1)
            state = {name: tensor.full_tensor() for name, tensor in net.state_dict().items()}
            if rank == 0:
                torch.save(state, out / f"losses_sharded_{convention}.pt")
            net.close()
    return result


def window_loader(size: int) -> DataLoader:
    """``loader_for``'s loader (batches of 4, one worker process), forked at each epoch's start after the model of the
    scenario's previous window size was closed: its destroyed group awaits collection then (test_exit)."""
    return loader_for(size, 4)


def run_windows(scenario: str, out: Path, rank: int) -> dict:
    """The window scenarios: each drop-in over windows of 2 and 4 batches under static shares that change inside
    windows and epochs and adaptive ones; several forwards a batch under ``accumulates=True``; two losses a step
    behind a prefetcher, which a window rule must leave in their step."""
    sharded = scenario.endswith("_sharded")

    def made(allocation, **options):
        if sharded:
            return sharded_model(allocation=allocation, **options)
        return hetdp.DDP(make_model(7 + rank), allocation, **options)

    def static(**allocated) -> tuple[nn.Module, object]:
        # Shares 4, 4, 8 of 16 (static 1, 1, 2), changed at step 1 and at step 5 (inside a window of either size,
        # and inside the second epoch), and each epoch's last step of 2 samples (a stand-in).
        model = made(hetdp.Static((1.0, 1.0, 2.0)))
        loader = model.allocate(window_loader(50), global_batch=GLOBAL_BATCH, **allocated)
        model.set_shares([4, 2, 10], at_step=1)
        model.set_shares([2, 6, 8], at_step=5)
        return model, loader

    result: dict = {}
    if scenario.startswith("windows_static"):
        # AdamW, a per-step schedule and clipping, as the prefetch scenario.
        for window in (2, 4):
            model, loader = static()
            result[f"window{window}"] = trained_in_windows(model, loader, torch.optim.AdamW(
                model.parameters(), lr=0.05), window=window, schedule=True)
            save_parameters(model, out / f"{scenario}_{window}.pt", rank)
            model.close()
    elif scenario.startswith("windows_adaptive"):
        # Adaptive shares on emulated devices (speeds 1, 2, 4): re-plans land inside windows. 10 ms a sample: at 2
        # the sharded drop-in's collectives, on a loaded machine, hid the speeds from the adaptive rule (no re-plan).
        for window in (2, 4):
            emulation = hetdp.Emulation(speeds=(1.0, 2.0, 4.0), sample_cost_ms=10.0)
            model = made("adaptive", emulation=emulation)
            loader = model.allocate(window_loader(400), global_batch=GLOBAL_BATCH)
            result[f"window{window}"] = {
                **trained_in_windows(model, loader, torch.optim.SGD(model.parameters(), lr=0.3), window=window),
                "replans": model.allocator.replans}
            save_parameters(model, out / f"{scenario}_{window}.pt", rank)
            model.close()
    elif scenario.startswith("windows_accumulates"):
        # accumulates=True: each batch of a window of 2 as 2 micro-batches, the first one's gradients waiting, an
        # optimizer step a batch: exact. Then windows whose two batches accumulate with no step between them, which
        # cannot be told from micro-batches of one batch: one warning.
        model, loader = static(accumulates=True)
        result["micro"] = trained_in_windows(model, loader, torch.optim.SGD(model.parameters(), lr=0.3), window=2,
                                             micro=2)
        save_parameters(model, out / f"{scenario}.pt", rank)
        model.close()
        model, loader = static(accumulates=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batches = iter(loader)
            while window := list(itertools.islice(batches, 2)):
                for i, batch in enumerate(window):
                    with gradients_wait(model) if i < len(window) - 1 else contextlib.nullcontext():
                        nn.functional.cross_entropy(model(batch["x"]), batch["y"]).backward()
                optimizer.step()
                optimizer.zero_grad()
        result["accumulated"] = [str(w.message) for w in caught if "hetdp" in str(w.message)]
        model.close()
        # A batch run as micro-batches under accumulates=False (the default: a batch is one forward), in a window:
        # each backward whose gradients wait ends a batch, and a warning says so.
        model, loader = static()
        result["split"] = trained_in_windows(model, loader, torch.optim.SGD(model.parameters(), lr=0.3), window=2,
                                             micro=2)["warnings"]
        model.close()
    elif scenario == "windows_syncs":
        # hetdp.DDP under each synchronization, windows of 2, rank 1 given no share from step 5 on (it sits out of
        # the allreduce's exchange, and joins the others' with a stand-in weighted 0); exact under allreduce.
        for sync in ("allreduce", "solo", "majority", "local:2"):
            model = hetdp.DDP(make_model(7 + rank), hetdp.Static((1.0, 1.0, 2.0)), sync)
            loader = model.allocate(window_loader(50), global_batch=GLOBAL_BATCH)
            model.set_shares([4, 2, 10], at_step=1)
            model.set_shares([6, 0, 10], at_step=5)
            result[sync] = trained_in_windows(model, loader, torch.optim.SGD(model.parameters(), lr=0.3), window=2)
            save_parameters(model, out / f"{scenario}_{sync}.pt", rank)
            model.close()
    elif scenario.startswith("windows_waiting"):
        # Two batches accumulated per optimizer step, the first one's gradients waiting (a batch a step: the
        # default accumulates=False), fetched as a window of 2, then through a prefetcher two batches ahead: there,
        # at each epoch's end, the loader has run out while the last two batches train, with no fetch and no
        # optimizer step between them.
        for shape in ("window", "prefetch"):
            model, loader = static()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
            seen: list = []
            for epoch in range(2):
                loader.sampler.set_epoch(epoch)
                for i, batch in enumerate(in_windows(loader, 2) if shape == "window" else ahead(loader, 2)):
                    seen.append([len(batch["y"]), model.step_samples])
                    with gradients_wait(model) if i % 2 == 0 else contextlib.nullcontext():
                        (nn.functional.cross_entropy(model(batch["x"]), batch["y"]) / 2).backward()
                    if i % 2 == 1:
                        optimizer.step()
                        optimizer.zero_grad()
            result[shape] = {"blocks": [f.shares for f in model.step_figures], "seen": seen,
                             "reports": len(model.epoch_reports)}
            save_parameters(model, out / f"{scenario}_{shape}.pt", rank)
            model.close()
    elif scenario.startswith("windows_twice"):
        # A prefetcher one batch ahead and two losses a step, backpropagated apart (a GAN's discriminator's): the
        # second forward follows a backward with a batch fetched ahead, but no update: it stays in its step.
        model, loader = static()
        result = trained_in_windows(model, loader, torch.optim.SGD(model.parameters(), lr=0.3), window=0,
                                    twice=True)
        save_parameters(model, out / f"{scenario}.pt", rank)
        model.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenarios", required=True, help="comma-separated")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for scenario in args.scenarios.split(","):
        result = (run_windows if scenario.startswith("windows") else run)(scenario, args.out, rank)
        (args.out / f"{scenario}_{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
