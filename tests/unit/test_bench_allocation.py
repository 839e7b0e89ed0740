"""`hetdp bench allocation`'s figures from rows as its workers write them (the launch itself is a benchmark's)."""

from __future__ import annotations

import pytest

from hetdp.bench import allocation

SPEEDS = (1.0, 1.0, 2.0, 4.0)


def _rows(seconds, shares, compute_s, samples, *, wait_s=(0.1, 0.1, 0.1, 0.1), sat_out=(), accuracy=0.9):
    return [{"epoch": i, "epoch_s": s, "warmup": i < len(seconds) // 2, "shares": shares, "samples": samples,
             "compute_s": compute_s, "wait_s": list(wait_s), "steps": 10, "replans": [],
             "sat_out": {str(rank): "why" for rank in sat_out}, "accuracy": accuracy}
            for i, s in enumerate(seconds)]


def _raw(homogeneous=None):
    # 1000 samples a rank under equal shares at 8, 8, 4, 2 ms a sample: the slowest computes 8 s; balanced,
    # 4000 samples at 125 + 125 + 250 + 500 samples/s take 4 s; the equal epoch of 9 s keeps 1 s of the rest
    equal = _rows([20.0, 9.0, 9.0, 9.0], [64] * 4, [8.0, 8.0, 4.0, 2.0], [1000] * 4)
    adaptive = _rows([12.0, 7.0, 5.0, 5.0], [32, 32, 64, 128], [4.0] * 4, [500, 500, 1000, 2000])
    static = _rows([6.0, 6.0, 6.0, 6.0], [32, 32, 64, 128], [4.0] * 4, [500, 500, 1000, 2000])
    return {"runs": {"equal": equal, "static": static, "adaptive": adaptive}, "settings": {},
            "homogeneous": homogeneous}


def test_speedup_is_read_against_the_ideal_from_the_equal_runs_own_compute():
    result = allocation.summarize(SPEEDS, _raw())
    assert result["speedup_vs_equal"] == pytest.approx(9.0 / 5.0)  # medians of the epochs past the warm-up
    assert result["ideal_speedup"] == pytest.approx(9.0 / 5.0)  # 9 s less the 4 s balanced shares save
    assert result["efficiency"] == pytest.approx(1.0) and result["efficiency_static"] == pytest.approx(5.0 / 6.0)
    assert result["per_sample_ms"] == pytest.approx([8.0, 8.0, 4.0, 2.0])
    assert result["exchange_ms_per_step"] == pytest.approx(10.0)  # 0.1 s over 10 steps
    assert result["ideal_speedup_from_speeds"] == 2.0 and "overhead_vs_ddp" not in result
    assert "ideal 1.800x" in allocation.render(result)


def test_the_overhead_is_the_drop_in_against_torch_ddp_every_rank_in_and_who_sat_out_is_recorded():
    def side(seconds, sat_out=()):
        return _rows(seconds, [16] * 4, [1.0] * 4, [100] * 4, sat_out=sat_out)

    homogeneous = {"torch_ddp": side([3.0, 9.0, 2.0, 2.0]), "hetdp_adaptive": side([3.0, 2.2, 2.1, 2.1]),
                   "hetdp_equal": side([3.0, 1.9, 1.9, 1.9], sat_out=(2,))}
    result = allocation.summarize(SPEEDS, _raw(homogeneous))
    assert result["overhead_vs_ddp"] == pytest.approx(0.05) and result["overhead_vs_ddp_equal"] == pytest.approx(-0.05)
    assert result["homogeneous"]["sat_out"] == {"torch_ddp": [], "hetdp_adaptive": [], "hetdp_equal": [2]}
    assert result["homogeneous"]["shares"]["hetdp_adaptive"] == [[16] * 4] * 4
    assert "overhead_vs_ddp +5.0%" in allocation.render(result)
