"""A launch across nodes: the endpoint, this node's place, the torchrun options and the workers' interface, and the
one-line errors of `hetdp run` / `hetdp probe` when a node's flags are wrong."""

from __future__ import annotations

import pytest

from hetdp.cli import main
from hetdp.errors import ConfigError
from hetdp.runtime.engines import ENV_NODE
from hetdp.launch.nodes import Nodes, parse_endpoint


@pytest.mark.parametrize(("text", "endpoint"), [
    ("10.0.0.1:29400", ("10.0.0.1", 29400)),
    ("node0.cluster", ("node0.cluster", 29500)),
    ("[fe80::1]:1234", ("fe80::1", 1234)),
])
def test_an_endpoint_gives_host_and_port(text, endpoint):
    assert parse_endpoint(text) == endpoint


@pytest.mark.parametrize("text", [":29500", "host:0", "host:x", "host:70000"])
def test_a_bad_endpoint_is_one_config_error(text):
    with pytest.raises(ConfigError, match="--rdzv-endpoint must look like HOST:PORT"):
        parse_endpoint(text)


def test_each_restart_meets_on_a_port_of_its_own_with_the_join_deadline():
    nodes = Nodes(count=2, rank=1, master_addr="10.0.0.1", master_port=29500, join_timeout_s=30.5)
    assert nodes.torchrun_args(2) == ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                                      "--master-port", "29502", "--rdzv-conf", "timeout=31"]


@pytest.mark.parametrize(("fields", "message"), [
    ({"count": 2, "rank": 2}, "--node-rank must be from 0 to 1 with --nnodes 2, got 2"),
    ({"count": 2, "rank": 0, "master_addr": "127.0.0.1"}, "is this machine's loopback"),
    ({"count": 2, "rank": 0, "master_addr": "localhost"}, "is this machine's loopback"),
    ({"count": 2, "rank": 0, "join_timeout_s": 0}, "--join-timeout-s must be > 0 seconds"),
    ({"count": 0, "rank": 0}, "--nnodes must be a positive integer"),
])
def test_a_node_that_could_not_meet_the_others_is_refused_before_it_starts(fields, message):
    with pytest.raises(ConfigError, match=message):
        Nodes(**{"master_addr": "10.0.0.1", **fields})


def test_one_node_on_loopback_labels_its_workers_and_leaves_gloo_its_own_choice():
    env = Nodes(count=1, rank=0, master_addr="127.0.0.1").worker_env({})
    assert env == {ENV_NODE: "node 0 (127.0.0.1)"}


def test_a_gloo_interface_this_node_lacks_is_one_config_error_naming_the_right_one():
    nodes = Nodes(count=1, rank=0, master_addr="127.0.0.1")
    with pytest.raises(ConfigError, match="GLOO_SOCKET_IFNAME names nosuch0, which this node does not have.*use lo"):
        nodes.worker_env({"GLOO_SOCKET_IFNAME": "nosuch0"})


@pytest.mark.parametrize(("flags", "message"), [
    (["--nnodes", "2"], "--nnodes 2 needs --node-rank (this node, 0 to 1) and --rdzv-endpoint"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "localhost:29500"], "loopback"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "10.0.0.1:x"], "--rdzv-endpoint must look like"),
    (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "10.0.0.1", "--speeds", "1,2"],
     "--speeds gives 2 values, fewer than the 3 ranks of this launch at the least"),
])
@pytest.mark.parametrize("command", ["run", "probe"])
def test_bad_node_flags_exit_2_with_one_line(capsys, tmp_path, command, flags, message):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    argv = [command, "-n", "2", *flags] + ([str(script)] if command == "run" else [])
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err and "Traceback" not in err
