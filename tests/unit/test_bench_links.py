"""`hetdp bench links`' figures from its workers' measurements (the launch across emulated hosts is a benchmark's)."""

import math

from hetdp.bench import links

SETTINGS = {"uplink_mbit": 50.0, "rate_mbit": 1000.0, "speeds": [1.0, 1.0, 2.0, 2.0], "sample_cost_ms": 8.0,
            "hidden": 256, "epochs": 3, "seed": 0}


def _run(epochs_s, shares, tail_s=(0.1, 0.1, 0.3, 0.3)):
    return {"epochs_s": epochs_s, "epoch_s": epochs_s[-1], "shares": shares, "diagnosis": "why", "tail_s": list(tail_s)}


def test_prediction_error_speedups_and_probe_errors_come_from_one_launch():
    cadp = {**_run([9.0, 2.2, 2.2], [0, 0, 0, 0], tail_s=(0.2, 0.3, 0.9, 0.9)), "epoch_s": 2.2,
            "samples": [300, 300, 419, 419], "predicted_epoch_s": 2.0, "predicted_comm_s": 0.1,
            "predicted_compute_s": 1.9, "send_s": 0.05, "predicted_send_s": 0.04}
    runs = {"cadp": cadp, "ddp": _run([4.4], [32] * 4), "adaptive": _run([3.0, 2.75], [26, 0, 51, 51]),
            "local_sgd": _run([2.3, 2.2], [21, 21, 43, 43]), "probed_mbit": [math.inf, 950.0, 47.5, 48.0],
            "probed_latency_ms": [0.0, 0.3, 0.4, 0.5], "model_bytes": 340_000.0}
    result = links.figures(runs, SETTINGS)
    assert math.isclose(result["prediction_error"], 0.1)
    assert result["merge_s"] == 0.2  # from the last step of the rank that computed longest: the merge after it
    assert result["speedup_vs_ddp"] == {"cadp": 2.0, "adaptive": 1.6, "local_sgd": 2.0}
    assert result["tbf_mbit"] == [None, 1000.0, 50.0, 50.0] and result["probed_mbit"][0] is None
    assert [round(error, 3) if error is not None else None for error in result["probe_error"]] == [
        None, 0.05, 0.05, 0.04]
    assert result["shares"]["adaptive"] == [26, 0, 51, 51] and result["targets"]["prediction_error"]["met"]
    text = links.render({**result, "benchmark": "links"})
    assert "prediction_error      0.100   target <= 0.15  met" in text and "2.00x" in text
