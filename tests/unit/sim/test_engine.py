import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetdp import ConfigError
from hetdp.collectives.protocol import initiator
from hetdp.sim.engine import LoopCosts, Strategy, simulate_strategy
from hetdp.sim.model import STRATEGIES


def fixed(seconds_per_sample):
    """Compute that takes share x seconds_per_sample[rank], the same every step."""
    per_sample = np.asarray(seconds_per_sample, dtype=float)
    return lambda step, shares: shares * per_sample


def drawn(world_size, seed, straggler_s=0.5):
    """Compute with jitter and a random straggler, a pure function of (seed, step)."""
    def compute_s(step, shares):
        rng = np.random.default_rng([seed, step])
        seconds = shares * 0.01 * rng.lognormal(0.0, 0.2, world_size)
        seconds[rng.integers(world_size)] += straggler_s
        return seconds
    return compute_s


def run(strategy, costs, world_size=4, global_batch=64, steps=20):
    return simulate_strategy(Strategy.parse(strategy), costs, world_size=world_size, global_batch=global_batch,
                             steps=steps)


def test_a_synchronous_step_is_the_loop_the_slowest_compute_and_the_allreduce():
    costs = LoopCosts(compute_s=fixed([0.01, 0.01, 0.02, 0.04]), loop_s=0.003, allreduce_s=0.005)
    result = run("equal", costs, steps=10)
    assert result.seconds == pytest.approx(10 * (0.003 + 16 * 0.04 + 0.005))


def test_static_shares_follow_the_speeds_and_balance_the_step():
    costs = LoopCosts(compute_s=fixed([0.04, 0.04, 0.02, 0.01]), static_weights=(1.0, 1.0, 2.0, 4.0))
    result = run("static", costs, steps=5)
    assert result.final_shares == [8, 8, 16, 32]
    assert result.seconds == pytest.approx(5 * 8 * 0.04)


def test_adaptive_allocation_reaches_the_balanced_shares_as_the_drop_in_does():
    costs = LoopCosts(compute_s=fixed([0.04, 0.04, 0.02, 0.01]))
    assert run("adaptive", costs).final_shares == [8, 8, 16, 32]
    assert run("adaptive+majority", costs).final_shares == [8, 8, 16, 32]  # re-planned at meetings


def test_local_averaging_meets_every_k_steps():
    costs = LoopCosts(compute_s=fixed([0.01] * 4), loop_s=0.001, average_s=0.05)
    result = run("equal+local:5", costs, steps=20)
    assert result.seconds == pytest.approx(20 * (0.001 + 16 * 0.01) + 4 * 0.05)


def test_a_quorum_of_every_rank_is_the_allreduce_plus_the_closing_meeting():
    costs = LoopCosts(compute_s=drawn(4, seed=1), allreduce_s=0.01, round_s=0.01, average_s=0.02)
    synchronous = run("equal", costs)
    quorum = run("equal+quorum:4", costs)
    assert quorum.seconds == pytest.approx(synchronous.seconds + 0.01 + 0.02)
    assert quorum.fresh_fraction == 1.0


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), world_size=st.integers(2, 12))
def test_solo_never_waits_longer_than_majority_nor_majority_than_allreduce(seed, world_size):
    costs = LoopCosts(compute_s=drawn(world_size, seed))  # free collectives: only the waiting differs
    seconds = {s: run(s, costs, world_size=world_size, global_batch=16 * world_size).seconds
               for s in ("equal+solo", "equal+majority", "equal")}
    assert seconds["equal+solo"] <= seconds["equal+majority"] + 1e-9
    assert seconds["equal+majority"] <= seconds["equal"] + 1e-9


def test_solo_runs_each_rank_at_its_own_pace_until_the_meeting():
    costs = LoopCosts(compute_s=fixed([0.01, 0.02, 0.03, 0.04]))
    result = run("equal+solo", costs, steps=10)
    assert result.seconds == pytest.approx(10 * 16 * 0.04)  # the slowest rank's own steps, never a wait
    assert result.fresh_fraction < 1.0  # the slow ranks' gradients miss rounds the fast ones fired


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_samples_per_second_is_the_global_batch_times_the_steps_over_the_time(strategy):
    costs = LoopCosts(compute_s=drawn(6, seed=3), loop_s=0.002, allreduce_s=0.01, round_s=0.012, average_s=0.01,
                      gather_s=0.001)
    result = run(strategy, costs, world_size=6, global_batch=96, steps=30)
    assert result.samples_per_s == pytest.approx(96 * 30 / result.seconds)
    fractions = (result.compute_fraction, result.wait_fraction, result.allreduce_fraction)
    assert all(0 <= fraction <= 1 for fraction in fractions) and sum(fractions) == pytest.approx(1.0)


@pytest.mark.parametrize("name", [*STRATEGIES, "static+quorum:3", "adaptive+local"])
def test_a_strategy_keeps_its_name(name):
    assert Strategy.parse(name).name == name


@pytest.mark.parametrize(("text", "message"), [
    ("gossip", "allocation must be one of"),
    ("equal+gossip", "synchronization must be one of"),
    ("equal+local:0", "K must be a positive integer"),
    ("equal+majority:3", "only quorum:K and local:K take a count"),
])
def test_bad_strategies_are_rejected(text, message):
    with pytest.raises(ConfigError, match=message):
        Strategy.parse(text)


def late_initiator(seed, world_size, late_steps, delay_s=1.0):
    """Compute of 0.01 s a sample, round 0's initiator ``delay_s`` late at each of ``late_steps``."""
    late = initiator(seed, 0, world_size)

    def compute_s(step, shares):
        seconds = shares * 0.01
        if step in late_steps:
            seconds[late] += delay_s
        return seconds
    return compute_s


@pytest.mark.parametrize(("bypass", "fresh"), [(True, 3 / 4), (False, 1.0)])
def test_a_majority_round_fires_without_an_initiator_that_is_the_only_rank_out(bypass, fresh):
    costs = LoopCosts(compute_s=late_initiator(0, 4, {0}), bypass=bypass)
    result = run("equal+majority", costs, steps=1)
    assert result.fresh_fraction == fresh  # bypassed, round 0 holds the three others; its initiator's goes stale
    assert result.seconds == pytest.approx(0.16 + 1.0)  # the meeting still waits for the late rank's own step


def test_a_bypassed_initiator_is_waited_for_at_its_next_round_until_it_arrives():
    seed = next(s for s in range(100) if initiator(s, 0, 4) == initiator(s, 1, 4))  # rounds 0 and 1: one initiator
    costs = LoopCosts(compute_s=late_initiator(seed, 4, {0, 1}), seed=seed)
    result = run("equal+majority", costs, steps=2)
    # Round 0 fires without it and its step-0 gradient goes stale; round 1 waits for it, which carries that gradient
    # and the fresh step 1 of every rank: two rounds and the meeting's. Bypassed again, its step 1 would need a third.
    assert result.rounds == 2 + 1
    assert result.fresh_fraction == 7 / 8
    assert result.seconds == pytest.approx(2 * (0.16 + 1.0))


@pytest.mark.parametrize(("grace", "fresh"), [(0.05, 1.0), (0.0, 1 / 4)])
def test_a_majority_initiator_waits_its_grace_for_the_ranks_just_behind(grace, fresh):
    per_sample = np.full(4, 0.01025)  # the others 4 ms behind a 160 ms step: within a grace of 5%, 8 ms
    per_sample[initiator(0, 0, 4)] = 0.01
    result = run("equal+majority", LoopCosts(compute_s=fixed(per_sample), grace=grace), steps=1)
    assert result.fresh_fraction == fresh
