"""`hetdp bench subset`'s figures from rows as its workers write them (the launch itself is a benchmark's)."""

import pytest

from hetdp.bench import subset


def _rows(seconds, shares, samples, compute_s, *, sat_out=(), all_in_exchange_s=None, warmup=None):
    warmup = len(seconds) // 2 if warmup is None else warmup
    return [{"epoch": i, "epoch_s": s, "report_epoch_s": 0.96 * s, "warmup": i < warmup, "shares": shares, "samples": samples,
             "compute_s": compute_s, "wait_s": [0.1] * 4, "steps": 12,
             "sat_out": {str(r): "why" for r in sat_out}, "all_in_exchange_s": all_in_exchange_s}
            for i, s in enumerate(seconds)]


def _raw(exchange_s):
    heavy = (_rows([2.0], [32] * 4, [384, 384, 384, 384], [0.384, 38.4, 38.4, 38.4], all_in_exchange_s=exchange_s,
                   warmup=1)
             + _rows([1.0, 1.0, 1.0], [128, 0, 0, 0], [1536, 0, 0, 0], [1.536, 0.0, 0.0, 0.0], sat_out=(1, 2, 3),
                     warmup=0))
    return {"parameters": {"mlp": 10, "convnet": 5}, "comm_heavy_sample_cost_ms": 100.0, "runs": {
        "fastest_alone": _rows([2.0, 1.0, 0.95, 0.95], [128, 0, 0, 0], [1536, 0, 0, 0], [0.0] * 4),
        "alone_kept_current": _rows([2.0, 1.0, 0.98, 0.98], [128, 0, 0, 0], [1536, 0, 0, 0], [0.0] * 4),
        "comm_heavy": heavy,
        # equal: 384 samples a rank at 8, 8, 4 and 2 ms: the slowest computes 3.072 s; balanced, 1536 samples at
        # 125 + 125 + 250 + 500 samples/s take 1.536 s
        "balanced_equal": _rows([4.0, 4.0, 3.2, 3.2], [32] * 4, [384] * 4, [3.072, 3.072, 1.536, 0.768]),
        "balanced_adaptive": _rows([3.0, 2.5, 1.8, 1.8], [16, 16, 32, 64], [192, 192, 384, 768], [1.536] * 4)}}


def test_the_group_is_read_against_the_best_subset_and_the_balanced_run_against_its_ideal():
    result = subset.summarize(_raw(exchange_s=0.05))
    assert result["vs_fastest_alone"] == pytest.approx(0.95)  # steady epochs past the warm-up
    heavy = result["settings"]["comm_heavy"]  # the end work the drop-in's own clock leaves out, on its own
    assert heavy["end_work_s"] == pytest.approx(0.04) and heavy["vs_fastest_alone_before_end_work"] == pytest.approx(
        0.95 / 0.96)
    # everyone in: 1536 samples at 1 ms (fast) against 1 / (1 + 3 / 100) ms: saves 0.045 s, adds 12 x 0.05 s
    best = result["settings"]["comm_heavy"]["best_subset"]
    assert best["all_in_epoch_s"] == pytest.approx(0.95 - 1.536 * (1 - 1 / 1.03) + 0.6)
    assert best["subset"] == [0] and result["ideal_vs_fastest_alone"] == 1.0
    assert result["efficiency_vs_best_subset"] == pytest.approx(0.95)
    # the floor: the fastest alone, then each epoch's gather and broadcast
    assert result["floor_vs_fastest_alone"] == pytest.approx(0.95 / 0.98)
    assert result["efficiency_vs_floor"] == pytest.approx(0.98)
    assert result["balanced_ideal_speedup"] == pytest.approx(3.2 / (3.2 - 1.536))
    assert result["balanced_efficiency"] == pytest.approx((3.2 - 1.536) / 1.8)
    assert result["settings"]["comm_heavy"]["sat_out"] == [1, 2, 3] and result["settings"]["balanced"]["sat_out"] == []
    text = subset.render({**result, "benchmark": "subset"})
    assert "vs_fastest_alone 0.950 (ideal 1.000)" in text and "balanced_efficiency 0.924" in text
    assert "0.969 of the fastest alone; the group 0.980 of the floor" in text


def test_everyone_in_is_the_best_subset_where_the_exchange_costs_less_than_the_compute_saved():
    result = subset.summarize(_raw(exchange_s=0.001))
    best = result["settings"]["comm_heavy"]["best_subset"]
    assert best["subset"] == [0, 1, 2, 3] and result["ideal_vs_fastest_alone"] > 1.0
    no_step_all_in = subset.summarize(_raw(exchange_s=None))["settings"]["comm_heavy"]["best_subset"]
    assert no_step_all_in["subset"] == [0] and "all_in_epoch_s" not in no_step_all_in
