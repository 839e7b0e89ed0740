"""The recursive-doubling schedule, executed symbolically: every rank ends with every contribution, once."""

from __future__ import annotations

import pytest

from hetdp.collectives.doubling import exchanges

MATCHES = {("send", "fold"), ("fold", "send"), ("swap", "swap"), ("unfold", "recv"), ("recv", "unfold")}


def run_schedule(world_size: int) -> list[frozenset[int]]:
    """Execute every rank's exchanges, matching each step with its peer's; return what each rank summed."""
    schedules = [exchanges(rank, world_size) for rank in range(world_size)]
    held = [frozenset([rank]) for rank in range(world_size)]
    while any(schedules):
        progressed = False
        for rank in range(world_size):
            if not schedules[rank]:
                continue
            kind, peer, tag = schedules[rank][0]
            if not schedules[peer]:
                continue
            other_kind, other_peer, other_tag = schedules[peer][0]
            if other_peer != rank or (kind, other_kind) not in MATCHES:
                continue
            assert tag == other_tag, (rank, peer)
            mine, theirs = held[rank], held[peer]
            if kind == "swap":
                assert not mine & theirs  # nothing counted twice
                held[rank] = held[peer] = mine | theirs
            elif kind == "fold":
                assert not mine & theirs
                held[rank] = mine | theirs
            elif kind == "send":
                held[peer] = mine | theirs
            elif kind == "unfold":
                held[peer] = mine
            else:
                held[rank] = theirs
            schedules[rank].pop(0)
            schedules[peer].pop(0)
            progressed = True
        assert progressed, f"deadlock in the schedule for {world_size} ranks"
    return held


@pytest.mark.parametrize("world_size", range(1, 34))
def test_every_rank_sums_every_contribution_exactly_once(world_size):
    everyone = frozenset(range(world_size))
    assert run_schedule(world_size) == [everyone] * world_size


def test_a_power_of_two_takes_log2_exchanges():
    assert [len(exchanges(rank, 16)) for rank in range(16)] == [4] * 16
    assert exchanges(5, 6) == [("send", 1, 0), ("recv", 1, 63)]  # folded into rank 1
