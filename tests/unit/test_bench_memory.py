"""`hetdp bench memory`: its figures from the record its workers write, and the meter that decides whether a model
fits, on a model sharded by torch's fully_shard in one process (the launch itself is a benchmark's)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from hetdp.bench import memory


def _raw() -> dict:
    probe = {"kind": "even", "layers": 13, "parameters": 100, "fits": True, "reason": "", "peak_held": [1, 1, 1, 1]}
    return {"capacity": {"even": {"layers": 13, "parameters": 1000, "peak_held": [11, 11, 11, 11]},
                         "uneven": {"layers": 26, "parameters": 1990, "peak_held": [11, 11, 22, 42]}},
            "state_bytes_per_rank": [100, 100, 210, 400], "probes": [probe], "timed": {"even": [2.0, 1.0, 3.0],
                                                                                       "uneven": [2.5, 2.0, 1.0]},
            "timed_layers": 13, "timed_parameters": 1000, "param_gap": 1e-7, "adamw_gap": {"even": 1e-4,
                                                                                          "uneven": 1e-4}}


def test_the_figures_are_measured_capacities_their_ratio_and_the_state_against_its_proportion_of_memory():
    result = memory.summarize(_raw(), (12.0, 12.0, 24.0, 48.0))
    assert result["capacity_ratio"] == 1.99 and result["memory_per_rank"] == [12_000_000] * 2 + [24_000_000, 48_000_000]
    # 810 bytes of state split as 12, 12, 24, 48: 101.25, 101.25, 202.5, 405; the worst is rank 2's 210 (3.7% over).
    assert result["state_vs_proportional"] == pytest.approx(210 / 202.5 - 1)
    assert result["speed_vs_even"] == 1.0  # medians: 2.0 / 2.0
    text = memory.render(result)
    assert "capacity_ratio 1.99 (ideal 2.0; target >= 1.6, goal 1.8)" in text
    assert "param_gap 1.0e-07 (ideal 0; target <= 1e-5)" in text and "speed_vs_even 1.00 (ideal 1.0 or more" in text


def test_the_meter_counts_the_state_the_optimizer_holds_and_the_activations_autograd_holds_while_it_holds_them(
        one_rank):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    fully_shard(model[0])
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meter = memory.MemoryMeter(model, optimizer)
    parameters = sum(p.numel() * 4 for p in model.parameters())
    assert meter.held() >= parameters
    with meter.saving():
        loss = model(torch.randn(32, 64)).square().mean()
        during = meter.held()
        loss.backward()
    assert during > parameters and not meter._saved  # the activations went with the graph
    optimizer.step()
    meter.sample()
    assert meter.state_bytes() >= 4 * parameters  # parameters, gradients, two moments
    assert meter.peak >= meter.state_bytes()
    with pytest.raises(memory.EmulatedOutOfMemory, match=r"^step 3: rank 0 held [0-9.]+ MB, more than its 0.001 MB$"):
        memory.check_room(meter, [1e3], 3)
    meter.close()
