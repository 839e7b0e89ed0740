"""`hetdp bench chaos`'s accounting of what was trained, on step logs written as its workers write them."""

from __future__ import annotations

import io

from hetdp.bench import chaos
from hetdp.bench.chaos import coverage, data_exact, log_step


def write_epochs(path, *, stand_in_copies: bool = True, twice: bool = False, missed: bool = False,
                 redone_by: str | None = None) -> None:
    """Both epochs of a run on 4 ranks: step k trains samples 16k..16k+15, rank 1 sits out (a stand-in of the step's
    first sample) where ``stand_in_copies``; ``twice`` / ``missed``: a sample of epoch 1 trained twice / never;
    ``redone_by``: a later launch ran epoch 1's steps again (as after a restart)."""
    log = io.StringIO()
    per_epoch = chaos.DATASET // chaos.GLOBAL_BATCH
    for launch in ("a", *([redone_by] if redone_by else [])):
        for epoch in range(chaos.EPOCHS):
            if launch != "a" and epoch == 0:
                continue
            for index in range(per_epoch):
                step = epoch * per_epoch + index + 1
                first = index * chaos.GLOBAL_BATCH
                blocks = {0: range(first, first + 4), 2: range(first + 4, first + 8), 3: range(first + 8, first + 16)}
                for rank, block in blocks.items():
                    indices = list(block)
                    if epoch == 1 and index == 0 and rank == 0:
                        indices = indices[1:] if missed else indices + [first] if twice else indices
                    log_step(log, launch, epoch, step, rank, indices, trained=True)
                if stand_in_copies:
                    log_step(log, launch, epoch, step, 1, [first], trained=False)
    path.write_text(log.getvalue())


def test_stand_ins_are_logged_as_such_and_train_no_sample(tmp_path):
    write_epochs(tmp_path / "steps.log")
    assert "stand-in" in (tmp_path / "steps.log").read_text()
    assert data_exact(tmp_path / "steps.log")
    assert all(set(counts.values()) == {1} for counts in coverage(tmp_path / "steps.log").values())


def test_a_sample_trained_twice_or_missed_fails_with_or_without_stand_ins(tmp_path):
    for fault in ("twice", "missed"):
        for stand_ins in (True, False):
            write_epochs(tmp_path / "steps.log", stand_in_copies=stand_ins, **{fault: True})
            assert not data_exact(tmp_path / "steps.log"), (fault, stand_ins)


def test_steps_run_again_by_a_later_launch_count_once(tmp_path):
    write_epochs(tmp_path / "steps.log", redone_by="b")
    assert data_exact(tmp_path / "steps.log")
