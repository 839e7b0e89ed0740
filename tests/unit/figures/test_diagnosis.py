from hetdp.figures.metrics import EpochReport, diagnose_straggler


def test_a_slow_computer_is_named_as_the_compute_straggler():
    verdict = diagnose_straggler(compute_s=[2.9, 1.5, 1.4, 0.7], wait_s=[0.2, 1.6, 1.7, 2.4])
    assert verdict.startswith("rank 0 is the straggler, by compute")


def test_balanced_compute_with_long_allreduces_is_communication_bound():
    verdict = diagnose_straggler(compute_s=[1.50, 1.52, 1.47, 1.42], wait_s=[0.9, 0.95, 1.0, 1.1])
    assert verdict.startswith("no compute straggler: communication-bound")


def test_equal_devices_that_tie_are_named_together_every_time():
    verdict = diagnose_straggler(compute_s=[4.10, 4.09, 2.05, 1.03], wait_s=[0.1, 0.1, 2.1, 3.1])
    assert verdict.startswith("ranks 0, 1 are the stragglers, by compute")


def test_an_exchange_that_is_a_small_part_of_the_step_is_not_communication_bound():
    # about 6% of the epoch in the exchange: the run is bound by compute, and the verdict gives the share
    verdict = diagnose_straggler(compute_s=[9.4, 9.35, 9.3, 9.38], wait_s=[0.6, 0.65, 0.7, 0.62])
    assert verdict.startswith("no straggler: bound by compute, the exchange takes 6% of the time")


def test_a_communication_bound_verdict_gives_the_exchanges_share_of_the_step():
    verdict = diagnose_straggler(compute_s=[1.50, 1.52, 1.47, 1.42], wait_s=[0.9, 0.95, 1.0, 1.1])
    assert "the exchange takes 36% of the time (every rank spends 0.90 s of 2.52 s in it)" in verdict


def test_a_compute_spread_within_noise_names_no_straggler():
    verdict = diagnose_straggler(compute_s=[5.0, 4.9, 4.95, 4.92], wait_s=[0.01, 0.11, 0.06, 0.09])
    assert verdict.startswith("no straggler")


def test_one_rank_has_nothing_to_wait_for():
    assert diagnose_straggler(compute_s=[3.0], wait_s=[0.03]) == "one rank: nothing to wait for (3.00 s computing)"


def test_the_diagnosis_names_the_ranks_that_sat_out_and_why_and_judges_the_members_alone():
    from hetdp import EpochReport

    report = EpochReport(epoch=0, shares=[0, 32, 0, 0], steps=10, epoch_s=1.0, compute_s=[0.01, 0.9, 0.02, 0.02],
                         wait_s=[0.0, 0.0, 0.0, 0.0], samples=[0, 320, 0, 0],
                         sat_out={0: "its 100 samples/s would save 1.0 ms", 2: "x", 3: "y"})
    text = report.diagnosis()
    assert text.startswith("rank 1 trains alone") and "rank 0 sat out: its 100 samples/s would save 1.0 ms" in text
    assert "communication-bound" not in text
    assert EpochReport(epoch=0, shares=[1], steps=1, epoch_s=1.0, compute_s=[1.0], wait_s=[0.03],
                       samples=[1]).diagnosis() == "rank 0 trains alone: no straggler, no exchange"


def test_a_rank_held_at_its_memory_cap_below_what_its_speed_would_take_is_named():
    # Rank 3 computes 4 times as fast, but its memory holds 5 of 16 samples: its speed would take 9.
    report = EpochReport(epoch=0, shares=[4, 4, 3, 5], steps=10, epoch_s=1.0, compute_s=[0.8, 0.8, 0.6, 0.25],
                         wait_s=[0.05, 0.05, 0.25, 0.6], samples=[40, 40, 30, 50], caps=[None, None, None, 5])
    assert report.memory_bound() == {3: 9}
    assert report.diagnosis().endswith("; rank 3 is bound by memory, not speed: its share 5 is its cap, its speed "
                                       "would take 9")


def test_a_cap_its_speed_would_not_reach_bounds_nothing():
    report = EpochReport(epoch=0, shares=[8, 8], steps=10, epoch_s=1.0, compute_s=[0.8, 0.8], wait_s=[0.1, 0.1],
                         samples=[80, 80], caps=[None, 8])
    assert report.memory_bound() == {} and "memory" not in report.diagnosis()
