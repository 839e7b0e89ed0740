"""The drop-in's side of emulated pacing: the deadline runs on only across steps that exchange nothing, and every
epoch's end restarts it (``True``: the step let its deadline run on into the next one; ``"restart"``: restarted
between steps)."""

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
        assert flags["local"] == [True, True, True, True, False, "restart"]


def test_local_every_k_steps_restarts_after_each_meeting(alone):
    for flags in alone:
        assert flags["local:2"] == [True, False, True, False, False, "restart"]


@pytest.mark.parametrize("sync", ["allreduce", "majority"])
def test_steps_that_exchange_gradients_restart_every_step(alone, sync):
    for flags in alone:
        assert flags[sync] == [False] * 5 + ["restart"]


def test_an_epoch_end_a_loop_of_its_own_did_not_announce_still_restarts_the_deadline(alone):
    for flags in alone:
        assert flags["own loop"] == [True, True, True, "restart", True, True, True, "restart"]
