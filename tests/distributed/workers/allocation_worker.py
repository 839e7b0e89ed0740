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

WIDE = 800_000
"""Width of the ``many_buckets`` model: 8.8 M parameters, above DDP's 25 MB bucket cap."""


def make_dataset(size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(size, 6, generator=generator)
    return TensorDataset(inputs, (inputs.sum(1) > 0).long())


def make_model(seed: int, wide: int = 0) -> nn.Module:
    """A tiny MLP; ``wide`` > 0 inserts a layer big enough that DDP splits the gradient into several buckets."""
    torch.manual_seed(seed)
    if wide:
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, wide), nn.Tanh(), nn.Linear(wide, 2))
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def train(config: AllocationConfig, size: int, epochs: range, *, emulation=None, resume: Path | None = None,
          save: Path | None = None, init_seed: int = 0, wide: int = 0):
    model = make_model(init_seed, wide)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02 if wide else 0.5, momentum=0.9)
    trainer = AllocatedTrainer(model, optimizer, make_dataset(size), config, emulation=emulation)
    if resume is not None:
        # Only rank 0 has the file (no shared filesystem): it reads and broadcasts.
        path = resume if torch.distributed.get_rank() == 0 else resume.with_name("only-on-rank-0.pt")
        assert trainer.load_checkpoint(path) == epochs.start
    with trainer:
        reports = [trainer.train_epoch(epoch) for epoch in epochs]
        if save is not None:
            trainer.save_checkpoint(save)  # resumes at the epoch after the last one trained
    return trainer, reports


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    rank, _ = hetdp.init_distributed()
    results = {}

    # Gradient equivalence: unequal shares, accumulation, a partial last step, batch mode with a memory cap, and a
    # model whose gradient spans several DDP buckets (earlier ones by gloo's allreduce, the last by doubling).
    static = AllocationConfig(policy="static", weights=(1.0, 2.0, 3.0), global_batch=12, micro_batch=2)
    for name, config, size, wide in [
        ("one_step", static, 12, 0),
        ("partial_epoch", static, 29, 0),
        ("batch_mode", AllocationConfig(policy="static", weights=(1.0, 2.0, 3.0), global_batch=12, mode="batch",
                                        max_batch=(8, 2, 8)), 29, 0),
        ("many_buckets", static, 29, WIDE),
    ]:
        trainer, reports = train(config, size, range(1), wide=wide)
        gradient_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        results[name] = {"shares": reports[0].shares, "samples": reports[0].samples,
                         "buckets_at_least": -(-gradient_bytes // trainer.model.bucket_bytes_cap)}
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
    # A checkpoint of another config is refused on every rank; a missing one, asked for as optional, is a fresh start.
    other = AllocationConfig(policy="static", weights=(3.0, 1.0, 2.0), global_batch=12, micro_batch=4, seed=6)
    with AllocatedTrainer(make_model(0), torch.optim.SGD(make_model(0).parameters(), lr=0.1), make_dataset(40),
                          other) as trainer:
        try:
            trainer.load_checkpoint(out / "ckpt.pt")
            results["mismatch"] = None
        except hetdp.CheckpointError as error:
            results["mismatch"] = str(error)
        results["missing_ok"] = trainer.load_checkpoint(out / "absent.pt", missing_ok=True)

    # Adaptive: emulated speeds 1, 2, 4 with a synthetic per-sample cost; re-plan every 2 steps.
    adaptive = AllocationConfig(policy="adaptive", global_batch=70, micro_batch=10, replan_every=2)
    emulation = hetdp.Emulation(speeds=(1.0, 2.0, 4.0), sample_cost_ms=3.0)
    _, reports = train(adaptive, 700, range(2), emulation=emulation)
    results["adaptive"] = {"shares": [r.shares for r in reports], "replans": [r.replans for r in reports],
                           "compute_s": [r.compute_s for r in reports], "wait_s": [r.wait_s for r in reports]}
    (out / f"results_{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
