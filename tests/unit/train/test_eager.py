"""EagerSGD in one process (a group of one rank): the update rule, its options and its settings."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetdp import ConfigError, PartialConfig
from hetdp.train.eager import EagerSGD


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    inputs = torch.randn(8, 5, generator=generator)
    return inputs, inputs.sum(1, keepdim=True)


def _train(model: nn.Module, step_fn, zero_grad, steps: int = 10) -> None:
    for step in range(steps):
        inputs, targets = _batch(step)
        zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        step_fn()


@pytest.mark.parametrize("mode", ["full", "solo", "majority"])
def test_alone_it_is_exactly_the_wrapped_optimizer(one_rank, mode):
    reference, model = _model(), _model()
    plain = torch.optim.Adam(reference.parameters(), lr=0.01)
    _train(reference, plain.step, plain.zero_grad)
    with EagerSGD(torch.optim.Adam(model.parameters(), lr=0.01), model, mode=mode) as eager:
        _train(model, eager.step, eager.zero_grad)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))
    assert (eager.steps, eager.rounds, eager.applied) == (10, 11, 10)  # round 10: the empty flush at close
    assert eager.gradients == 10  # one per step: the empty flush holds none
    assert eager.divergence() == 0.0


def test_sync_every_counts_round_boundaries(one_rank):
    # What averaging does is checked on several ranks (tests/distributed/test_partial.py); alone, only when.
    model = _model()
    eager = EagerSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, mode=PartialConfig(mode="quorum", quorum=1),
                     sync_every=3, divide_by="contributors")
    _train(model, eager.step, eager.zero_grad, steps=7)
    assert eager.syncs == 2  # after rounds 2 and 5
    eager.close()
    assert "quorum" in repr(eager)


def test_a_parameter_without_gradient_gets_a_zero_gradient(one_rank):
    model = nn.Linear(3, 1)
    frozen_in_graph = nn.Linear(3, 1)
    model.extra = frozen_in_graph  # a trainable parameter the loss never touches
    with EagerSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, mode="solo") as eager:
        before = frozen_in_graph.weight.detach().clone()
        model(torch.ones(2, 3)).sum().backward()
        eager.step()
        assert torch.equal(frozen_in_graph.weight, before)
        assert torch.equal(frozen_in_graph.weight.grad, torch.zeros_like(before))


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        ({"sync_every": -1}, "sync_every"),
        ({"sync_every": 1.5}, "sync_every"),
        ({"divide_by": "rounds"}, "divide_by"),
        ({"mode": "eager"}, "mode must be one of"),
    ],
)
def test_bad_settings_are_config_errors(one_rank, settings, fragment):
    model = _model()
    with pytest.raises(ConfigError, match=fragment):
        EagerSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, **settings)


def test_the_optimizer_and_the_parameters_are_checked(one_rank):
    model = _model()
    with pytest.raises(ConfigError, match="torch.optim.Optimizer"):
        EagerSGD(object(), model)  # type: ignore[arg-type]
    frozen = _model().requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameter"):
        EagerSGD(torch.optim.SGD(model.parameters(), lr=0.1), frozen)
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    with pytest.raises(ConfigError, match="one dtype and device"):
        EagerSGD(torch.optim.SGD(mixed.parameters(), lr=0.1), mixed)
