"""The drop-in's hot path: with nothing paced, a step runs no device synchronize and no collective beyond its exchange.

Real runs of one and two ranks over gloo, with spies on every collective call and on
``hetdp.runtime.synchronize`` (the one seam through which hetdp waits for a device).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


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
