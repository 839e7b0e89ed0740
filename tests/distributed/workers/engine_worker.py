"""Worker for test_engines.py: a process an engine started, with no torchrun around it. It joins the group with
``hetdp.init_distributed()`` from whatever engine's variables the test set, sums a tensor over the group, and writes
to ``--out/rank-R.json`` where it stands, the interface gloo was given, and what ``hetdp.DDP`` said of the emulation
settings in its environment."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import hetdp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank, world_size = hetdp.init_distributed("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    try:
        hetdp.DDP(nn.Linear(2, 1)).close()
        refused = None
    except hetdp.ConfigError as error:
        refused = str(error)
    outcome = {"rank": rank, "world_size": world_size, "sum": total.item(), "local_rank": os.environ["LOCAL_RANK"],
               "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME"), "refused": refused}
    (args.out / f"rank-{rank}.json").write_text(json.dumps(outcome))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
