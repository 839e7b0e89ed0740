"""The drop-in's partial synchronization on one rank: with nobody to wait for, it must be the loop's own optimizer."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hetdp

STEPS, BATCH = 10, 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1))


def _data() -> TensorDataset:
    inputs = torch.randn(STEPS * BATCH, 5, generator=torch.Generator().manual_seed(1))
    return TensorDataset(inputs, inputs.sum(1, keepdim=True))


def _train(model: nn.Module, loader, optimizer: torch.optim.Optimizer) -> None:
    for inputs, targets in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()


@pytest.mark.parametrize("sync", ["full", "solo", "majority"])
def test_alone_it_is_exactly_the_loops_optimizer(one_rank, sync):
    reference, net = _model(), _model()
    _train(reference, DataLoader(_data(), batch_size=BATCH), torch.optim.Adam(reference.parameters(), lr=0.01))
    with hetdp.DDP(net, "equal", sync, emulation=hetdp.Emulation()) as model:
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        steps = [0]
        optimizer.register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
        _train(model, model.allocate(DataLoader(_data(), batch_size=BATCH)), optimizer)
        assert model.steps_done == STEPS
    assert steps[0] == STEPS  # one optimizer step per round: the empty round that ends the epoch is none
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), net.parameters()))


def test_a_parameter_the_loss_never_touches_stays_where_it_was(one_rank):
    net = nn.Linear(3, 1)
    net.extra = nn.Linear(3, 1)  # trainable, in the partial allreduce's flat gradient, never in the loss
    untouched, trained = net.extra.weight.detach().clone(), net.weight.detach().clone()
    with hetdp.DDP(net, "equal", "solo", emulation=hetdp.Emulation(), find_unused_parameters=True) as model:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for (inputs,) in model.allocate(DataLoader(TensorDataset(torch.ones(6, 3)), batch_size=2)):
            optimizer.zero_grad()
            model(inputs).sum().backward()
            optimizer.step()
    assert torch.equal(net.extra.weight, untouched)
    assert not torch.equal(net.weight, trained)


def test_partial_synchronization_needs_parameters_of_one_dtype_and_device(one_rank):
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    with pytest.raises(hetdp.ConfigError, match="one dtype and device"):
        hetdp.DDP(mixed, "equal", "solo")
