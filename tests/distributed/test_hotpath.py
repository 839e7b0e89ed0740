"""The drop-in's hot path: with nothing paced, a step runs no device synchronize and no collective beyond its exchange.

Real runs of one and two ranks over gloo, with spies on every collective call and on
``hetdp.runtime.synchronize`` (the one seam through which hetdp waits for a device).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from dropin_worker import Pairs  # noqa: E402
from hotpath_worker import make_module  # noqa: E402
from torch_order import global_batches  # noqa: E402


def run(torchrun, folder: Path, ranks: int) -> list[dict]:
    torchrun("hotpath_worker.py", ranks, "--out", folder, timeout_s=180)
    return [json.loads((folder / f"hotpath_{ranks}_{rank}.json").read_text()) for rank in range(ranks)]


@pytest.fixture(scope="module")
def alone(tmp_path_factory, torchrun) -> list[dict]:
    return run(torchrun, tmp_path_factory.mktemp("hotpath1"), 1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, torchrun) -> list[dict]:
    return run(torchrun, tmp_path_factory.mktemp("hotpath2"), 2)


def test_a_rank_alone_runs_no_collective_and_no_device_synchronize_in_its_steps(alone):
    (record,) = alone
    assert record["steps"] > 0 and record["step_figures"] > 0  # it trained, and its figures were gathered
    for phase in ("body", "bookkeeping"):
        assert record["counts"].get(phase, {}) == {}, phase


def test_a_rank_alone_keeps_its_gradients_out_of_torch_ddps_buckets_and_trains_as_a_plain_loop(alone):
    # Nothing to exchange: after the first step (torch DDP records its buckets' order there) autograd leaves each
    # gradient in .grad, as under no_sync, instead of the reducer copying it into a bucket and back.
    (record,) = alone
    assert set(record["bucketed_steps"]) <= {0}, record["bucketed_steps"]
    model, data = make_module(), Pairs(256)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(4):
        for index in global_batches(256, 16, seed=3, epoch=epoch):  # torch's DistributedSampler(seed=3)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(data.x[index]), data.y[index]).backward()
            optimizer.step()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(torch.tensor(record["state"][name], dtype=tensor.dtype), tensor, msg=name)


def test_two_ranks_exchange_each_step_once_and_never_synchronize_the_device(pair):
    for record in pair:
        steps, body = record["steps"], record["counts"]["body"]
        assert steps > 0
        # The step's one gradient bucket is small: one recursive-doubling exchange (a send and a receive); the
        # rest is torch DDP's own broadcast of rank 0's BatchNorm buffers before each forward.
        assert body == {"ProcessGroup.send": steps, "ProcessGroup.recv": steps, "_broadcast_coalesced": steps}
        bookkeeping = record["counts"]["bookkeeping"]
        assert "synchronize" not in bookkeeping
        # Between steps only the figures travel, at gathers (every few steps and at each epoch's end), never a
        # per-step collective.
        assert set(bookkeeping) <= {"all_gather"}
        assert 0 < bookkeeping.get("all_gather", 0) < steps
