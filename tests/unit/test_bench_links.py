"""`hetdp bench links`' figures from its workers' measurements (the launch across emulated hosts is a benchmark's)."""

import math

import pytest

from hetdp.bench import links

SETTINGS = {"uplink_mbit": 50.0, "rate_mbit": 1000.0, "speeds": [1.0, 1.0, 2.0, 2.0], "sample_cost_ms": 8.0,
            "hidden": 256, "epochs": 3, "seed": 0}


def _rows(seconds, shares, samples, compute_s, tail_s=(0.1, 0.1, 0.3, 0.3), accuracy=0.9):
    return [{"epoch": i, "epoch_s": s, "warmup": i == 0, "shares": shares, "samples": samples,
             "compute_s": compute_s, "wait_s": [0.2] * 4, "steps": 45, "sat_out": {}, "diagnosis": "why",
             "tail_s": list(tail_s), "accuracy": accuracy} for i, s in enumerate(seconds)]


def test_every_method_is_timed_alike_against_ddp_beside_its_ideal_and_its_accuracy():
    # DDP: 360 samples a rank at 8, 8, 4 and 4 ms: the slowest computes 2.88 s; balanced, 1440 samples at 125 + 125
    # + 250 + 250 samples/s take 1.92 s
    ddp = _rows([9.0, 4.4, 4.0], [32] * 4, [360] * 4, [2.88, 2.88, 1.44, 1.44], accuracy=0.8)
    cadp = _rows([9.0, 2.2, 2.2], [0] * 4, [300, 300, 419, 419], [2.0] * 4, tail_s=(0.2, 0.3, 0.9, 0.9), accuracy=0.85)
    runs = {"rows": {"cadp": cadp, "ddp": ddp, "adaptive": _rows([3.0, 2.75, 2.75], [26, 0, 51, 51], [1] * 4, [1] * 4),
                     "local_sgd": _rows([2.3, 2.2, 2.2], [21, 21, 43, 43], [1] * 4, [1] * 4, accuracy=0.7)},
            "cadp": {"samples": [300, 300, 419, 419], "predicted_epoch_s": 2.0, "predicted_comm_s": 0.1,
                     "predicted_compute_s": 1.9, "send_s": 0.05, "predicted_send_s": 0.04},
            "probed_mbit": [math.inf, 950.0, 47.5, 48.0], "probed_latency_ms": [0.0, 0.3, 0.4, 0.5],
            "model_bytes": 340_000.0}
    result = links.figures(runs, SETTINGS)
    assert result["epoch_s"]["ddp"] == pytest.approx(4.2)  # the median past the warm-up, as for every method
    assert math.isclose(result["prediction_error"], 0.1)
    assert result["merge_s"] == 0.2  # from the last step of the rank that computed longest: the merge after it
    assert result["speedup_vs_ddp"] == pytest.approx({"cadp": 4.2 / 2.2, "adaptive": 4.2 / 2.75,
                                                      "local_sgd": 4.2 / 2.2})
    assert result["ideal_speedup"]["adaptive"] == pytest.approx(4.2 / (4.2 - 0.96))
    assert result["ideal_speedup"]["local_sgd"] == pytest.approx(4.2 / (1.92 + 0.2))
    assert result["accuracy"] == {"cadp": 0.85, "ddp": 0.8, "adaptive": 0.9, "local_sgd": 0.7}
    assert result["tbf_mbit"] == [None, 1000.0, 50.0, 50.0] and result["probed_mbit"][0] is None
    assert [round(error, 3) if error is not None else None for error in result["probe_error"]] == [
        None, 0.05, 0.05, 0.04]
    assert result["shares"]["adaptive"] == [26, 0, 51, 51] and result["targets"]["prediction_error"]["met"]
    text = links.render({**result, "benchmark": "links"})
    assert "prediction_error      0.100   target <= 0.15  met" in text and "1.91x" in text and "0.85" in text
