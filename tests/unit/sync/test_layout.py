"""The flat gradient of partial rounds keeps each parameter at one place, whatever order the buckets take."""

import pytest
import torch

from hetdp.errors import ConfigError
from hetdp.sync.layout import GradientLayout

WEIGHT, BIAS, EXTRA = torch.zeros(2, 3), torch.zeros(2), torch.zeros(4)


def buckets_of(*groups: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Bucket buffers whose gradients are each parameter's number (weight 1, bias 2, extra 3), as the buckets lay
    them out."""
    value = {id(WEIGHT): 1.0, id(BIAS): 2.0, id(EXTRA): 3.0}
    buffers = [torch.cat([torch.full((p.numel(),), value[id(p)]) for p in group]) for group in groups]
    return buffers, [list(group) for group in groups]


def in_layout() -> torch.Tensor:
    return torch.cat([torch.full((6,), 1.0), torch.full((2,), 2.0), torch.full((4,), 3.0)])


@pytest.mark.parametrize("groups", [
    ([WEIGHT, BIAS, EXTRA],),  # one bucket, the parameters' own order
    ([EXTRA, BIAS], [WEIGHT]),  # torch DDP's first buckets: reversed
    ([BIAS], [WEIGHT, EXTRA]),  # a rebuild: the order gradients became ready
])
def test_every_bucket_order_gathers_each_gradient_at_its_parameters_place(groups):
    layout = GradientLayout([WEIGHT, BIAS, EXTRA])
    buffers, parameters = buckets_of(*groups)
    assert torch.equal(layout.gather(buffers, parameters), in_layout())


def test_scatter_puts_each_gradient_back_where_the_buckets_hold_it():
    layout = GradientLayout([WEIGHT, BIAS, EXTRA])
    expected, parameters = buckets_of([BIAS, EXTRA], [WEIGHT])
    buffers = [torch.zeros_like(buffer) for buffer in expected]
    layout.scatter(in_layout(), buffers, parameters)
    assert all(torch.equal(got, want) for got, want in zip(buffers, expected))


def test_a_contribution_before_a_rebuild_adds_to_its_own_parameters_after_it():
    layout = GradientLayout([WEIGHT, BIAS, EXTRA])
    before = layout.gather(*buckets_of([EXTRA, BIAS, WEIGHT]))
    after = layout.gather(*buckets_of([BIAS], [WEIGHT, EXTRA]))
    assert torch.equal(before + after, 2 * in_layout())


def test_neighbours_in_both_orders_move_in_one_copy():
    layout = GradientLayout([WEIGHT, BIAS, EXTRA])
    assert len(layout._plan([[WEIGHT, BIAS, EXTRA]]).gather) == 1
    assert len(layout._plan([[BIAS, EXTRA], [WEIGHT]]).gather) == 2


def test_placed_gives_each_parameter_its_offset():
    assert [offset for _, offset in GradientLayout([WEIGHT, BIAS, EXTRA]).placed] == [0, 6, 8]


@pytest.mark.parametrize("groups", [([WEIGHT, BIAS],), ([WEIGHT, BIAS, EXTRA, torch.zeros(1)],)])
def test_buckets_that_hold_other_parameters_are_a_config_error(groups):
    layout = GradientLayout([WEIGHT, BIAS, EXTRA])
    parameters = [list(group) for group in groups]
    buffers = [torch.zeros(sum(p.numel() for p in group)) for group in groups]
    with pytest.raises(ConfigError):
        layout.gather(buffers, parameters)


def test_a_parameter_held_twice_in_place_of_another_of_its_size_is_a_config_error():
    first, second = torch.zeros(2), torch.zeros(2)
    with pytest.raises(ConfigError):
        GradientLayout([first, second]).gather([torch.zeros(4)], [[first, first]])
