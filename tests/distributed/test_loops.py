"""Loop shapes and loss conventions of real scripts train what one process (or plain DDP) trains, with real processes.

A loop that fetches batches ahead binds each step's shares to its batch, and so does a loop that fetches a window of
batches and trains them with no fetch between; a summed loss and a mean over the global step's tokens give, under
unequal shares, plain DDP's gradient at equal shares on the same global batches.
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

RANKS = 3
SCENARIOS = ("prefetch", "prefetch_adaptive", "losses", "losses_sharded")
WINDOWS = (*(f"windows_{kind}{drop_in}" for kind in ("static", "adaptive", "accumulates", "twice", "waiting")
             for drop_in in ("", "_sharded")), "windows_syncs")


@pytest.fixture(scope="module")
def out(tmp_path_factory, torchrun) -> Path:
    folder = tmp_path_factory.mktemp("loops")
    torchrun("loops_worker.py", RANKS, "--out", folder, "--scenarios", ",".join(SCENARIOS + WINDOWS), timeout_s=600)
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
    # Shares that change at steps 1 and 5 and a last step of 2 samples (a stand-in): bound to the moment the
    # loader yields, the batches train under the next step's shares and the last one outside any step.
    figures = load(out, "prefetch")
    mine = figures[0][f"depth{depth}"]
    assert mine["blocks"][:4] == [[2, 4, 10], [4, 2, 10], [4, 2, 10], [1, 0, 1]]
    assert mine["blocks"][4:] == [[4, 2, 10], [2, 6, 8], [2, 6, 8], [0, 1, 1]]
    assert mine["reports"] == [1, 2]  # each epoch's report is there right after its for loop
    assert mine["samples"] == [[11, 8, 31], [8, 15, 27]]
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
    assert figures["blocks"][:4] == [[2, 4, 10]] * 3 + [[0, 1, 1]]
    assert figures["warnings"] == []
    assert_trains_as(out / f"losses_{loss}.pt", reference(50, 16, optimizer="sgd", loss=loss))


@pytest.mark.parametrize("loss", ["sum", "global_mean"])
def test_a_sharded_loss_that_is_not_a_per_rank_mean_trains_as_plain_fsdp2_at_equal_shares(out, loss):
    figures = load(out, "losses_sharded")[0][loss]
    assert figures["blocks"][:4] == [[2, 4, 10]] * 3 + [[0, 1, 1]]
    assert figures["warnings"] == []
    expected = reference(50, 16, optimizer="sgd", loss=loss)
    assert_trains_as(out / f"losses_sharded_{loss}.pt", expected)


# --- a loop that fetches a window of batches, then trains them with no fetch between ---------------------------------

STATIC_BLOCKS = [[4, 4, 8], [4, 2, 10], [4, 2, 10], [1, 0, 1], [4, 2, 10], [2, 6, 8], [2, 6, 8], [0, 1, 1]]
"""Static shares 1, 1, 2 of 16, set to 4, 2, 10 at step 1 and 2, 6, 8 at step 5 (inside a window of 2 or 4, and
inside the second epoch), each epoch's last step of 2 samples (a stand-in): 2 x 4/16, 2/16, 10/16 are 0.5, 0.25 and
1.25, the largest remainder rank 0's; 2 x 2/16, 6/16, 8/16 are 0.25, 0.75 and 1, rank 1's."""
DROP_INS = ["", "_sharded"]


def assert_each_batch_under_its_own_step(figures: list[dict], blocks: list[list[int]]) -> None:
    """``model.step_samples``, read in the loop body before a batch's first forward, is that batch's on every rank:
    its size, 0 on a stand-in batch."""
    for rank, record in enumerate(figures):
        assert [samples for _, samples in record["seen"]] == [block[rank] for block in blocks], rank
        assert all(size == samples for size, samples in record["seen"] if samples), rank


def accumulated_reference(size: int, global_batch: int, every: int) -> dict[str, torch.Tensor]:
    """One process on the global batches (ordered as ``reference``), ``every`` of them accumulated per SGD step, each
    its mean loss over ``every``."""
    model = make_model(7)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    data = Pairs(size)
    for epoch in range(2):
        order = torch.randperm(size, generator=torch.Generator().manual_seed(SEED + epoch))
        for step, first in enumerate(range(0, size, global_batch)):
            index = order[first : first + global_batch]
            (nn.functional.cross_entropy(model(data.x[index]), data.y[index]) / every).backward()
            if (step + 1) % every == 0:
                opt.step()
                opt.zero_grad()
    return model.state_dict()


def two_losses_reference(size: int, global_batch: int) -> dict[str, torch.Tensor]:
    """One process on the global batches (ordered as ``reference``), each step two losses backpropagated apart: the
    mean over the global batch, then over the batch mirrored (-x, 1 - y); SGD."""
    model = make_model(7)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    data = Pairs(size)
    for epoch in range(2):
        order = torch.randperm(size, generator=torch.Generator().manual_seed(SEED + epoch))
        for first in range(0, size, global_batch):
            index = order[first : first + global_batch]
            opt.zero_grad()
            nn.functional.cross_entropy(model(data.x[index]), data.y[index]).backward()
            nn.functional.cross_entropy(model(-data.x[index]), 1 - data.y[index]).backward()
            opt.step()
    return model.state_dict()


@pytest.mark.parametrize("drop_in", DROP_INS)
@pytest.mark.parametrize("window", [2, 4])
def test_a_loop_that_trains_a_window_of_fetched_batches_trains_each_under_its_own_shares(out, window, drop_in):
    # Bound to the moment the loader yields, every batch of a window trained under the window's first step: its
    # shares, its weights, its model.step_samples.
    figures = [record[f"window{window}"] for record in load(out, f"windows_static{drop_in}")]
    mine = figures[0]
    assert mine["blocks"] == STATIC_BLOCKS
    assert mine["reports"] == [1, 2]  # each epoch's report is there right after its for loop
    assert mine["samples"] == [[13, 8, 29], [8, 15, 27]]
    assert mine["warnings"] == []
    assert_each_batch_under_its_own_step(figures, STATIC_BLOCKS)
    assert_trains_as(out / f"windows_static{drop_in}_{window}.pt", reference(50, 16, optimizer="adamw"))


@pytest.mark.parametrize("drop_in", DROP_INS)
@pytest.mark.parametrize("window", [2, 4])
def test_a_window_loop_under_adaptive_shares_trains_as_one_process(out, window, drop_in):
    figures = [record[f"window{window}"] for record in load(out, f"windows_adaptive{drop_in}")]
    mine = figures[0]
    assert mine["replans"] >= 1 and mine["reports"] == [1, 2] and mine["steps"] == 50
    assert len({tuple(block) for block in mine["blocks"]}) > 1  # the shares changed inside the run
    assert mine["warnings"] == []
    assert_each_batch_under_its_own_step(figures, mine["blocks"])
    assert_trains_as(out / f"windows_adaptive{drop_in}_{window}.pt", reference(400, 16, optimizer="sgd"),
                     atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("drop_in", DROP_INS)
def test_under_accumulates_a_window_of_batches_run_as_micro_batches_trains_as_one_process(out, drop_in):
    # allocate(..., accumulates=True): a batch may run as several forwards, so a backward whose gradients wait does
    # not end its batch; the optimizer step after it does.
    records = load(out, f"windows_accumulates{drop_in}")
    figures = [record["micro"] for record in records]
    assert figures[0]["blocks"] == STATIC_BLOCKS and figures[0]["warnings"] == []
    assert_each_batch_under_its_own_step(figures, STATIC_BLOCKS)
    assert_trains_as(out / f"windows_accumulates{drop_in}.pt", reference(50, 16, optimizer="sgd"))
    # A window whose batches accumulate with no optimizer step between them cannot be told from micro-batches of one
    # batch under accumulates=True: one warning (rank 0's), which names the loop shape.
    warned = records[0]["accumulated"]
    assert len(warned) == 1 and "accumulates=True" in warned[0] and "window" in warned[0], warned
    assert all(record["accumulated"] == [] for record in records[1:])
    # Micro-batches under accumulates=False (a batch is one forward): the first backward whose gradients wait ends
    # the batch; one warning names the setting.
    split = records[0]["split"]
    assert len(split) == 1 and "accumulates=True" in split[0] and "micro-batches" in split[0], split


@pytest.mark.parametrize("sync", ["allreduce", "solo", "majority", "local:2"])
def test_a_window_loop_binds_each_batch_to_its_step_under_every_synchronization(out, sync):
    # Shares 4, 2, 10 from step 1, then 6, 0, 10 from step 5: under allreduce rank 1 sits out of the exchange
    # (a stand-in of its own); partial rounds and local averaging weigh what they hold by each batch's samples.
    figures = [record[sync] for record in load(out, "windows_syncs")]
    blocks = figures[0]["blocks"]
    assert blocks[:4] == STATIC_BLOCKS[:4] and blocks[5] == blocks[6] == [6, 0, 10], blocks
    assert figures[0]["reports"] == [1, 2] and figures[0]["warnings"] == []
    assert_each_batch_under_its_own_step(figures, blocks)
    if sync == "allreduce":
        assert_trains_as(out / "windows_syncs_allreduce.pt", reference(50, 16, optimizer="sgd"))


@pytest.mark.parametrize("drop_in", DROP_INS)
def test_two_losses_a_step_behind_a_prefetcher_stay_in_their_step(out, drop_in):
    # A forward after a backward with a batch fetched ahead, but with no update between them: the same step's (a
    # GAN's discriminator runs two). Ending steps at every backward would train the second loss under the next
    # batch's shares.
    figures = load(out, f"windows_twice{drop_in}")
    assert figures[0]["blocks"] == STATIC_BLOCKS and figures[0]["warnings"] == []
    assert_each_batch_under_its_own_step(figures, STATIC_BLOCKS)
    assert_trains_as(out / f"windows_twice{drop_in}.pt", two_losses_reference(50, 16))


@pytest.mark.parametrize("drop_in", DROP_INS)
@pytest.mark.parametrize("shape", ["window", "prefetch"])
def test_gradients_that_wait_across_the_batches_of_a_window_train_each_under_its_own_step(out, shape, drop_in):
    # Two batches accumulated per optimizer step, fetched as a window of 2, or two batches ahead (the epoch's last
    # two then train after the loader ran out): no fetch and no optimizer step between the two batches. A backward
    # whose gradients wait ends its batch (a batch is one forward under accumulates=False).
    figures = [record[shape] for record in load(out, f"windows_waiting{drop_in}")]
    assert figures[0]["blocks"] == STATIC_BLOCKS and figures[0]["reports"] == 2
    assert_each_batch_under_its_own_step(figures, STATIC_BLOCKS)
    assert_trains_as(out / f"windows_waiting{drop_in}_{shape}.pt", accumulated_reference(50, 16, every=2))
