"""hetdp.fully_shard's modules: torch's FSDP modules with the drop-in's surface, and the settings that do not map
refused in one line (one rank; the distributed behaviour is tests/distributed/test_sharded.py's)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, TensorDataset

from hetdp import ConfigError, fully_shard
from hetdp.fsdp.shard import ShardedModule


def _sharded(**settings) -> nn.Sequential:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    fully_shard(model[0])
    return fully_shard(model, **settings)


def _loader() -> DataLoader:
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 2))
    return DataLoader(data, batch_size=8)


def test_a_sharded_module_is_torch_s_fsdp_module_with_the_drop_in_s_surface(one_rank):
    model = _sharded()
    assert isinstance(model, FSDPModule) and isinstance(model, ShardedModule) and isinstance(model[0], ShardedModule)
    assert type(model).__mro__.index(ShardedModule) < type(model).__mro__.index(FSDPModule)
    assert type(model[0:2]) is nn.Sequential  # torch's FSDPModule.__new__ still finds the original class
    assert model.shares == [] and model.last_epoch is None and model.step_samples is None
    with pytest.raises(ConfigError, match="call model.allocate"):
        model.set_shares([8])


def test_allocate_re_cuts_the_loader_and_trains_as_a_plain_loop_alone(one_rank):
    model = _sharded(allocation="equal")
    loader = model.allocate(_loader(), shuffle=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert model.shares == [8] and model.last_epoch.steps == 4 and model.last_epoch.samples == [32]
    model.close()
    model.close()  # idempotent


@pytest.mark.parametrize(("sync", "why"), [("local", "no replica to train alone or average"),
                                            ("majority", "every rank takes part in every step")])
def test_a_synchronization_that_needs_replicas_or_leaves_ranks_out_is_one_error_naming_why(one_rank, sync, why):
    with pytest.raises(ConfigError, match=why):
        _sharded(sync=sync).allocate(_loader())


def test_settings_given_below_the_root_are_one_error(one_rank):
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fully_shard(model[0], allocation="equal")
    fully_shard(model)
    with pytest.raises(ConfigError, match="give them to the root's fully_shard"):
        model.allocate(_loader())


def test_a_unit_of_an_allocated_root_does_not_allocate_on_its_own(one_rank):
    model = _sharded()
    model.allocate(_loader())
    with pytest.raises(ConfigError, match="call allocate on that root"):
        model[0].allocate(_loader())
    model.close()


def test_a_module_whose_own_names_the_drop_in_would_hide_is_refused_before_it_is_sharded(one_rank):
    class Counting(nn.Linear):
        shares = 3

    module = Counting(4, 2)
    with pytest.raises(ConfigError, match="adds shares to Counting, which has its own"):
        fully_shard(module)
    assert not isinstance(module, FSDPModule)
