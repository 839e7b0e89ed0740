"""Launches across emulated hosts (network namespaces on rate-limited links): `hetdp run --nnodes 2` trains a drop-in
script as one process would, through a restart; a probe measures a slow link; a slow link is not a dead peer, and a
host taken off the network mid-run is named with its node. Skipped, with the reason, where hosts cannot be made
(not root, no network namespaces)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest
import torch
from torch import nn

from hetdp.hosts import EmulatedHosts, HostsUnavailable, Topology, check_available
from hetdp.hosts.topology import Names

from .conftest import WORKERS

sys.path.insert(0, str(WORKERS))
from hosts_dropin_worker import SIZE, make_data, make_model, make_optimizer

ENDPOINT = "10.44.0.1:29500"
"""Host 0's address and the rendezvous port: each set of hosts has a network of its own."""


@pytest.fixture(scope="module", autouse=True)
def hosts_can_be_made():
    try:
        check_available()
    except HostsUnavailable as error:
        pytest.skip(str(error))


def hetdp_run(node: int, nproc: int, *args: object, join_timeout_s: float = 120) -> list[str]:
    """`hetdp run` for host ``node`` of two."""
    return [sys.executable, "-m", "hetdp.cli", "run", "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint",
            ENDPOINT, "--join-timeout-s", str(join_timeout_s), "-n", str(nproc), *map(str, args)]


def one_process(epochs: int, global_batch: int) -> dict[str, torch.Tensor]:
    """The hosts' training in one process: the mean loss over each global batch, in the sampler's order."""
    model, (x, y) = make_model(), make_data().tensors
    optimizer = make_optimizer(model)
    for _ in range(epochs):
        for first in range(0, SIZE, global_batch):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[first:first + global_batch]), y[first:first + global_batch]).backward()
            optimizer.step()
    return model.state_dict()


@pytest.mark.timeout(400)
def test_a_dropin_script_across_two_hosts_restarts_and_trains_as_one_process(tmp_path):
    # A rank on each host behind 100 Mbit links, emulated speeds given for the global ranks; rank 1 (host 1) is
    # killed at step 15 of 24 and both hosts start again on the next port, resuming from the step-14 checkpoint.
    worker = [WORKERS / "hosts_dropin_worker.py", "--out", tmp_path, "--ckpt", tmp_path / "ckpt", "--die-at", 15,
              "--die-rank", 1]
    emulation = ["--speeds", "1,4", "--sample-cost-ms", "2", "--max-restarts", "1"]
    with EmulatedHosts(Topology.flat(2, rate_mbit=100)) as hosts:
        done = hosts.run([hetdp_run(node, 1, *emulation, *worker) for node in range(2)], timeout_s=360)
    assert [result.returncode for result in done] == [0, 0], "\n".join(result.stdout for result in done)
    assert all("restart 1, on a new rendezvous at 10.44.0.1:29501" in result.stdout for result in done)
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    assert [rank["node"] for rank in ranks] == ["node 0 (10.44.0.1)", "node 1 (10.44.0.2)"]
    assert all(rank["attempt"] == "1" and rank["world_size"] == 2 for rank in ranks)
    assert all(rank["speeds"] == [1.0, 4.0] for rank in ranks)
    final = torch.load(tmp_path / "final.pt")
    for name, expected in one_process(epochs=2, global_batch=8).items():
        torch.testing.assert_close(final[name], expected, rtol=0, atol=1e-5)


@pytest.mark.serial  # the probed rate is a measured time
@pytest.mark.timeout(400)
def test_a_slow_link_is_probed_and_waited_for_and_a_host_taken_off_it_is_named(tmp_path):
    step_timeout_s = 8
    worker = [WORKERS / "hosts_link_worker.py", "--out", tmp_path, "--step-timeout", step_timeout_s]
    with EmulatedHosts(Topology.flat(2, rate_mbit=10)) as hosts:
        host_0, host_1 = (hosts.start(node, hetdp_run(node, 1, *worker)) for node in range(2))
        deadline_s = time.monotonic() + 300
        while not (tmp_path / "steps.json").exists():
            assert host_0.poll() is None and host_1.poll() is None, hosts.output(0) + hosts.output(1)
            assert time.monotonic() < deadline_s, hosts.output(0) + hosts.output(1)
            time.sleep(0.2)
        hosts.cut(1)
        host_0.wait(timeout=120)
        output = hosts.output(0)

    probed = json.loads((tmp_path / "probe.json").read_text())
    assert abs(probed["bandwidth_mbps"] - 10) <= 1.5, probed  # within 15% of the token bucket's 10 Mbit/s
    # Each of the first two steps moved 2.2 MB of gradient each way over 10 Mbit/s, about 2 s of exchange, within an
    # 8 s step deadline: neither the deadline nor the heartbeats took the slow link for a dead peer.
    steps_s = json.loads((tmp_path / "steps.json").read_text())["steps_s"]
    assert len(steps_s) == 2 and min(steps_s) > 1.0, steps_s
    # Host 1 went silent mid-step (its link removed, then its processes killed): host 0's rank names it, and its node.
    assert host_0.returncode == 2, output
    error = [line for line in output.splitlines() if line.startswith("hetdp run: error:")]
    assert len(error) == 1, output
    assert "rank 1 stopped answering" in error[0] and "; rank 1 ran on node 1 (10.44.0.2) (rank 0)" in error[0], error


@pytest.mark.timeout(200)
def test_a_node_whose_peers_never_come_gives_up_in_one_line(tmp_path):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('never run: node 0 never came')\n")
    with EmulatedHosts(Topology.flat(2)) as hosts:
        alone = hosts.start(1, hetdp_run(1, 1, script, join_timeout_s=2))
        alone.wait(timeout=150)
        output = hosts.output(1)
    assert alone.returncode == 2, output
    error = [line for line in output.splitlines() if line.startswith("hetdp run: error:")]
    assert len(error) == 1 and "Traceback" not in output, output
    assert error[0].startswith(f"hetdp run: error: node 1: could not meet node 0 at {ENDPOINT} within 2 s ("), error
    assert error[0].endswith("is node 0 started, is 10.44.0.1 its address as this node reaches it, and is the port "
                             "open?"), error


@pytest.mark.timeout(60)
def test_hosts_are_removed_after_a_failed_command_and_a_dead_runs_leftovers_before_a_new_set():
    dead = max(psutil.pids()) + 10_000  # no process has this id
    leftover = Names(dead)
    subprocess.run(["ip", "netns", "add", leftover.namespace(0)], check=True)
    subprocess.run(["ip", "link", "add", leftover.site_bridge(0), "type", "bridge"], check=True)
    with pytest.raises(RuntimeError, match="the caller's own error"), EmulatedHosts(Topology.flat(2)) as hosts:
        assert leftover.namespace(0) not in _listed(["ip", "netns", "list"])
        assert leftover.site_bridge(0) not in _listed(["ip", "-o", "link", "show"])
        done = hosts.run([["sh", "-c", "exit 3"], ["ip", "-o", "-4", "addr", "show", "eth0"]], timeout_s=30)
        assert [result.returncode for result in done] == [3, 0] and "10.44.0.2/24" in done[1].stdout
        raise RuntimeError("the caller's own error")
    assert not any(name.startswith(f"hdp{hosts.names.owner}") for name in
                   _listed(["ip", "netns", "list"]) + _listed(["ip", "-o", "link", "show"]))


def _listed(command: list[str]) -> list[str]:
    """The names in an `ip netns list` or `ip -o link show` listing."""
    lines = subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()
    if command[1] == "netns":
        return [line.split()[0] for line in lines if line.split()]
    return [line.split(":")[1].strip().split("@")[0] for line in lines if line.count(":") >= 2]
