"""What the user's loader asks of an epoch, read off it once (hetdp.data.order): its order, batch and drops."""

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)

from hetdp import ConfigError
from hetdp.data.order import LoaderOrder

DATA = TensorDataset(torch.arange(10.0))


def test_a_loader_batched_by_its_own_batch_sampler_keeps_that_samplers_order_batch_and_drop_last():
    loader = DataLoader(DATA, batch_sampler=BatchSampler(RandomSampler(DATA), batch_size=4, drop_last=True))
    order = LoaderOrder.read(loader)  # loader.sampler, unused, is sequential
    assert order.shuffle and order.drawn  # a plain shuffle: each rank draws a seed, and the ranks agree on one
    assert (order.drop_last, order.batch) == (True, 4)
    loader = DataLoader(DATA, batch_sampler=BatchSampler(SequentialSampler(DATA), batch_size=4, drop_last=False))
    order = LoaderOrder.read(loader)
    assert (order.shuffle, order.seed, order.drop_last) == (False, 0, False)


def test_a_distributed_sampler_gives_the_order_its_epochs_follow_and_the_tail_it_drops():
    sampler = DistributedSampler(DATA, num_replicas=4, rank=1, shuffle=True, seed=7, drop_last=True)
    order = LoaderOrder.read(DataLoader(DATA, batch_size=2, sampler=sampler, drop_last=True))
    assert (order.shuffle, order.seed, order.source, order.drop_last, order.batch) == (True, 7, sampler, True, 2)
    assert (order.size, order.epoch_size(4)) == (10, 8)
    assert LoaderOrder.read(DataLoader(DATA, batch_size=2, sampler=sampler), shuffle=False).shuffle is False


class Buckets:
    """A batch sampler of the user's own (batches by length, say)."""

    def __iter__(self):
        yield from ([0, 1], [2, 3])

    def __len__(self) -> int:
        return 2


def test_a_batch_sampler_it_cannot_imitate_is_one_config_error_unless_the_order_is_given():
    loader = DataLoader(DATA, batch_sampler=Buckets())
    with pytest.raises(ConfigError, match="cannot imitate a Buckets"):
        LoaderOrder.read(loader)
    order = LoaderOrder.read(loader, True, 5)
    assert (order.shuffle, order.seed, order.batch) == (True, 5, None)  # no batch size: allocate asks global_batch=


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(3)


def test_an_iterable_dataset_is_one_config_error():
    with pytest.raises(ConfigError, match="allocate\\(\\) needs a map-style dataset .* got Stream"):
        LoaderOrder.read(DataLoader(Stream()), shuffle=False)
