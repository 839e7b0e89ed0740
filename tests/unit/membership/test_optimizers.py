"""Finding the optimizers of the drop-in's modules through torch's global step hooks, in one process."""

from __future__ import annotations

import torch
from torch import nn

from hetdp.membership.optimizers import Optimizers


class CountedLinear(nn.Linear):
    """A module that counts how often its parameters are listed: what a look at an optimizer costs."""

    listed = 0

    def parameters(self, recurse: bool = True):  # type: ignore[no-untyped-def]
        CountedLinear.listed += 1
        return super().parameters(recurse)


def _step(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            parameter.grad = torch.ones_like(parameter)
    optimizer.step()


def test_the_optimizer_over_the_module_is_found_and_another_models_is_not():
    module, other = nn.Linear(3, 2), nn.Linear(3, 2)
    found = Optimizers([module])
    ours, theirs = torch.optim.SGD(module.parameters(), lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1)
    _step(theirs)
    _step(ours)
    assert list(found) == [ours]


def test_another_models_optimizer_is_looked_at_once_not_at_every_step():
    # The hook is global: every optimizer in the process runs it, and a look lists the modules' parameters.
    module = CountedLinear(3, 2)
    found = Optimizers([module])
    theirs = torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1)
    CountedLinear.listed = 0
    for _ in range(50):
        _step(theirs)
    assert CountedLinear.listed == 1 and list(found) == []


def test_an_optimizer_is_found_once_it_gains_the_modules_parameters_or_follows_a_module_added_later():
    module, follower = nn.Linear(3, 2), nn.Linear(3, 2)
    found = Optimizers([module])
    later = torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1)
    _step(later)
    later.add_param_group({"params": list(module.parameters())})
    _step(later)
    over_follower = torch.optim.SGD(follower.parameters(), lr=0.1)
    _step(over_follower)
    found.add(follower)
    _step(over_follower)
    assert list(found) == [later, over_follower]  # by their first parameter's place in the modules
