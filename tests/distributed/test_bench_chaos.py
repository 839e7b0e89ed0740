"""`hetdp bench chaos` counts what was trained: a stand-in batch is no sample trained, and a sample trained twice or
missed fails ``data_exact``."""

from __future__ import annotations

from hetdp.bench import chaos
from hetdp.launch import run_local


def test_a_worker_that_trains_a_sample_twice_fails_data_exact_in_that_epoch_only(tmp_path):
    completed = run_local("hetdp.bench.chaos", len(chaos.SPEEDS),
                          ["--folder", tmp_path, "--every", 100, "--repeat-a-sample-in-epoch", 1], module=True,
                          capture=True, timeout_s=240)
    assert completed.returncode == 0, completed.stdout
    covered = chaos.coverage(tmp_path / "steps.log")
    assert sorted(covered) == [0, 1]
    # epoch 0 trained each sample once, whoever sat out a step (its stand-ins are logged and trained nothing)
    assert sorted(covered[0]) == list(range(chaos.DATASET)) and set(covered[0].values()) == {1}
    twice = [sample for sample, times in covered[1].items() if times == 2]
    assert len(twice) == 1 and len(covered[1]) == chaos.DATASET - 1 and set(covered[1].values()) == {1, 2}
    assert not chaos.data_exact(tmp_path / "steps.log")
