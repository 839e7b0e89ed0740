"""The drop-in's side of emulated pacing: the deadline runs on only across steps that exchange nothing."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def alone(tmp_path_factory, torchrun):
    out = tmp_path_factory.mktemp("pacing")
    torchrun("pacing_worker.py", 2, "--out", out, timeout_s=180)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_local_steps_run_on_until_the_meeting_at_the_epochs_end(alone):
    for flags in alone:
        assert flags["local"] == [True, True, True, True, False]


def test_local_every_k_steps_restarts_after_each_meeting(alone):
    for flags in alone:
        assert flags["local:2"] == [True, False, True, False, False]


@pytest.mark.parametrize("sync", ["allreduce", "majority"])
def test_steps_that_exchange_gradients_restart_every_step(alone, sync):
    for flags in alone:
        assert flags[sync] == [False] * 5
