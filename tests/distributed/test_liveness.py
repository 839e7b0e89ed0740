"""A peer that is stopped (SIGSTOP) or wedged in its own code makes every survivor raise PeerTimeoutError naming it
(heartbeats on the launcher's store), whichever of the drop-in's collectives they wait in, and the launch ends in that
one line instead of waiting on the stopped process.
(A killed peer is named the same way, but on one machine torchrun tears the survivors down first; test_faults
restarts it.)"""

from __future__ import annotations

import json

import pytest

from hetdp.errors import HetDPError
from hetdp.launch import run_local

from .conftest import WORKERS

EXPECTED = {
    "stop": "rank {victim} stopped answering",
    "sleep": "rank {victim} is alive but never joined",
}
WAITING_IN = {
    "gradients": "the gradient allreduce",
    "buffers": "the forward's buffer broadcast",
    "checkpoint": "gathering the random states to checkpoint",
}


# Rank 0 broadcasts the buffers: a stopped receiver holds nobody up, a stopped rank 0 holds up everyone.
@pytest.mark.parametrize(("how", "where", "victim"), [("stop", "gradients", 2), ("sleep", "gradients", 2),
                                                      ("stop", "buffers", 0), ("stop", "checkpoint", 2)])
def test_every_survivor_names_the_silent_rank(tmp_path, how, where, victim):
    expected = EXPECTED[how].format(victim=victim)
    with pytest.raises(HetDPError) as caught:
        run_local(WORKERS / "hang_worker.py", 3,
                  ["--out", str(tmp_path), "--how", how, "--where", where, "--victim", str(victim)],
                  capture=True, timeout_s=90, report_errors=True)
    assert str(caught.value).startswith(expected)
    outcomes = {int(path.stem.split("-")[1]): json.loads(path.read_text()) for path in tmp_path.glob("rank-*.json")}
    assert sorted(outcomes) == sorted({0, 1, 2} - {victim})
    for survivor, outcome in outcomes.items():
        assert outcome["rank"] == victim
        assert outcome["message"].startswith(expected), outcome["message"]
        assert f"{WAITING_IN[where]} on rank {survivor} failed within 3 s" in outcome["message"]
