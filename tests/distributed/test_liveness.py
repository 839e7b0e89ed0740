"""A peer that is stopped (SIGSTOP) or wedged in its own code makes every survivor raise PeerTimeoutError naming it
(heartbeats on the process group's store), whichever of the drop-in's collectives they wait in, and the launch ends in that
one line instead of waiting on the stopped process.
(A killed peer is named the same way, but on one machine torchrun tears the survivors down first; test_faults
restarts it.)"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys

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
    "all-gather": "FSDP2's all-gather",
    "epoch-end": "gathering step figures",
}


# Rank 0 broadcasts the buffers: a stopped receiver holds nobody up, a stopped rank 0 holds up everyone. A rank stopped
# before the gradient allreduce is the case the tcp:// and file:// launches below check, survivor by survivor. A rank
# asleep before its forward, while the others wait in a collective that the forward starts with (torch DDP's buffer
# broadcast, FSDP2's all-gather), beats on: it is named because it never started the step they started. One asleep
# after its epoch's last step, while the others wait in the epoch's gather of figures, is named because it never
# entered the epoch's end.
@pytest.mark.parametrize(("how", "where", "victim"), [("sleep", "gradients", 2), ("sleep", "buffers", 0),
                                                      ("stop", "checkpoint", 2), ("sleep", "all-gather", 1),
                                                      ("sleep", "epoch-end", 1)])
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


@pytest.mark.parametrize(("init", "how", "where"), [("tcp", "stop", "gradients"), ("file", "sleep", "all-gather")])
def test_a_hung_rank_is_named_by_every_survivor_which_then_exits_under_tcp_and_file_init(tmp_path, init, how, where):
    """No launcher's variables: plain processes join by tcp:// or file:// (a script of one's own), and the heartbeats
    still name the hung rank, from the process group's own store (a TCPStore, a FileStore): rank 2, stopped before
    the gradient allreduce (``hetdp.DDP``), or asleep before FSDP2's all-gather (``hetdp.fully_shard``), in every
    survivor's error, which says where it waited. No launcher ends the survivors either: each exits by itself,
    though the default group's deadline is torch's 30 minutes and the victim never comes back."""
    # The port stays bound (SO_REUSEADDR, not listening) until the workers are done: rank 0's store binds it beside
    # this socket, and no other test's process can take it in between.
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        url = (f"tcp://127.0.0.1:{holder.getsockname()[1]}" if init == "tcp" else
               f"file://{tmp_path / 'store'}")
        env = {name: value for name, value in os.environ.items()
               if name not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
        logs = [tmp_path / f"rank-{rank}.log" for rank in range(3)]
        with contextlib.ExitStack() as files:
            workers = [subprocess.Popen([sys.executable, str(WORKERS / "hang_worker.py"), "--out", str(tmp_path),
                                         "--how", how, "--where", where, "--victim", "2", "--init-method", url,
                                         "--rank", str(rank),
                                         "--world-size", "3"], env=env, stdout=files.enter_context(log.open("w")),
                                        stderr=subprocess.STDOUT)
                       for rank, log in enumerate(logs)]
            try:
                for worker in workers[:2]:
                    worker.wait(timeout=90)
            finally:
                for worker in workers:
                    worker.kill()
                    worker.wait()
    output = "".join(f"--- rank {rank}\n{log.read_text()}" for rank, log in enumerate(logs))
    assert sorted(path.name for path in tmp_path.glob("rank-*.json")) == ["rank-0.json", "rank-1.json"], output
    for survivor in (0, 1):
        outcome = json.loads((tmp_path / f"rank-{survivor}.json").read_text())
        assert outcome["rank"] == 2
        assert outcome["message"].startswith(EXPECTED[how].format(victim=2)), outcome["message"]
        assert f"{WAITING_IN[where]} on rank {survivor} failed within 3 s" in outcome["message"]
