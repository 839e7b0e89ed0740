"""PartialAllreduce and its settings in one process (a group of one rank, on the store it hosts itself)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

import hetdp
from hetdp import ConfigError, HetDPError, Partial, PartialAllreduce, PartialResult, Timeouts


def _partial_threads() -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.name.startswith("hetdp-partial")]


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        ({"mode": "eager"}, "mode must be one of"),
        ({"mode": "quorum"}, "needs quorum=k"),
        ({"mode": "quorum", "quorum": 0}, "needs quorum=k"),
        ({"mode": "quorum", "quorum": True}, "needs quorum=k"),
        ({"mode": "majority", "quorum": 2}, "only applies to mode='quorum'"),
        ({"data_backend": "mpi"}, "data_backend"),
        ({"bucket_mb": 0}, "bucket_mb"),
    ],
)
def test_bad_settings_are_config_errors_naming_the_value(settings, fragment):
    with pytest.raises(ConfigError, match=fragment):
        Partial(**settings)


def test_required_arrivals_per_mode():
    assert Partial(mode="solo").required(4) == 1
    assert Partial(mode="quorum", quorum=3).required(4) == 3
    assert Partial(mode="full").required(4) == 4
    with pytest.raises(ConfigError, match="exceeds the group's 4 ranks"):
        Partial(mode="quorum", quorum=5).required(4)


def test_needs_torch_distributed():
    if dist.is_initialized():
        pytest.skip("a default group already exists in this process")
    with pytest.raises(ConfigError, match="init_distributed"):
        PartialAllreduce(4)


@pytest.mark.parametrize("mode", ["solo", "majority", "quorum", "full"])
def test_one_rank_gets_its_own_tensor_back_round_by_round(one_rank, mode):
    quorum = 1 if mode == "quorum" else None
    shape_like = torch.zeros(2, 3, dtype=torch.float64)
    with PartialAllreduce(shape_like, mode=mode, quorum=quorum, timeout=10.0) as partial:
        for step in range(3):
            tensor = torch.full((2, 3), float(step), dtype=torch.float64)
            result = partial.allreduce(tensor)
            assert isinstance(result, PartialResult)
            assert (result.round, result.contributors, result.fresh, result.parts) == (step, 1, True, 1)
            assert result.rounds == (result,)
            assert result.tensor.shape == (2, 3) and result.tensor.dtype == torch.float64
            assert torch.equal(result.tensor, tensor)
            assert tensor.eq(step).all()  # the input is left as it was
        last = partial.close()
    assert [r.round for r in last] == [3] and last[0].parts == 0  # the flushing round, empty here
    assert _partial_threads() == []


def test_close_is_idempotent_and_a_closed_instance_refuses_calls(one_rank):
    partial = PartialAllreduce(4, mode="solo", timeout=Timeouts(round_s=5.0, shutdown_s=5.0))
    assert "open" in repr(partial)
    partial.close()
    assert partial.close() == ()
    assert "closed" in repr(partial)
    with pytest.raises(HetDPError, match="closed"):
        partial.allreduce(torch.ones(4))
    assert _partial_threads() == []


def test_a_tensor_of_the_wrong_size_is_a_config_error(one_rank):
    with PartialAllreduce(4, mode="solo") as partial:
        with pytest.raises(ConfigError, match="expects a tensor of 4 elements, got 5"):
            partial.allreduce(torch.ones(5))


@pytest.mark.parametrize("value", [0, -3, 2.5, "4"])
def test_a_bad_size_is_a_config_error(one_rank, value):
    with pytest.raises(ConfigError, match="positive element count"):
        PartialAllreduce(value)


def test_half_precision_travels_with_exact_counters(one_rank):
    with PartialAllreduce(torch.zeros(3, dtype=torch.float16), mode="solo") as partial:
        result = partial.allreduce(torch.tensor([0.5, 1.5, -2.0], dtype=torch.float16))
        assert result.tensor.dtype == torch.float16
        assert result.tensor.tolist() == [0.5, 1.5, -2.0]


def test_an_error_inside_the_context_is_reported_to_the_others_and_closes(one_rank):
    with pytest.raises(ValueError, match="boom"):
        with PartialAllreduce(4, mode="majority", timeout=5.0) as partial:
            partial.allreduce(torch.ones(4))
            raise ValueError("boom")
    assert partial._book.error is not None and "left on ValueError" in str(partial._book.error)
    assert _partial_threads() == []


def test_the_public_names_are_exported():
    for name in ("Partial", "PartialAllreduce", "PartialResult"):
        assert name in hetdp.__all__
