"""Ranks that wait between steps (for a gather the drop-in began in the background) keep the partial rounds firing."""

from __future__ import annotations

import json

import pytest

RANKS = 4
CALLS = 8


@pytest.mark.parametrize("mode", ["majority", "quorum"])
def test_a_rank_in_standby_fires_the_rounds_the_last_rank_needs(torchrun, tmp_path, mode):
    # The last rank joins the gather only after 8 contributions; in majority mode about 3 in 4 of those rounds have
    # a waiting rank as initiator, and in quorum mode (k = 2) every one needs a waiting rank to arrive.
    torchrun("standby_worker.py", RANKS, "--out", tmp_path, "--mode", mode, "--calls", CALLS, timeout_s=120)
    for rank in range(RANKS):
        result = json.loads((tmp_path / f"standby_{rank}.json").read_text())
        assert result["gathered"] == [float(r) for r in range(RANKS)]
        assert result["samples"] == CALLS, (rank, result)  # every contribution reached every rank exactly once


def test_a_rank_blocked_between_steps_would_stall_the_round_it_initiates(torchrun, tmp_path):
    # The same run with a plain blocking wait: the last rank's round waits for an initiator that waits for it.
    result = torchrun("standby_worker.py", RANKS, "--out", tmp_path, "--wait", "block", timeout_s=120, expect_rc=None)
    assert result.returncode != 0
    assert "did not fire" in result.stdout, result.stdout[-2000:]
