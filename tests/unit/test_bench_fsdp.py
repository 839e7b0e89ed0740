"""`hetdp bench fsdp`'s figures from rows as its workers write them (the launch itself is a benchmark's)."""

from hetdp.bench import fsdp


def _rows(seconds, shares, caps=None):
    return [{"epoch": i, "epoch_s": s, "shares": shares, "caps": caps, "diagnosis": "d"} for i, s in enumerate(seconds)]


def test_the_figures_are_ratios_of_steady_epochs_and_the_state_a_rank_holds_against_a_replica():
    raw = {"runs": {"equal": _rows([9.0, 8.0], [16] * 4), "adaptive": _rows([6.0, 4.0], [8, 8, 16, 32]),
                    "ddp": _rows([4.0, 3.2], [8, 8, 16, 32])},
           "capped": {"caps": [None, None, None, 20], "shares": [11, 11, 22, 20], "diagnosis": "rank 3 is bound"},
           "param_gap": 1e-7, "state_bytes_per_rank": [250, 250, 251, 250], "replica_state_bytes": 1000,
           "sample_cost_ms": 80.0, "calibration": {}, "parameters": 42}
    result = fsdp.summarize(raw)
    assert result["speedup_vs_equal"] == 2.0 and result["vs_ddp"] == 1.25  # the last epochs: 8 / 4, 4 / 3.2
    assert result["final_shares"] == [8, 8, 16, 32] and result["state_fraction"] == 0.251
    assert result["caps"] == [None, None, None, 20] and result["capped_shares"] == [11, 11, 22, 20]
    text = fsdp.render(result)
    assert "speedup_vs_equal 2.00" in text and "param_gap 1.0e-07" in text and "11,11,22,20" in text
