"""Ranks that sit out of the exchange and rejoin it, with real processes over gloo: exact gradients throughout."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from dropin_worker import Pairs  # noqa: E402
from sitout_worker import ACCUMULATE, EPOCHS, GLOBAL_BATCH, RESTORED_MEMBERS, SAVED_AT, SIZE, make_wide_model  # noqa: E402
from torch_order import global_batches  # noqa: E402

RANKS = 4
CHANGE_AT = 22
"""The step from which the two fast ranks run at the slow ones' speed: the first two epochs (10 steps each) end
before it, so one of their reports tells why the slow ranks sat out, however long the first decisions took."""


@pytest.fixture(scope="module")
def out(tmp_path_factory, torchrun) -> Path:
    folder = tmp_path_factory.mktemp("sitout")
    torchrun("sitout_worker.py", RANKS, "--out", folder, "--change-at", CHANGE_AT, timeout_s=300)
    return folder


@pytest.fixture(scope="module")
def forced(tmp_path_factory, torchrun) -> Path:
    folder = tmp_path_factory.mktemp("forced")
    torchrun("sitout_worker.py", RANKS, "--out", folder, "--change-at", CHANGE_AT, "--forced", timeout_s=300)
    return folder


def load(out: Path, name: str = "sitout") -> list[dict]:
    return [json.loads((out / f"{name}_{rank}.json").read_text()) for rank in range(RANKS)]


@functools.cache
def reference(every: int = 1) -> dict[str, torch.Tensor]:
    """One process on the global batches of torch's ``DistributedSampler(seed=3)``, the mean loss over each, ``every``
    of them accumulated per optimizer step (and the epoch's last)."""
    model = make_wide_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = Pairs(SIZE)
    for epoch in range(EPOCHS):
        batches = global_batches(SIZE, GLOBAL_BATCH, seed=3, epoch=epoch)
        steps = len(batches)
        for i, index in enumerate(batches):
            if i % every == 0:
                optimizer.zero_grad()
            (nn.functional.cross_entropy(model(data.x[index]), data.y[index]) / every).backward()
            if (i + 1) % every == 0 or i == steps - 1:
                optimizer.step()
    return model.state_dict()


def assert_every_rank_ends_with_the_reference(folder: Path, name: str, every: int = 1) -> None:
    """Every rank's saved model (``<name>_<rank>.pt``) is the one process's, to float tolerance."""
    expected = reference(every)
    for rank in range(RANKS):
        for key, tensor in torch.load(folder / f"{name}_{rank}.pt").items():
            torch.testing.assert_close(tensor, expected[key], atol=2e-6, rtol=1e-5, msg=f"rank {rank} {key}")


@pytest.mark.serial  # who sits out, and when a rank rejoins, follow measured times
def test_slow_ranks_sit_out_while_their_exchange_costs_more_than_they_save_and_rejoin_when_they_pay(out):
    members = load(out)[0]["members"]
    before = members[:CHANGE_AT]
    assert any(2 not in step and 3 not in step for step in before), before  # the slow ranks left the exchange
    assert members[-1] == [0, 1, 2, 3], members  # and came back once the fast ranks slowed down to their speed
    assert all(step == members_of_rank["members"][i] for members_of_rank in load(out)
               for i, step in enumerate(members))  # every rank agrees on every step's members


@pytest.mark.serial  # reads the serial tests' launch: marked alike, the module launches it once, not once a pass
def test_the_model_trains_as_one_process_on_the_global_batches_while_ranks_sit_out_and_after_they_rejoin(out):
    assert_every_rank_ends_with_the_reference(out, "sitout")  # the ranks that sat out too: brought current


@pytest.mark.serial  # who sits out, and when a rank rejoins, follow measured times
def test_every_member_starts_each_step_with_the_current_model_a_rejoining_rank_included(out):
    results = load(out)
    members = results[0]["members"]
    rejoined = [step for step in range(1, len(members)) if set(members[step]) - set(members[step - 1])]
    assert rejoined, members
    for step, ranks in enumerate(members):
        sums = {results[rank]["sums"][step] for rank in ranks}
        assert len(sums) == 1, (step, ranks, sums)


@pytest.mark.serial  # who sits out, and when a rank rejoins, follow measured times
def test_the_epoch_reports_say_which_ranks_sat_out_and_why(out):
    reports = load(out)[0]["reports"]
    # How many of the first epoch's 10 steps the first decisions take follows measured times (CHANGE_AT).
    first = next((report for report in reports if report["sat_out"]), reports[0])
    assert {"2", "3"} <= set(first["sat_out"]), reports  # JSON keys
    assert "sat out" in first["diagnosis"] and "exchange adds" in first["diagnosis"], first["diagnosis"]
    assert reports[-1]["sat_out"] == {}, reports[-1]


def test_a_subset_of_members_sums_among_itself_exactly_whichever_ranks_it_holds(forced):
    # Members 0, 1, 3 (three: one folds into the doubling), then 1, 2 (rank 2 rejoins as rank 0 and 3 leave),
    # then all four: every member starts every step with the same model, and the run is the one process's.
    results = load(forced, "forced")
    members = results[0]["members"]
    assert members[:9] == [[0, 1, 2, 3]] * 2 + [[0, 1, 3]] * 3 + [[1, 2]] * 3 + [[0, 1, 2, 3]], members
    for step, ranks in enumerate(members):
        assert len({results[rank]["sums"][step] for rank in ranks}) == 1, (step, ranks)
    assert_every_rank_ends_with_the_reference(forced, "forced")


def test_a_checkpoint_saved_while_a_rank_sits_out_resumes_to_the_one_process_model(forced):
    # Saved after step 4 of the forced run, while rank 2 sat out (steps 2 to 4); resumed on every rank, ranks sit
    # out again (1 and 2 alone from step 5), and every rank ends with the one process's model.
    resumed = load(forced, "resumed")
    members = resumed[0]["members"]
    assert len(members) == EPOCHS * SIZE // GLOBAL_BATCH - SAVED_AT and [1, 2] in members, members
    assert_every_rank_ends_with_the_reference(forced, "resumed")


def test_ranks_out_in_a_restored_allocation_sit_out_from_the_first_restored_step_and_the_model_stays_exact(forced):
    # Adaptive allocation resumed from the step-4 checkpoint, whose allocator state says ranks 2 and 3 sat out:
    # they sit out the first restored step, and every rank still ends with the one process's model.
    restored = load(forced, "restored")
    members = restored[0]["members"]
    assert len(members) == EPOCHS * SIZE // GLOBAL_BATCH - SAVED_AT and members[0] == RESTORED_MEMBERS, members
    assert all(record["members"] == members for record in restored)  # every rank agrees on every step
    assert_every_rank_ends_with_the_reference(forced, "restored")


def test_batchnorm_buffers_stand_still_on_a_rank_out_and_are_the_keepers_after_each_catch_up(forced):
    results = load(forced, "batchnorm")
    members = results[0]["members"]
    assert members[2] == [0, 1, 3] and members[7] == [1, 2, 3] and members[-1] == [1, 2, 3], members
    # A stand-in runs in eval mode: rank 2's statistics stand still while it sits out (steps 2 to 6), rank 0's too
    # from step 7 until the epoch's end brings it current; the members' move.
    assert len({results[2]["buffers"][step] for step in range(1, 7)}) == 1
    assert len({results[0]["buffers"][step] for step in range(6, 10)}) == 1
    assert len({results[1]["buffers"][step] for step in range(6, 10)}) == 4
    # Every epoch ends with rank 0 out: every rank then holds the keeper's (rank 1's) buffers and parameters.
    steps = SIZE // GLOBAL_BATCH
    for epoch in range(EPOCHS):
        kept = results[1]["buffers"][(epoch + 1) * steps - 1]
        assert [result["epoch_buffers"][epoch] for result in results] == [kept] * RANKS, epoch
        assert len({result["epoch_sums"][epoch] for result in results}) == 1, epoch
    for step, ranks in enumerate(members):  # and every member starts every step with the same parameters
        assert len({results[rank]["sums"][step] for rank in ranks}) == 1, (step, ranks)


def test_batches_accumulated_under_no_sync_across_a_membership_change_train_as_one_process(forced):
    # Two batches per optimizer step, the first under no_sync. The change at step 5 falls inside the window of steps
    # 4 and 5: ranks 0 and 3 leave the exchange holding step 4's gradient, and rank 2 rejoins without it. The window's
    # gradient is still the mean over both global batches, on every rank.
    results = load(forced, "accumulated")
    members = results[0]["members"]
    assert members[4] == [0, 1, 3] and members[5] == [1, 2], members
    for step, ranks in enumerate(members):
        assert len({results[rank]["sums"][step] for rank in ranks}) == 1, (step, ranks)
    assert_every_rank_ends_with_the_reference(forced, "accumulated", ACCUMULATE)
