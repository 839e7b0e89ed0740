"""`hetdp bench fsdp`'s figures from rows as its workers write them (the launch itself is a benchmark's)."""

import pytest

from hetdp.bench import fsdp


def _rows(seconds, shares, compute_s=(1.0,) * 4, samples=(96,) * 4, caps=None):
    return [{"epoch": i, "epoch_s": s, "warmup": i == 0, "shares": shares, "samples": list(samples),
             "compute_s": list(compute_s), "wait_s": [0.3] * 4, "steps": 6, "sat_out": {}, "caps": caps,
             "diagnosis": "d"} for i, s in enumerate(seconds)]


def _raw(held_bytes):
    # equal: 96 samples a rank at 10, 10, 5 and 2.5 ms a sample: the slowest computes 0.96 s; balanced, 384 samples
    # at 100 + 100 + 200 + 400 samples/s take 0.48 s
    equal = _rows([9.0, 1.5, 1.6], [16] * 4, compute_s=(0.96, 0.96, 0.48, 0.24))
    return {"runs": {"equal": equal, "adaptive": _rows([6.0, 1.1, 1.14], [8, 8, 16, 32]),
                     "ddp": _rows([4.0, 0.5, 0.5], [8, 8, 16, 32])},
            "plain": {"torch_fully_shard": _rows([3.0, 1.0, 1.0], [16] * 4),
                      "hetdp_equal": _rows([3.0, 1.02, 1.02], [16] * 4)},
            "capped": {"caps": [None, None, None, 20], "shares": [11, 11, 22, 20], "diagnosis": "rank 3 is bound",
                       "rank": 3, "memory_mb": 12.0, "activation_mb_per_sample": 0.5, "held_bytes": held_bytes},
            "param_gap": 1e-7, "state_bytes_per_rank": [250, 250, 251, 250], "replica_state_bytes": 1000,
            "sample_cost_ms": 10.0, "parameters": 42}


def test_the_figures_are_steady_epochs_against_the_ideal_and_torchs_fully_shard():
    result = fsdp.summarize(_raw({"16": 9_000_000, "20": 11_400_000}))
    assert result["speedup_vs_equal"] == pytest.approx(1.55 / 1.12)  # medians past the warm-up epoch
    assert result["ideal_speedup"] == pytest.approx(1.55 / (1.55 - 0.48))
    assert result["efficiency"] == pytest.approx(result["speedup_vs_equal"] / result["ideal_speedup"])
    assert result["vs_fully_shard"] == pytest.approx(1.02) and result["vs_ddp"] == pytest.approx(2.24)
    assert result["final_shares"] == [8, 8, 16, 32] and result["state_fraction"] == 0.251
    assert result["caps"] == [None, None, None, 20] and result["capped_shares"] == [11, 11, 22, 20]
    text = fsdp.render(result)
    assert "efficiency 0.955" in text and "vs_fully_shard 1.020" in text and "11,11,22,20" in text


def test_the_cap_is_checked_against_the_memory_the_rank_held():
    held = fsdp.held_figures(_raw({"16": 9_000_000, "20": 11_400_000})["capped"])
    assert held["largest_share"] == 20 and held["cap_holds"] and held["held_mb"] == pytest.approx(11.4)
    assert held["mb_per_sample"] == pytest.approx(0.6) and held["spare_samples"] == pytest.approx(1.0)
    overrun = fsdp.held_figures(_raw({"16": 9_000_000, "20": 12_600_000})["capped"])
    assert not overrun["cap_holds"] and overrun["spare_samples"] == pytest.approx(-0.6 / 0.9)
    assert "OVERRUN" in fsdp.render(fsdp.summarize(_raw({"16": 9_000_000, "20": 12_600_000})))
    single = fsdp.held_figures(_raw({"20": 11_000_000})["capped"])
    assert single["cap_holds"] and single["spare_samples"] is None
