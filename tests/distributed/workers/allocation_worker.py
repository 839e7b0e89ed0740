"""Worker for tests/distributed/test_allocation.py: runs every scenario on 3 ranks, rank 0 saves results."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import hetdp
from hetdp.train.allocation import AllocatedTrainer, AllocationConfig


def make_dataset(size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(size, 6, generator=generator)
    return TensorDataset(inputs, (inputs.sum(1) > 0).long())


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def train(config: AllocationConfig, size: int, epochs: range, *, emulation=None, resume: Path | None = None,
          save: Path | None = None, init_seed: int = 0):
    model = make_model(init_seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    trainer = AllocatedTrainer(model, optimizer, make_dataset(size), config, emulation=emulation)
    if resume is not None:
        assert trainer.load_checkpoint(resume) == epochs.start
    with trainer:
        reports = [trainer.train_epoch(epoch) for epoch in epochs]
        if save is not None:
            trainer.save_checkpoint(save, next_epoch=epochs.stop)
    return trainer, reports


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    rank, _ = hetdp.init_distributed()
    results = {}

    # Gradient equivalence: unequal shares, accumulation, a partial last step, and batch mode with a memory cap.
    static = AllocationConfig(policy="static", weights=(1.0, 2.0, 3.0), global_batch=12, micro_batch=2)
    for name, config, size in [
        ("one_step", static, 12),
        ("partial_epoch", static, 29),
        ("batch_mode", AllocationConfig(policy="static", weights=(1.0, 2.0, 3.0), global_batch=12, mode="batch",
                                        max_batch=(8, 2, 8)), 29),
    ]:
        trainer, reports = train(config, size, range(1))
        results[name] = {"shares": reports[0].shares, "samples": reports[0].samples}
        if rank == 0:
            torch.save(trainer.model.module.state_dict(), out / f"{name}.pt")

    # Checkpoint resume: 2 epochs straight vs 1 epoch, checkpoint, fresh process state, 1 more epoch.
    resumable = AllocationConfig(policy="static", weights=(3.0, 1.0, 2.0), global_batch=12, micro_batch=4, seed=5)
    straight, _ = train(resumable, 40, range(2))
    train(resumable, 40, range(1), save=out / "ckpt.pt")
    resumed, _ = train(resumable, 40, range(1, 2), resume=out / "ckpt.pt", init_seed=123)
    if rank == 0:
        torch.save(straight.model.module.state_dict(), out / "straight.pt")
        torch.save(resumed.model.module.state_dict(), out / "resumed.pt")

    # Adaptive: emulated speeds 1, 2, 4 with a synthetic per-sample cost; re-plan every 2 steps.
    adaptive = AllocationConfig(policy="adaptive", global_batch=70, micro_batch=10, replan_every=2)
    emulation = hetdp.Emulation(speeds=(1.0, 2.0, 4.0), sample_cost_ms=3.0)
    _, reports = train(adaptive, 700, range(2), emulation=emulation)
    results["adaptive"] = {"shares": [r.shares for r in reports], "replans": [r.replans for r in reports],
                           "compute_s": [r.compute_s for r in reports], "wait_s": [r.wait_s for r in reports]}
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
