"""A peer that is stopped (SIGSTOP) or wedged in its own code makes every survivor raise PeerTimeoutError naming it
(heartbeats on the launcher's store), and the launch ends in that one line instead of waiting on the stopped process.
(A killed peer is named the same way, but on one machine torchrun tears the survivors down first; test_faults
restarts it.)"""

from __future__ import annotations

import json

import pytest

from hetdp.errors import HetDPError
from hetdp.launch import run_local

from .conftest import WORKERS

EXPECTED = {
    "stop": "rank 2 stopped answering",
    "sleep": "rank 2 is alive but never joined",
}


@pytest.mark.parametrize("how", EXPECTED)
def test_every_survivor_names_the_silent_rank(tmp_path, how):
    with pytest.raises(HetDPError) as caught:
        run_local(WORKERS / "hang_worker.py", 3, ["--out", str(tmp_path), "--how", how], capture=True,
                  timeout_s=90, report_errors=True)
    assert str(caught.value).startswith(EXPECTED[how])
    outcomes = {int(path.stem.split("-")[1]): json.loads(path.read_text()) for path in tmp_path.glob("rank-*.json")}
    assert sorted(outcomes) == [0, 1]
    for survivor, outcome in outcomes.items():
        assert outcome["rank"] == 2
        assert outcome["message"].startswith(EXPECTED[how]), outcome["message"]
        assert f"the gradient allreduce on rank {survivor} failed within 3 s" in outcome["message"]
