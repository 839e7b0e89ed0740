"""The drop-in (hetdp.DDP + model.allocate) in a user's own loop, with real processes over gloo."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hetdp.allocate.policy import MEETING_WINDOW, PLAN_LAG
from hetdp.cluster.emulate import Emulation

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from dropin_worker import Pairs, make_model, make_optimizer, make_tower  # noqa: E402
from torch_order import global_batches  # noqa: E402

RANKS = 4

# Shares, plans and their timing (drift, background gathers, the first plan, two backwards) follow measured times,
# which other tests' processes would distort.
pytestmark = pytest.mark.serial


def launch(torchrun, out: Path, scenarios: str, env: dict | None = None, timeout_s: float = 300) -> Path:
    torchrun("dropin_worker.py", RANKS, "--out", out, "--scenarios", scenarios, env=env, timeout_s=timeout_s)
    return out


def load(out: Path, scenario: str) -> list[dict]:
    return [json.loads((out / f"{scenario}_{rank}.json").read_text()) for rank in range(RANKS)]


@pytest.fixture(scope="module")
def out(tmp_path_factory, torchrun) -> Path:
    """One launch for every scenario whose emulation, if any, is given in code."""
    scenarios = ("exact,accumulate,follow,policies,batchnorm,drift,partial,meetings,momentum,background,out_of_step,"
                 "two_backwards,metrics")
    return launch(torchrun, tmp_path_factory.mktemp("dropin"), scenarios)


def reference(size: int, global_batch: int, epochs: int, kind: str, every: int = 1, tower: bool = False
              ) -> dict[str, torch.Tensor]:
    """One process on the global batches of torch's ``DistributedSampler(seed=3)``, with the mean loss over each,
    ``every`` global batches accumulated per optimizer step (counted within each epoch, as the ranks' loop does);
    ``tower``: the model is fed by ``make_tower``'s."""
    model = nn.Sequential(make_tower(7), make_model(7)) if tower else make_model(7)
    optimizer = make_optimizer(model, kind)
    steps = -(-size // global_batch)
    scheduler = (torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=epochs * steps)
                 if kind == "adamw" else None)
    data = Pairs(size)
    for epoch in range(epochs):
        for i, index in enumerate(global_batches(size, global_batch, seed=3, epoch=epoch)):
            (nn.functional.cross_entropy(model(data.x[index]), data.y[index]) / every).backward()
            if (i + 1) % every == 0:
                if kind == "adamw":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                optimizer.zero_grad()
                if scheduler is not None:
                    scheduler.step()
    return model.state_dict()


@pytest.mark.parametrize(("sync", "kind"), [("allreduce", "adamw"), ("full", "adamw"), ("local:1", "sgd")])
def test_unequal_shares_in_the_users_loop_train_as_one_process_on_the_global_batch(out, sync, kind):
    # AdamW with a per-step schedule and clipping, dict batches from a DataLoader worker, a last step of 2 samples
    # for 4 ranks; a partial allreduce whose every round holds all ranks (full), and merges after every step of
    # plain SGD (local:1), give the same parameters as the allreduce: rounds and merges weigh samples.
    figures = load(out, "exact")[0][sync]
    assert figures["shares"] == [2, 4, 6, 4] and figures["steps"] == 4
    assert all(sum(samples) == 50 for samples in figures["samples"])
    assert figures["blocks"][3] == [0, 1, 1, 0]  # two ranks sit out the last step with a stand-in
    expected = reference(50, 16, 2, kind)
    for name, tensor in torch.load(out / f"exact_{sync}.pt").items():
        torch.testing.assert_close(tensor, expected[name], atol=2e-6, rtol=1e-5, msg=f"{sync} {name}")


@pytest.mark.parametrize("sync", ["allreduce", "full"])
def test_gradients_accumulated_under_no_sync_weigh_each_batch_by_its_own_shares(out, sync):
    # The shares change inside a window (step 1) and the last step's stand-ins end one: weighed by the last
    # batch's shares, the window's sum would take the wrong weights, and lose what the stand-in ranks accumulated.
    blocks = load(out, "accumulate")[0][sync]["blocks"]
    assert blocks[:3] == [[2, 4, 6, 4], [4, 2, 6, 4], [4, 2, 6, 4]]
    assert sum(blocks[3]) == 2 and blocks[3].count(0) == 2  # two ranks join the last step with a stand-in
    expected = reference(50, 16, 2, "adamw", every=2)
    for name, tensor in torch.load(out / f"accumulate_{sync}.pt").items():
        torch.testing.assert_close(tensor, expected[name], atol=2e-6, rtol=1e-5, msg=f"{sync} {name}")


def test_a_model_that_follows_anothers_steps_trains_as_one_process_on_the_global_batch(out):
    figures = load(out, "follow")[0]
    assert figures["blocks"][:4] == [[2, 4, 6, 4], [2, 4, 6, 4], [2, 4, 6, 4], [0, 1, 1, 0]]
    assert figures["follower_steps"] == 8 and figures["follower_epochs"] == 2  # it opened and closed every one
    expected = reference(50, 16, 2, "sgd", tower=True)
    for name, tensor in torch.load(out / "follow.pt").items():
        torch.testing.assert_close(tensor, expected[name], atol=2e-6, rtol=1e-5, msg=name)


def test_accumulating_batches_are_timed_and_rebalanced_with_exact_gradients(out):
    figures = load(out, "accumulate")[0]["adaptive"]
    assert all(seconds > 0 for step in figures["compute_s"] for seconds in step)  # no batch left untimed
    assert figures["replans"] >= 1
    shares = figures["shares"]
    assert shares[0] < shares[2] < shares[3] and shares[1] < shares[2], shares  # emulated speeds 1, 1, 2, 4
    expected = reference(400, 16, 2, "sgd", every=2)
    for name, tensor in torch.load(out / "accumulate_adaptive.pt").items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_last_step_with_fewer_samples_than_ranks_completes_under_every_allocation(out):
    results = load(out, "policies")
    for name in ("equal", "static:1,1,2,4", "adaptive"):
        figures = results[0][name]
        assert figures["steps"] == 17 and sum(figures["samples"]) == 2050, (name, figures)
        assert all(r[name] == figures for r in results)


def test_a_rank_without_samples_never_trains_its_batchnorm_on_a_stand_in(out):
    # Rank 3 has weight 0: a stand-in every step. As under DDP, every forward starts from rank 0's buffers, so each
    # rank's BatchNorm counts rank 0's batches, plus one for its own last forward, but not for a stand-in.
    results = load(out, "batchnorm")
    assert results[3]["real_steps"] == 0 and results[3]["tracked"] == 3
    for rank in range(3):
        assert results[rank]["tracked"] == results[rank]["real_steps"] == results[rank]["steps"] == 4


def test_the_emulation_of_hetdp_run_reaches_the_drop_in_and_it_rebalances(tmp_path, torchrun):
    env = Emulation(speeds=(1.0, 1.0, 2.0, 4.0), sample_cost_ms=2.0).to_env()
    results = load(launch(torchrun, tmp_path, "emulated", env=env), "emulated")
    shares = results[0]["shares"]
    assert results[0]["speeds"] == [1.0, 1.0, 2.0, 4.0]
    for share, ideal in zip(shares, [8, 8, 16, 32]):
        assert abs(share - ideal) <= 0.2 * ideal, shares
    assert results[0]["epochs"][0]["replans"], "no re-plan in the first epoch"


def test_a_device_that_slows_down_after_the_shares_settle_is_rebalanced(out):
    figures = load(out, "drift")[0]
    assert figures["changes"] == [[25, [1.0, 1.0, 2.0, 1.0]]]
    assert figures["restarts"] >= 1
    for share, ideal in zip(figures["shares"], [64 * v / 5 for v in (1.0, 1.0, 2.0, 1.0)]):
        assert abs(share - ideal) <= 0.2 * ideal, figures["shares"]


def test_partial_and_local_synchronization_meet_with_identical_replicas_and_cover_every_epoch(out):
    results = load(out, "partial")
    for name in ("majority", "solo", "local:3"):
        figures = results[0][name]
        assert figures["gap"] == 0.0, (name, figures["gap"])
        assert all(sum(samples) == figures["dataset"] for samples in figures["samples"]), name
        assert figures["replans"] >= 1 and figures["shares"][3] > figures["shares"][0], (name, figures["shares"])
        # After the first decision, re-plans wait for MEETING_WINDOW steps: none from a straggler's 2 steps at an
        # epoch's end.
        windows = figures["windows"]
        first = next(i for i, (_, decided) in enumerate(windows) if decided)
        assert all(steps >= MEETING_WINDOW for steps, _ in windows[first + 1 :]), (name, windows)


def test_every_rank_applies_every_round_in_flight_before_a_meeting_averages_the_replicas(out):
    results = load(out, "meetings")[0]
    # Majority meets every 4 steps counted from the last meeting, the unannounced one included, and at the end.
    assert results["majority"]["meetings"] == [[4, True], [6, False], [9, True], [10, True]]
    assert results["solo"]["meetings"] == [[5, False], [10, True]]
    for name, figures in results.items():
        assert figures["differing_steps"] > 0, name  # ranks did apply rounds at different steps
        assert len(figures["equal_sums"]) >= 1 and all(figures["equal_sums"]), (name, figures["equal_sums"])


def test_a_rank_that_receives_several_rounds_at_once_steps_a_momentum_optimizer_once_per_round(out):
    for sync, figures in load(out, "momentum")[0].items():
        assert sum(figures["extra_steps"]) > 0, sync  # some rank did catch up on several rounds in one step
        assert figures["gap"] < 1e-5, (sync, figures)  # and its replica is the others' before any averaging


def test_adaptive_shares_re_plan_from_background_gathers_without_averaging_the_replicas(out):
    results = load(out, "background")
    figures = results[0]
    # Plans come from gathers in the background: the replicas, equal at the start, were not averaged (made equal
    # again) before the epoch's end ...
    assert figures["identical_steps"] == [0], figures["identical_steps"]
    # ... and yet the shares moved, and every rank cut every step by the same ones (a prefetching loader too).
    # A checkpoint (every 15 steps) meets first: the replicas are one model right after each.
    assert figures["checkpointed"]["identical_steps"] == [0, 15, 30], figures["checkpointed"]["identical_steps"]
    for run in (figures, figures["majority"]):
        assert run["replans"] >= 1 and run["shares"][3] > run["shares"][0], run["shares"]
        assert len(run["blocks"]) == run["steps"] and all(sum(block) == 32 for block in run["blocks"])


def test_out_of_step_the_first_plan_comes_from_the_rules_own_window(out):
    # Equal shares on unequal devices cost every step: the first decision does not wait for MEETING_WINDOW steps.
    blocks = load(out, "out_of_step")[0]["blocks"]
    first = next(i for i, block in enumerate(blocks) if block != [8, 8, 8, 8])
    assert first < MEETING_WINDOW + PLAN_LAG, blocks[: MEETING_WINDOW + PLAN_LAG + 1]


def test_the_fast_rank_does_not_time_ddps_bucket_rebuild_as_compute(out):
    # At equal shares the emulated compute is 80 ms a step on ranks 0-2 and 10 ms on rank 3. Timed with the rebuild,
    # rank 3's second step read as long as the slow ranks' (it waited for them), and its first window as noise.
    figures = load(out, "out_of_step")[0]
    equal = [compute for compute, block in zip(figures["compute_s"], figures["blocks"]) if block == [8, 8, 8, 8]]
    assert len(equal) >= 2 and all(step[3] < 0.5 * step[0] for step in equal), equal[:3]


def test_under_allreduce_a_plan_applies_from_the_step_right_after_its_window(out):
    # The ranks are in step: a plan waits for no rank behind, and PLAN_LAG more steps at the old shares (on speeds
    # 1,1,1,8 at equal shares, each step twice the planned one) cost what the simulator does not count.
    plans = load(out, "two_backwards")[0]["plans"]
    assert plans and all(first == newest + 1 for first, newest in plans), plans


def test_a_step_of_two_synchronized_backwards_is_timed_without_the_wait_between_them(out):
    # At equal shares rank 3 computes 10 ms a step, the others 80. Timed to its second backward's end, rank 3's step
    # held its wait for the others at the end of the first: it read 80 ms like theirs, and the shares never moved.
    figures = load(out, "two_backwards")[0]
    equal = [(compute, wait) for compute, wait, block in zip(figures["compute_s"], figures["wait_s"], figures["blocks"])
             if block == [8, 8, 8, 8]]
    assert equal and all(compute[3] < 0.5 * compute[0] for compute, _ in equal), equal
    assert all(wait[3] > 0.5 * (compute[0] - compute[3]) for compute, wait in equal), equal  # counted as wait
    assert figures["blocks"][-1][3] > 2 * figures["blocks"][-1][0], figures["blocks"][-1]


def test_metrics_are_written_for_every_step_and_rank(out):
    results = load(out, "metrics")
    with (out / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == results[0]["steps"] * RANKS == results[0]["figures"] * RANKS
    assert {int(row["rank"]) for row in rows} == set(range(RANKS))
    assert all(float(row["compute_s"]) >= 0 and float(row["wait_s"]) >= 0 for row in rows)
    with (out / "metrics_epochs.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 2 * RANKS
