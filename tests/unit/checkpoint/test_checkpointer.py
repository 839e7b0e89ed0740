"""Step checkpoints on disk: newest first, a damaged newest one is reported and the previous one used."""

import random

import numpy as np
import pytest
import torch

from hetdp.checkpoint.checkpointer import checkpoint_paths, load_newest
from hetdp.checkpoint.files import load_checkpoint, save_checkpoint
from hetdp.data.randomness import random_state, set_random_state


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
    from hetdp.checkpoint.checkpointer import ResumeState

    state = ResumeState(allocator={"shares": [1, 3]}, steps_done=12, world_size=2, position=(1, 4))
    assert ResumeState.of(state.to_dict(), world_size=4) == state
    older = ResumeState.of({"allocator": None, "steps_done": 5}, world_size=4)
    assert (older.world_size, older.position) == (4, None)


class RunsCode:
    """Unpickled, it would run a shell command: what a crafted checkpoint holds."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_crafted_to_run_code_is_refused_unrun_and_not_skipped_for_an_older_one(tmp_path):
    from hetdp.errors import RefusedCheckpointError

    marker = tmp_path / "ran"
    save_checkpoint(tmp_path / "step-00000003.pt", {"step": 3})
    torch.save({"step": 6, "payload": RunsCode(marker)}, tmp_path / "step-00000006.pt")
    with pytest.raises(RefusedCheckpointError, match=r"refused checkpoint .*step-00000006\.pt: .*system") as caught:
        load_newest(tmp_path)
    assert "\n" not in str(caught.value)
    assert not marker.exists()


def test_a_state_a_checkpoint_cannot_carry_fails_where_it_is_saved_and_leaves_the_previous_file(tmp_path):
    from hetdp.errors import RefusedCheckpointError

    path = save_checkpoint(tmp_path / "step-00000003.pt", {"step": 3})
    with pytest.raises(RefusedCheckpointError, match="step-00000003.pt"):
        save_checkpoint(path, {"step": 6, "payload": RunsCode(tmp_path / "ran")})
    assert load_checkpoint(path) == {"step": 3}
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000003.pt"]  # no temporary file left behind


def training_state(optimizer_class, **options):
    """A model, its optimizer, a scheduler and a scaler after two steps, and what a checkpoint holds of them."""
    from hetdp.allocate.policy import Adaptive, Allocator

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = optimizer_class(model.parameters(), **options)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
    step_lr = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        scheduler.step()
        step_lr.step()
    allocator = Allocator(Adaptive(), 4, 64, membership=True)
    for _ in range(2):
        allocator.measure([0.0001 * s for s in allocator.shares], [0.02, 0.0, 0.0, 0.0])
    allocator.replan()
    return {"random": [random_state()], "module": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "step_lr": step_lr.state_dict(), "scaler": scaler.state_dict(),
            "hetdp": {"allocator": allocator.state_dict(), "steps_done": 2, "world_size": 4, "position": (0, 2)}}


@pytest.mark.parametrize("optimizer_class, options", [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (torch.optim.Adam, {"lr": 0.1}),
    (torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.01, "amsgrad": True}),
], ids=["sgd", "adam", "adamw"])
def test_the_training_state_of_each_optimizer_the_tests_use_reads_back_as_plain_data(tmp_path, optimizer_class,
                                                                                      options):
    state = training_state(optimizer_class, **options)
    loaded = load_checkpoint(save_checkpoint(tmp_path / "step-00000002.pt", state))
    assert plain(loaded) == plain(state)


def plain(value):
    """``value`` with every tensor as (dtype, values), to compare nested states with ``==``."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype), value.tolist()
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(plain(item) for item in value)
    return value
