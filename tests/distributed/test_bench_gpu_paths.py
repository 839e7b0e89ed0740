"""`hetdp bench gpu`'s path checks, run where CI can: every rank on the CPU (on a GPU machine, rank 0 is on it)."""

from __future__ import annotations

import json

import pytest

from hetdp.bench import gpu_paths
from hetdp.launch import run_local

PARTIAL = ("solo", "majority", "quorum:2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("paths") / "paths.json"
    completed = run_local("hetdp.bench.gpu_paths", 2, ["--out", str(out)], module=True, capture=True, timeout_s=240)
    assert completed.returncode == 0, completed.stdout
    return json.loads(out.read_text())["runs"]


def test_every_synchronization_trains_each_sample_once_into_one_replica_and_resumes_it(runs):
    assert set(runs) == set(gpu_paths.runs_for(2))
    for name, run in runs.items():
        assert run["finite"] and run["replica_gap"] <= gpu_paths.REPLICA_TOLERANCE, (name, run)
        assert run["each_sample_once"] and run["resume_gap"] <= gpu_paths.REPLICA_TOLERANCE, (name, run)
        assert run["stand_ins"] > 0, name  # the epoch's last step had fewer samples than ranks


def test_allreduce_and_local_sgd_are_exactly_one_process(runs):
    for name, run in runs.items():
        if run["reference"] == "replicas" or not name.startswith(PARTIAL):
            assert run["ok"] and run["reference_gap"] < 1e-5, (name, run)  # here on one device: float rounding
    assert runs["allreduce, sit out and rejoin"]["fewest_members"] == 1


def test_partial_allreduce_applies_every_contribution_once(runs):
    # Whichever round a gradient lands in, stale or fresh, before or after torch DDP rebuilds its buckets.
    for name in PARTIAL:
        assert runs[name]["reference_gap"] < 1e-5, (name, runs[name])
