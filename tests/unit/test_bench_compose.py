"""hetdp bench compose's figures, read off the mean curves of the repeats, on made-up curves."""

from __future__ import annotations

import argparse

import pytest

from hetdp.bench.compose import PAIRINGS, _seed_list, group_seeds, render, run, summarize, summarize_seeds
from hetdp.errors import ConfigError

SNAPSHOTS = 10
STEPS = [2, 4, 6, 8, 9, 11, 13, 15, 17, 18]
"""Steps trained at each snapshot: every two, and at the ends of epochs of 9 steps (as the bench snapshots)."""


def _run(first_good: int | None, seconds_per_snapshot: float, samples_per_s: float = 100.0) -> dict:
    """A run whose accuracy is 0 before snapshot ``first_good`` and 1 from it (never, for None)."""
    good = SNAPSHOTS if first_good is None else first_good
    return {"time_s": [seconds_per_snapshot * (i + 1) for i in range(SNAPSHOTS)],
            "accuracy": [0.0 if i < good else 1.0 for i in range(SNAPSHOTS)],
            "steps": list(STEPS),
            "shares": [16, 16, 16, 16], "samples_per_s": samples_per_s}


EXACT_PAIRS = [{"parameter_gap": 3e-7, "parameter_moved": 0.5}, {"parameter_gap": 5e-7, "parameter_moved": 0.4}]
"""Per repeat: how far apart the synchronous pairings end, and how far training moved them."""


def _raw(first_good: dict[str, tuple[int | None, int | None]]) -> dict:
    """Two repeats per pairing: the first at 1 s per snapshot, the second at 2 s."""
    return {"settings": {"straggler_ms": 100.0, "global_batch": 64, "epochs": 4, "lr": 0.05, "momentum": 0.9},
            "runs": {name: [_run(first_good[name][0], 1.0, 100.0), _run(first_good[name][1], 2.0, 200.0)]
                     for name in first_good},
            "exact_pairs": EXACT_PAIRS}


def _figures(first_good: dict[str, tuple[int | None, int | None]]) -> dict:
    return summarize(_raw(first_good), (1.0, 1.0, 2.0, 4.0), quorum=2)


BASE = {"equal+allreduce": (0, 0), "adaptive+allreduce": (2, 2), "equal+majority": (3, None),
        "adaptive+majority": (1, 3), "adaptive+quorum": (0, 0)}


def test_pairings_are_named_in_order():
    assert list(BASE) == [f"{allocation}+{sync}" for allocation, sync in PAIRINGS]


def test_the_time_to_accuracy_is_read_off_the_mean_curve_not_averaged_over_the_repeats():
    result = _figures(BASE)
    # A mean curve reaches 1 once every repeat has: the five-snapshot window is then all ones, four snapshots on.
    assert result["time_to_accuracy_s"]["adaptive+allreduce"] == pytest.approx(1.5 * 7)
    assert result["time_to_accuracy_s"]["adaptive+majority"] == pytest.approx(1.5 * 8)
    assert result["time_to_accuracy_s"]["equal+majority"] is None  # its second repeat never gets there
    assert result["speedup_vs_best_single_axis"] == pytest.approx(7 / 8)
    # Each repeat alone: 7 s against 6 s (equal+majority 8 s), then 14 s against 16 s (equal+majority never).
    assert result["per_repeat"]["speedup_vs_best_single_axis"] == pytest.approx([7 / 6, 14 / 16])
    assert result["repeats"] == 2


def test_accuracy_drop_and_throughput_are_means_over_the_repeats():
    result = _figures(BASE)
    assert result["accuracy_drop_points"] == pytest.approx(0.0)
    assert result["final_accuracy"]["equal+majority"] == pytest.approx(0.5)  # one repeat at 1, the other at 0
    assert result["per_repeat"]["accuracy_drop_points"] == [pytest.approx(0.0), pytest.approx(0.0)]
    assert result["samples_per_s"]["adaptive+majority"] == pytest.approx(150.0)
    assert result["train_s"]["adaptive+majority"] == pytest.approx(1.5 * SNAPSHOTS)


def test_the_synchronous_pairings_are_compared_on_parameters_at_their_worst_repeat():
    result = _figures(BASE)
    assert result["exact_pairs"] == EXACT_PAIRS
    assert result["parameter_gap"] == 5e-7 and result["parameter_moved"] == 0.4
    assert ("equal+allreduce and adaptive+allreduce (exact gradients, their own shares) end at most 5.0e-07 apart in "
            "any parameter, which training moved by at least 0.40") in render(result)
    seeds = _two_seeds(BASE)
    assert [figures["parameter_gap"] for figures in seeds["per_seed"]] == [3e-7, 5e-7]
    assert seeds["parameter_gap"] == 5e-7 and "at most 5.0e-07 apart" in render(seeds)


def test_no_speedup_when_the_composed_pairing_never_reaches_the_target():
    result = _figures({**BASE, "adaptive+majority": (1, None)})
    assert result["speedup_vs_best_single_axis"] is None
    assert result["per_repeat"]["speedup_vs_best_single_axis"] == [pytest.approx(7 / 6), None]
    assert "run by run: 1.17x, -" in render(result)


def test_one_run_reports_its_figures_once():
    raw = _raw(BASE)
    raw["runs"] = {name: repeats[:1] for name, repeats in raw["runs"].items()}
    raw["exact_pairs"] = raw["exact_pairs"][:1]
    result = summarize(raw, (1.0, 1.0, 2.0, 4.0), quorum=2)
    assert result["repeats"] == 1
    assert result["per_repeat"]["speedup_vs_best_single_axis"] == [result["speedup_vs_best_single_axis"]]
    assert result["speedup_vs_best_single_axis"] == pytest.approx(7 / 6)
    assert "run by run" not in render(result) and "runs" not in render(result)


def test_the_steps_to_accuracy_are_read_at_the_same_crossing_as_the_time():
    result = _figures(BASE)
    assert result["steps_to_accuracy"]["adaptive+allreduce"] == 13  # the snapshot at 1.5 * 7 s
    assert result["steps_to_accuracy"]["adaptive+majority"] == 15  # the one at 1.5 * 8 s
    assert result["steps_to_accuracy"]["equal+majority"] is None


def test_the_render_takes_the_speedup_apart_into_pace_and_steps():
    text = render(_figures(BASE))
    # adaptive+majority: 15 steps in 12 s against adaptive+allreduce's 13 in 10.5 s; the product is the speedup 7/8.
    pace, steps = (15 / 12) / (13 / 10.5), 15 / 13
    assert pace / steps == pytest.approx(7 / 8)
    assert (f"takes {pace:.2f}x the steps per second of adaptive+allreduce up to the target and needs {steps:.2f}x its "
            f"steps") in text
    assert "steps per second" not in render(_figures({**BASE, "adaptive+majority": (1, None)}))


@pytest.mark.parametrize("momentum", [-0.1, 1.0])
def test_a_momentum_outside_0_to_1_is_refused_before_any_rank_starts(momentum: float):
    args = argparse.Namespace(speeds="1,2", straggler_ms=5.0, epochs=1, global_batch=32, sample_cost_ms=0.2,
                              sync_every=0, quorum=None, lr=0.05, momentum=momentum, repeats=1, quick=True, seed=0,
                              seeds=None)
    with pytest.raises(ConfigError, match="--momentum"):
        run(args)


def _two_seeds(first_good: dict[str, tuple[int | None, int | None]]) -> dict:
    """Seeds 3 and 7, one run each: seed 3's at 1 s per snapshot, seed 7's at 2 s."""
    return summarize_seeds(_raw(first_good), (3, 7), (1.0, 1.0, 2.0, 4.0), quorum=2)


def test_the_figures_over_the_seeds_are_read_off_their_mean_curves_and_each_seeds_beside_them():
    result = _two_seeds(BASE)
    # Seed 3: adaptive+majority at 6 s against adaptive+allreduce's 7 s; seed 7: 16 s against 14 s.
    assert [figures["seed"] for figures in result["per_seed"]] == [3, 7]
    assert [figures["speedup_vs_best_single_axis"] for figures in result["per_seed"]] == [
        pytest.approx(7 / 6), pytest.approx(14 / 16)]
    # The mean curves, as the repeats of one seed are read: 1.5 * 7 s against 1.5 * 8 s.
    assert result["mean_speedup_vs_best_single_axis"] == pytest.approx(7 / 8)
    assert result["time_to_accuracy_s"]["adaptive+majority"] == pytest.approx(1.5 * 8)
    assert result["speedup_spread"]["min"] == pytest.approx(14 / 16)
    assert result["speedup_spread"]["max"] == pytest.approx(7 / 6)
    assert result["mean_accuracy_drop_points"] == pytest.approx(0.0)
    assert result["repeats"] == 1 and result["seeds_without_speedup"] == []
    assert result["meets_targets"] is False  # 7/8 < 1.15


def _flat_run(accuracy: float, seconds_per_snapshot: float) -> dict:
    return {**_run(0, seconds_per_snapshot), "accuracy": [accuracy] * SNAPSHOTS}


def test_a_seed_that_misses_its_own_target_is_named_and_the_mean_curves_still_decide():
    """Seed 7's adaptive+majority ends 1.5 points below its synchronous run, so never reaches its own target; over
    both seeds the drop is 0.75 points, and the mean curve reaches the mean target."""
    finals = {"equal+allreduce": (0.96, 0.97), "adaptive+allreduce": (0.96, 0.97), "equal+majority": (0.96, 0.97),
              "adaptive+majority": (0.96, 0.955), "adaptive+quorum": (0.96, 0.97)}
    raw = _raw(BASE)
    raw["runs"] = {name: [_flat_run(first, 1.0), _flat_run(second, 2.0)] for name, (first, second) in finals.items()}
    result = summarize_seeds(raw, (3, 7), (1.0, 1.0, 2.0, 4.0), quorum=2)
    assert [figures["speedup_vs_best_single_axis"] for figures in result["per_seed"]] == [pytest.approx(1.0), None]
    assert result["seeds_without_speedup"] == [7]
    assert result["target_accuracy"] == pytest.approx(0.955)
    assert result["mean_speedup_vs_best_single_axis"] == pytest.approx(1.0)
    assert result["mean_accuracy_drop_points"] == pytest.approx(0.75)
    assert "never on seed 7" in render(result)


def test_no_speedup_when_the_mean_curve_never_reaches_the_mean_target():
    result = _two_seeds({**BASE, "adaptive+majority": (1, None), "equal+allreduce": (0, 2)})
    assert result["seeds_without_speedup"] == [7]
    assert result["mean_speedup_vs_best_single_axis"] is None  # the mean curve ends at 0.5 against 0.99
    assert result["mean_accuracy_drop_points"] == pytest.approx(50.0)  # seed 7 ends at 0 against 1
    assert result["accuracy_drop_spread"] == {"min": pytest.approx(0.0), "max": pytest.approx(100.0),
                                              "stdev": pytest.approx(70.71, abs=0.01)}
    assert result["meets_targets"] is False
    text = render(result)
    assert "never on seed 7" in text and "seed by seed 1.17 to 1.17x" in text and "targets not met" in text


def test_seeds_that_meet_both_targets_say_so():
    result = _two_seeds({**BASE, "adaptive+majority": (0, 0)})
    assert result["mean_speedup_vs_best_single_axis"] > 1.15
    assert result["meets_targets"] is True and "targets met" in render(result)


def test_seeds_are_distinct_integers_and_exclude_seed():
    assert _seed_list("0,1,2,3,4") == (0, 1, 2, 3, 4)
    for bad in ("0,x", "1,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            _seed_list(bad)
    args = argparse.Namespace(speeds="1,2", straggler_ms=5.0, epochs=1, global_batch=32, sample_cost_ms=0.2,
                              sync_every=0, quorum=None, lr=0.05, momentum=0.9, repeats=None, quick=True, seed=2,
                              seeds=(0, 1))
    with pytest.raises(ConfigError, match="either --seed or --seeds"):
        run(args)


def test_each_group_runs_one_repeat_of_one_seed_and_no_two_groups_share_a_repeat():
    seeds, repeats = (0, 1, 4), 2
    runs = [group_seeds(group, seeds, repeats) for group in range(len(seeds) * repeats)]
    assert [of_seed for of_seed, _ in runs] == [0, 0, 1, 1, 4, 4]  # the order summarize_seeds reads them in
    assert len({seed for _, seed in runs}) == len(runs)
    assert group_seeds(1, (3,), 3) == (3, 10)  # --seeds 3 runs the repeats --seed 3 runs
