"""hetdp under Ray Train: Ray starts the workers and their process group, hetdp allocates each one's share.

Inside ``train_loop_per_worker``, ``hetdp.DDP`` takes the place of ``ray.train.torch.prepare_model`` and
``model.allocate(loader)`` that of ``prepare_data_loader`` (which would replace the allocated loader's sampler). Step
checkpoints go to a folder Ray's restarts find again: a worker group that Ray restarts after a failure
(``FailureConfig(max_failures=...)``) resumes from the last one.

Run on a local Ray instance with 4 CPU workers (``pip install '.[ray]'``):
    python examples/ray_train.py --workers 4 --allocation static:1,1,2,4 --checkpoint /tmp/ray-ckpt
``--fail-at STEP`` makes worker 2 die at that global step once, to watch Ray restart the group and the loop resume.
Emulated unequal workers take hetdp's settings through the job's environment, as ``hetdp run`` would set them:
``ray.init(runtime_env={"env_vars": hetdp.Emulation(speeds=(1, 1, 2, 4), sample_cost_ms=2).to_env()})``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import ray
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hetdp

SAMPLES, FEATURES, CLASSES = 300, 8, 3
BATCH = 8
"""Each worker's batch under plain DDP: a step trains ``BATCH * workers`` samples, shared out by the allocation."""


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def allocation(text: str) -> str | hetdp.Static:
    if text.startswith("static:"):
        return hetdp.Static([float(weight) for weight in text.removeprefix("static:").split(",")])
    return text


def train_loop_per_worker(config: dict) -> None:
    rank, world_size = hetdp.init_distributed()  # Ray set the group up: this returns its rank and world size
    model = hetdp.DDP(network(), allocation(config["allocation"]))
    data = dataset()
    loader = model.allocate(DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=False)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint = model.checkpointer(config["checkpoint"], optimizer, every=3)
    resumed = checkpoint.resume()
    fail_marker = Path(config["checkpoint"]) / "failed-once"
    with model:
        for epoch in range(checkpoint.epoch, config["epochs"]):
            loader.sampler.set_epoch(epoch)
            for x, y in loader:
                if (rank == 2 and model.steps_done == config["fail_at"] and not fail_marker.exists()):
                    fail_marker.touch()
                    os._exit(1)  # a worker lost mid-epoch: Ray restarts the group, which resumes from the checkpoint
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
        if rank == 0 and config.get("out"):
            parameters = [parameter.detach().tolist() for parameter in model.module.parameters()]
            Path(config["out"]).write_text(json.dumps({"parameters": parameters, "resumed": resumed,
                                                       "shares": model.shares, "world_size": world_size,
                                                       "speeds": model.emulation.speeds}))


def fit(workers: int, config: dict, max_failures: int = 0) -> None:
    """Train on ``workers`` CPU workers of the Ray instance this process joined; Ray restarts the group after up to
    ``max_failures`` failures."""
    TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="hetdp-ray-runs-"),
                             failure_config=FailureConfig(max_failures=max_failures)),
    ).fit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--allocation", default="adaptive", help="equal, adaptive or static:W0,W1,...")
    parser.add_argument("--checkpoint", default=None, help="step checkpoints' folder (default: a temporary one)")
    parser.add_argument("--fail-at", type=int, default=-1, help="worker 2 dies once at this global step")
    parser.add_argument("--out", default=None, help="rank 0 writes the final parameters there (JSON)")
    args = parser.parse_args()
    config = {"allocation": args.allocation, "epochs": args.epochs, "fail_at": args.fail_at, "out": args.out,
              "checkpoint": args.checkpoint or tempfile.mkdtemp(prefix="hetdp-ray-")}
    ray.init(num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=False)
    try:
        fit(args.workers, config, max_failures=1 if args.fail_at >= 0 else 0)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
