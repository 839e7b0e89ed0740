"""Worker for tests/distributed/test_standby.py: ranks waiting between steps keep a partial allreduce's rounds firing.

Ranks 0..N-2 wait for an all-gather that the last rank joins only after it contributed ``--calls`` gradients of
one sample each (each of ``--modes``, majority or quorum, in turn): a round waiting for a waiting rank would never
fire. With ``--wait standby`` they wait in ``PartialGradients.standby``; with ``--wait block``, in a plain blocking wait.
``--then-block``: once the modes ran, the first of them runs again with a plain blocking wait (where the launch fails).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from hetdp.collectives.partial import Partial
from hetdp.runtime import Timeouts
from hetdp.sync.partial import PartialGradients


def run(mode: str, calls: int, wait: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = Partial(mode=mode, quorum=2 if mode == "quorum" else None, seed=1, grace=0.0, bypass=False,
                     timeouts=Timeouts(round_s=10.0))
    gradients = PartialGradients(3, config)
    mine = torch.tensor([float(rank)])
    rows = [torch.empty(1) for _ in range(world)]
    received = []
    if rank == world - 1:
        for _ in range(calls):
            received += gradients.contribute(torch.ones(3), 1.0)
        work = dist.all_gather(rows, mine, async_op=True)
        work.wait()
    else:
        work = dist.all_gather(rows, mine, async_op=True)
        if wait == "standby":
            gradients.standby(work.is_completed, 30.0)
        work.wait()
    received += gradients.close()
    received += gradients.carried
    return {"samples": sum(r.samples for r in received), "gathered": [float(r) for r in rows]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--modes", default="majority", help="comma-separated, run in this order")
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--wait", choices=("standby", "block"), default="standby")
    parser.add_argument("--then-block", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    modes = args.modes.split(",")
    for mode in modes:
        result = run(mode, args.calls, args.wait)
        (args.out / f"standby_{mode}_{dist.get_rank()}.json").write_text(json.dumps(result))
    if args.then_block:
        run(modes[0], args.calls, "block")
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
