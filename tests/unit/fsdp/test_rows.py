"""Memory-sized rows (``hetdp.fsdp.rows``): whole rows per rank, every parameter's rows accounted for, each rank's bytes
over a unit in proportion to its weight within a few rows, and the segments' offsets."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetdp import ConfigError
from hetdp.fsdp.rows import RowSplit, segment_offsets, segment_sizes, split_rows

weights_strategy = st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.0, 2.0, 4.0, 11.0, 24.0]), min_size=1,
                            max_size=8).filter(lambda weights: sum(weights) > 0)
units = st.lists(st.tuples(st.integers(0, 300), st.integers(1, 256)), min_size=1, max_size=12)
"""A unit's parameters as (rows, bytes a row)."""


@given(weights=weights_strategy, unit=units)
def test_every_parameter_is_split_into_whole_rows_that_add_up_and_a_zero_weight_holds_none(weights, unit):
    splits = split_rows([rows for rows, _ in unit], [size for _, size in unit], weights)
    for split, (rows, _) in zip(splits, unit):
        assert len(split.rows) == len(weights) and all(count >= 0 for count in split.rows)
        assert split.total == rows
        assert all(split.rows[rank] == 0 for rank, weight in enumerate(weights) if weight == 0)


@given(weights=weights_strategy, unit=units)
def test_each_rank_s_bytes_stay_within_a_few_rows_of_its_proportion_of_the_unit(weights, unit):
    splits = split_rows([rows for rows, _ in unit], [size for _, size in unit], weights)
    total = sum(rows * size for rows, size in unit)
    holders = sum(weight > 0 for weight in weights)
    largest_row = max(size for _, size in unit)
    for rank, weight in enumerate(weights):
        held = sum(split.rows[rank] * size for split, (_, size) in zip(splits, unit))
        assert abs(held - weight / sum(weights) * total) <= holders * largest_row + 1e-6


@given(ranks=st.integers(1, 8), unit=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 64)), min_size=1,
                                              max_size=10))
def test_equal_weights_split_every_parameter_equally_where_its_rows_divide(ranks, unit):
    rows = [count * ranks for count, _ in unit]
    splits = split_rows(rows, [size for _, size in unit], [3.0] * ranks)
    assert [split.rows for split in splits] == [(count,) * ranks for count, _ in unit]


@given(weights=weights_strategy, count=st.integers(1, 7), size=st.integers(1, 64))
def test_a_parameter_with_fewer_rows_than_holding_ranks_goes_whole_to_one_rank(weights, count, size):
    holders = sum(weight > 0 for weight in weights)
    (split,) = split_rows([count], [size], weights)
    if count < holders:
        assert split.owner is not None and weights[split.owner] > 0 and split.rows[split.owner] == count


def test_rows_follow_memories_1_1_2_4_and_rounding_is_made_up_by_the_next_parameter():
    assert split_rows([16, 64], [64, 64], [1, 1, 2, 4])[0].rows == (2, 2, 4, 8)
    # 3 rows of 1, 1, 2, 4 cannot be even: whichever rank the first lacks most, the second parameter evens it out.
    first, second = split_rows([6, 10], [8, 8], [1, 1, 2, 4])
    assert [a + b for a, b in zip(first.rows, second.rows)] == [2, 2, 4, 8]


@given(weights=weights_strategy, unit=units)
def test_offsets_and_segments_place_each_rank_s_rows_after_the_ranks_and_parameters_before_it(weights, unit):
    splits = split_rows([rows for rows, _ in unit], [size for _, size in unit], weights)
    numels = [size for _, size in unit]
    for split in splits:
        assert split.offsets == tuple(itertools.accumulate(split.rows, initial=0))[:-1]
    sizes = segment_sizes(splits, numels)
    assert sum(sizes) == sum(rows * numel for (rows, _), numel in zip(unit, numels))
    for rank in range(len(weights)):
        starts = segment_offsets(splits, numels, rank)
        ends = [start + split.rows[rank] * numel for start, split, numel in zip(starts, splits, numels)]
        assert starts[0] == 0 and ends[-1] == sizes[rank] and starts[1:] == ends[:-1]


def test_a_split_names_its_single_owner_only_when_one_rank_holds_every_row():
    assert RowSplit((0, 5, 0)).owner == 1 and RowSplit((1, 4, 0)).owner is None and RowSplit((0, 0)).owner is None


@pytest.mark.parametrize(("weights", "match"), [([0.0, 0.0], "not all 0"), ([1.0, -1.0], ">= 0"),
                                                 ([float("nan"), 1.0], "finite")])
def test_bad_weights_are_one_error(weights, match):
    with pytest.raises(ConfigError, match=match):
        split_rows([4], [4], weights)
