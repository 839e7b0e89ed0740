"""The storage of memory-sized shards on its own (``hetdp.fsdp.rowshard``: no module hooks, no drop-in), three real
processes over gloo holding rows in the ratio 0, 1, 3: gathered whole, freed and refilled under autograd's saved
references, gradients weighed onto the rows' owners, mixed precision, and DCP with each rank's real offsets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RANKS = 3


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, torchrun) -> list[dict]:
    folder = tmp_path_factory.mktemp("rowshard")
    torchrun("rowshard_worker.py", RANKS, "--out", folder, timeout_s=180)
    return json.loads((Path(folder) / "rowshard.json").read_text())


def test_rows_follow_the_weights_a_zero_weight_holds_none_and_a_one_row_parameter_goes_whole(ranks):
    assert [rank["rows"] for rank in ranks] == [{"weight": 0, "bias": 0, "small": 0},
                                                {"weight": 2, "bias": 2, "small": 0},
                                                {"weight": 6, "bias": 6, "small": 1}]
    assert all(rank["sharded_views"] for rank in ranks)  # each parameter's rows are a view of the rank's segment


@pytest.mark.parametrize("check", ["gathered", "freed", "backward_after_regather", "regathered"])
def test_a_unit_gathers_whole_frees_and_refills_without_breaking_autograd_s_saved_references(ranks, check):
    assert all(rank[check] for rank in ranks), check


@pytest.mark.parametrize("check", ["reduced", "unsharded_grads_dropped", "accumulated", "grad_is_dtensor_of_the_rows"])
def test_gradients_are_weighed_summed_onto_their_owners_a_zero_weight_zeroes_a_nan_and_reduces_accumulate(ranks, check):
    assert all(rank[check] for rank in ranks), check


def test_mixed_precision_gathers_in_param_dtype_and_reduces_in_reduce_dtype(ranks):
    assert all(rank["bf16_gathered"] and rank["fp32_reduced"] for rank in ranks)


def test_dcp_records_each_rank_s_real_rows_and_reshards_them_onto_even_shards_and_other_rows(ranks):
    assert ranks[0]["chunks"] == [[[0, 0], [2, 6]], [[2, 0], [6, 6]]]  # the weight's 8 rows: none, 2, 6
    assert all(rank["full_tensor"] and rank["onto_even"] and rank["onto_other_rows"] for rank in ranks)
