"""How a step applies the partial rounds it received: each sample moves the model as in a synchronous step."""

import torch

from hetdp.collectives.partial import PartialResult
from hetdp.sync.partial import GradientRound, combine


def round_of(*contributions: tuple[float, int], step: int = 64) -> GradientRound:
    """A round holding (gradient value, samples) contributions to steps of ``step`` samples, each weighted by its
    part of its step, as the drop-in contributes."""
    return round_with(*((g, n, step) for g, n in contributions))


def round_with(*contributions: tuple[float, int, int]) -> GradientRound:
    """A round holding (gradient value, samples, the step's samples) contributions."""
    weighted = sum(n / step * torch.full((3,), g) for g, n, step in contributions)
    weight = float(sum(n / step for _, n, step in contributions))
    result = PartialResult(tensor=torch.cat([weighted, torch.tensor([weight])]), round=0, contributors=1, fresh=True)
    return GradientRound(weighted_sum=weighted, samples=weight, result=result)


def test_a_round_that_holds_the_whole_step_is_its_sample_weighted_mean():
    full = round_of((1.0, 8), (2.0, 8), (3.0, 16), (4.0, 32))
    assert torch.allclose(combine([full], torch.zeros(3)), full.mean())
    assert torch.allclose(full.mean(), torch.full((3,), (8 + 16 + 48 + 128) / 64))


def test_a_round_of_a_few_samples_is_that_part_of_a_step():
    alone = round_of((5.0, 8))  # the slow rank's 8 of 64 samples
    assert torch.allclose(combine([alone], torch.zeros(3)), torch.full((3,), 5.0 / 8))


def test_a_step_that_split_into_rounds_adds_up_to_the_synchronous_gradient():
    first, second = round_of((1.0, 8), (4.0, 32)), round_of((2.0, 8), (3.0, 16))
    whole = round_of((1.0, 8), (4.0, 32), (2.0, 8), (3.0, 16))
    assert torch.allclose(combine([first, second], torch.zeros(3)), whole.mean())


def test_a_rank_that_receives_three_full_rounds_at_once_moves_three_steps():
    rounds = [round_of((1.0, 64)), round_of((2.0, 64)), round_of((3.0, 64))]
    assert torch.allclose(combine(rounds, torch.zeros(3)), torch.full((3,), 6.0))


def test_a_late_part_of_a_full_step_keeps_its_weight_in_the_epochs_short_last_step():
    # A slow rank's 8 of a full step's 64 samples arrive with another rank's 4 of the short last step's 12.
    mixed = round_with((1.0, 8, 64), (2.0, 4, 12))
    assert torch.allclose(combine([mixed], torch.zeros(3)), torch.full((3,), 8 / 64 + 2.0 * 4 / 12))


def test_an_empty_round_moves_nothing():
    assert torch.equal(combine([round_of((1.0, 0))], torch.zeros(3)), torch.zeros(3))
