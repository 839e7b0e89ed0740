"""Each engine's variables, as a real allocation sets them, give the worker's placement, or one line saying what is
missing; across nodes gloo speaks on the interface that reaches the master (hetdp.runtime.engines)."""

from __future__ import annotations

import socket

import pytest

from hetdp.runtime.engines import ENV_NODE, SLURM_PORT_BASE, first_host, gloo_interface, node_label, placement, tasks_on_node
from hetdp.errors import ConfigError

# `srun --nodes 2 --ntasks-per-node 3 python train.py`, task 4 (node 1, its second task), job 81234.
SRUN = {"SLURM_JOB_ID": "81234", "SLURM_PROCID": "4", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
        "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "3(x2)",
        "SLURM_TASKS_PER_NODE": "3(x2)", "SLURM_NNODES": "2"}
# `srun --ntasks-per-node 1 torchrun --nproc-per-node 3 ...`: torchrun's variables beside srun's (task = node).
SRUN_TORCHRUN = {**SRUN, "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "TORCHELASTIC_RUN_ID": "81234",
                 "RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "1",
                 "MASTER_ADDR": "gpu07", "MASTER_PORT": "29400"}
# A PyTorchJob worker pod (the training operator's variables), nprocPerNode 1: RANK is the pod's index.
PYTORCHJOB = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2",
              "PET_NPROC_PER_NODE": "1", "PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "job-master-0",
              "PET_MASTER_PORT": "23456"}


def test_srun_tasks_are_ranks_meeting_on_the_first_node_at_a_port_of_the_job():
    place = placement(SRUN)
    assert (place.engine, place.rank, place.world_size, place.local_rank, place.local_world_size) == (
        "slurm", 4, 6, 1, 3)
    assert place.master_addr == "gpu07"
    assert place.master_port == SLURM_PORT_BASE + 81234 % 10000
    assert placement({**SRUN, "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"}).master_port == 29500


def test_torchrun_under_srun_is_torchrun_not_the_node_task():
    place = placement(SRUN_TORCHRUN)
    assert (place.engine, place.rank, place.world_size, place.local_rank, place.local_world_size) == (
        "torchrun", 5, 6, 2, 3)
    assert (place.master_addr, place.master_port) == ("gpu07", 29400)


def test_pytorchjob_pod_is_one_rank():
    place = placement(PYTORCHJOB)
    assert (place.engine, place.rank, place.world_size, place.local_rank) == ("pytorchjob", 2, 3, 0)
    assert place.environ()["MASTER_ADDR"] == "job-master-0"


def test_pytorchjob_with_several_processes_a_pod_needs_torchrun():
    with pytest.raises(ConfigError, match="nprocPerNode=4 sets RANK to the pod's index"):
        placement({**PYTORCHJOB, "PET_NPROC_PER_NODE": "4"})
    # torchrun inside the pod: its own variables win
    inside = {**PYTORCHJOB, "PET_NPROC_PER_NODE": "4", "RANK": "9", "WORLD_SIZE": "12", "LOCAL_RANK": "1",
              "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "none"}
    assert (placement(inside).rank, placement(inside).local_rank) == (9, 1)


@pytest.mark.parametrize(("environ", "says"), [
    ({}, "no launcher's variables"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR, MASTER_PORT not"),
    ({"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT unset"),
    ({**SRUN, "SLURM_JOB_ID": ""}, "SLURM_JOB_ID"),
    ({**SRUN, "SLURM_STEP_NODELIST": "", "SLURM_JOB_NODELIST": ""}, "name no node"),
    ({**SRUN, "SLURM_PROCID": "6"}, "rank 6 in a world of 6"),
    ({**PYTORCHJOB, "RANK": "two"}, "RANK must be an integer, got 'two'"),
])
def test_incomplete_variables_are_one_line_naming_what_is_missing(environ, says):
    with pytest.raises(ConfigError, match=says):
        placement(environ)


@pytest.mark.parametrize(("nodes", "first"), [("gpu[07-09,12],cpu3", "gpu07"), ("node1,node2", "node1"),
                                              ("a-b-c", "a-b-c"), ("n[3]", "n3"), ("rack1-n[010-011]", "rack1-n010")])
def test_first_host_of_a_slurm_node_list(nodes, first):
    assert first_host(nodes) == first


def test_tasks_on_each_node():
    assert [tasks_on_node("2(x3),1", node) for node in range(5)] == [2, 2, 2, 1, None]
    assert tasks_on_node("", 0) is None


# A Ray Train worker (TorchConfig's default init_method "env"), world rank 5 of 8 on its second node: Ray joins the
# process group itself before the training function runs, and sets torchrun's variables for code that reads them.
RAY_TRAIN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "NODE_RANK": "1",
             "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "41234", "ACCELERATE_TORCH_DEVICE": "cpu"}


def test_a_ray_train_worker_reads_as_torchrun():
    place = placement(RAY_TRAIN)
    assert (place.rank, place.world_size, place.local_rank, place.local_world_size) == (5, 8, 1, 4)
    assert (place.master_addr, place.master_port) == ("10.0.0.1", 41234)


def routes(table):
    """A route function over a fixed table: host -> (this machine's address, its interface)."""
    def route(host, port):
        if host not in table:
            raise ConfigError(f"no route from this node to {host}:{port}")
        return table[host]
    return route


INTERFACES = ("lo", "eth0", "ib0")
ACROSS_NODES = placement(SRUN)  # 3 of 6 ranks on this node, meeting at gpu07


def test_across_nodes_gloo_speaks_on_the_interface_that_reaches_the_master():
    assert gloo_interface(ACROSS_NODES, {}, INTERFACES, routes({"gpu07": ("10.1.0.8", "ib0")})) == "ib0"


@pytest.mark.parametrize(("place", "environ", "table"), [
    (placement(SRUN_TORCHRUN | {"RANK": "2", "WORLD_SIZE": "3"}), {}, {"gpu07": ("10.1.0.8", "ib0")}),  # one node
    (ACROSS_NODES, {"GLOO_SOCKET_IFNAME": "eth0"}, {"gpu07": ("10.1.0.8", "ib0")}),  # the user's choice
    (placement(SRUN | {"MASTER_ADDR": "127.0.0.1"}), {}, {}),  # several agents on one machine
    (ACROSS_NODES, {}, {}),  # MASTER_ADDR does not resolve (yet): the group's own retries wait for it
])
def test_gloo_keeps_its_choice_where_there_is_nothing_to_pick(place, environ, table):
    assert gloo_interface(place, environ, INTERFACES, routes(table)) is None


def test_a_master_name_that_resolves_to_this_machines_loopback_warns_across_nodes():
    with pytest.warns(UserWarning, match="MASTER_ADDR gpu07 resolves to this machine's loopback .127.0.1.1."):
        assert gloo_interface(ACROSS_NODES, {}, INTERFACES, routes({"gpu07": ("127.0.1.1", "lo")})) is None


def test_a_gloo_interface_this_machine_lacks_is_one_config_error():
    with pytest.raises(ConfigError, match=r"GLOO_SOCKET_IFNAME names ib1, which this node does not have \(its "
                       r"interfaces: eth0, ib0, lo\)"):
        gloo_interface(ACROSS_NODES, {"GLOO_SOCKET_IFNAME": "eth0,ib1"}, INTERFACES, routes({}))


def test_a_workers_node_label_is_hetdp_runs_else_its_host(monkeypatch):
    monkeypatch.setenv(ENV_NODE, "node 1 (10.0.0.2)")
    assert node_label() == "node 1 (10.0.0.2)"
    monkeypatch.delenv(ENV_NODE)
    assert node_label() == f"host {socket.gethostname()}"
