"""The verdict a failed collective reaches from two reads of every rank's heartbeat, and the store clients a heartbeat
keeps."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import distributed_c10d
from hypothesis import given
from hypothesis import strategies as st

from hetdp.runtime.liveness import Heartbeat, Verdict, judge, step_progress

RANKS = [0, 1, 2, 3]


def test_a_rank_whose_beat_did_not_move_is_silent():
    before = [(5, 8), (5, 8), (3, 6), (5, 8)]
    after = [(7, 9), (7, 9), (3, 6), (7, 9)]
    assert judge(before, after, me=0, ranks=RANKS) == Verdict(silent=(2,))


def test_a_rank_that_never_beat_is_silent():
    assert judge([(1, 0), None], [(3, 1), None], me=0, ranks=[0, 1]).silent == (1,)


def test_a_rank_that_beats_but_lags_behind_this_one_is_stuck():
    before = [(5, 9), (5, 8), (5, 9)]
    after = [(7, 9), (7, 8), (7, 9)]
    assert judge(before, after, me=2, ranks=[0, 1, 2]) == Verdict(stuck=(1,))


@given(st.integers(0, 1000))
def test_a_rank_held_up_before_its_forward_lags_one_waiting_inside_the_step(steps_done):
    # The others wait in a collective their forward began with (an all-gather, a buffer broadcast); this one has not
    # started the step: behind, and behind one whose gradient synchronizes. A clock's "reached" left over from the
    # last step does not count before the step starts.
    idle = step_progress(steps_done, started=False, reached=True, epoch_ends=0)
    forward = step_progress(steps_done, started=True, reached=False, epoch_ends=0)
    synchronizing = step_progress(steps_done, started=True, reached=True, epoch_ends=0)
    assert idle < forward < synchronizing < step_progress(steps_done + 1, started=False, reached=False, epoch_ends=0)


@given(st.integers(0, 1000), st.integers(0, 100))
def test_a_rank_held_up_before_its_epoch_end_lags_the_ranks_in_it_and_leads_any_still_in_a_step(steps_done, ends):
    # Every rank meets at an epoch's end between two steps: one held up after its last step (its own code before the
    # loader's next batch) has not entered it; the ranks in it have not started the next step.
    held = step_progress(steps_done, started=False, reached=False, epoch_ends=ends)
    meeting = step_progress(steps_done, started=False, reached=False, epoch_ends=ends + 1)
    next_step = step_progress(steps_done, started=True, reached=False, epoch_ends=ends + 1)
    last_step = step_progress(steps_done - 1, started=True, reached=True, epoch_ends=ends)
    assert last_step < held < meeting < next_step


def test_silence_outranks_lag_and_ranks_are_named_in_the_default_group():
    before = [(5, 9), (5, 8), (5, 9)]
    after = [(7, 9), (7, 8), (5, 9)]
    verdict = judge(before, after, me=0, ranks=[4, 6, 8])
    assert verdict == Verdict(silent=(8,), stuck=(6,))
    assert verdict.culprits == (8,)
    assert verdict.describe().startswith("rank 8 stopped answering")


def test_every_rank_alive_and_level_names_nobody():
    state = [(5, 9), (5, 9)]
    verdict = judge(state, [(6, 9), (6, 9)], me=1, ranks=[0, 1])
    assert verdict.culprits == () and verdict.describe() == ""


@given(st.lists(st.integers(0, 64), max_size=5, unique=True), st.lists(st.integers(0, 64), max_size=5, unique=True))
def test_a_verdict_survives_the_store(silent, stuck):
    verdict = Verdict(tuple(silent), tuple(stuck))
    assert Verdict.decode(verdict.encode()) == verdict


def test_a_heartbeat_takes_the_store_clients_of_a_stopped_one(one_rank):
    """A model built after another one connects nothing new to the process group's store, and beats into it."""
    first = Heartbeat(dist.group.WORLD, lambda: 0).start()
    store, beater = first._store, first._beater
    first.stop()
    second = Heartbeat(dist.group.WORLD, lambda: 7).start()
    try:
        assert second._store is store and second._beater is beater
        assert distributed_c10d._get_default_store().get(f"{second._prefix}0") == b"1 7"
    finally:
        second.stop()
