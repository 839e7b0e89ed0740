"""Ranks that wait between steps (for a gather the drop-in began in the background) keep the partial rounds firing."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

RANKS = 4
CALLS = 8


@pytest.fixture(scope="module")
def launch(tmp_path_factory, torchrun) -> tuple[Path, subprocess.CompletedProcess]:
    """One launch that runs the majority mode's gather, then the quorum mode's, each rank writing what it received;
    then the majority mode's again with a plain blocking wait, where it fails."""
    out = tmp_path_factory.mktemp("standby")
    result = torchrun("standby_worker.py", RANKS, "--out", out, "--modes", "majority,quorum", "--calls", CALLS,
                      "--then-block", timeout_s=120, expect_rc=None)
    return out, result


@pytest.fixture(scope="module")
def standby(launch) -> Path:
    return launch[0]


@pytest.mark.parametrize("mode", ["majority", "quorum"])
def test_a_rank_in_standby_fires_the_rounds_the_last_rank_needs(standby, mode):
    # The last rank joins the gather only after 8 contributions; in majority mode about 3 in 4 of those rounds have
    # a waiting rank as initiator, and in quorum mode (k = 2) every one needs a waiting rank to arrive.
    for rank in range(RANKS):
        result = json.loads((standby / f"standby_{mode}_{rank}.json").read_text())
        assert result["gathered"] == [float(r) for r in range(RANKS)]
        assert result["samples"] == CALLS, (rank, result)  # every contribution reached every rank exactly once


def test_a_rank_blocked_between_steps_would_stall_the_round_it_initiates(launch):
    # The majority run again with a plain blocking wait: the last rank's round waits for an initiator that waits for
    # it. Every rank wrote both standby runs' results first: the launch failed in the blocking run, not before.
    out, result = launch
    assert len(list(out.glob("standby_*.json"))) == 2 * RANKS, result.stdout[-2000:]
    assert result.returncode != 0
    assert "did not fire" in result.stdout, result.stdout[-2000:]
