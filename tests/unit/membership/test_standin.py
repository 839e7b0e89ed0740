"""A stand-in forward runs in the module's own mode and changes nothing that persists, nor what a SyncBatchNorm shares
with the other ranks."""

import pytest
import torch
from torch import nn

import hetdp
from hetdp.errors import ConfigError
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


def test_a_stand_in_s_sync_batchnorm_normalises_its_own_samples_and_feeds_the_layer_none():
    # torch runs SyncBatchNorm on CUDA only; with no process group it is a BatchNorm, which here shows the layer
    # given an empty batch (its collectives would count none of it) and the stand-in's own samples normalised by
    # their own statistics. The collectives themselves (CUDA, NCCL) are argued from torch's source in
    # docs/guide/dropin.md, not run.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4), nn.ReLU())
    x = torch.randn(2, 3, 5, 5)
    before = {name: b.clone() for name, b in model.named_buffers()}
    seen: list[int] = []
    model[1].register_forward_hook(lambda layer, args, output: seen.append(len(args[0])))  # the batch it was fed
    with weighing_nothing(model):
        output = model(x)
    own = nn.functional.batch_norm(model[0](x), None, None, model[1].weight, model[1].bias, True, 0.0, model[1].eps)
    assert seen == [0] and torch.allclose(output, own.relu())
    output.sum().backward()
    assert model[1].weight.grad is not None
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, before[name]), name
    seen.clear()
    model(x)  # outside a stand-in the layer sees the batch
    assert seen == [2] and int(model[1].num_batches_tracked) == 1


def test_a_model_with_a_sync_batchnorm_follows_no_model_whose_ranks_may_sit_out(one_rank):
    # Refused before torch's DDP is made (which takes a SyncBatchNorm on GPU modules only: that such a model never
    # sits out, its seam None, runs on CUDA only).
    plain = hetdp.DDP(nn.Linear(3, 4), "equal")
    try:
        with pytest.raises(ConfigError, match="SyncBatchNorm meets every rank in every step, and the model it follows "
                                              "lets ranks sit out"):
            hetdp.DDP(nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4)), follow=plain)
    finally:
        plain.close()
