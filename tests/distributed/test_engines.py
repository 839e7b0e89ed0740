"""hetdp.init_distributed in processes an engine started, with no torchrun: two `srun` tasks and two PyTorchJob pods
(one rank each) join from their engine's variables alone, as a real allocation sets them; across nodes gloo is given
the interface that reaches the master, and emulation settings for another number of ranks are one ConfigError."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys

import psutil

from hetdp.runtime.engines import SLURM_PORT_BASE

from .conftest import WORKERS

LAUNCHERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
             "TORCHELASTIC_RUN_ID", "GLOO_SOCKET_IFNAME")


def free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def slurm_job_id() -> int:
    """A job id whose store port (``SLURM_PORT_BASE + id % 10000``) is free here."""
    port = next(port for port in random.sample(range(SLURM_PORT_BASE, SLURM_PORT_BASE + 10000), 200) if free(port))
    return 4_810_000 + port - SLURM_PORT_BASE


def an_address() -> tuple[str, str | None]:
    """An address of this machine other nodes could reach (else loopback), and the interface that holds it."""
    for name, entries in psutil.net_if_addrs().items():
        for entry in entries:
            if entry.family == socket.AF_INET and not entry.address.startswith("127."):
                return entry.address, name
    return "127.0.0.1", None


def test_srun_tasks_and_pytorchjob_pods_join_from_their_engines_variables(tmp_path):
    base = {name: value for name, value in os.environ.items()
            if name not in LAUNCHERS and not name.startswith(("SLURM_", "PET_", "HETDP_"))}
    base |= {"OMP_NUM_THREADS": "1", "HETDP_SPEEDS": "1,2,3"}
    address, interface = an_address()
    job = str(slurm_job_id())
    # `srun --nodes 2 --ntasks-per-node 1 python worker.py`: one task per node, the first node's address its name
    srun = [{"SLURM_JOB_ID": job, "SLURM_PROCID": str(task), "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
             "SLURM_NODEID": str(task), "SLURM_NNODES": "2", "SLURM_STEP_NODELIST": f"{address},{address}",
             "SLURM_JOB_NODELIST": f"{address},{address}", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
             "SLURM_TASKS_PER_NODE": "1(x2)"} for task in range(2)]
    # a PyTorchJob of 2 pods, nprocPerNode 1: the training operator's variables
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pods = [{"MASTER_ADDR": "localhost", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(pod),
             "PET_NPROC_PER_NODE": "1", "PET_NNODES": "2", "PET_NODE_RANK": str(pod)} for pod in range(2)]
    outs = {"srun": tmp_path / "srun", "pytorchjob": tmp_path / "pytorchjob"}
    workers = []
    for engine, environs in (("srun", srun), ("pytorchjob", pods)):
        outs[engine].mkdir()
        workers += [subprocess.Popen([sys.executable, str(WORKERS / "engine_worker.py"), "--out", str(outs[engine])],
                                     env=base | environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                    for environ in environs]
    try:
        for worker in workers:
            worker.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pass
    for worker in workers:
        worker.kill()
    outputs = [worker.communicate()[0] for worker in workers]
    assert all(worker.returncode == 0 for worker in workers), "\n".join(outputs)
    for engine, out in outs.items():
        outcomes = {rank: json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(2)}
        for rank, outcome in outcomes.items():
            assert (outcome["rank"], outcome["world_size"], outcome["sum"], outcome["local_rank"]) == (rank, 2, 2.0, "0")
            assert outcome["refused"] == ("the emulation gives 3 speeds (HETDP_SPEEDS) for a group of 2 ranks: give "
                                          "one per rank")
            # across nodes gloo speaks where the master is reached from; a master on loopback leaves gloo its choice
            expected = interface if engine == "srun" else None
            assert outcome["gloo_interface"] == expected, (engine, outcome)
