"""Worker for tests/distributed/test_hosts.py: two ranks on two emulated hosts joined by a slow link.

It probes the link (real transfers), writes the probed rate to ``OUT/probe.json``, then trains a model whose
exchange takes seconds over that link, with every step's exchange waited for at most ``--step-timeout`` seconds;
after two steps rank 0 writes their wall times to ``OUT/steps.json`` and training goes on (until the test takes a
host away, or ``--steps`` steps of 8 samples a rank).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hetdp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--step-timeout", type=float, required=True)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()

    rank, _ = hetdp.init_distributed("gloo")
    torch.manual_seed(0)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    config = hetdp.ProbeConfig(batch_size=8, warmup=0, repeats=1, payload_bytes=1_000_000, pings=3)
    cluster = hetdp.probe_cluster(nn.Linear(64, 10), x, y, config)
    if rank == 0:
        link = cluster.devices[1]
        (args.out / "probe.json").write_text(json.dumps({"bandwidth_mbps": link.bandwidth_mbps,
                                                         "latency_ms": link.latency_ms}))
    wide = nn.Sequential(nn.Linear(64, 700), nn.ReLU(), nn.Linear(700, 700), nn.ReLU(), nn.Linear(700, 10))
    model = hetdp.DDP(wide, "equal", step_timeout_s=args.step_timeout)  # 2.2 MB of gradient every step
    data = TensorDataset(torch.randn(16 * args.steps, 64), torch.randint(0, 10, (16 * args.steps,)))
    loader = model.allocate(DataLoader(data, batch_size=8, sampler=DistributedSampler(data)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps_s = []
    with model:
        started = time.perf_counter()
        for inputs, targets in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
            steps_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            if rank == 0 and len(steps_s) == 2:
                (args.out / "steps.json").write_text(json.dumps({"steps_s": steps_s}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
