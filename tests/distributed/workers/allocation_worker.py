"""Worker for tests/distributed/test_allocation.py: every scenario on 3 ranks through the drop-in (``hetdp.DDP``,
``model.allocate(loader, accumulates=True)``, the user's loop); rank 0 saves results."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import hetdp
from hetdp.bench.loop import tensor_loader, train_share

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


def policy(name: str, weights: tuple[float, ...] | None = None, replan_every: int = 0) -> hetdp.Static | hetdp.Adaptive:
    return hetdp.Static(weights) if name == "static" else hetdp.Adaptive(replan_every=replan_every)


def train(allocation, size: int, epochs: range, *, global_batch: int = 12, largest: int | None = None,
          max_batch=None, seed: int = 0, emulation=None, checkpoint: Path | None = None, init_seed: int = 0,
          wide: int = 0, accumulates: bool = True):
    """The user's loop over the drop-in: shares of ``global_batch``, run as micro-batches of at most ``largest``
    (``max_batch``'s, where given); with ``accumulates=False`` the caps bound the shares."""
    module = make_model(init_seed, wide)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.02 if wide else 0.5, momentum=0.9)
    model = hetdp.DDP(module, allocation, "allreduce", emulation=emulation)
    loader = model.allocate(tensor_loader(make_dataset(size), global_batch), global_batch=global_batch, shuffle=True,
                            seed=seed, max_batch=max_batch, accumulates=accumulates)
    saver = model.checkpointer(checkpoint, optimizer) if checkpoint is not None else None
    if saver is not None and epochs.start:
        # Only rank 0 has the folder (no shared filesystem): it reads and broadcasts.
        assert saver.resume() and saver.epoch == epochs.start
    reports = []
    with model:
        for epoch in epochs:
            loader.sampler.set_epoch(epoch)
            for inputs, targets in loader:
                optimizer.zero_grad()
                train_share(model, inputs, targets, largest=largest if max_batch is None else max_batch[model.rank])
                optimizer.step()
            reports.append(model.last_epoch)
        if saver is not None:
            saver.save()  # resumes at the epoch after the last one trained
    return model, reports


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    rank, _ = hetdp.init_distributed()
    results = {}

    # Gradient equivalence: unequal shares, accumulation, a partial last step, batch mode with a memory cap, and a
    # model whose gradient spans several DDP buckets (earlier ones by gloo's allreduce, the last by doubling).
    static = policy("static", (1.0, 2.0, 3.0))
    for name, largest, max_batch, size, wide in [
        ("one_step", 2, None, 12, 0),
        ("partial_epoch", 2, None, 29, 0),
        ("batch_mode", None, (8, 2, 8), 29, 0),
        ("many_buckets", 2, None, 29, WIDE),
    ]:
        model, reports = train(static, size, range(1), largest=largest, max_batch=max_batch, wide=wide)
        gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        results[name] = {"shares": reports[0].shares, "samples": reports[0].samples,
                         "buckets_at_least": -(-gradient_bytes // model.bucket_bytes_cap)}
        if rank == 0:
            torch.save(model.module.state_dict(), out / f"{name}.pt")

    # Checkpoint resume: 2 epochs straight vs 1 epoch, checkpoint, fresh process state, 1 more epoch.
    resumable = policy("static", (3.0, 1.0, 2.0))
    straight, _ = train(resumable, 40, range(2), largest=4, seed=5)
    folder = out / "ckpt" if rank == 0 else out / f"only-on-rank-0-{rank}"
    train(resumable, 40, range(1), largest=4, seed=5, checkpoint=folder)
    capped_folder = out / "ckpt-capped" if rank == 0 else out / f"only-on-rank-0-capped-{rank}"
    if rank == 0:
        shutil.copytree(folder, capped_folder)
    resumed, _ = train(resumable, 40, range(1, 2), largest=4, seed=5, checkpoint=folder, init_seed=123)
    # The same save resumed where every rank's memory holds 4 samples a forward: its shares 6, 2, 4 do not fit.
    capped, capped_reports = train(resumable, 40, range(1, 2), seed=5, checkpoint=capped_folder, init_seed=123,
                                   max_batch=(4, 4, 4), accumulates=False)
    results["capped_resume"] = {"shares": capped_reports[0].shares, "caps": capped.allocator.caps}
    if rank == 0:
        torch.save(straight.module.state_dict(), out / "straight.pt")
        torch.save(resumed.module.state_dict(), out / "resumed.pt")
        torch.save(capped.module.state_dict(), out / "capped.pt")

    # Adaptive: emulated speeds 1, 2, 4 with a synthetic per-sample cost; re-plan every 2 steps.
    emulation = hetdp.Emulation(speeds=(1.0, 2.0, 4.0), sample_cost_ms=3.0)
    _, reports = train(policy("adaptive", replan_every=2), 700, range(2), global_batch=70, largest=10,
                       emulation=emulation)
    results["adaptive"] = {"shares": [r.shares for r in reports], "replans": [r.replans for r in reports],
                           "compute_s": [r.compute_s for r in reports], "wait_s": [r.wait_s for r in reports]}
    (out / f"results_{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
