"""Loop shapes and loss conventions of real scripts train what one process (or plain DDP) trains, with real processes.

A loop that fetches batches ahead binds each step's shares to its batch; a summed loss and a mean over the global
step's tokens give, under unequal shares, plain DDP's gradient at equal shares on the same global batches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from dropin_worker import Pairs, make_model  # noqa: E402
from loops_worker import LR_SUM, SEED, tokens_of  # noqa: E402

RANKS = 4
SCENARIOS = ("prefetch", "prefetch_adaptive", "losses", "losses_sharded")


@pytest.fixture(scope="module")
def out(tmp_path_factory, torchrun) -> Path:
    folder = tmp_path_factory.mktemp("loops")
    torchrun("loops_worker.py", RANKS, "--out", folder, "--scenarios", ",".join(SCENARIOS), timeout_s=600)
    return folder


def load(out: Path, scenario: str) -> list[dict]:
    return [json.loads((out / f"{scenario}_{rank}.json").read_text()) for rank in range(RANKS)]


def reference(size: int, global_batch: int, *, optimizer: str, loss: str = "mean", epochs: int = 2
              ) -> dict[str, torch.Tensor]:
    """One process on the global batches (``DistributedSampler``'s order: seed + epoch), each step's gradient plain
    DDP's at equal shares: the mean loss over the global batch; for a sum, the sum over the ranks; for a global token
    mean, the mean over the step's tokens over the ranks (plain DDP averages the ranks' gradients)."""
    model = make_model(7)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=epochs * -(-size // global_batch))
    else:
        opt, scheduler = torch.optim.SGD(model.parameters(), lr=LR_SUM if loss == "sum" else 0.3), None
    data = Pairs(size)
    for epoch in range(epochs):
        order = torch.randperm(size, generator=torch.Generator().manual_seed(SEED + epoch))
        for first in range(0, size, global_batch):
            index = order[first : first + global_batch]
            opt.zero_grad()
            each = nn.functional.cross_entropy(model(data.x[index]), data.y[index], reduction="none")
            if loss == "mean":
                value = each.mean()
            elif loss == "sum":
                value = each.sum() / RANKS
            else:
                tokens = tokens_of(index)
                value = (each.double() * tokens).sum().float() / (tokens.sum().float() * RANKS)
            value.backward()
            if scheduler is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            if scheduler is not None:
                scheduler.step()
    return model.state_dict()


def assert_trains_as(path: Path, expected: dict[str, torch.Tensor], atol: float = 2e-6, rtol: float = 1e-5) -> None:
    for name, tensor in torch.load(path).items():
        torch.testing.assert_close(tensor, expected[name], atol=atol, rtol=rtol, msg=f"{path.name} {name}")


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_a_loop_that_fetches_ahead_trains_each_batch_under_its_own_shares(out, depth):
    # Shares that change at steps 1 and 5 and a last step of 2 samples (two stand-ins): bound to the moment the
    # loader yields, the batches train under the next step's shares and the last one outside any step.
    figures = load(out, "prefetch")
    mine = figures[0][f"depth{depth}"]
    assert mine["blocks"][:4] == [[2, 4, 6, 4], [4, 2, 6, 4], [4, 2, 6, 4], [1, 0, 1, 0]]
    assert mine["blocks"][4:] == [[4, 2, 6, 4], [2, 6, 4, 4], [2, 6, 4, 4], [0, 1, 1, 0]]
    assert mine["reports"] == [1, 2]  # each epoch's report is there right after its for loop
    assert mine["samples"] == [[11, 8, 19, 12], [8, 15, 15, 12]]
    assert mine["warnings"] == []
    # model.step_samples, read in the loop body before the forward, is the batch's own at every depth: its size,
    # and 0 on a stand-in batch (whose samples a step's token count must not count).
    for rank, record in enumerate(figures):
        seen = record[f"depth{depth}"]["seen"]
        assert [samples for _, samples in seen] == [block[rank] for block in mine["blocks"]]
        assert all(size == samples for size, samples in seen if samples)
    assert_trains_as(out / f"prefetch_{depth}.pt", reference(50, 16, optimizer="adamw"))


def test_a_loop_one_batch_ahead_under_adaptive_shares_trains_as_one_process(out):
    figures = load(out, "prefetch_adaptive")[0]
    assert figures["replans"] >= 1 and figures["reports"] == [1, 2] and figures["steps"] == 50
    assert len({tuple(block) for block in figures["blocks"]}) > 1  # the shares changed inside the run
    assert figures["warnings"] == []
    assert_trains_as(out / "prefetch_adaptive.pt", reference(400, 16, optimizer="sgd"), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("loss", ["sum", "global_mean"])
def test_a_loss_that_is_not_a_per_rank_mean_trains_as_plain_ddp_at_equal_shares(out, loss):
    figures = load(out, "losses")[0][loss]
    assert figures["blocks"][:4] == [[2, 4, 6, 4]] * 3 + [[0, 1, 1, 0]]
    assert figures["warnings"] == []
    assert_trains_as(out / f"losses_{loss}.pt", reference(50, 16, optimizer="sgd", loss=loss))


@pytest.mark.parametrize("loss", ["sum", "global_mean"])
def test_a_sharded_loss_that_is_not_a_per_rank_mean_trains_as_plain_fsdp2_at_equal_shares(out, loss):
    figures = load(out, "losses_sharded")[0][loss]
    assert figures["blocks"][:4] == [[2, 4, 6, 4]] * 3 + [[0, 1, 1, 0]]
    assert figures["warnings"] == []
    expected = reference(50, 16, optimizer="sgd", loss=loss)
    assert_trains_as(out / f"losses_sharded_{loss}.pt", expected)
