"""The round rules of partial allreduce, in one process: initiators, firing, and one rank's ledger."""

from __future__ import annotations

import inspect
import threading
from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import hetdp
from hetdp.cluster.emulate import Emulation
from hetdp.collectives.partial import Partial, PartialAllreduce
from hetdp.collectives.protocol import GRACE, RoundBook, fires, grace_s, initiator
from hetdp.errors import ConfigError


def test_initiator_is_a_pure_function_of_seed_and_round():
    assert [initiator(3, r, 8) for r in range(50)] == [initiator(3, r, 8) for r in range(50)]
    assert [initiator(3, r, 8) for r in range(50)] != [initiator(4, r, 8) for r in range(50)]


def test_initiators_do_not_follow_other_draws_on_the_same_seed():
    emulation = Emulation(straggler_count=1, straggler_delay_ms=1.0, seed=0)
    same = sum(initiator(0, step, 8) in emulation.stragglers(step, 8) for step in range(800))
    assert 50 <= same <= 150  # independent draws agree one time in eight


def test_initiators_are_spread_evenly_over_the_ranks():
    counts = Counter(initiator(0, r, 8) for r in range(8000))
    assert set(counts) == set(range(8))
    assert all(800 <= n <= 1200 for n in counts.values())  # expectation 1000, sd about 30


@pytest.mark.parametrize(
    ("mode", "required", "arrivals", "flushing", "initiator_in", "expected"),
    [
        ("solo", 1, 1, 0, False, True),
        ("solo", 1, 0, 3, False, False),  # flushing ranks alone never fire a round
        ("majority", 1, 5, 0, False, False),  # only the initiator fires it
        ("majority", 1, 1, 0, True, True),
        ("quorum", 3, 2, 0, False, False),
        ("quorum", 3, 3, 0, False, True),
        ("quorum", 3, 2, 1, False, True),  # a flushing rank counts as arrived
        ("quorum", 3, 0, 4, False, False),
        ("full", 4, 3, 0, False, False),
        ("full", 4, 4, 0, False, True),
    ],
)
def test_when_a_round_fires(mode, required, arrivals, flushing, initiator_in, expected):
    assert fires(mode, required, arrivals=arrivals, flushing=flushing, initiator_in=initiator_in) is expected


@given(k=st.integers(1, 8), arrivals=st.integers(0, 8))
def test_a_quorum_without_flushing_ranks_fires_exactly_from_k_arrivals(k, arrivals):
    assert fires("quorum", k, arrivals=arrivals) is (arrivals >= k)


def _complete(book: RoundBook, rounds: list) -> None:
    snapshot = book.take()
    rounds.append(snapshot)
    book.complete(snapshot.round, snapshot.payload.clone())


def test_a_deposit_travels_in_the_next_round_with_its_counters():
    book = RoundBook(3, torch.float64)
    deposit = book.deposit(torch.tensor([1.0, 2.0, 3.0]))
    assert (deposit.round, deposit.missed, deposit.arrived) == (0, False, True)
    book.deposit(torch.tensor([1.0, 1.0, 1.0]))
    snapshot = book.take()
    assert snapshot.payload.tolist() == [2.0, 3.0, 4.0, 1.0, 2.0]  # data, arrived, parts
    assert book.take().payload.tolist() == [0.0] * 5  # the buffer was emptied


def test_a_call_after_rounds_ran_without_it_returns_them_in_order_and_carries_its_tensor():
    book, rounds = RoundBook(2, torch.float64), []
    book.deposit(torch.tensor([1.0, 0.0]))
    _complete(book, rounds)
    assert [r[0].item() for r in book.wait_collect(0, timeout_s=1.0)] == [1.0]
    _complete(book, rounds)  # rounds 1 and 2 run while this rank computes
    _complete(book, rounds)
    late = book.deposit(torch.tensor([0.0, 5.0]))
    assert (late.round, late.missed, late.arrived, late.last_needed) == (3, True, False, 2)
    assert [int(r[-1]) for r in book.wait_collect(late.last_needed, timeout_s=1.0)] == [0, 0]
    _complete(book, rounds)
    assert rounds[-1].payload.tolist() == [0.0, 5.0, 0.0, 1.0]  # carried, not an arrival, counted once


def test_a_flushing_round_is_counted():
    book = RoundBook(1, torch.float32)
    book.complete(book.take().round, "round 0")
    book.complete(book.take().round, "round 1")
    book.flushed()
    assert book.flushes == 1 and book.collect_completed() == ["round 0", "round 1"]


@given(plan=st.lists(st.tuples(st.booleans(), st.integers(-5, 5)), min_size=1, max_size=40))
def test_conservation_every_deposit_lands_in_exactly_one_round(plan):
    book, rounds, total = RoundBook(1, torch.float64), [], 0
    for take_now, value in plan:
        if take_now:
            _complete(book, rounds)
        else:
            book.deposit(torch.tensor([float(value)]))
            total += value
    _complete(book, rounds)
    assert sum(r.payload[0].item() for r in rounds) == total
    assert sum(r.payload[2].item() for r in rounds) == sum(1 for take_now, _ in plan if not take_now)


def test_a_waiting_caller_wakes_when_its_round_completes_and_on_errors():
    book = RoundBook(1, torch.float32)
    book.deposit(torch.ones(1))
    runner = threading.Timer(0.05, lambda: _complete(book, []))
    runner.start()
    assert len(book.wait_collect(0, timeout_s=5.0)) == 1
    runner.join()
    assert book.wait_collect(1, timeout_s=0.01) is None  # a deadline, then None
    threading.Timer(0.05, lambda: book.fail(RuntimeError("peer gone"))).start()
    with pytest.raises(RuntimeError, match="peer gone"):
        book.wait_collect(1, timeout_s=5.0)


def test_a_grace_is_a_part_of_the_median_recent_step():
    assert grace_s([], 0.5) == 0.0  # no step measured yet: fire at once
    assert grace_s([0.1, 0.1, 0.1], 0.0) == 0.0  # the paper's rule
    assert grace_s([0.1, 0.1, 2.0], 0.05) == pytest.approx(0.005)  # a meeting's long step moves nothing


@given(st.lists(st.floats(1e-4, 10.0), min_size=1, max_size=9), st.floats(0.0, 0.99))
def test_a_grace_never_exceeds_its_part_of_the_longest_step(steps, grace):
    assert 0.0 <= grace_s(steps, grace) <= grace * max(steps) * (1 + 1e-12)


@pytest.mark.parametrize("grace", [-0.1, 1.0, True, "0.1"])
def test_a_grace_outside_a_step_is_one_clear_error(grace):
    with pytest.raises(ConfigError, match="grace"):
        Partial(grace=grace)


def test_the_drop_ins_majority_waits_its_grace_and_the_papers_collective_does_not():
    assert Partial().grace == GRACE > 0
    assert Partial(grace=0.0).grace == 0.0
    assert inspect.signature(PartialAllreduce).parameters["grace"].default == 0.0


def test_the_drop_ins_majority_bypasses_a_lone_late_initiator_and_the_papers_collective_does_not():
    assert Partial().bypass is True
    assert Partial(bypass=False).bypass is False
    assert inspect.signature(PartialAllreduce).parameters["bypass"].default is False


def test_a_bypass_that_is_not_a_bool_is_one_clear_error():
    with pytest.raises(ConfigError, match="bypass must be True or False"):
        Partial(bypass="yes")


def test_the_old_names_keep_working_for_a_release_with_the_papers_rules():
    with pytest.warns(DeprecationWarning, match="use hetdp.Partial"):
        config = hetdp.PartialConfig(mode="solo")
    assert config == Partial(mode="solo", grace=0.0, bypass=False)
    with pytest.warns(DeprecationWarning, match=r"hetdp.Partial\(every=K\)"):
        assert Partial(sync_every=3).every == 3
