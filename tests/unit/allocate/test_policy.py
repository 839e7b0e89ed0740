import math
import random

import pytest

from hetdp import Adaptive, ClusterSpec, ConfigError, DeviceSpec, Equal, Planned, Static
from hetdp.allocate.policy import MEETING_WINDOW, Allocator, allocation_policy


@pytest.mark.parametrize(
    ("text", "expected"),
    [("equal", Equal()), ("adaptive", Adaptive()), ("static:1,1,2,4", Static((1.0, 1.0, 2.0, 4.0)))],
)
def test_names_give_the_policies(text, expected):
    assert allocation_policy(text) == expected


@pytest.mark.parametrize("text", ["fair", "static", "static:1,x", "static:0,0", "adaptive:3"])
def test_bad_names_are_one_config_error(text):
    with pytest.raises(ConfigError, match="allocation must be|static weights"):
        allocation_policy(text)


def test_the_environment_chooses_when_the_code_does_not(monkeypatch):
    monkeypatch.setenv("HETDP_ALLOCATION", "equal")
    assert allocation_policy(None) == Equal()
    assert allocation_policy("adaptive") == Adaptive()  # the code's choice wins


def test_fixed_policies_never_ask_for_measurements():
    for policy in (Equal(), Static((1.0, 3.0))):
        allocator = Allocator(policy, 2, 100)
        assert allocator.window() is None and allocator.observe([[1.0], [9.0]]) is None
    assert Allocator(Static((1.0, 3.0)), 2, 100).shares == [25, 75]


def test_a_planned_allocation_follows_the_c_adp_plan():
    devices = (DeviceSpec(name="slow", batch_size=8, batch_time_s=0.04, bandwidth_mbps=math.inf),
               DeviceSpec(name="fast", batch_size=8, batch_time_s=0.01, bandwidth_mbps=math.inf))
    allocator = Allocator(Planned(cluster=ClusterSpec(devices=devices, sample_bytes=10, model_bytes=10)), 2, 100,
                          dataset_size=1000)
    assert allocator.shares == [20, 80]
    with pytest.raises(ConfigError, match="2 devices for 3 ranks"):
        Allocator(Planned(cluster=ClusterSpec(devices=devices, sample_bytes=10, model_bytes=10)), 3, 99,
                  dataset_size=1000)


def test_a_random_straggler_in_a_window_does_not_read_as_a_slower_device():
    allocator = Allocator(Adaptive(replan_every=5), 2, 100)
    # per-step seconds at shares [50, 50]: equal devices; rank 0 was delayed 200 ms in one step of five
    assert allocator.observe([[0.05, 0.05, 0.25, 0.05, 0.05], [0.05] * 5]) is None
    assert allocator.shares == [50, 50]


def test_timing_noise_of_two_step_windows_on_equal_devices_rarely_moves_the_shares():
    # Four equal ranks sharing two cores: each step takes 0.7x to 1.5x its usual time, at random. Over 300 runs of
    # ten re-plan windows, most never move (a trial and its roll-back count as two moves).
    replans = []
    for seed in range(300):
        rng = random.Random(seed)
        allocator = Allocator(Adaptive(), 4, 128)
        for _ in range(10):
            allocator.observe([[1e-4 * share * rng.uniform(0.7, 1.5) for _ in range(2)] for share in allocator.shares])
        replans.append(allocator.replans)
    assert replans.count(0) >= 0.75 * len(replans) and sum(replans) / len(replans) <= 0.4  # without the guard: 0 and 4.2


def test_a_rank_a_random_straggler_delayed_in_most_steps_of_a_window_is_not_read_as_slow():
    allocator = Allocator(Adaptive(replan_every=10), 2, 100)
    # equal devices; six of rank 0's ten steps were delayed 20 ms (a median would read it as 3x slower)
    delayed = [0.03, 0.01, 0.03, 0.03, 0.01, 0.03, 0.01, 0.03, 0.01, 0.03]
    assert allocator.observe([delayed, [0.01] * 10]) is None and allocator.shares == [50, 50]
    # a rank slowed down in every step is
    assert allocator.observe([[0.03] * 10, [0.01] * 10]) == [25, 75]


def test_a_rank_delayed_in_half_of_a_window_does_not_make_it_too_noisy_to_decide_on():
    allocator = Allocator(Adaptive(replan_every=4), 2, 100)
    # rank 0 is twice as slow; a random straggler delayed two of its four steps by 200 ms. The delays sit above the
    # low quantile that reads its speed, and are no noise to it: the window decides.
    assert allocator.observe([[0.100, 0.300, 0.101, 0.301], [0.050, 0.051, 0.050, 0.051]]) == [33, 67]


def test_a_window_too_noisy_to_decide_on_grows_until_its_typical_time_holds():
    allocator = Allocator(Adaptive(replan_every=2), 2, 100)
    # rank 0 is twice as slow, but one of its two steps was delayed: the two-step window says nothing yet
    allocator.observe([[0.10, 0.50], [0.05, 0.05]])
    assert allocator.shares == [50, 50] and allocator.window() == 4 and allocator.measured == 2
    shares = allocator.observe([[0.10, 0.10], [0.05, 0.05]])  # four steps: the low quantile ignores the delayed one
    assert shares == [33, 67] and allocator.measured == 0


def test_a_step_some_rank_did_not_time_is_left_out_of_the_window():
    # A rank that ran no forward with gradients in a step reports 0 s: no speed can be read off it.
    allocator = Allocator(Adaptive(replan_every=2), 2, 100)
    allocator.measure([0.0, 0.01])
    assert allocator.measured == 0
    allocator.measure([0.04, 0.01])
    allocator.measure([0.04, 0.01])
    assert allocator.measured == 2 and allocator.replan() == [20, 80]


def test_out_of_step_only_the_first_decision_comes_from_a_short_window():
    allocator = Allocator(Adaptive(replan_every=2), 2, 100)
    assert allocator.out_of_step_window() == 0  # equal shares were never measured: the rule's own window suffices
    allocator.observe([[0.04, 0.04], [0.01, 0.01]])
    assert allocator.shares == [20, 80] and allocator.out_of_step_window() == MEETING_WINDOW


def test_a_stable_allocation_decides_on_its_own_watch_window_when_a_speed_changes_inside_it():
    # Speeds 1 and 3, settled; rank 1 then drops to rank 0's speed at the second step of a 4-step watch window. Its
    # lower half (one fast step, one slow) is no timing noise: grown to 8 and 16 steps, the window held the change
    # for steps after it, and the re-plan came 20 steps after the window began instead of 12.
    allocator = Allocator(Adaptive(), 2, 100)
    allocator.observe([[0.10, 0.10], [0.0333, 0.0333]])
    while not allocator.stable:
        allocator.observe([[0.001 * allocator.shares[0]] * 2, [0.001 * allocator.shares[1] / 3] * 2])
    settled = list(allocator.shares)
    watch = allocator.window()

    def window(changed_from: int) -> list[list[float]]:
        return [[0.001 * allocator.shares[0]] * watch,
                [0.001 * allocator.shares[1] / (1 if step >= changed_from else 3) for step in range(watch)]]

    assert allocator.observe(window(1)) is None and allocator.measured == 0  # decided on: calm, too noisy to tell
    steps = watch
    while allocator.shares == settled:
        assert allocator.observe(window(0)) in (None, [50, 50]) and allocator.measured == 0
        steps += watch
    assert allocator.shares == [50, 50] and steps == 3 * watch
