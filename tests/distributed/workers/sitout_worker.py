"""Worker for tests/distributed/test_sitout.py: ranks that do not pay sit out of the exchange, and rejoin.

Two fast ranks beside two slow ones train a model whose exchange costs more than
the slow ranks' samples save; from ``--change-at`` on the fast ranks slow down to
the others' speed, so the slow ones pay again. Every rank records, per step, the
members and a checksum of the parameters it starts the step with, and its final
parameters.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import hetdp
from hetdp.cluster.emulate import Emulation

from dropin_worker import Pairs  # noqa: E402  (the test puts this folder on the path)

SIZE, GLOBAL_BATCH, EPOCHS = 320, 32, 5


def make_wide_model(seed: int = 0) -> nn.Module:
    """A model whose exchange (66k parameters) outweighs a slow rank's few samples."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 2))


def checksum(module: nn.Module) -> float:
    return float(torch.cat([p.detach().flatten() for p in module.parameters()]).double().sum())


FORCED = {1: (2, [11, 11, 0, 10]), 4: (5, [0, 16, 16, 0]), 7: (8, [8, 8, 8, 8])}
"""--forced: at loop step k, the shares and members (those with a share) from step s on, as a re-plan would set
them: three members (one folded into the doubling), then two that were not both members, then all again."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--change-at", type=int, required=True)
    parser.add_argument("--forced", action="store_true", help="memberships set by FORCED, not decided")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    emulation = Emulation(speeds=(20.0, 20.0, 1.0, 1.0), sample_cost_ms=2.0,
                          speed_changes=((args.change_at, (1.0, 1.0, 1.0, 1.0)),))
    model = hetdp.DDP(make_wide_model(), "equal" if args.forced else "adaptive", emulation=emulation)
    data = Pairs(SIZE)
    loader = model.allocate(DataLoader(data, batch_size=GLOBAL_BATCH // 4, sampler=DistributedSampler(data, seed=3)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    members, sums = [], []
    for epoch in range(EPOCHS):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            if args.forced and model.steps_done in FORCED:
                first, shares = FORCED[model.steps_done]
                model._schedule.append((first, shares))
                model._sitting.schedule(first, [r for r, share in enumerate(shares) if share])
            members.append(list(model._sitting.members_at(model.steps_done)))
            sums.append(checksum(model.module))
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(batch["x"]), batch["y"]).backward()
            optimizer.step()
    reports = [{"sat_out": report.sat_out, "diagnosis": report.diagnosis(), "shares": report.shares}
               for report in model.epoch_reports]
    name = "forced" if args.forced else "sitout"
    (args.out / f"{name}_{rank}.json").write_text(json.dumps({"members": members, "sums": sums, "reports": reports}))
    torch.save(model.module.state_dict(), args.out / f"{name}_{rank}.pt")
    model.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
