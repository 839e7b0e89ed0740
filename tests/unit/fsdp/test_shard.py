"""hetdp.fully_shard's modules: torch's FSDP modules with the drop-in's surface, and the settings that do not map
refused in one line (one rank; the distributed behaviour is tests/distributed/test_sharded.py's)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, TensorDataset

from hetdp import ConfigError, Emulation, fully_shard
from hetdp.cluster.devices import DeviceModel
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


def _capped(memory_mb: float) -> nn.Sequential:
    """A model whose gradients outweigh what a sample adds, on an emulated device of ``memory_mb`` whose table gives
    no activations (the drop-in probes them)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 512), nn.Tanh(), nn.Linear(512, 2))
    fully_shard(model[0])
    devices = (DeviceModel(memory_mb=memory_mb),)
    return fully_shard(model, allocation="equal", emulation=Emulation(sample_cost_ms=0.01, devices=devices))


def test_a_loop_that_accumulates_is_capped_with_fsdp2_s_unsharded_gradients_counted(one_rank):
    plain, accumulating = _capped(0.2), _capped(0.2)
    plain.allocate(_loader(), global_batch=8)
    accumulating.allocate(_loader(), global_batch=8, accumulates=True)
    held, per_sample = plain.drop_in.footprint, plain.drop_in.activation_bytes_per_sample
    waiting = accumulating.drop_in.footprint.waiting
    assert waiting == sum(p.numel() for p in plain.parameters()) * 4  # one rank: its whole gradient, float32
    assert plain.allocator.caps == [int((0.2e6 - held.held) // per_sample)]
    # accumulates=True: shares are not capped, each forward is (the piecewise rule's micro-batches)
    assert accumulating.allocator.chunks == [int((0.2e6 - held.held - waiting) // per_sample)]
    assert accumulating.allocator.chunks[0] < plain.allocator.caps[0]
    plain.close()
    accumulating.close()


def test_gradients_that_wait_beyond_a_cap_cut_for_a_loop_that_lets_none_wait_warn_once_with_the_cap(one_rank):
    model = _capped(0.2)
    model.allocate(_loader(), global_batch=8)
    held, per_sample = model.drop_in.footprint, model.drop_in.activation_bytes_per_sample
    waiting = sum(p.numel() for p in model.parameters()) * 4
    with pytest.warns(UserWarning, match=rf"rank 0: gradients that wait .* its memory cap of {model.allocator.caps[0]} "
                                         rf"samples did not count; with them it holds "
                                         rf"{int((0.2e6 - held.held - waiting) // per_sample)} samples a forward"):
        model.set_requires_gradient_sync(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.set_requires_gradient_sync(True)
        model.set_requires_gradient_sync(False)  # once
    model.close()


@pytest.mark.parametrize(("loss", "warns"), [("mean", True), ("sum", False)])
def test_a_sync_batchnorm_under_a_per_rank_mean_warns_that_unequal_shares_are_not_exact(one_rank, loss, warns):
    model = nn.Sequential(nn.Linear(4, 8), nn.SyncBatchNorm(8), nn.Linear(8, 2))
    fully_shard(model, allocation="equal", loss=loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.allocate(_loader())
    said = [str(w.message) for w in caught if "SyncBatchNorm" in str(w.message)]
    assert said == (["hetdp.fully_shard: a SyncBatchNorm sums the ranks' gradients before they are weighed, so under "
                     "loss='mean' (each rank's loss the mean over its own share) unequal shares give another gradient "
                     "than one process: divide each rank's summed loss by the equal share (global batch / ranks) and "
                     "pass loss='sum'"] if warns else [])
    model.close()
