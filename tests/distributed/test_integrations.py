"""The framework adapters (hetdp.integrations) with real processes over gloo, launched as users launch them."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hetdp.allocate.sampler import split_step
from hetdp.cluster.emulate import Emulation

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from dropin_worker import Pairs, make_model  # noqa: E402
from loops_worker import LR_SUM  # noqa: E402
from torch_order import global_batches  # noqa: E402

# A module's launches run several scenarios each and take their time on a loaded machine: more than the 300 s a test
# may take by default, its fixtures' launches included. The shares they reach follow measured times, which other
# tests' processes would distort: they run alone.
pytestmark = [pytest.mark.timeout(900), pytest.mark.serial]

RANKS = 4
# 4 ms a sample at speed 1: the emulated times stay well above the real compute of the tiny models even when other
# tests' processes slow it several times (at 1 ms, the measured speeds evened out on a loaded machine); an epoch of
# the emulated scenarios still waits only about 1.5 s.
EMULATION = Emulation(speeds=(1.0, 1.0, 2.0, 4.0), sample_cost_ms=4.0)
BF16_ATOL = 4e-3


def launch(torchrun, worker: str, out: Path, scenarios: list[str], env: dict | None = None) -> dict[str, list[dict]]:
    """Run ``scenarios`` one after another in one launch (each rank imports its framework once); every scenario's
    results, one per rank."""
    torchrun(worker, RANKS, "--out", out, "--scenarios", ",".join(scenarios), env=env, timeout_s=500)
    prefix = worker.removesuffix("_worker.py")
    return {scenario: [json.loads((out / f"{prefix}_{scenario}_{rank}.json").read_text()) for rank in range(RANKS)]
            for scenario in scenarios}


def reference(size: int, global_batch: int, epochs: int, every: int, total_steps: int | None = None, seed: int = 3,
              bf16: bool = False, rank_means: list[int] | None = None) -> tuple[dict[str, torch.Tensor], float]:
    """One process on the global batches of torch's ``DistributedSampler(seed=seed)``: the mean loss over each
    global batch, ``every`` batches accumulated per AdamW step (and the epoch's last, as Lightning and Accelerate
    do), clipped at 0.5, a OneCycle schedule of ``total_steps`` if given, the forward under CPU autocast to bfloat16
    if ``bf16``; with ``rank_means`` (shares), the loss is instead the mean of the ranks' mean losses over the blocks
    those shares cut (the weighting plain DDP gives unequal shares: wrong); returns the parameters and the last epoch's
    mean loss over its samples."""
    model = make_model(7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = (None if total_steps is None else
                 torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=total_steps))
    data = Pairs(size)
    steps = math.ceil(size / global_batch)
    for epoch in range(epochs):
        loss_sum = 0.0
        for i, index in enumerate(global_batches(size, global_batch, seed, epoch)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                output = model(data.x[index])
            loss_sum += nn.functional.cross_entropy(output, data.y[index], reduction="sum").item()
            loss = nn.functional.cross_entropy(output, data.y[index])
            if rank_means is not None:
                blocks = split_step(rank_means, len(index))
                loss = torch.stack([nn.functional.cross_entropy(o, y) for o, y in
                                    zip(output.split(blocks), data.y[index].split(blocks)) if len(y)]).mean()
            (loss / every).backward()
            if (i + 1) % every == 0 or i == steps - 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                optimizer.zero_grad()
                if scheduler is not None:
                    scheduler.step()
    return model.state_dict(), loss_sum / size


@pytest.fixture(scope="module")
def lightning_first(tmp_path_factory, torchrun) -> tuple[dict[str, list[dict]], Path]:
    """The launch of the exact scenario, the fit interrupted after a checkpoint and the one under local SGD."""
    pytest.importorskip("lightning")
    out = tmp_path_factory.mktemp("lightning")
    return launch(torchrun, "lightning_worker.py", out, ["exact", "interrupted", "local", "sharded", "sum",
                                                         "sharded_sum"]), out


def summed_reference(size: int, global_batch: int, seed: int, epochs: int = 2) -> dict[str, torch.Tensor]:
    """What plain DDP (or FSDP2) trains at equal shares with a summed loss, in one process on the global batches in the
    order of a sampler seeded ``seed`` (torch's ``randperm``, seed + epoch): each step the sum over the global batch
    over the ranks (DDP averages the ranks' sums); SGD."""
    model = make_model(7)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR_SUM)
    data = Pairs(size)
    for epoch in range(epochs):
        order = torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch))
        for first in range(0, size, global_batch):
            index = order[first : first + global_batch]
            (nn.functional.cross_entropy(model(data.x[index]), data.y[index], reduction="sum") / RANKS).backward()
            optimizer.step()
            optimizer.zero_grad()
    return model.state_dict()


def assert_trains_summed(path: Path, seed: int) -> None:
    expected = summed_reference(50, 16, seed)
    for name, tensor in torch.load(path).items():
        torch.testing.assert_close(tensor, expected[name], atol=2e-6, rtol=1e-5, msg=name)


UNEQUAL_BLOCKS = [[2, 4, 6, 4]] * 3 + [[0, 1, 1, 0]] + [[2, 4, 6, 4]] * 3 + [[0, 1, 1, 0]]
"""Static shares 1:2:3:2 of 16 samples, 50 samples an epoch: a last step of 2 where ranks 0 and 3 run stand-ins."""


@pytest.mark.parametrize("scenario", ["sum", "sharded_sum"])
def test_lightning_strategies_train_a_summed_loss_at_unequal_shares_as_plain_ddp_at_equal_ones(lightning_first,
                                                                                               scenario):
    # HetdpStrategy(loss="sum") and HetdpShardedStrategy(loss="sum"): each rank's sum weighed 1 / ranks, as plain
    # DDP and FSDP2 average; weighed by its samples (the per-rank mean's weights), unequal shares would train another.
    results, out = lightning_first
    assert results[scenario][0]["blocks"] == UNEQUAL_BLOCKS and results[scenario][0]["epochs"] == 2
    assert_trains_summed(out / f"lightning_{scenario}.pt", seed=3)


@pytest.fixture(scope="module")
def lightning_second(lightning_first, torchrun) -> dict[str, list[dict]]:
    """A second launch: it resumes the interrupted fit, then fits under the emulation of ``hetdp run``. The emulation
    only paces the resumed fit's static shares; its exact comparison would catch anything else."""
    _, out = lightning_first
    return launch(torchrun, "lightning_worker.py", out, ["resumed", "emulated"], env=EMULATION.to_env())


@pytest.fixture(scope="module")
def lightning_exact(lightning_first) -> tuple[list[dict], Path]:
    results, out = lightning_first
    return results["exact"], out


def test_lightning_unequal_shares_train_as_one_process_on_the_global_batch(lightning_exact):
    # AdamW + a OneCycle schedule sized by estimated_stepping_batches, clipping and accumulate_grad_batches=2 on the
    # Trainer; static shares 1:2:3:2 of 16 samples, and a last step of 2 samples where ranks 0 and 3 run stand-ins.
    results, out = lightning_exact
    blocks = results[0]["blocks"]
    assert blocks == [[2, 4, 6, 4]] * 3 + [[0, 1, 1, 0]] + [[2, 4, 6, 4]] * 3 + [[0, 1, 1, 0]], blocks
    expected, _ = reference(50, 16, 2, every=2, total_steps=4)
    for name, tensor in torch.load(out / "lightning_exact.pt").items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=1e-4, msg=name)


def test_lightning_sees_plain_ddps_batch_count_and_leaves_validation_untouched(lightning_exact):
    results, _ = lightning_exact
    for result in results:
        # Every rank: 4 batches an epoch (50 samples, 4 a rank as DDP would cut them), 2 optimizer steps an epoch.
        assert result["batches"] == 4 and result["stepping_batches"] == 4, result
        # The validation loader is Lightning's own: 40 samples over 4 ranks in batches of 5, after 2 sanity batches.
        assert result["val_batches"] == [5] * 6, result["val_batches"]
        assert result["epochs"] == 2 and result["closed"]  # every epoch closed, the model released at teardown


def test_lightning_epoch_means_weigh_samples_and_not_a_stand_in(lightning_exact):
    # self.log(..., on_epoch=True, sync_dist=True) weighs by batch size: the stand-in batches of the last step (one
    # sample each on ranks 0 and 3, weighted 0 in the gradient) count for nothing, so the epoch's mean is the
    # reference's mean loss over the epoch's 50 samples.
    results, _ = lightning_exact
    _, mean_loss = reference(50, 16, 2, every=2, total_steps=4)
    assert results[0]["metrics"]["train_loss"] == pytest.approx(mean_loss, abs=1e-5)


def test_lightning_loggers_receive_the_epochs_figures(lightning_exact):
    metrics = lightning_exact[0][0]["metrics"]
    assert [metrics[f"hetdp/share_{rank}"] for rank in range(RANKS)] == [2.0, 4.0, 6.0, 4.0]
    assert metrics["hetdp/epoch_s"] > 0 and all(metrics[f"hetdp/compute_s_{rank}"] > 0 for rank in range(RANKS))


def test_lightning_bf16_mixed_precision_keeps_the_exact_gradient_weighting(lightning_exact):
    # precision="bf16-mixed" (CPU autocast) is Lightning's plugin, untouched: the forward runs in bfloat16, the
    # gradients and hetdp's share weighting in float32. Against one process under the same autocast on the same
    # global batches, the parameters differ by bfloat16's rounding of forwards on other batch shapes (a rank's
    # block, not the global batch): 1.1e-3 here. Plain DDP's weighting of the unequal shares (the mean of the ranks'
    # means) moves them 1.3e-2 from the exact gradient's run: the bound tells the two apart, with room for another
    # CPU's bfloat16 kernels. (AdamW's normalized steps and clipping keep both gaps small.)
    results, out = lightning_exact
    assert results[0]["bf16_blocks"] == results[0]["blocks"]
    expected, _ = reference(50, 16, 2, every=2, total_steps=4, bf16=True)
    ddp_weighting, _ = reference(50, 16, 2, every=2, total_steps=4, bf16=True, rank_means=[2, 4, 6, 4])
    trained = torch.load(out / "lightning_bf16.pt")
    gap = max((trained[name] - expected[name]).abs().max().item() for name in expected)
    wrong = max((ddp_weighting[name] - expected[name]).abs().max().item() for name in expected)
    assert gap <= BF16_ATOL < wrong / 2, (gap, wrong)


def test_lightning_s_fsdp2_path_under_the_sharded_drop_in_trains_as_one_process(lightning_first):
    # strategy="hetdp_fsdp": Lightning's ModelParallelStrategy, the module sharded by torch's fully_shard in
    # configure_model, static shares 1,1,2,4, clipping by the Trainer, a last step of 2 samples for 4 ranks.
    from .test_sharded import assert_as_one_process
    from .test_sharded import reference as sharded_reference

    results, out = lightning_first
    figures = results["sharded"][0]
    assert figures["shares"] == [2, 2, 4, 8] and figures["epochs"] == 2 and figures["closed"]
    assert figures["blocks"][:4] == [[2, 2, 4, 8]] * 4 and sum(figures["blocks"][4]) == 2
    assert_as_one_process(torch.load(out / "lightning_sharded.pt"), sharded_reference(2, schedule=False))


def test_lightning_resumes_a_checkpoint_saved_inside_an_epoch_where_the_uninterrupted_run_ends(lightning_first,
                                                                                              lightning_second):
    # The exact scenario's fit with an AdamW step per batch (8 steps, the OneCycle schedule over 8): a
    # ModelCheckpoint(every_n_train_steps=5) saves after the fifth, the second epoch's first batch, and the fit stops
    # there; a second launch resumes with trainer.fit(ckpt_path=...). The checkpoint holds hetdp's state ("hetdp":
    # shares, steps done, position); the re-cut loader continues the epoch at its batch 1, so the resumed run trains
    # the epoch's last three steps (the last one of 2 samples, stand-ins on ranks 0 and 3) and ends where one process
    # running the 8 steps uninterrupted ends (which the exact scenario's hetdp run matches). A loader restarted at the
    # epoch's first batch would train batch 0 again, and one reporting only the batches left would end Lightning's
    # epoch a batch early.
    first, out = lightning_first
    interrupted = first["interrupted"][0]
    assert interrupted["global_step"] == 5 and len(interrupted["blocks"]) == 5, interrupted
    results = lightning_second["resumed"]
    for result in results:
        assert result["saved"] == [1, 1] and result["steps_done"] == 8 and result["global_step"] == 8, result
    assert results[0]["blocks"] == [[2, 4, 6, 4]] * 2 + [[0, 1, 1, 0]], results[0]["blocks"]
    expected, _ = reference(50, 16, 2, every=1, total_steps=8)
    for name, tensor in torch.load(out / "lightning_resumed.pt").items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=1e-4, msg=name)
    # hetdp's own step checkpoints hold none of Lightning's loop state: one ConfigError naming Lightning's.
    assert "ModelCheckpoint" in results[0]["refused"] and "ckpt_path" in results[0]["refused"], results[0]


def test_lightning_checkpoint_under_local_sgd_holds_the_model_every_rank_holds(lightning_first):
    # Under local SGD the replicas train apart until the epoch ends; a ModelCheckpoint inside the epoch makes them
    # meet first, so the file holds the one model every rank then continues from (rank 0's alone otherwise).
    results = lightning_first[0]["local"]
    assert [result["saved_gap"] for result in results] == [0.0] * RANKS, results


def test_lightning_adaptive_shares_follow_the_emulated_speeds_within_the_first_epoch(lightning_second):
    # The emulation reaches the strategy through the environment only (hetdp run sets it): no code.
    result = lightning_second["emulated"][0]
    assert result["speeds"] == [1.0, 1.0, 2.0, 4.0] and result["replans"], result
    for share, ideal in zip(result["shares"], [16, 16, 32, 64]):
        assert abs(share - ideal) <= 0.2 * ideal, result["shares"]
    # trainer.save_checkpoint after the fit holds the allocation: a fit resumed from it (ckpt_path, one more epoch)
    # starts at the shares learned, not at equal ones to learn again.
    assert result["resumed_first"] == result["shares"] and result["resumed_epochs"] == 1, result


@pytest.fixture(scope="module")
def accelerate_runs(tmp_path_factory, torchrun) -> tuple[dict[str, list[dict]], Path]:
    """One launch under the emulation of ``hetdp run``: the exact scenario (static shares, which the emulation only
    paces), then adaptive shares."""
    pytest.importorskip("accelerate")
    out = tmp_path_factory.mktemp("accelerate")
    return launch(torchrun, "accelerate_worker.py", out, ["exact", "emulated", "sum"], env=EMULATION.to_env()), out


@pytest.fixture(scope="module")
def accelerate_exact(accelerate_runs) -> tuple[list[dict], Path]:
    results, out = accelerate_runs
    return results["exact"], out


def test_accelerate_unequal_shares_train_as_one_process_on_the_global_batch(accelerate_exact):
    # accelerator.accumulate over 2 batches (the epoch's last batch synchronizes), accelerator.backward, clipping when
    # gradients sync; static shares 1:2:3:2 of 16 samples, a last step of 2 where ranks 0 and 3 run stand-ins. Had
    # Accelerate's BatchSamplerShard re-sharded the re-cut batches, the ranks would not cover the global batches.
    results, out = accelerate_exact
    blocks = results[0]["blocks"]
    assert blocks == [[2, 4, 6, 4]] * 3 + [[0, 1, 1, 0]] + [[2, 4, 6, 4]] * 3 + [[0, 1, 1, 0]], blocks
    expected, _ = reference(50, 16, 2, every=2, seed=results[0]["seed"])  # a RandomSampler's: drawn by rank 0
    for name, tensor in torch.load(out / "accelerate_exact.pt").items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=1e-4, msg=name)


def test_accelerate_keeps_its_batch_count_and_its_own_evaluation_loader(accelerate_exact):
    results, _ = accelerate_exact
    for result in results:
        assert result["batches"] == 4 and result["epochs"] == 2, result  # Accelerate's 4 batches a process
        # The evaluation loader (no shuffle) is Accelerate's: gather_for_metrics sees each of its 40 samples once.
        assert result["evaluation_loader"] == "DataLoaderShard" and result["evaluated"] == 40, result


def test_accelerate_refuses_a_second_trainable_model_and_a_comm_hook_of_its_own(accelerate_exact):
    # Accelerate's prepare_model takes only its built-in comm hooks, and they would replace hetdp's, which weighs
    # the ranks' shares; one model's shares size its loader's steps.
    refused = accelerate_exact[0][0]["refused"]
    assert "comm hook" in refused["comm_hook"] and "one model" in refused["second_model"], refused


def test_accelerate_adaptive_shares_follow_the_emulated_speeds_within_the_first_epoch(accelerate_runs):
    result = accelerate_runs[0]["emulated"][0]
    assert result["speeds"] == [1.0, 1.0, 2.0, 4.0] and result["replans"], result
    for share, ideal in zip(result["shares"], [16, 16, 32, 64]):
        assert abs(share - ideal) <= 0.2 * ideal, result["shares"]


def test_accelerate_trains_a_summed_loss_at_unequal_shares_as_plain_ddp_at_equal_ones(accelerate_runs):
    # Accelerator(loss="sum"): each rank's sum weighed 1 / ranks, as Accelerate's DDP averages.
    results, out = accelerate_runs
    assert results["sum"][0]["blocks"] == UNEQUAL_BLOCKS
    assert_trains_summed(out / "accelerate_sum.pt", seed=results["sum"][0]["seed"])


def lm_reference(size: int, global_batch: int, epochs: int, every: int, shifted: bool, seed: int
                 ) -> dict[str, torch.Tensor]:
    """One process on the global batches of torch's ``DistributedSampler(seed=seed)``: per optimizer step, the sum of
    the token losses of its ``every`` global batches over their token count (transformers' loss normalization, which
    counts the labels from the second position on where it sees that the loss shifts them: ``shifted``), clipped at
    0.5, SGD."""
    from transformers_worker import Tokens, make_lm

    model = make_lm(7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    data = Tokens(size)
    steps = math.ceil(size / global_batch)
    for epoch in range(epochs):
        batches = global_batches(size, global_batch, seed, epoch)
        for first in range(0, steps, every):
            update = batches[first : first + every]
            tokens = sum(int((data.labels[index][:, int(shifted) :] != -100).sum()) for index in update)
            for index in update:
                logits = model(input_ids=data.ids[index], attention_mask=data.mask[index]).logits
                nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), data.labels[index][:, 1:].flatten(),
                                            ignore_index=-100, reduction="sum").div(tokens).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
    return model.state_dict()


@pytest.fixture(scope="module")
def transformers_runs(tmp_path_factory, torchrun) -> tuple[dict[str, list[dict]], Path]:
    """One launch under the emulation of ``hetdp run``: the exact scenario (static shares, which the emulation only
    paces), then adaptive shares."""
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("transformers")
    return launch(torchrun, "transformers_worker.py", out, ["exact", "emulated"], env=EMULATION.to_env()), out


def test_transformers_unequal_shares_count_the_token_normalization_once(transformers_runs):
    # A tiny GPT-2 on sequences of 4 to 12 tokens: transformers divides each rank's loss by the step's token count
    # over all ranks (average_tokens_across_devices) and scales it by the number of ranks. Weighed again by the
    # shares, the gradient would count the ranks' shares twice; a stand-in batch's tokens would count too.
    runs, out = transformers_runs
    results = runs["exact"]
    blocks = results[0]["blocks"]
    assert blocks == [[2, 4, 6, 4]] * 3 + [[0, 1, 1, 0]] + [[2, 4, 6, 4]] * 3 + [[0, 1, 1, 0]], blocks
    for result in results:
        assert result["batches"] == 4 and result["updates"] == 4 and result["epochs"] == 2 and result["closed"]
    expected = lm_reference(50, 16, 2, every=2, shifted=results[0]["shifts_labels"], seed=results[0]["seed"])
    for name, tensor in torch.load(out / "transformers_exact.pt").items():
        if name in expected:
            torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=1e-4, msg=name)


def test_transformers_adaptive_shares_follow_the_emulated_speeds_within_the_first_epoch(transformers_runs):
    result = transformers_runs[0]["emulated"][0]
    assert result["speeds"] == [1.0, 1.0, 2.0, 4.0] and result["replans"], result
    for share, ideal in zip(result["shares"], [16, 16, 32, 64]):
        assert abs(share - ideal) <= 0.2 * ideal, result["shares"]
