"""Each rank's memory for memory-sized shards (``hetdp.fsdp.budgets``): read from the emulated devices' table, equal
memories (within 5%) keep torch's even shards, and a device that cannot hold a unit at all is one error naming it."""

from __future__ import annotations

import pytest

from hetdp import ConfigError
from hetdp.cluster.devices import DeviceModel
from hetdp.cluster.emulate import Emulation
from hetdp.fsdp.budgets import EVEN_WITHIN, MemoryBudget, check_room, row_weights, table_budgets


def _budgets(*megabytes: float | None) -> list[MemoryBudget]:
    return [MemoryBudget(bytes=None if size is None else size * 1e6, device=f"its device of {size} MB")
            for size in megabytes]


def test_the_device_table_gives_each_rank_its_memory_less_its_fixed_part():
    devices = (DeviceModel(memory_mb=40.0, fixed_memory_mb=4.0), DeviceModel(memory_mb=80.0), DeviceModel())
    budgets = table_budgets(Emulation(sample_cost_ms=1.0, devices=devices), 4)
    assert [budget.bytes for budget in budgets] == [36e6, 80e6, None, None]
    assert budgets[0].device == "its emulated device of 40 MB"


def test_known_unequal_memories_weigh_the_rows_and_anything_else_keeps_even_shards():
    assert row_weights(_budgets(1, 1, 2, 4)) == (1e6, 1e6, 2e6, 4e6)
    assert row_weights(_budgets(1, 1, 2, None)) is None  # one unknown: even
    assert row_weights(_budgets(4)) is None  # one rank
    assert row_weights(_budgets(80, 80 * (1 + EVEN_WITHIN))) is None  # equal cards, a little free memory apart
    assert row_weights(_budgets(80, 80 * (1 + 2 * EVEN_WITHIN))) is not None


def test_a_device_with_no_memory_left_is_one_error_naming_it():
    with pytest.raises(ConfigError, match=r"^rank 1: its device of -2 MB leaves no memory to hold a shard"):
        row_weights(_budgets(4, -2))


def test_a_device_that_cannot_hold_a_unit_whole_beside_its_part_is_one_error_with_the_bytes():
    budgets = _budgets(1, 0.5)
    check_room(budgets, whole_bytes=400_000, part_bytes=[50_000, 50_000], unit="Block")
    with pytest.raises(ConfigError) as error:
        check_room(budgets, whole_bytes=400_000, part_bytes=[200_000, 150_000], unit="Block")
    assert str(error.value) == ("rank 1: its device of 0.5 MB cannot hold any shard of Block: it would need 0.55 MB "
                                "(0.4 MB to compute with it whole, 0.15 MB of its state) and has 0.5 MB; give it more "
                                "memory, or leave it out of the group")
