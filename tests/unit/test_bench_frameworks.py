"""hetdp bench frameworks: its settings are checked before any worker starts, and its table reads its figures;
the one-process reference it measures the parameter gap against trains on the global batches."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch.utils.data import DistributedSampler

from hetdp.bench.frameworks import Classifier, Paced, Points, reference, render, run, summarize
from hetdp.cluster.emulate import Emulation
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


def _rows(side, seconds, shares, samples=None, compute_s=None):
    rows = [{"side": side, "fit": 0, "epoch": i, "epoch_s": s, "warmup": i == 0, "shares": shares, "sat_out": {}}
            for i, s in enumerate(seconds)]
    if samples is not None:
        for row in rows:
            row.update(samples=samples, compute_s=compute_s, wait_s=[0.01] * 4, steps=12)
    return rows


def test_each_framework_is_read_against_its_own_ddp_beside_the_ideal_and_the_table_shows_it():
    # hetdp's adaptive run measured 4, 4, 2 and 1 ms a sample: under DDP's 384 samples a rank the slowest computes
    # 1.536 s; balanced, 1536 samples at 250 + 250 + 500 + 1000 samples/s take 0.768 s
    raw = {"runs": {"framework_ddp": _rows("framework_ddp", [3.0, 1.7, 1.6], [32] * 4),
                    "hetdp_adaptive": _rows("hetdp_adaptive", [2.0, 0.9, 0.95], [16, 16, 32, 64],
                                            samples=[192, 192, 384, 768], compute_s=[0.768] * 4)},
           "param_gap": 3e-8}
    figures = summarize(raw, batch_per_rank=32)
    assert figures["speedup_vs_framework_ddp"] == pytest.approx(1.65 / 0.925)
    assert figures["ideal_speedup"] == pytest.approx(1.65 / (1.65 - 0.768))
    assert figures["per_sample_ms"] == pytest.approx([4.0, 4.0, 2.0, 1.0])
    result = {"frameworks": {"lightning": figures}, "missing": ["transformers"],
              "settings": {"samples": 1536, "epochs": 3, "rounds": 2, "speeds": [1.0, 1.0, 2.0, 4.0],
                           "sample_cost_ms": 4.0, "batch_per_rank": 32, "static_shares": [1.0, 1.0, 2.0, 4.0],
                           "baselines": {"lightning": 'Lightning Trainer(strategy="ddp")'}}}
    table = render(result)
    assert "lightning" in table and "1.784" in table and "16,16,32,64" in table and "3e-08" in table
    assert 'strategy="ddp"' in table and "not installed, skipped: transformers" in table


def test_a_paced_model_computes_as_the_model_does_and_counts_its_forwards():
    net = Classifier(0)
    paced = Paced(net, Emulation(), rank=0)
    x, labels = torch.randn(5, 16), torch.randint(0, 4, (5,))
    torch.testing.assert_close(paced(x, labels)["loss"], net(x, labels)["loss"])
    assert paced.calls == 1 and list(paced.parameters()) == list(net.parameters())


def test_the_reference_takes_one_sgd_step_per_global_batch():
    data = Points(10, seed=0)
    trained = reference(Classifier(0), data, global_batch=10, seed=0)  # one step on the whole set, in any order
    expected = Classifier(0)
    expected(data.x, data.labels)["loss"].backward()
    with torch.no_grad():
        for parameter in expected.parameters():
            parameter -= 0.2 * parameter.grad
    for a, b in zip(trained.parameters(), expected.parameters()):
        torch.testing.assert_close(a, b)


def test_the_reference_takes_the_global_batches_in_distributed_samplers_order():
    data = Points(12, seed=0)
    trained = reference(Classifier(0), data, global_batch=4, seed=7)
    order = list(DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=7))  # torch's global order
    expected = Classifier(0)
    optimizer = torch.optim.SGD(expected.parameters(), lr=0.2)
    for first in range(0, 12, 4):
        index = torch.tensor(order[first : first + 4])
        optimizer.zero_grad()
        expected(data.x[index], data.labels[index])["loss"].backward()
        optimizer.step()
    for a, b in zip(trained.parameters(), expected.parameters()):
        torch.testing.assert_close(a, b)
