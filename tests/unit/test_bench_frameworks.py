"""hetdp bench frameworks: its settings are checked before any worker starts, and its table reads its figures;
the one-process reference it measures the parameter gap against trains on the global batches."""

from __future__ import annotations

import argparse

import pytest
import torch

from hetdp.bench.frameworks import Classifier, Points, reference, render, run
from hetdp.errors import ConfigError


def _args(**overrides) -> argparse.Namespace:
    settings = {"frameworks": "lightning,accelerate,transformers", "sample_cost_ms": 4.0, "batch_size": 32,
                "quick": True, "seed": 0}
    return argparse.Namespace(**{**settings, **overrides})


@pytest.mark.parametrize("overrides", [{"frameworks": "keras"}, {"frameworks": ""}, {"batch_size": 0},
                                       {"sample_cost_ms": 0.0}])
def test_bad_settings_are_one_config_error_before_any_worker_starts(overrides):
    with pytest.raises(ConfigError):
        run(_args(**overrides))


def test_the_table_shows_each_frameworks_speedup_shares_and_gap():
    figures = {"equal_epoch_s": 2.0, "hetdp_epoch_s": 1.25, "speedup_vs_framework_ddp": 1.6,
               "final_shares": [16, 16, 32, 64], "first_epoch_shares": [16, 16, 32, 64], "param_gap": 3e-8}
    result = {"frameworks": {"lightning": figures}, "missing": ["transformers"],
              "settings": {"samples": 2048, "epochs": 2, "speeds": [1.0, 1.0, 2.0, 4.0], "sample_cost_ms": 4.0,
                           "batch_per_rank": 32, "static_shares": [1.0, 1.0, 2.0, 4.0]}}
    table = render(result)
    assert "lightning" in table and "1.6" in table and "16,16,32,64" in table and "3e-08" in table
    assert "not installed, skipped: transformers" in table


def test_the_reference_takes_one_sgd_step_per_global_batch():
    data = Points(10, seed=0)
    trained = reference(Classifier(0), data, global_batch=10, seed=0)  # one step on the whole set
    expected = Classifier(0)
    expected(data.x, data.labels)["loss"].backward()
    with torch.no_grad():
        for parameter in expected.parameters():
            parameter -= 0.2 * parameter.grad
    for a, b in zip(trained.parameters(), expected.parameters()):
        torch.testing.assert_close(a, b)
