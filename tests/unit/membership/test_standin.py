"""A stand-in forward runs in the module's own mode and changes nothing that persists."""

import torch
from torch import nn

from hetdp.membership.standin import stand_in_samples, weighing_nothing


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 1))


def test_a_stand_in_leaves_the_batchnorm_statistics_and_the_random_stream_as_they_were():
    model = make()
    before = {name: b.clone() for name, b in model.named_buffers()}
    batch = torch.randn(2, 3)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with weighing_nothing(model):
        output = model(batch)  # a training forward: dropout draws, BatchNorm updates (copies)
    assert model.training and all(m.training for m in model.modules())
    output.sum().backward()  # BatchNorm's backward reads the buffers it was given: unchanged under it
    assert torch.equal(torch.rand(3), expected)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name
    assert int(model[1].num_batches_tracked) == 0


def test_a_forward_outside_a_stand_in_still_updates_the_statistics():
    model = make()
    with weighing_nothing(model):
        pass  # a stand-in step whose forward never ran notes nothing
    model(torch.randn(2, 3))
    assert int(model[1].num_batches_tracked) == 1


def test_a_batchnorm_that_trains_needs_two_samples():
    model = make()
    assert stand_in_samples(model) == 2
    assert stand_in_samples(model.eval()) == 1
    assert stand_in_samples(nn.Linear(2, 2)) == 1
