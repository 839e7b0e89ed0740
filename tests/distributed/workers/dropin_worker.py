"""Worker for tests/distributed/test_dropin.py: the drop-in in a user's own loop, one scenario per --scenario.

Each scenario trains with ``hetdp.DDP`` and ``model.allocate`` in a plain
``zero_grad / forward / backward / step`` loop over a DataLoader of dict batches
with a worker process, and rank 0 (or every rank) saves what the test checks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import hetdp
from hetdp.allocate.policy import Allocator

FEATURES = 6


class Pairs(Dataset):
    """A map-style dataset of dict items, as users write them."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(size, FEATURES, generator=generator)
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "y": self.y[index]}


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 2))


def make_tower(seed: int = 0) -> nn.Module:
    """A second model that feeds ``make_model``'s, as one tower of several (or a GAN's generator) does."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Tanh())


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.3)
    return torch.optim.AdamW(model.parameters(), lr=0.05)


def train(model: hetdp.DDP, loader, optimizer, epochs: int, *, clip: float | None = None, schedule: bool = False,
          every: int = 1):
    """The user's loop, untouched by hetdp: every option a real loop has, ``every`` batches accumulated under
    ``no_sync`` per optimizer step (counted within each epoch: a window may run on into the next)."""
    scheduler = (torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=epochs * len(loader))
                 if schedule else None)
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            synchronizing = (i + 1) % every == 0
            with contextlib.nullcontext() if synchronizing else model.no_sync():
                (nn.functional.cross_entropy(model(batch["x"]), batch["y"]) / every).backward()
            if synchronizing:
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad()
                if scheduler is not None:
                    scheduler.step()


def loader_for(dataset: Dataset, batch_size: int, workers: int = 0) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, sampler=DistributedSampler(dataset, seed=3), num_workers=workers)


def record_replan_windows(allocator: Allocator) -> list[tuple[int, bool]]:
    """The steps each re-plan of ``allocator`` is offered, and whether it decided on them (not too noisy), in order
    (filled as the run goes)."""
    windows: list[tuple[int, bool]] = []
    replan = allocator.replan

    def recorded() -> list[int] | None:
        measured = allocator.measured
        shares = replan()
        windows.append((measured, allocator.measured == 0))
        return shares

    allocator.replan = recorded
    return windows


def record_plan_steps(model: hetdp.DDP) -> list[int]:
    """The newest step whose figures each re-plan of ``model`` that moved the shares knew of, in order (filled as
    the run goes): beside the schedule's first steps, how many steps a plan came after its window."""
    newest: list[int] = []
    allocator = model.allocator
    replan = allocator.replan

    def recorded() -> list[int] | None:
        shares = replan()
        if shares is not None:
            newest.append(model.step_figures[-1].step)
        return shares

    allocator.replan = recorded
    return newest


def record_meetings(model: hetdp.DDP, applied: list) -> list[tuple[int, bool]]:
    """(steps applied, announced) at each meeting of ``model`` (filled as the run goes; the loop marks the meetings
    it calls itself, and deletes the recorder when done)."""
    meetings: list[tuple[int, bool]] = []
    meet = model.synchronizer.meet

    def recorded(*args, **kwargs):
        meetings.append((len(applied), True))
        return meet(*args, **kwargs)

    model.synchronizer.meet = recorded
    return meetings


def run(scenario: str, args: argparse.Namespace, rank: int) -> dict:
    out: Path = args.out
    result: dict = {}
    emulation = hetdp.Emulation(speeds=(1.0, 1.0, 2.0, 4.0), sample_cost_ms=2.0)
    if scenario == "exact":
        # Unequal static shares, AdamW + per-step schedule + clipping, a worker process, and a last step with fewer
        # samples than ranks (2 of 4): two ranks join it with a stand-in weighted 0.
        for sync in ("allreduce", "full", "local:1"):
            model = hetdp.DDP(make_model(7 + rank), hetdp.Static((1.0, 2.0, 3.0, 2.0)), sync)
            loader = model.allocate(loader_for(Pairs(50), batch_size=4, workers=1))
            kind = "sgd" if sync == "local:1" else "adamw"  # local:1 equals allreduce only for plain SGD
            train(model, loader, make_optimizer(model, kind), 2, clip=None if kind == "sgd" else 0.5,
                  schedule=kind == "adamw")
            result[sync] = {"shares": model.shares, "steps": len(loader),
                            "samples": [r.samples for r in model.epoch_reports],
                            "blocks": [f.shares for f in model.step_figures]}
            if rank == 0:
                torch.save(model.module.state_dict(), out / f"exact_{sync}.pt")
            model.close()
    elif scenario == "accumulate":
        # Two batches accumulated under no_sync per optimizer step. The shares change between the two (at step 1,
        # as a re-plan may), and the epoch's last step, where two ranks join with stand-ins, ends a window.
        for sync in ("allreduce", "full"):
            model = hetdp.DDP(make_model(7 + rank), hetdp.Static((1.0, 2.0, 3.0, 2.0)), sync)
            loader = model.allocate(loader_for(Pairs(50), batch_size=4, workers=1))
            model._schedule.append((1, [4, 2, 6, 4]))
            train(model, loader, make_optimizer(model, "adamw"), 2, clip=0.5, schedule=True, every=2)
            result[sync] = {"blocks": [f.shares for f in model.step_figures]}
            if rank == 0:
                torch.save(model.module.state_dict(), out / f"accumulate_{sync}.pt")
            model.close()
        # Adaptive shares on emulated devices: every batch, accumulated or not, is timed and paced alone, and the
        # re-plans that follow land anywhere in a window (25 steps an epoch: one window runs into the next epoch).
        model = hetdp.DDP(make_model(7 + rank), "adaptive", emulation=emulation)
        loader = model.allocate(loader_for(Pairs(400), batch_size=4))
        train(model, loader, make_optimizer(model, "sgd"), 2, every=2)
        result["adaptive"] = {"shares": model.shares, "replans": model.allocator.replans,
                              "compute_s": [f.compute_s for f in model.step_figures]}
        if rank == 0:
            torch.save(model.module.state_dict(), out / "accumulate_adaptive.pt")
        model.close()
    elif scenario == "follow":
        # Two models on the same batches, the first feeding the second, which owns the loader: the first follows its
        # steps. Unequal static shares and a last step where two ranks join with a stand-in; weighed as plain DDP,
        # the follower's gradient would be the mean of the ranks' means, not the mean over the step's samples.
        tower, head = make_tower(7 + rank), make_model(7 + rank)
        model = hetdp.DDP(head, hetdp.Static((1.0, 2.0, 3.0, 2.0)))
        follower = hetdp.DDP(tower, follow=model)
        loader = model.allocate(loader_for(Pairs(50), batch_size=4, workers=1))
        optimizer = torch.optim.SGD([*follower.parameters(), *model.parameters()], lr=0.3)
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)
            for batch in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(follower(batch["x"])), batch["y"]).backward()
                optimizer.step()
        result = {"blocks": [f.shares for f in model.step_figures], "follower_steps": follower.steps_done,
                  "follower_epochs": len(follower.epoch_reports)}
        if rank == 0:
            torch.save(nn.Sequential(tower, head).state_dict(), out / "follow.pt")
        follower.close()
        model.close()
    elif scenario == "policies":
        # The crash: 2,050 samples, 4 ranks, 32 per rank: the last step holds 2 samples.
        for allocation in ("equal", hetdp.Static((1.0, 1.0, 2.0, 4.0)), "adaptive"):
            model = hetdp.DDP(make_model(), allocation)
            loader = model.allocate(loader_for(Pairs(2050), batch_size=32))
            train(model, loader, make_optimizer(model, "sgd"), 1)
            result[model.allocation.describe()] = {"samples": model.last_epoch.samples, "steps": len(loader)}
            model.close()
    elif scenario == "batchnorm":
        # A rank with no sample in a step never runs its BatchNorm in train mode on a stand-in.
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))
        model = hetdp.DDP(net, hetdp.Static((1.0, 1.0, 2.0, 0.0)), "allreduce")
        loader = model.allocate(loader_for(Pairs(60), batch_size=4))
        train(model, loader, make_optimizer(model, "sgd"), 1)
        real = sum(1 for f in model.step_figures if f.shares[rank] > 0)
        result = {"tracked": int(net[1].num_batches_tracked), "real_steps": real, "steps": len(loader)}
    elif scenario in ("emulated", "drift"):
        # "emulated": the emulation reaches the drop-in through the environment only (hetdp run sets it);
        # "drift": the fastest rank drops to speed 1 at step 25, after the shares settled.
        if scenario == "drift":
            emulation = dataclasses.replace(emulation, speed_changes=((25, (1.0, 1.0, 2.0, 1.0)),))
        model = hetdp.DDP(make_model(), "adaptive", emulation=emulation if scenario == "drift" else None)
        loader = model.allocate(loader_for(Pairs(640), batch_size=16))
        train(model, loader, make_optimizer(model, "sgd"), 2 if scenario == "emulated" else 5)
        adaptive = model.allocator.adaptive
        result = {"shares": model.shares, "restarts": adaptive.restarts, "replans": model.allocator.replans,
                  "epochs": [vars(r) for r in model.epoch_reports], "speeds": model.emulation.speeds,
                  "changes": [list(c) for c in model.emulation.speed_changes]}
    elif scenario == "partial":
        # Partial synchronization with a straggler: rounds weigh samples, replicas meet at every epoch's end.
        straggling = dataclasses.replace(emulation, straggler_count=1, straggler_delay_ms=20.0)
        for sync in (hetdp.Partial(mode="majority", every=5), "solo", "local:3"):
            model = hetdp.DDP(make_model(), "adaptive", sync, emulation=straggling)
            loader = model.allocate(loader_for(Pairs(320), batch_size=8))
            windows = record_replan_windows(model.allocator)
            train(model, loader, make_optimizer(model, "adamw"), 3)
            flat = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
            gathered = [torch.empty_like(flat) for _ in range(model.world_size)]
            dist.all_gather(gathered, flat)
            result[model.sync.describe()] = {
                "gap": max(float((g - flat).abs().max()) for g in gathered),
                "samples": [r.samples for r in model.epoch_reports], "shares": model.shares,
                "replans": model.allocator.replans, "dataset": len(loader.dataset), "windows": windows}
            model.close()
    elif scenario == "meetings":
        # Plain SGD at a constant rate: a replica moves by the sum of the gradients it applied. Under partial rounds
        # with a straggler, ranks apply rounds at different steps, yet before each meeting every rank has applied
        # every round: the gradients each applied since the last meeting sum to the same. A straggler's delay of
        # several steps makes it receive several rounds in one step. The loop also meets once unannounced
        # (synchronize), where ranks still carry different rounds: from there on, the sums agree again.
        straggling = dataclasses.replace(emulation, straggler_count=1, straggler_delay_ms=60.0)
        for sync, unannounced in ((hetdp.Partial(mode="majority", every=4), 6), (hetdp.Partial(mode="solo"), 5)):
            model = hetdp.DDP(make_model(), "equal", sync, emulation=straggling)
            loader = model.allocate(loader_for(Pairs(300), batch_size=8))  # 10 steps
            optimizer = make_optimizer(model, "sgd")
            parameters = list(model.module.parameters())
            applied = []  # gathered only after the loop: a collective per step would keep the ranks in step
            meetings = record_meetings(model, applied)
            for step, batch in enumerate(loader, start=1):
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(batch["x"]), batch["y"]).backward()
                optimizer.step()
                applied.append(torch.cat([p.grad.reshape(-1) for p in parameters]))
                if step == unannounced:
                    model.synchronize()
                    meetings[-1] = (step, False)
            del model.synchronizer.meet  # the recorder's cycle would keep gloo's group for a forked worker's GC
            mine = torch.stack(applied)
            gathered = [torch.empty_like(mine) for _ in range(model.world_size)]
            dist.all_gather(gathered, mine)
            differing = sum(not all(torch.equal(g[step], mine[step]) for g in gathered) for step in range(len(mine)))
            starts = [0] + [end for end, _ in meetings]
            sums = [all(torch.allclose(g[start:end].sum(0), mine[start:end].sum(0), rtol=0.0, atol=1e-5)
                        for g in gathered) for start, (end, announced) in zip(starts, meetings) if announced]
            result[model.sync.describe()] = {"equal_sums": sums, "differing_steps": differing,
                                             "meetings": meetings}
            model.close()
    elif scenario == "momentum":
        # SGD with momentum under partial rounds with a straggler: a rank several steps behind receives several rounds
        # in one step, and steps the loop's optimizer once per round; before the epoch's meeting averages the
        # replicas (after the last step's optimizer.step()), they are already one model.
        straggling = dataclasses.replace(emulation, straggler_count=1, straggler_delay_ms=60.0)
        for sync in ("majority", "solo"):
            model = hetdp.DDP(make_model(), "equal", sync, emulation=straggling)
            loader = model.allocate(loader_for(Pairs(300), batch_size=8))  # 10 steps
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for step, batch in enumerate(loader, start=1):
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(batch["x"]), batch["y"]).backward()
                optimizer.step()
                if step == len(loader):
                    before_meeting = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
            gathered = [torch.empty_like(before_meeting) for _ in range(model.world_size)]
            dist.all_gather(gathered, before_meeting)
            extra = [0] * model.world_size
            dist.all_gather_object(extra, model.synchronizer.extra_steps)
            result[sync] = {"gap": max(float((g - before_meeting).abs().max()) for g in gathered),
                            "extra_steps": extra}
            model.close()
    elif scenario == "background":
        # Local averaging per epoch with adaptive shares, a prefetching loader: plans come from background gathers,
        # so the replicas stay apart until the epoch's end, and every rank cuts every step by the same shares.
        for checkpoint_every in (None, 15):
            model = hetdp.DDP(make_model(), "adaptive", "local", emulation=emulation)
            loader = model.allocate(loader_for(Pairs(1280), batch_size=8, workers=1))
            optimizer = make_optimizer(model, "sgd")
            if checkpoint_every:  # a checkpoint meets first: it saves the averaged model, not rank 0's replica
                model.checkpointer(out / "background_checkpoints", optimizer, every=checkpoint_every)
            checksums = []
            for batch in loader:  # the parameters each step starts from: after the last step's meeting, if any
                checksums.append(float(sum(p.detach().double().sum() for p in model.module.parameters())))
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(batch["x"]), batch["y"]).backward()
                optimizer.step()
            mine = torch.tensor(checksums, dtype=torch.float64)
            gathered = [torch.empty_like(mine) for _ in range(model.world_size)]
            dist.all_gather(gathered, mine)
            run_ = {"identical_steps": [step for step in range(len(checksums))
                                        if all(torch.equal(g[step], mine[step]) for g in gathered)],
                    "steps": len(checksums), "blocks": [f.shares for f in model.step_figures],
                    "replans": model.allocator.replans, "shares": model.shares}
            model.close()
            if checkpoint_every:
                result["checkpointed"] = run_
            else:
                result.update(run_)
        # The same under majority rounds with a random straggler: ranks awaiting a gather keep the rounds firing.
        straggling = dataclasses.replace(emulation, straggler_count=1, straggler_delay_ms=30.0)
        model = hetdp.DDP(make_model(), "adaptive", "majority", emulation=straggling)
        loader = model.allocate(loader_for(Pairs(1280), batch_size=8, workers=1))
        train(model, loader, make_optimizer(model, "sgd"), 1)
        result["majority"] = {"steps": len(loader), "blocks": [f.shares for f in model.step_figures],
                              "replans": model.allocator.replans, "shares": model.shares}
        model.close()
    elif scenario == "out_of_step":
        # Local averaging, adaptive shares, one fast rank (emulated 80 ms a step against 10 at equal shares). The
        # first plan takes the rule's own window. torch's DDP rebuilds its buckets, a collective, as the second
        # step's forward starts: the fast rank waits there for the slow ones, which is not its compute.
        model = hetdp.DDP(make_model(), "adaptive", "local",
                          emulation=hetdp.Emulation(speeds=(1.0, 1.0, 1.0, 8.0), sample_cost_ms=10.0))
        loader = model.allocate(loader_for(Pairs(512), batch_size=8))
        train(model, loader, make_optimizer(model, "sgd"), 1)
        result = {"compute_s": [f.compute_s for f in model.step_figures],
                  "blocks": [f.shares for f in model.step_figures]}
        model.close()
    elif scenario == "two_backwards":
        # Two synchronized backwards a step, as a GAN's discriminator runs them, under allreduce and adaptive shares,
        # with one fast rank (emulated 80 ms a step against 10 at equal shares). The fast rank waits at the end of
        # the first backward for the slow ones: that is not compute of its second.
        model = hetdp.DDP(make_model(), "adaptive",
                          emulation=hetdp.Emulation(speeds=(1.0, 1.0, 1.0, 8.0), sample_cost_ms=10.0))
        loader = model.allocate(loader_for(Pairs(512), batch_size=8))
        newest = record_plan_steps(model)
        optimizer = make_optimizer(model, "sgd")
        for batch in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(batch["x"]), batch["y"]).backward()
            nn.functional.cross_entropy(model(-batch["x"]), 1 - batch["y"]).backward()
            optimizer.step()
        result = {"compute_s": [f.compute_s for f in model.step_figures],
                  "wait_s": [f.wait_s for f in model.step_figures],
                  "blocks": [f.shares for f in model.step_figures],
                  "plans": [[first, known] for (first, _), known in zip(model._schedule[1:], newest)]}
        model.close()
    elif scenario == "metrics":
        csv = out / "metrics.csv"
        model = hetdp.DDP(make_model(), hetdp.Static((1.0, 1.0, 2.0, 4.0)),
                          metrics=hetdp.MetricsConfig(csv=csv, every=3))
        loader = model.allocate(loader_for(Pairs(50), batch_size=4))
        train(model, loader, make_optimizer(model, "sgd"), 2)
        result = {"steps": 2 * len(loader), "figures": len(model.step_figures)}
        model.close()
    (out / f"{scenario}_{rank}.json").write_text(json.dumps(result))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenarios", required=True, help="comma-separated")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    for scenario in args.scenarios.split(","):
        run(scenario, args, dist.get_rank())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
