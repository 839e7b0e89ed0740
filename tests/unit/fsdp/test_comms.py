"""What a rank's gradient weighs under FSDP2: the step's share in the reduce-scatter, or, while gradients wait
across backwards, each backward's own share in the parameters' hooks and 1 in the reduce-scatter."""

from __future__ import annotations

import torch

from hetdp.fsdp.comms import Weighing


def test_outside_a_step_the_reduce_scatter_averages_as_fsdp2_does():
    weighing = Weighing(world_size=4)
    assert weighing.reduce_weight() == 0.25 and not weighing.in_hooks


def test_a_step_s_reduce_scatter_weighs_its_share_and_the_hooks_leave_the_gradient_alone():
    weighing = Weighing(world_size=4)
    weighing.step = 3 / 16
    assert weighing.reduce_weight() == 3 / 16
    assert weighing.scale(torch.ones(2)) is None


def test_while_gradients_wait_each_backward_is_weighed_in_the_hooks_and_the_window_s_end_sums():
    weighing = Weighing(world_size=4)
    weighing.syncing, weighing.step = False, 0.25
    torch.testing.assert_close(weighing.scale(torch.ones(2)), torch.full((2,), 0.25))
    assert weighing.reduce_weight() == 1.0
    weighing.backward_ended()
    weighing.syncing, weighing.step = True, 0.5  # the window's last backward: its own share, then the sum
    torch.testing.assert_close(weighing.scale(torch.ones(2)), torch.full((2,), 0.5))
    assert weighing.reduce_weight() == 1.0
    weighing.backward_ended()
    assert not weighing.waiting and weighing.reduce_weight() == 0.5


def test_a_stand_in_s_gradient_is_zeroed_not_multiplied_so_nan_does_not_survive():
    weighing = Weighing(world_size=2)
    weighing.syncing, weighing.step = False, 0.0
    assert torch.equal(weighing.scale(torch.tensor([float("nan"), 1.0])), torch.zeros(2))
