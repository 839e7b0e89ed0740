import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hetdp.ddp.accumulation import StepAccumulation


def _gradient(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    model(x).sum().backward()
    return model.weight.grad.clone()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.125, 0.25, 0.5, 1.0]), min_size=2, max_size=5))
def test_a_window_over_steps_sums_each_steps_gradient_times_its_own_weight(weights):
    torch.manual_seed(0)
    model = nn.Linear(3, 2, bias=False)
    inputs = [torch.randn(4, 3) for _ in weights]
    expected = sum(w * _gradient(model, x) for w, x in zip(weights, inputs))
    model.zero_grad()
    accumulation = StepAccumulation(model)
    for index, (weight, x) in enumerate(zip(weights, inputs)):
        last = index == len(weights) - 1
        reduces_with_one = accumulation.forward_starts(weight, synchronizing=last)
        model(x).sum().backward()
        accumulation.step_ended(weight, synchronized=last)
        assert reduces_with_one == last  # the synchronizing step sums what the others weighed
    torch.testing.assert_close(model.weight.grad, expected)
    assert not accumulation.waiting and not accumulation.weighted


def test_micro_batches_within_one_step_are_left_to_the_comm_hook_to_weigh():
    torch.manual_seed(0)
    model = nn.Linear(3, 2, bias=False)
    first, second = torch.randn(4, 3), torch.randn(4, 3)
    expected = _gradient(model, first) + _gradient(model, second)
    model.zero_grad()
    accumulation = StepAccumulation(model)
    assert not accumulation.forward_starts(0.25, synchronizing=False)
    model(first).sum().backward()
    assert not accumulation.forward_starts(0.25, synchronizing=True)
    model(second).sum().backward()
    accumulation.step_ended(0.25, synchronized=True)
    torch.testing.assert_close(model.weight.grad, expected)  # unweighted: one step, one weight, in the hook


def test_closed_it_no_longer_scales_gradients():
    model = nn.Linear(3, 2, bias=False)
    accumulation = StepAccumulation(model)
    accumulation.forward_starts(0.5, synchronizing=False)
    model(torch.ones(1, 3)).sum().backward()
    accumulation.step_ended(0.5, synchronized=False)
    accumulation.forward_starts(0.5, synchronizing=True)
    accumulation.close()
    model.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    torch.testing.assert_close(model.weight.grad, torch.ones(2, 3))
