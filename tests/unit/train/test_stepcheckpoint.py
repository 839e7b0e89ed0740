"""Step checkpoints on disk: newest first, a damaged newest one is reported and the previous one used."""

import random

import numpy as np
import pytest
import torch

from hetdp.train.checkpoint import load_checkpoint, save_checkpoint
from hetdp.train.stepcheckpoint import checkpoint_paths, load_newest, random_state, set_random_state


def test_the_newest_checkpoint_is_loaded(tmp_path):
    for step in (3, 12, 6):
        save_checkpoint(tmp_path / f"step-{step:08d}.pt", {"step": step})
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert [path.name for path in checkpoint_paths(tmp_path)] == [f"step-{s:08d}.pt" for s in (12, 6, 3)]
    assert load_newest(tmp_path) == {"step": 12}


def test_a_truncated_newest_checkpoint_warns_and_the_previous_one_is_used(tmp_path):
    save_checkpoint(tmp_path / "step-00000003.pt", {"step": 3, "weights": torch.ones(100)})
    newest = save_checkpoint(tmp_path / "step-00000006.pt", {"step": 6, "weights": torch.ones(100)})
    newest.write_bytes(newest.read_bytes()[:50])
    with pytest.warns(UserWarning, match="step-00000006.pt"):
        assert load_newest(tmp_path)["step"] == 3


def test_no_checkpoint_is_none(tmp_path):
    assert load_newest(tmp_path / "missing") is None


def draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_a_saved_random_state_draws_again_what_followed_it(tmp_path):
    torch.manual_seed(7)
    path = save_checkpoint(tmp_path / "step-00000001.pt", {"random": random_state()})
    expected = draws()
    assert draws() != expected
    set_random_state(load_checkpoint(path)["random"])
    assert draws() == expected


def test_the_resume_state_reads_back_and_fills_what_an_older_one_lacks():
    from hetdp.train.stepcheckpoint import ResumeState

    state = ResumeState(allocator={"shares": [1, 3]}, steps_done=12, world_size=2, position=(1, 4))
    assert ResumeState.of(state.to_dict(), world_size=4) == state
    older = ResumeState.of({"allocator": None, "steps_done": 5}, world_size=4)
    assert (older.world_size, older.position) == (4, None)
