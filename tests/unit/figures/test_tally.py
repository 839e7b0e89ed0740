"""The epoch's figures: one rank's tally, and the report every rank builds from all ranks' totals."""

import pytest
import torch

from hetdp.figures.clock import StepTimes
from hetdp.figures.tally import Epochs, EpochTally, EpochTotals


def test_the_report_takes_the_slowest_rank_for_the_epoch_and_the_sample_weighted_loss():
    tally = EpochTally(2, first=10)
    tally.add_step(StepTimes(0.0, [[0.5, 0.6]]), 3)  # host marks: ready at 0.5 s, synchronized at 0.6 s
    tally.add_loss(torch.tensor(2.0), 3)
    tally.add_replan(12, [2, 6])
    mine = tally.totals()
    assert (mine.compute_s, mine.wait_s, mine.samples, mine.loss, mine.loss_samples) == (0.5, pytest.approx(0.1), 3.0,
                                                                                         6.0, 3.0)
    other = EpochTotals(compute_s=0.25, wait_s=0.3, samples=5.0, elapsed_s=9.0, loss=5.0, loss_samples=5.0)
    report = tally.report([EpochTotals.of(mine.values()), other], shares=[2, 6], stable=True,
                          sat_out={})
    assert report.epoch == 2 and report.steps == 1
    assert report.compute_s == [0.5, 0.25] and report.wait_s == pytest.approx([0.1, 0.3]) and report.samples == [3, 5]
    assert report.epoch_s == 9.0
    assert report.loss == pytest.approx(11.0 / 8.0)
    assert report.replans == [(2, [2, 6])]


def test_an_epoch_without_a_recorded_loss_reports_none():
    tally = EpochTally(0, first=0)
    tally.add_step(StepTimes(None, []), 4)
    assert tally.report([tally.totals()], shares=[4], stable=False, sat_out={}).loss is None


def test_a_checkpoint_between_epochs_resumes_at_the_next_ones_start():
    epochs = Epochs(writer=None)
    epochs.begin(0, first=0)
    epochs.tally.add_step(StepTimes(None, []), 4)  # type: ignore[union-attr]
    assert epochs.position(1) == (0, 1)
    epochs.end([epochs.tally.totals().values()], shares=[4], stable=True, sat_out={})  # type: ignore[union-attr]
    assert epochs.position(1) == (1, 0) and epochs.reports[-1].epoch == 0
