"""Failures in the group: a killed worker is restarted from the last step checkpoint and ends where an
uninterrupted run ends; a checkpoint resumes on fewer ranks with every sample of the epoch trained once."""

from __future__ import annotations

import collections
import sys

import pytest
import torch
from torch import nn

from hetdp.cluster.emulate import Emulation
from hetdp.errors import HetDPError, WorkerError
from hetdp.launch import run_local

from .conftest import WORKERS

sys.path.insert(0, str(WORKERS))
from resume_worker import Indexed  # noqa: E402
from torch_order import global_batches  # noqa: E402

DATASET = 96
GLOBAL_BATCH = 12
EPOCHS = 2
EVERY = 3
RESUME_ATOL = 1e-5
"""Parameters after a resize against one process: the sums of 2 or 3 ranks in another order than one process's."""


def launch(tmp_path, nproc: int, name: str, *args: object, max_restarts: int = 0, restarts: list | None = None,
           emulation: Emulation | None = None):
    out = tmp_path / f"{name}.pt"
    argv = ["--ckpt", tmp_path / f"{name}-ckpt", "--record", tmp_path / f"{name}.log", "--out", out,
            "--every", EVERY, *args]
    on_restart = (lambda attempt, code: restarts.append(attempt)) if restarts is not None else None
    completed = run_local(WORKERS / "resume_worker.py", nproc, [str(arg) for arg in argv], capture=True,
                          timeout_s=120, max_restarts=max_restarts, on_restart=on_restart, report_errors=True,
                          env=None if emulation is None else emulation.to_env())
    return completed, out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The final parameters of an uninterrupted run (2 ranks, as the faulted one)."""
    completed, out = launch(tmp_path_factory.mktemp("reference"), 2, "reference")
    assert completed.returncode == 0, completed.stdout
    return torch.load(out)


def steps_of(log_path) -> tuple[dict[int, list[int]], list[int]]:
    """The samples each epoch trained (every step as its last launch ran it), and for each launch that failed, in
    the order they ran, how many of its steps ran again after it (work redone)."""
    launches: dict[int, dict[str, list[tuple[int, list[int]]]]] = collections.defaultdict(dict)
    last_launch: dict[int, str] = {}
    for line in log_path.read_text().splitlines():
        launch_id, *numbers = line.split()
        epoch, step, _, *indices = map(int, numbers)
        launches[step].setdefault(launch_id, []).append((epoch, indices))
        last_launch[step] = launch_id
    covered: dict[int, list[int]] = collections.defaultdict(list)
    for step, by_launch in launches.items():
        for epoch, indices in by_launch[last_launch[step]]:
            covered[epoch].extend(indices)
    redone = collections.Counter(launch_id for by_launch in launches.values() if len(by_launch) > 1
                                 for launch_id in list(by_launch)[:-1])
    return covered, list(redone.values())


def batches_of(log_path) -> list[list[int]]:
    """The samples each global step trained, every step as its last launch ran it, in the order of the steps."""
    last: dict[int, tuple[str, list[int]]] = {}
    for line in log_path.read_text().splitlines():
        launch_id, _, step, _, *indices = line.split()
        held = last.get(int(step))
        last[int(step)] = (launch_id, (held[1] if held and held[0] == launch_id else []) + list(map(int, indices)))
    return [sorted(last[step][1]) for step in sorted(last)]


def one_process(repeat_step: int | None = None) -> dict[str, torch.Tensor]:
    """The worker's model without dropout, trained by one process on the global batches of torch's
    ``DistributedSampler(seed=5)``, each step the mean loss over its batch; ``repeat_step``: that step trained twice
    (what a resume that redoes a checkpointed step gives)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.0), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
    data = Indexed(DATASET)
    batches = [batch for epoch in range(EPOCHS) for batch in global_batches(DATASET, GLOBAL_BATCH, 5, epoch)]
    for step, index in enumerate(batches):
        for _ in range(2 if step == repeat_step else 1):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(data.x[index]), data.y[index]).backward()
            optimizer.step()
            scheduler.step()
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def ranks_of(log_path) -> list[set[int]]:
    """The ranks that logged steps in each launch, in the order the launches ran."""
    ranks: dict[str, set[int]] = {}
    for line in log_path.read_text().splitlines():
        launch_id, _, _, rank, *_ = line.split()
        ranks.setdefault(launch_id, set()).add(int(rank))
    return list(ranks.values())


def test_a_killed_worker_and_later_a_hung_one_are_restarted_and_end_where_an_uninterrupted_run_ends(tmp_path,
                                                                                                     reference):
    # One launch of 2 ranks, two faults: rank 1 is killed after step 8 of the first attempt, and stopped after step 14
    # of the second (the restart), which resumed from the checkpoint at step 6. A stopped worker hangs the group: the
    # survivor times out on it (6 s), and the launcher kills the group. 3 s timed out once on a restarted launch under
    # the suite's load (a send of 3 s on 2 cores), with nobody stopped. Each failure must redo at most the steps
    # since its last checkpoint, and the parameters (with dropout, whose draws each rank's state brings back) must be
    # the uninterrupted run's.
    restarts: list[int] = []
    faulted, faulted_out = launch(tmp_path, 2, "faulted", "--die-at", "8,14", "--die-rank", "1,1",
                                  "--signal", "KILL,STOP", "--step-timeout", 6, max_restarts=2, restarts=restarts)
    assert faulted.returncode == 0, faulted.stdout
    assert restarts == [1, 2]
    expected, actual = reference, torch.load(faulted_out)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=1e-6)
    covered, redone_steps = steps_of(tmp_path / "faulted.log")
    assert all(sorted(indices) == list(range(DATASET)) for indices in covered.values())
    assert len(redone_steps) == 2 and all(0 < steps <= EVERY for steps in redone_steps), redone_steps


def test_a_checkpoint_of_three_ranks_resumes_on_two_with_each_sample_once_and_ends_as_one_process(tmp_path):
    # Without dropout (whose draws no other rank count reproduces), the model trained on 3 ranks, resumed on 2, is
    # one process's on the same global batches. Emulated speeds unequal on both launches: the adaptive shares leave
    # equal ones, so that a rank weighed other than by its samples would show.
    with pytest.raises(WorkerError, match=r"^rank 1 died \(signal SIGKILL\); the other ranks were stopped$"):
        launch(tmp_path, 3, "resize", "--die-at", 11, "--allocation", "adaptive", "--dropout", 0,
               emulation=Emulation(speeds=(1.0, 2.0, 3.0), sample_cost_ms=2.0))
    second, out = launch(tmp_path, 2, "resize", "--allocation", "adaptive", "--dropout", 0,
                         emulation=Emulation(speeds=(1.0, 3.0), sample_cost_ms=2.0))
    assert second.returncode == 0, second.stdout
    assert "checkpoint of 3 ranks resumed on 2" in second.stdout
    covered, redone_steps = steps_of(tmp_path / "resize.log")
    assert sorted(covered) == [0, 1]
    assert all(sorted(indices) == list(range(DATASET)) for indices in covered.values())
    # The second launch went on from the last checkpoint (step 9 of the 10 the first one ran) on ranks 0 and 1: a
    # launch that started over would cover every sample too, but redo 10 steps.
    assert len(redone_steps) == 1 and 0 < redone_steps[0] <= EVERY, redone_steps
    assert ranks_of(tmp_path / "resize.log")[-1] == {0, 1}
    expected = [sorted(batch.tolist()) for epoch in range(EPOCHS)
                for batch in global_batches(DATASET, GLOBAL_BATCH, 5, epoch)]
    assert batches_of(tmp_path / "resize.log") == expected  # step by step, torch's order, through the resize
    # The bound: float rounding of sums in another order, far below what one step trained twice moves.
    reference, redone = one_process(), one_process(repeat_step=9)
    wrong = max((redone[name] - tensor).abs().max().item() for name, tensor in reference.items())
    assert RESUME_ATOL < wrong / 100, wrong
    for name, tensor in torch.load(out).items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=RESUME_ATOL, msg=name)


def test_static_weights_for_another_count_of_ranks_is_one_clear_error_and_not_retried(tmp_path):
    # A ConfigError is the user's to fix: restarting would fail the same way.
    restarts: list[int] = []
    with pytest.raises(HetDPError, match="3") as caught:
        run_local(WORKERS / "resume_worker.py", 2,
                  ["--ckpt", str(tmp_path / "c"), "--record", str(tmp_path / "l"), "--out", str(tmp_path / "o"),
                   "--weights", "1,2,3"], capture=True, timeout_s=120, report_errors=True, max_restarts=2,
                  on_restart=lambda attempt, code: restarts.append(attempt))
    assert "\n" not in str(caught.value)
    assert restarts == []


class RunsCode:
    """Unpickled, it would run a shell command: what a crafted checkpoint holds."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_crafted_to_run_code_stops_every_rank_with_one_error_and_runs_nothing(tmp_path):
    folder, marker = tmp_path / "ckpt", tmp_path / "ran"
    folder.mkdir()
    torch.save({"module": RunsCode(marker)}, folder / "step-00000099.pt")
    with pytest.raises(HetDPError, match=r"refused checkpoint .*step-00000099\.pt") as caught:
        run_local(WORKERS / "resume_worker.py", 2,
                  ["--ckpt", str(folder), "--record", str(tmp_path / "l"), "--out", str(tmp_path / "o")],
                  capture=True, timeout_s=120, report_errors=True)
    assert "\n" not in str(caught.value)
    assert not marker.exists()

