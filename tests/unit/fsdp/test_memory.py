"""What a sharded rank holds whatever its batch, and the budget its device gives (the sharded spike's formula)."""

from __future__ import annotations

import pytest
import torch

from hetdp.cluster.devices import DeviceModel
from hetdp.cluster.emulate import Emulation
from hetdp.fsdp.memory import OPTIMIZER_COPIES, Footprint, UnitShape, budget, footprint


def test_a_rank_holds_its_shards_the_optimizer_s_copies_and_fsdp2_s_buffers():
    shapes = [UnitShape(gathered_bytes=400, reduced_bytes=800, kept=True),  # a root kept gathered
              UnitShape(gathered_bytes=1000, reduced_bytes=2000, kept=False),
              UnitShape(gathered_bytes=1000, reduced_bytes=2000, kept=False)]
    held = footprint(shapes, parameter_bytes=600)
    assert held == Footprint(parameters=600, gradients=600, optimizer=OPTIMIZER_COPIES * 600,
                             buffers=3 * 1000 + 2000 + 400)
    assert held.state == 600 * (2 + OPTIMIZER_COPIES) and held.held == held.state + held.buffers


def test_an_emulated_device_s_budget_is_its_table_memory_beside_its_fixed_part():
    held = footprint([UnitShape(gathered_bytes=1000, reduced_bytes=1000, kept=False)], parameter_bytes=500)
    devices = (DeviceModel(), DeviceModel(memory_mb=2.0, fixed_memory_mb=0.5, activation_mb_per_sample=0.25))
    emulation = Emulation(sample_cost_ms=1.0, devices=devices)
    mine = budget(1, torch.device("cpu"), emulation, held)
    assert mine.memory_bytes == pytest.approx(1.5e6) and mine.held_bytes == held.held
    assert mine.per_sample_bytes == pytest.approx(0.25e6) and mine.device == "its emulated device of 2 MB"
    assert budget(0, torch.device("cpu"), emulation, held) is None  # no memory given: nothing bounds the share


def test_a_device_table_without_activations_asks_for_a_probe():
    held = footprint([], parameter_bytes=0)
    emulation = Emulation(sample_cost_ms=1.0, devices=(DeviceModel(memory_mb=1.0),))
    assert budget(0, torch.device("cpu"), emulation, held).per_sample_bytes is None
