"""`hetdp bench gpu`'s path checks, run where CI can: every rank on the CPU (on a GPU machine, rank 0 is on it)."""

from __future__ import annotations

import json

from hetdp.bench import gpu_paths
from hetdp.launch import run_local


def test_every_synchronization_passes_its_checks_with_stand_ins_a_checkpoint_and_a_resume(tmp_path):
    out = tmp_path / "paths.json"
    completed = run_local("hetdp.bench.gpu_paths", 2, ["--out", str(out)], module=True, capture=True, timeout_s=240)
    assert completed.returncode == 0, completed.stdout
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == set(gpu_paths.runs_for(2))
    for name, run in runs.items():
        assert run["ok"], (name, run)
        assert run["stand_ins"] > 0, name  # the epoch's last step had fewer samples than ranks
    assert runs["allreduce"]["reference_gap"] < 1e-5  # exactly one process on the global batches, here on one device
