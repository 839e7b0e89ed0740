"""The sharded drop-in (``hetdp.fully_shard``) in a user's own FSDP2 loop, with real processes over gloo: whatever the
shares, the parameters are those of one process on the same global batches; memory caps; checkpoints refused.

Then memory-sized shards (emulated memories of 1, 1 and 2 MB): each rank holds rows of every parameter in
proportion to its memory, and whatever the shares the parameters are those of one process on the same global
batches; caps after placement; a device too small for any shard; checkpoints onto even shards and back (a killed rank
and a resume on fewer ranks: ``test_sharded_resume.py``). One launch runs the scenarios of both on 3 ranks, torch's
even shards first (``uneven_worker.py --even-scenarios``)."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from hetdp.cluster.emulate import Emulation

from .conftest import WORKERS

sys.path.insert(0, str(WORKERS))
from sharded_worker import BATCH, CRAFTED_CLASS, assert_as_one_process, reference  # noqa: E402
from uneven_worker import MEMORIES_MB  # noqa: E402

RANKS = 3
MIS_WEIGHTING_FRACTION = 16
"""The mixed-precision test fails on a weighting off by this fraction of plain FSDP2's 1/W (or more)."""


@pytest.fixture(scope="module")
def out(tmp_path_factory, torchrun) -> Path:
    """The memory-sized shards' files; torch's even shards' in ``out / "even"``."""
    folder = tmp_path_factory.mktemp("sharded")
    torchrun("uneven_worker.py", RANKS, "--out", folder, "--even-scenarios", "exact,accumulate,mixed,caps,checkpoints",
             "--scenarios", "exact,recompute,compiled,accumulate,mixed,caps,too_small,checkpoints,refusals",
             timeout_s=500)
    return folder


@pytest.fixture(scope="module")
def even(out) -> Path:
    """The files of ``sharded_worker``'s scenarios, on torch's even shards."""
    return out / "even"


def record(out: Path, scenario: str) -> dict:
    return json.loads((out / f"{scenario}.json").read_text())


@pytest.mark.parametrize("reshard", [True, False])
def test_unequal_shares_a_zero_share_and_a_short_last_step_train_as_one_process(even, reshard):
    # Static weights 0, 1, 3 of 16: rank 0 runs a stand-in every step; the last step of each epoch has 2 samples for
    # 3 ranks, one each for the two with a share. AdamW's state lives sharded, clipping runs on the sharded
    # parameters, a OneCycle schedule per step.
    figures = record(even, "exact")
    assert figures[f"shares_{reshard}"] == [0, 4, 12]
    blocks = figures[f"blocks_{reshard}"]
    assert blocks[:4] == [[0, 4, 12]] * 4 and blocks[4] == [0, 1, 1]
    assert figures[f"sharded_state_{reshard}"]
    assert_as_one_process(torch.load(even / f"exact_{reshard}.pt"), reference(2))


def test_gradients_that_wait_under_set_requires_gradient_sync_weigh_each_step_by_its_own_shares(even):
    # The shares change inside the first window, and the epoch's last step (rank 1 on a stand-in: 2 samples at shares
    # 4, 2, 10 are 0.5, 0.25, 1.25, the largest remainder rank 0's) opens a window that runs into the next epoch: one
    # weight on the window's sum would be wrong for all of them.
    blocks = record(even, "accumulate")["blocks"]
    assert blocks[:2] == [[4, 4, 8], [4, 2, 10]] and blocks[4] == [1, 0, 1]
    assert_as_one_process(torch.load(even / "accumulate.pt"), reference(2, every=2))


def test_mixed_precision_trains_as_fully_shard_of_one_rank_under_the_same_policy(even):
    # bf16 parameters with an fp32 reduction, at shares 1, 1, 2, against fully_shard of one rank under the same
    # policy on the same global batches. The error guarded against is a weighting of the ranks other than by their
    # samples: plain FSDP2's 1/W moves the parameters `wrong` from the exact run, and weights off by a fraction f of
    # that move them about f x `wrong`. The bound takes f = 1/16, above bf16's own noise (forwards of other shapes):
    # a mis-weighting of a sixteenth of the bug's fails.
    assert record(even, "mixed")["blocks"][0] == [4, 4, 8]
    states = torch.load(even / "mixed.pt")
    expected = states["reference"]
    gap = max((states["hetdp"][name] - value).abs().max().item() for name, value in expected.items())
    wrong = max((states["rank_means"][name] - value).abs().max().item() for name, value in expected.items())
    assert gap <= wrong / MIS_WEIGHTING_FRACTION, (gap, wrong)


def test_a_rank_s_cap_is_what_its_device_memory_leaves_beside_its_shard_and_the_rest_re_split(even):
    figures = record(even, "caps")
    held, per_sample = figures["held_bytes"], figures["plain_per_sample_bytes"]
    given, probed = figures["given"], figures["probed"]
    # The device table's activations: 0.34 MB of memory, 0.1 MB a sample, beside the shard and FSDP2's buffers.
    assert given["caps"] == [None, None, math.floor((0.34e6 - held) / 0.1e6)] == [None, None, 2]
    # Probed on the sharded model, what a sample adds to a step's peak is what it adds in the same model whole (its
    # unsharded parameters, live while a unit runs, and FSDP2's buffers are state, the same at any batch).
    assert probed["caps"] == [None, None, math.floor((0.16e6 - held) / per_sample)] == [None, None, 2]
    for shares in (given["shares"], probed["shares"]):  # the global batch: the loader's batch_size on each rank
        assert shares[2] == 2 and sum(shares) == BATCH * RANKS and max(shares[:2]) - min(shares[:2]) <= 1


def test_a_device_too_small_for_its_shard_plus_one_sample_is_one_error_naming_it_and_the_bytes(even):
    figures = record(even, "caps")
    need = (figures["held_bytes"] + figures["plain_per_sample_bytes"]) / 1e6
    error = figures["too_small"]["error"]
    assert error.startswith("rank 2: its emulated device of 0.02 MB cannot hold its shard plus one sample: "
                            f"it would need {need:.3f} MB")
    assert "\n" not in error


def test_a_checkpoint_crafted_to_run_code_is_refused_on_every_rank_and_runs_nothing(even):
    # Its metadata asks DCP's metadata module for a class by a dotted name (one that creates a file when called).
    errors = [rank_errors["crafted"] for rank_errors in record(even, "checkpoints")["errors"]]
    assert len(errors) == RANKS
    for error in errors:
        assert error.startswith("RefusedCheckpointError: refused checkpoint ") and "step-00000000" in error, error
        assert f"metadata refers to torch.distributed.checkpoint.metadata.{CRAFTED_CLASS}" in error, error
    assert not (even / "crafted-ran").exists()


def test_a_checkpoint_folder_not_every_rank_sees_is_one_error_at_the_first_save_naming_the_ranks(even):
    errors = [rank_errors["local"] for rank_errors in record(even, "checkpoints")["errors"]]
    assert len(errors) == RANKS
    for error in errors:
        assert error.startswith("ConfigError: checkpoint folder "), error
        assert "is not one folder on every rank: ranks 1, 2 cannot read what rank 0 wrote there" in error, error
        assert "\n" not in error


def test_the_adopted_fsdp2_script_shards_by_memory_and_names_the_straggler_under_hetdp_run_devices(tmp_path,
                                                                                                  hetdp_run):
    # The README's script, unchanged, on two ranks (the README runs four): `hetdp run --devices` hands the ranks a
    # table of unequal memories and speeds, and the three adopted lines are all it takes to shard by the memories.
    # At equal shares rank 0 (40 ms a sample) computes each step three times as long as rank 1: 320 ms against
    # 107 ms, several times the exchanges of a step here, so the diagnosis the script prints must name it, by compute.
    table = tmp_path / "devices.toml"
    table.write_text("".join(f'[[devices]]\nname = "{name}"\nbatch_size = 8\nbatch_time_s = {seconds}\n'
                             f'memory_mb = {mb}\n' for name, seconds, mb in (("small", 0.32, 400),
                                                                             ("large", 0.32 / 3, 1200))))
    script = Path(__file__).parents[2] / "examples" / "adopt_fsdp2.py"
    completed = hetdp_run("-n", 2, "--devices", table, "--allocation", "equal", script, "--samples", "128",
                          "--epochs", "1")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    found = re.search(r"^epoch 0: loss (\d+\.\d{4}); (.*)$", completed.stdout, re.MULTILINE)
    assert found and math.isfinite(float(found.group(1))), completed.stdout
    assert found.group(2).startswith("rank 0 is the straggler, by compute: "), found.group(2)


@pytest.mark.serial
def test_the_emulation_of_hetdp_run_reaches_the_sharded_drop_in_and_it_rebalances(tmp_path, torchrun):
    # Pacing every compute segment before each of FSDP2's collectives: balanced shares reach each collective
    # together, and the compute times the adaptive rule reads are the emulated devices'.
    env = Emulation(speeds=(1.0, 2.0, 5.0), sample_cost_ms=10.0).to_env()
    torchrun("sharded_worker.py", RANKS, "--out", tmp_path, "--scenarios", "adaptive,memory_bound", env=env,
             timeout_s=300)
    figures = record(tmp_path, "adaptive")
    assert figures["speeds"] == [1.0, 2.0, 5.0]
    for share, ideal in zip(figures["shares"], [8, 16, 40]):  # 64 a step in proportion to the speeds
        assert abs(share - ideal) <= 0.2 * ideal, figures["shares"]
    assert figures["replans"][0], "no re-plan in the first epoch"
    bound = record(tmp_path, "memory_bound")
    # Static 1, 1, 4 of 12 (4 a rank's batch): rank 2's 8 capped at 2, the other 10 split evenly.
    assert bound["caps"] == [None, None, 2] and bound["shares"] == [5, 5, 2]
    assert "rank 2 is bound by memory, not speed: its share 2 is its cap" in bound["diagnosis"]


# --- memory-sized shards ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("reshard", [True, False])
def test_each_rank_holds_rows_of_every_parameter_in_proportion_to_its_memory(out, reshard):
    layouts = record(out, "exact")[f"layout_{reshard}"]
    assert all(layout["uneven"] and not layout["fsdp2"] for layout in layouts)
    total = sum(layout["bytes"] for layout in layouts)
    for layout, memory in zip(layouts, MEMORIES_MB):
        assert abs(layout["bytes"] / total - memory / sum(MEMORIES_MB)) < 0.02, [lay["bytes"] for lay in layouts]
        assert layout["state_rows"] == [True]  # AdamW's moments hold the same rows as their parameter
    # A parameter of 16 rows splits 4, 4, 8; the head's bias (32 rows) 8, 8, 16, give or take the running
    # rounding; every parameter's rows add up.
    assert [layout["rows"]["blocks.0.norm1.weight"] for layout in layouts] == [4, 4, 8]
    for name in layouts[0]["rows"]:
        assert sum(layout["rows"][name] for layout in layouts) > 0


@pytest.mark.parametrize("reshard", [True, False])
def test_a_zero_share_a_short_last_step_clipping_and_adamw_train_as_one_process_on_uneven_shards(out, reshard):
    figures = record(out, "exact")
    blocks = figures[f"blocks_{reshard}"]
    assert blocks[:4] == [[0, 4, 12]] * 4 and blocks[4] == [0, 1, 1]  # as on even shards
    assert_as_one_process(torch.load(out / f"exact_{reshard}.pt"), reference(2))


def test_activation_checkpointing_recomputes_a_freed_unit_and_trains_as_one_process(out):
    assert_as_one_process(torch.load(out / "recompute.pt"), reference(2))


def test_torch_compile_of_the_sharded_model_trains_as_one_process(out):
    assert_as_one_process(torch.load(out / "compiled.pt"), reference(1))


def test_gradients_that_wait_under_set_requires_gradient_sync_weigh_each_step_on_uneven_shards(out):
    blocks = record(out, "accumulate")["blocks"]
    assert blocks[:2] == [[4, 4, 8], [4, 2, 10]] and blocks[4] == [1, 0, 1]  # as on even shards
    assert_as_one_process(torch.load(out / "accumulate.pt"), reference(2, every=2))


def test_mixed_precision_on_uneven_shards_trains_as_fully_shard_of_one_rank_under_the_same_policy(out):
    assert all(record(out, "mixed")["uneven"])
    states = torch.load(out / "mixed.pt")
    gap = max((states["hetdp"][name] - value).abs().max().item() for name, value in states["reference"].items())
    assert gap < 2e-3


def test_each_rank_s_cap_is_what_its_memory_leaves_beside_its_own_uneven_shard(out):
    figures = record(out, "caps")
    memories = (0.3e6, 0.3e6, 1.2e6)
    assert figures["caps"] == [math.floor((memory - held) / 0.05e6) for memory, held in zip(memories, figures["held"])]
    state = figures["state"]
    for part, memory in zip(state, memories):
        assert abs(part / sum(state) - memory / sum(memories)) < 0.02
    # Equal shares of the global batch (8 a rank) would pass ranks 0 and 1's caps: the caps bind.
    assert figures["caps"][2] > figures["caps"][0] and sum(figures["shares"]) == 8 * RANKS
    assert figures["caps"][0] < 8 and figures["shares"][:2] == figures["caps"][:2]
    assert all(share <= cap for share, cap in zip(figures["shares"], figures["caps"]))


def test_a_device_too_small_for_any_shard_is_one_error_on_every_rank_naming_it_and_the_bytes(out):
    errors = record(out, "too_small")["errors"]
    assert all(len(each) == 1 and each == errors[0] for each in errors)
    error = errors[0][0]
    assert error.startswith("rank 2: its emulated device of 0.02 MB cannot hold any shard of Block: it would need ")
    assert "MB to compute with it whole" in error and "\n" not in error


def test_checkpoints_record_real_offsets_and_resume_onto_even_shards_and_back_exactly(out):
    figures = record(out, "checkpoints")
    # The head's 32 rows as the ranks held them when saved: memory-sized, then torch's even ones.
    # torch's even shards are torch.chunk's: 11, 11 and 10 rows.
    assert figures["uneven_to_even_chunks"] == [[[0, 0], [8, 16]], [[8, 0], [8, 16]], [[16, 0], [16, 16]]]
    assert figures["even_to_uneven_chunks"] == [[[0, 0], [11, 16]], [[11, 0], [11, 16]], [[22, 0], [10, 16]]]
    assert figures["uneven_to_even_rows"] == [[8, 8, 16], [11, 11, 10]]
    assert figures["even_to_uneven_rows"] == [[11, 11, 10], [8, 8, 16]]
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
