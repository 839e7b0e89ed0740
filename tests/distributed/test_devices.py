"""Cost-balanced steps and memory caps with real processes over gloo: exact gradients, shares under the caps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from hetdp import apportion

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from devices_worker import COST_SHARES, Sequences, make_model, per_sequence_loss, per_token_loss  # noqa: E402
from torch_order import global_batches  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory, torchrun):
    out = tmp_path_factory.mktemp("devices")
    torchrun("devices_worker.py", 3, "--out", out, timeout_s=240)
    return out, json.loads((out / "results.json").read_text())


def reference(loss_fn) -> dict[str, torch.Tensor]:
    """One process, the whole global step at once (in the order of torch's ``DistributedSampler(seed=0)``), the loss
    over all of it: what cost-balanced ranks must give."""
    dataset, model = Sequences(30), make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for batch in global_batches(30, 12, seed=0, epoch=0):
        optimizer.zero_grad()
        loss_fn(model, [dataset[i] for i in batch.tolist()]).backward()
        optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize(("mean_over", "loss_fn"), [("cost", per_token_loss), ("samples", per_sequence_loss)])
def test_cost_balanced_steps_give_the_gradient_of_the_whole_step(results, mean_over, loss_fn):
    out, _ = results
    actual = torch.load(out / f"cost_{mean_over}.pt")
    for name, tensor in reference(loss_fn).items():
        torch.testing.assert_close(actual[name], tensor, atol=1e-5, rtol=0.0, msg=name)


def test_cost_balanced_blocks_follow_the_shares_in_cost_not_in_count(results):
    _, per_rank = results
    figures = per_rank[0]["cost"]
    for rank_figures in per_rank[1:]:
        assert rank_figures["cost"]["blocks"] == figures["blocks"]  # every rank cut the same steps
    full = [(block, cost) for block, cost in zip(figures["blocks"], figures["costs"]) if sum(block) == 12]
    assert full
    for block, cost in full:
        assert sum(block) == 12
        # Rank 2 has three times rank 0's share of the cost: within a sequence of the longest (12 tokens).
        assert abs(cost[2] - 3 * cost[0]) <= 3 * 12
    assert any(block != apportion(COST_SHARES, 12) for block, _ in full)  # counts are not what balances


def test_adaptive_shares_stay_under_the_emulated_memory_caps(results):
    _, per_rank = results
    schedule = per_rank[0]["capped"]["shares"]
    assert schedule and all(sum(shares) == 12 for shares in schedule)
    assert all(share <= cap for shares in schedule for share, cap in zip(shares, (3, 5, 6)))


def test_a_global_batch_above_the_caps_is_a_config_error_on_every_rank(results):
    _, per_rank = results
    for figures in per_rank:
        assert "a global batch of 20 does not fit under the ranks' memory caps [3, 5, 6]" in figures["too_big"]["error"]


def test_accumulated_shares_stay_uncapped_and_each_micro_batch_under_the_emulated_cap_counts_as_a_forward(results):
    _, per_rank = results
    for rank, figures in enumerate(per_rank):
        steps = figures["micro_batches"]
        assert steps["shares"] == [8, 8, 8]  # above the caps of 3 and 5: the loop accumulates
        assert steps["forwards"] == [[3, 2, 1][rank]] * 2  # ceil(8 / cap) near-equal micro-batches, every step
        assert steps["memory_warnings"] == []  # no forward above its rank's emulated memory


def test_hetdp_run_devices_reaches_a_drop_in_script_and_caps_its_shares(tmp_path, hetdp_run):
    table = tmp_path / "devices.toml"
    table.write_text(
        '[[devices]]\nname = "big"\nbatch_size = 8\nbatch_time_s = 0.004\n'
        '[[devices]]\nname = "small"\nbatch_size = 8\nbatch_time_s = 0.016\nmemory_mb = 1000\n'
        "fixed_memory_mb = 100\nactivation_mb_per_sample = 150\nstep_overhead_ms = 2\n"
    )
    script = Path(__file__).parent / "workers" / "devices_script.py"
    completed = hetdp_run("-n", 2, "--devices", table, script)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "rank 0: caps [None, 6]" in completed.stdout and "rank 1: caps [None, 6]" in completed.stdout
    schedule = json.loads(completed.stdout.split("rank 0:")[1].split("schedule ")[1].splitlines()[0])
    assert all(shares[1] <= 6 and sum(shares) == 16 for shares in schedule)
