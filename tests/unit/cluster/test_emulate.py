import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetdp import ConfigError, Emulation, Link
from hetdp.cluster.devices import DeviceModel
from hetdp.cluster.emulate import parse_speeds


def test_environment_round_trip_reaches_workers_unchanged():
    emulation = Emulation(speeds=(1.0, 2.5), sample_cost_ms=3.0, straggler_count=1, straggler_delay_ms=200.0, seed=9)
    assert Emulation.from_env(emulation.to_env()) == emulation
    assert Emulation.from_env({}) == Emulation()


def test_stretch_mode_runs_the_fastest_rank_natively_and_slows_the_others():
    emulation = Emulation(speeds=(1.0, 4.0))
    assert emulation.padding_s(1, measured_s=0.1, samples=10) == 0.0
    assert emulation.padding_s(0, measured_s=0.1, samples=10) == pytest.approx(0.3)


def test_synthetic_mode_pads_to_samples_times_cost_over_speed():
    emulation = Emulation(speeds=(1.0, 4.0), sample_cost_ms=2.0)
    assert emulation.padding_s(1, measured_s=0.001, samples=8) == pytest.approx(0.004 - 0.001)
    assert emulation.padding_s(0, measured_s=1.0, samples=8) == 0.0  # real compute already slower


def test_synthetic_mode_sleeps_a_lead_first_and_counts_it_in_the_block():
    emulation = Emulation(speeds=(1.0, 4.0), sample_cost_ms=2.0)
    lead_s = emulation.lead_s(1, samples=8)
    assert 0 < lead_s < 0.004
    measured_s = lead_s + 0.001
    assert measured_s + emulation.padding_s(1, measured_s=measured_s, samples=8) == pytest.approx(0.004)
    assert Emulation(speeds=(1.0, 4.0)).lead_s(0, samples=8) == 0.0  # stretching cannot know the length ahead


@given(seed=st.integers(0, 100), step=st.integers(0, 1000), world=st.integers(1, 16), count=st.integers(0, 4))
def test_straggler_draws_are_a_function_of_seed_and_step(seed, step, world, count):
    first = Emulation(straggler_count=count, straggler_delay_ms=5.0, seed=seed)
    second = Emulation(straggler_count=count, straggler_delay_ms=5.0, seed=seed)
    drawn = first.stragglers(step, world)
    assert drawn == second.stragglers(step, world)
    assert len(drawn) == min(count, world) and all(0 <= rank < world for rank in drawn)


def test_link_time_is_latency_plus_size_over_bandwidth():
    assert Link(bandwidth_mbps=8.0, latency_ms=10.0).transfer_s(1_000_000) == pytest.approx(0.01 + 1.0)


@pytest.mark.parametrize("text", ["0", "-2", "1,abc", "inf", ""])
def test_bad_speeds_are_rejected(text):
    with pytest.raises(ConfigError, match="speeds"):
        parse_speeds(text)


@pytest.mark.parametrize("kwargs", [{"bandwidth_mbps": 0.0}, {"bandwidth_mbps": 1.0, "latency_ms": -1.0}])
def test_bad_links_are_rejected(kwargs):
    with pytest.raises(ConfigError):
        Link(**kwargs)


@pytest.mark.parametrize(("emulation", "says"), [
    (Emulation(speeds=(1.0, 2.0, 4.0)), r"gives 3 speeds \(HETDP_SPEEDS\) for a group of 4 ranks"),
    (Emulation(speed_changes=((10, (1.0, 2.0)),)), r"gives 2 speeds from step 10 \(HETDP_SPEED_CHANGES\)"),
    (Emulation(sample_cost_ms=1.0, devices=(DeviceModel(),) * 2), r"gives 2 device models \(HETDP_DEVICES\)"),
])
def test_settings_for_another_number_of_ranks_are_one_config_error(emulation, says):
    """Under an engine the settings are the environment's, which no `hetdp run` counted against the group."""
    with pytest.raises(ConfigError, match=says):
        emulation.pacer(0, 4)
    Emulation(speeds=(1.0, 2.0, 4.0, 8.0)).pacer(3, 4)
