"""Worker for tests/distributed/test_hotpath.py: what the drop-in's steps run beside the user's compute.

Every collective call (torch.distributed's functions and a process group's own
send / recv / ...) and every device synchronize (``hetdp.runtime.synchronize``)
is counted by a spy, split into the loop body (forward, backward with the comm
hook, ``optimizer.step()``) and the allocated loader's step bookkeeping between
batches (closing the step, gathers, re-plans, opening the next). Nothing is
emulated, so nothing is paced. Each rank writes its counts as JSON.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import hetdp
from hetdp import runtime

from dropin_worker import FEATURES, Pairs

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "barrier", "send", "recv", "isend", "irecv", "reduce_scatter_tensor",
               "_broadcast_coalesced")
GROUP_METHODS = ("send", "recv", "allreduce", "allgather", "broadcast", "barrier")


class Spies:
    """Counts of collective calls and device synchronizes, by where the loop is (``phase``)."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._depth = 0
        """Spied calls in progress: only the outermost counts (``dist.all_gather`` calls its group's ``allgather``)."""

    def install(self) -> None:
        for name in COLLECTIVES:
            setattr(dist, name, self._wrap(getattr(dist, name), name))
        for name in GROUP_METHODS:
            setattr(dist.ProcessGroup, name, self._wrap(getattr(dist.ProcessGroup, name), f"ProcessGroup.{name}"))
        runtime.synchronize = self._wrap(runtime.synchronize, "synchronize")

    def _wrap(self, function, name: str):
        @functools.wraps(function)
        def spy(*args, **kwargs):
            if not self._depth:
                self.counts[self.phase][name] += 1
            self._depth += 1
            try:
                return function(*args, **kwargs)
            finally:
                self._depth -= 1

        return spy


def make_module() -> nn.Module:
    torch.manual_seed(0)
    # BatchNorm: its buffers are what torch's DDP broadcasts from rank 0 before every forward
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 2))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank, world_size = hetdp.init_distributed()
    module = make_module()
    spies = Spies()
    spies.install()
    data = Pairs(256)
    # No rank sits out (a loaded machine could make one look slow): every step has the same exchange.
    with hetdp.DDP(module, hetdp.Adaptive(sit_out=False)) as model:
        bucketed = collections.Counter()  # steps whose gradient went through torch DDP's buckets to the comm hook
        reduce = model.synchronizer.reduce

        def counted(*args):
            bucketed[model.steps_done] += 1
            return reduce(*args)

        model.synchronizer.reduce = counted
        loader = model.allocate(DataLoader(data, batch_size=16, sampler=DistributedSampler(data, seed=3)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = 0
        for epoch in range(4):
            loader.sampler.set_epoch(epoch)
            spies.phase = "bookkeeping" if epoch else "first epoch"
            for batch in loader:
                if epoch:
                    spies.phase, steps = "body", steps + 1
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(batch["x"]), batch["y"]).backward()
                optimizer.step()
                spies.phase = "bookkeeping" if epoch else "first epoch"
            gathers = len(model.step_figures)
        spies.phase = "close"
        state = {name: tensor.tolist() for name, tensor in model.module.state_dict().items()}
    result = {"rank": rank, "world_size": world_size, "steps": steps, "step_figures": gathers,
              "counts": {phase: dict(counts) for phase, counts in spies.counts.items()},
              "bucketed_steps": sorted(bucketed), "state": state}
    (args.out / f"hotpath_{world_size}_{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
