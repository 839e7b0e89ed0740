import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler, TensorDataset

from hetdp import ConfigError
from hetdp.data.loader import _drops_last, _order_of

DATA = TensorDataset(torch.arange(10.0))


def test_a_loader_batched_by_its_own_batch_sampler_keeps_that_samplers_order_and_drop_last():
    loader = DataLoader(DATA, batch_sampler=BatchSampler(RandomSampler(DATA), batch_size=4, drop_last=True))
    order = _order_of(loader, None, None)  # loader.sampler, unused, is sequential
    assert order.shuffle and order.seed is None  # a plain shuffle: the ranks draw a seed and agree on it
    assert _drops_last(loader)
    loader = DataLoader(DATA, batch_sampler=BatchSampler(SequentialSampler(DATA), batch_size=4, drop_last=False))
    order = _order_of(loader, None, None)
    assert (order.shuffle, order.seed) == (False, 0) and not _drops_last(loader)


class Buckets:
    """A batch sampler of the user's own (batches by length, say)."""

    def __iter__(self):
        yield from ([0, 1], [2, 3])

    def __len__(self) -> int:
        return 2


def test_a_batch_sampler_it_cannot_imitate_is_one_config_error_unless_the_order_is_given():
    loader = DataLoader(DATA, batch_sampler=Buckets())
    with pytest.raises(ConfigError, match="cannot imitate a Buckets"):
        _order_of(loader, None, None)
    order = _order_of(loader, True, 5)
    assert (order.shuffle, order.seed) == (True, 5)
