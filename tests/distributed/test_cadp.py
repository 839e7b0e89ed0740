"""C-ADP with real processes over gloo: planned disjoint delivery, weighted averaging, and the drop-in training each
rank's own samples (``allocate(loader, own_data=True)``) checked against one process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hetdp.data.distribute import partition
from hetdp.data.owndata import epoch_order
from hetdp.sync.averaging import merge_weights

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from cadp_worker import AVERAGING_COUNTS, SIZE, make_dataset, make_model, make_optimizer  # noqa: E402

RANKS = 3


@pytest.fixture(scope="module")
def out(tmp_path_factory, torchrun):
    folder = tmp_path_factory.mktemp("cadp")
    torchrun("cadp_worker.py", RANKS, "--out", folder, timeout_s=240)
    return folder


def report(out: Path, rank: int) -> dict:
    return json.loads((out / f"report_{rank}.json").read_text())


@pytest.mark.parametrize("transport", ["samples", "indices"])
def test_each_device_receives_exactly_its_planned_disjoint_samples(out, transport):
    planned = report(out, 0)["plan"]
    assert sum(planned) == SIZE and all(n > 0 for n in planned)
    inputs, labels, _ = make_dataset().tensors
    expected = partition(planned, seed=7)
    seen = []
    for rank in range(RANKS):
        held = torch.load(out / f"delivery_{transport}_{rank}.pt")
        received_inputs, received_labels, received_ids = held["tensors"]
        assert held["indices"].tolist() == expected[rank].tolist()
        assert len(received_ids) == planned[rank]
        assert received_ids.tolist() == expected[rank].tolist()  # each sample is the one named by its index
        torch.testing.assert_close(received_inputs, inputs[held["indices"]])
        assert torch.equal(received_labels, labels[held["indices"]])
        seen += received_ids.tolist()
    assert sorted(seen) == list(range(SIZE))  # disjoint and complete


def weighted_average(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """sum_i weights[i] * tensors[i], computed in float64: the value the distributed merge must give."""
    total = sum(float(w) * t.detach().double() for w, t in zip(weights, tensors, strict=True))
    return total.to(tensors[0].dtype)


def assert_weighted_average(path, models, weights, *, atol, rank):
    """The state dict saved at ``path`` is sum_i weights[i] * models[i], tensor by tensor."""
    for name, tensor in torch.load(path).items():
        expected = weighted_average([m[name] for m in models], weights)
        torch.testing.assert_close(tensor, expected, rtol=0, atol=atol, msg=f"rank {rank} {name}")


def test_weighted_averaging_equals_the_hand_computed_average(out):
    weights = merge_weights(AVERAGING_COUNTS)
    models = [make_model(10 + rank).state_dict() for rank in range(RANKS)]
    for rank in range(RANKS):
        assert_weighted_average(out / f"averaged_{rank}.pt", models, weights, atol=1e-6, rank=rank)


def test_one_cadp_epoch_equals_local_training_then_the_d_weighted_average(out):
    figures = report(out, 0)["cadp"]
    planned, batch_sizes = figures["plan"], figures["batch_sizes"]
    inputs, labels, _ = make_dataset().tensors
    shares = partition(planned, seed=3)
    local_models = []
    for rank in range(RANKS):
        model = make_model(0)
        optimizer = make_optimizer(model)
        mine = torch.from_numpy(shares[rank]).long()
        order = epoch_order(len(mine), seed=3, epoch=0, rank=rank)
        for start in range(0, len(mine), batch_sizes[rank]):
            batch = mine[order[start : start + batch_sizes[rank]]]
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(inputs[batch]), labels[batch]).backward()
            optimizer.step()
        local_models.append(model.state_dict())
    weights = merge_weights(planned)
    for rank in range(RANKS):
        assert report(out, rank)["cadp"]["samples"] == planned[rank]
        assert_weighted_average(out / f"cadp_{rank}.pt", local_models, weights, atol=1e-5, rank=rank)


def test_per_step_gradient_allreduce_equals_one_process_on_the_union_of_the_batches(out):
    figures = report(out, 0)["ddp"]
    planned, batch_sizes = figures["plan"], figures["batch_sizes"]
    assert max(planned) - min(planned) <= 1  # the equal split
    inputs, labels, _ = make_dataset().tensors
    shares = [torch.from_numpy(share).long() for share in partition(planned, seed=3)]
    model = make_model(0)
    optimizer = make_optimizer(model)
    steps = max(-(-n // b) for n, b in zip(planned, batch_sizes))
    for epoch in range(figures["epochs"]):
        orders = [share[epoch_order(len(share), seed=3, epoch=epoch, rank=r)] for r, share in enumerate(shares)]
        for step in range(steps):
            batch = torch.cat([order[step * b : (step + 1) * b] for order, b in zip(orders, batch_sizes)])
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(inputs[batch]), labels[batch]).backward()
            optimizer.step()
    for rank in range(RANKS):
        for name, tensor in torch.load(out / f"ddp_{rank}.pt").items():
            torch.testing.assert_close(tensor, model.state_dict()[name], rtol=0, atol=1e-5, msg=f"rank {rank} {name}")


def test_a_device_planned_no_samples_stays_out_of_the_drop_ins_group_while_the_others_train_and_merge(out):
    figures = [report(out, rank)["sits_out"] for rank in range(RANKS)]
    assert [f["samples"] for f in figures] == [20, SIZE - 20, 0]
    assert [f["epochs"] for f in figures] == [2, 2, 0]
    models = [torch.load(out / f"sits_out_{rank}.pt") for rank in range(RANKS)]
    initial = make_model(0).state_dict()
    for name, tensor in models[0].items():
        torch.testing.assert_close(models[1][name], tensor, rtol=0, atol=0)  # merged: one model
        torch.testing.assert_close(models[2][name], initial[name], rtol=0, atol=0)  # never trained
    assert any(not torch.equal(tensor, initial[name]) for name, tensor in models[0].items())


def test_a_data_owner_that_does_not_train_holds_no_samples_and_stays_out_of_the_drop_in(out):
    held = [report(out, rank)["parameter_server"] for rank in range(RANKS)]
    assert [figures["samples"] for figures in held] == [0, 20, 27]
    for figures in held:
        assert "own_data=True needs samples on every rank, got [0, 20, 27]" in figures["error"]


def test_a_plan_that_does_not_fit_the_dataset_fails_its_delivery_on_every_rank(out):
    for rank in range(RANKS):
        message = report(out, rank)["bad_plan"]
        assert message is not None and "samples sum to 30 but the owner's dataset has 47" in message
