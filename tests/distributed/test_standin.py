"""A stand-in is a training step that weighs nothing, and ranks may use different parameters in a step: both drop-ins
train a model with train-only outputs (and a BatchNorm) at a short last step and with a rank that sits out or has no
share, and a small mixture of experts whose experts get no token on some ranks, exactly as one process would; a closed
sharded drop-in's model computes on with what it trained."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

WORKERS = Path(__file__).parent / "workers"
sys.path.insert(0, str(WORKERS))
from standin_worker import BATCH, EPOCHS, SEED, SIZE, dataset, loss_of, make  # noqa: E402
from torch_order import epoch_order  # noqa: E402

RANKS = 3
SCENARIOS = ("aux_ddp", "aux_sitout", "moe_ddp", "aux_sharded", "moe_sharded")

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def out(tmp_path_factory, torchrun) -> Path:
    folder = tmp_path_factory.mktemp("standin")
    torchrun("standin_worker.py", RANKS, "--out", folder, "--scenarios", ",".join(SCENARIOS), timeout_s=400)
    return folder


def records(out: Path, scenario: str) -> list[dict]:
    return [json.loads((out / f"{scenario}_{rank}.json").read_text()) for rank in range(RANKS)]


def reference(kind: str, blocks: list[list[int]], chain_of: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """One process on the global batches of torch's ``DistributedSampler(seed=SEED)``: each step's gradient the
    sample-weighted sum of the per-rank mean losses' over each rank's block (a BatchNorm normalizes by each rank's own
    batch), and the buffers rank ``chain_of`` holds: updated by its real samples only."""
    model = make(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = dataset().tensors
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    steps = iter(blocks)
    for epoch in range(EPOCHS):
        order = epoch_order(SIZE, SEED, epoch)
        for first in range(0, SIZE, BATCH * RANKS):
            block = next(steps)
            total, offset = sum(block), first
            optimizer.zero_grad()
            for rank, samples in enumerate(block):
                if not samples:
                    continue
                index = torch.tensor(order[offset : offset + samples])
                offset += samples
                kept = {name: b.clone() for name, b in model.named_buffers()}
                for name, b in model.named_buffers():
                    b.copy_(buffers[name])
                (loss_of(kind, model(x[index]), y[index]) * samples / total).backward()
                if rank == chain_of:
                    buffers = {name: b.clone() for name, b in model.named_buffers()}
                for name, b in model.named_buffers():
                    b.copy_(kept[name])
            optimizer.step()
    return model, buffers


def assert_parameters(state: dict, model: nn.Module) -> None:
    for name, parameter in model.named_parameters():
        assert torch.allclose(torch.tensor(state[name], dtype=torch.float64), parameter.detach().double(),
                              atol=1e-5), name


def assert_buffers(state: dict, buffers: dict[str, torch.Tensor]) -> None:
    for name, buffer in buffers.items():
        assert torch.allclose(torch.tensor(state[name], dtype=torch.float64), buffer.double(), atol=1e-5), name


def test_every_epoch_ends_with_a_step_of_fewer_samples_than_ranks(out):
    for scenario in SCENARIOS:
        blocks = records(out, scenario)[0]["blocks"]
        last = [block for index, block in enumerate(blocks) if sum(block) < BATCH * RANKS]
        assert len(last) == EPOCHS and all(sum(block) < RANKS for block in last), scenario


def test_a_train_only_output_trains_through_ddp_at_a_short_last_step_as_one_process(out):
    ranks = records(out, "aux_ddp")
    model, buffers = reference("aux", ranks[0]["blocks"], chain_of=0)
    for record in ranks:
        assert_parameters(record["state"], model)
    # torch DDP broadcasts rank 0's buffers at each forward: they count rank 0's real samples only, and a
    # stand-in (ranks 0 and 1 at each last step, two samples each: BatchNorm trains) left every rank's unchanged.
    assert_buffers(ranks[0]["state"], buffers)
    stand_ins = [rank for rank, samples in enumerate(ranks[0]["blocks"][-1]) if samples == 0]
    assert stand_ins
    for rank in stand_ins:
        assert_buffers(ranks[rank]["state"], buffers)


def test_a_train_only_output_trains_through_ddp_with_a_rank_sitting_out_as_one_process(out):
    ranks = records(out, "aux_sitout")
    assert all(block[0] == 0 for block in ranks[0]["blocks"][1:])  # rank 0 sat out from step 1
    model, _ = reference("aux", ranks[0]["blocks"], chain_of=1)
    for record in ranks:
        assert_parameters(record["state"], model)


def test_a_train_only_output_trains_through_the_sharded_drop_in_with_stand_ins_as_one_process(out):
    ranks = records(out, "aux_sharded")
    assert all(block[0] == 0 for block in ranks[0]["blocks"])  # rank 0: stand-ins every step
    model, _ = reference("aux", ranks[0]["blocks"], chain_of=0)
    for record in ranks:
        assert_parameters(record["state"], model)
    initial = dict(make("aux").named_buffers())
    assert_buffers(ranks[0]["state"], initial)  # its stand-ins changed none of its BatchNorm's statistics
    for rank in range(1, RANKS):  # no buffer broadcast under FSDP2: each rank's count its own real samples
        assert_buffers(ranks[rank]["state"], reference("aux", ranks[0]["blocks"], chain_of=rank)[1])


@pytest.mark.parametrize("scenario", ["moe_ddp", "moe_sharded"])
def test_experts_without_tokens_train_exactly_as_one_process(out, scenario):
    ranks = records(out, scenario)
    model, _ = reference("moe", ranks[0]["blocks"], chain_of=0)
    for record in ranks:
        assert_parameters(record["state"], model)


@pytest.mark.parametrize("kind", ["aux", "moe"])
def test_the_model_of_a_closed_sharded_drop_in_computes_with_what_it_trained(out, kind):
    for record in records(out, f"{kind}_sharded"):
        model = make(kind)  # each rank's own state: its BatchNorm's statistics count its own samples
        model.load_state_dict({name: torch.tensor(value) for name, value in record["state"].items()})
        model.eval()
        expected = model(dataset().tensors[0][:BATCH]).detach().double()
        assert torch.allclose(torch.tensor(record["closed_output"], dtype=torch.float64), expected, atol=1e-5)
