"""Memory-sized shards (``hetdp.fully_shard`` on ranks whose emulated memories are 1, 1, 2 and 4 MB) in a user's own
FSDP2 loop, with real processes over gloo: each rank holds rows of every parameter in proportion to its memory, and
whatever the shares the parameters are those of one process on the same global batches; caps after placement; a
device too small for any shard; checkpoints onto even shards and back; a killed rank restarted and a resume on fewer
ranks, on even shards and memory-sized ones."""

from __future__ import annotations

import collections
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from hetdp.launch import run_local

from .conftest import WORKERS
from .test_sharded import STEPS_PER_EPOCH, assert_as_one_process, reference

sys.path.insert(0, str(WORKERS))
from uneven_worker import MEMORIES_MB  # noqa: E402

RANKS = 4


@pytest.fixture(scope="module")
def out(tmp_path_factory, torchrun) -> Path:
    folder = tmp_path_factory.mktemp("uneven")
    torchrun("uneven_worker.py", RANKS, "--out", folder, "--scenarios",
             "exact,recompute,compiled,accumulate,mixed,caps,too_small,checkpoints,refusals", timeout_s=400)
    return folder


def record(out: Path, scenario: str) -> dict:
    return json.loads((out / f"{scenario}.json").read_text())


@pytest.mark.parametrize("reshard", [True, False])
def test_each_rank_holds_rows_of_every_parameter_in_proportion_to_its_memory(out, reshard):
    layouts = record(out, "exact")[f"layout_{reshard}"]
    assert all(layout["uneven"] and not layout["fsdp2"] for layout in layouts)
    total = sum(layout["bytes"] for layout in layouts)
    for layout, memory in zip(layouts, MEMORIES_MB):
        assert abs(layout["bytes"] / total - memory / sum(MEMORIES_MB)) < 0.02, [lay["bytes"] for lay in layouts]
        assert layout["state_rows"] == [True]  # AdamW's moments hold the same rows as their parameter
    # A parameter of 16 rows splits 2, 2, 4, 8; the head's bias (32 rows) 4, 4, 8, 16, give or take the running
    # rounding; every parameter's rows add up.
    assert [layout["rows"]["blocks.0.norm1.weight"] for layout in layouts] == [2, 2, 4, 8]
    for name in layouts[0]["rows"]:
        assert sum(layout["rows"][name] for layout in layouts) > 0


@pytest.mark.parametrize("reshard", [True, False])
def test_a_zero_share_a_short_last_step_clipping_and_adamw_train_as_one_process_on_uneven_shards(out, reshard):
    figures = record(out, "exact")
    blocks = figures[f"blocks_{reshard}"]
    assert blocks[:4] == [[0, 2, 4, 10]] * 4 and sum(blocks[4]) == 2 and blocks[4].count(0) >= 2
    assert_as_one_process(torch.load(out / f"exact_{reshard}.pt"), reference(2))


def test_activation_checkpointing_recomputes_a_freed_unit_and_trains_as_one_process(out):
    assert_as_one_process(torch.load(out / "recompute.pt"), reference(2))


def test_torch_compile_of_the_sharded_model_trains_as_one_process(out):
    assert_as_one_process(torch.load(out / "compiled.pt"), reference(1))


def test_gradients_that_wait_under_set_requires_gradient_sync_weigh_each_step_on_uneven_shards(out):
    blocks = record(out, "accumulate")["blocks"]
    assert blocks[:2] == [[2, 2, 4, 8], [4, 2, 6, 4]] and blocks[4].count(0) == 2
    assert_as_one_process(torch.load(out / "accumulate.pt"), reference(2, every=2))


def test_mixed_precision_on_uneven_shards_trains_as_fully_shard_of_one_rank_under_the_same_policy(out):
    assert all(record(out, "mixed")["uneven"])
    states = torch.load(out / "mixed.pt")
    gap = max((states["hetdp"][name] - value).abs().max().item() for name, value in states["reference"].items())
    assert gap < 2e-3


def test_each_rank_s_cap_is_what_its_memory_leaves_beside_its_own_uneven_shard(out):
    figures = record(out, "caps")
    memories = (0.3e6, 0.3e6, 0.6e6, 1.2e6)
    assert figures["caps"] == [math.floor((memory - held) / 0.05e6) for memory, held in zip(memories, figures["held"])]
    state = figures["state"]
    for part, memory in zip(state, memories):
        assert abs(part / sum(state) - memory / sum(memories)) < 0.02
    assert figures["caps"][3] > figures["caps"][0] and sum(figures["shares"]) == 32
    assert all(share <= cap for share, cap in zip(figures["shares"], figures["caps"]))


def test_a_device_too_small_for_any_shard_is_one_error_on_every_rank_naming_it_and_the_bytes(out):
    errors = record(out, "too_small")["errors"]
    assert all(len(each) == 1 and each == errors[0] for each in errors)
    error = errors[0][0]
    assert error.startswith("rank 3: its emulated device of 0.02 MB cannot hold any shard of Block: it would need ")
    assert "MB to compute with it whole" in error and "\n" not in error


def test_checkpoints_record_real_offsets_and_resume_onto_even_shards_and_back_exactly(out):
    figures = record(out, "checkpoints")
    # The head's 32 rows as the ranks held them when saved: memory-sized, then torch's even ones.
    assert figures["uneven_to_even_chunks"] == [[[0, 0], [4, 16]], [[4, 0], [4, 16]], [[8, 0], [8, 16]],
                                                [[16, 0], [16, 16]]]
    assert figures["even_to_uneven_chunks"] == [[[row, 0], [8, 16]] for row in (0, 8, 16, 24)]
    assert figures["uneven_to_even_rows"] == [[4, 4, 8, 16], [8, 8, 8, 8]]
    assert figures["even_to_uneven_rows"] == [[8, 8, 8, 8], [4, 4, 8, 16]]
    for name in ("uneven_to_even", "even_to_uneven"):
        assert_as_one_process(torch.load(out / f"{name}.pt"), reference(2))


def test_fsdp2_methods_that_do_not_map_are_one_error_and_unshard_reshard_work(out):
    figures = record(out, "refusals")
    assert figures["unsharded"] and figures["resharded"]
    for call, error in figures["refused"].items():
        assert error.startswith(f"{call} does not map onto memory-sized shards ("), error
    assert figures["after_allocate"].startswith("set_custom_all_gather does not map onto memory-sized shards (")


def test_equal_memories_and_shard_sizes_even_keep_torch_s_fsdp2_and_a_model_mixing_both_is_one_error(out):
    figures = record(out, "refusals")
    assert figures["equal_is_fsdp2"] and figures["even_is_fsdp2"]
    assert figures["mixed"] == ("UnevenBlock has memory-sized shards and TinyLM would get torch's even ones: give "
                                "every fully_shard call of a model the same shard_sizes"), figures["mixed"]


def test_a_killed_rank_resumes_under_restarts_on_even_and_uneven_shards_and_fewer_ranks_reshard_them_exactly(
        tmp_path):
    # One chain of launches over 3 epochs (15 steps), every rank saving every 2 steps, each launch on fewer ranks than
    # the last: 3 ranks on torch's even shards, rank 1 killed in step 3 and the launch restarted from the save at
    # step 2, stopped after step 5; 2 ranks of 1 and 3 MB resume it (DCP reshards the model and AdamW's state from
    # even shards onto memory-sized ones), rank 1 killed in step 9 and restarted from the save at step 8, stopped
    # after step 11; one rank resumes that and ends the run (memory-sized shards onto one).
    restarts: list[int] = []
    args = ["--ckpt", tmp_path / "ckpt", "--record", tmp_path / "steps.log", "--out", tmp_path / "final.pt",
            "--epochs", 3]
    for ranks, options in ((3, ["--die-at", 3, "--stop-at", 6]), (2, ["--memories", "1,3", "--die-at", 9,
                                                                     "--stop-at", 12]), (1, [])):
        completed = run_local(WORKERS / "sharded_resume_worker.py", ranks, [*map(str, args), *map(str, options)],
                              capture=True, timeout_s=300, max_restarts=1 if options else 0, report_errors=True,
                              on_restart=lambda attempt, code: restarts.append(attempt))
        assert completed.returncode == 0, completed.stdout
    assert restarts == [1, 1]
    steps: dict[str, set[int]] = collections.defaultdict(set)
    ranks: dict[str, set[int]] = collections.defaultdict(set)
    for line in (tmp_path / "steps.log").read_text().splitlines():
        launch, step, rank = line.split()
        steps[launch].add(int(step))
        ranks[launch].add(int(rank))
    # In the order the launches ran: each killed one, its restart (two steps redone), then the last.
    assert [(min(each), max(each)) for each in steps.values()] == [(0, 3), (2, 5), (6, 9), (8, 11),
                                                                   (12, 3 * STEPS_PER_EPOCH - 1)]
    assert list(ranks.values()) == [{0, 1, 2}] * 2 + [{0, 1}] * 2 + [{0}]
    held = [json.loads(line) for line in (tmp_path / "final.pt.rows").read_text().splitlines()]
    assert [launch["uneven"] for launch in held] == [False, True, False]  # one rank holds everything: torch's path
    elements = held[1]["elements"]  # the 2 ranks of 1 and 3 MB
    assert abs(elements[0] / sum(elements) - 0.25) < 0.02, elements
    assert_as_one_process(torch.load(tmp_path / "final.pt"), reference(3))
