"""hetdp bench compose's launch: its repeats train at once, each on a group of ranks of its own."""

from __future__ import annotations

import argparse

from hetdp.bench.compose import PAIRINGS, run


def test_repeats_train_at_once_on_groups_of_their_own_from_their_own_seeds():
    args = argparse.Namespace(speeds="1,2", straggler_ms=5.0, epochs=1, global_batch=32, sample_cost_ms=2.0,
                              sync_every=0, quorum=None, lr=0.05, momentum=0.9, repeats=2, quick=False, seed=0,
                              seeds=None)
    result = run(args)  # 4 ranks: repeat 0 on ranks 0-1, repeat 1 on ranks 2-3
    assert result["repeats"] == 2 and len(result["runs"]) == len(PAIRINGS)
    for name, repeats in result["runs"].items():
        assert len(repeats) == 2, name
        for run_ in repeats:  # snapshots every 2 of the epoch's 45 steps, and at its end
            assert len(run_["accuracy"]) == len(run_["time_s"]) == 23, name
            assert run_["steps"] == [*range(2, 45, 2), 45], name
            assert run_["time_s"] == sorted(run_["time_s"]) and sum(run_["shares"]) == 32, (name, run_)
        # Each repeat from its own initial model and data order: their curves differ.
        assert repeats[0]["accuracy"] != repeats[1]["accuracy"], name
    # Within a repeat every pairing starts from the same model: both allreduce pairings (exact gradients) end with
    # the same parameters whatever their shares, to rounding. At 2 ms a sample, well above the real compute, the
    # adaptive shares leave equal ones, which the comparison needs. A weighting of the ranks off by a fraction f of a
    # step's gradient moves the parameters about f of what training moved them: the bound fails any f above 1/1000.
    adaptive = result["runs"]["adaptive+allreduce"]
    assert all(run_["shares"][0] < run_["shares"][1] for run_ in adaptive), adaptive  # speeds 1, 2
    assert len(result["exact_pairs"]) == 2
    for pair in result["exact_pairs"]:
        assert pair["parameter_gap"] <= pair["parameter_moved"] / 1000, pair
