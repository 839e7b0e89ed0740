"""The sharded drop-in (``hetdp.fully_shard``) in a user's own FSDP2 loop, with real processes over gloo: whatever the
shares, the parameters are those of one process on the same global batches; memory caps. (A killed rank and a resume
on fewer ranks, on these even shards and on memory-sized ones: test_uneven.py.)"""

from __future__ import annotations

import functools
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
from sharded_worker import CRAFTED_CLASS, global_batches, loss_of, make_model, make_optimizer  # noqa: E402

RANKS = 4
STEPS_PER_EPOCH = 5
"""66 samples in steps of 16: four full ones and one of 2."""
MIS_WEIGHTING_FRACTION = 16
"""The mixed-precision test fails on a weighting off by this fraction of plain FSDP2's 1/W (or more)."""


@pytest.fixture(scope="module")
def out(tmp_path_factory, torchrun) -> Path:
    folder = tmp_path_factory.mktemp("sharded")
    torchrun("sharded_worker.py", RANKS, "--out", folder, "--scenarios", "exact,accumulate,mixed,caps,checkpoints", timeout_s=300)
    return folder


def record(out: Path, scenario: str) -> dict:
    return json.loads((out / f"{scenario}.json").read_text())


@functools.cache
def reference(epochs: int, kind: str = "adamw", every: int = 1, schedule: bool = True) -> dict[str, torch.Tensor]:
    """One process on the union of the ranks' batches: the mean loss over each global batch, ``every`` global
    batches accumulated per optimizer step (counted within each epoch, as the ranks' loop does), clipped at 0.5."""
    model = make_model()
    optimizer = make_optimizer(model, kind)
    scheduler = (torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=epochs * STEPS_PER_EPOCH)
                 if schedule else None)
    for index, tokens in enumerate(global_batches(epochs)):
        (loss_of(model, tokens) / every).backward()
        if (index % STEPS_PER_EPOCH + 1) % every == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def assert_as_one_process(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float = 1e-5):
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("reshard", [True, False])
def test_unequal_shares_a_zero_share_and_a_short_last_step_train_as_one_process(out, reshard):
    # Static weights 0, 1, 2, 5: rank 0 runs a stand-in every step; the last step of each epoch has 2 samples for 4
    # ranks. AdamW's state lives sharded, clipping runs on the sharded parameters, a OneCycle schedule per step.
    figures = record(out, "exact")
    assert figures[f"shares_{reshard}"] == [0, 2, 4, 10]
    blocks = figures[f"blocks_{reshard}"]
    assert blocks[:4] == [[0, 2, 4, 10]] * 4 and sum(blocks[4]) == 2 and blocks[4].count(0) >= 2
    assert figures[f"sharded_state_{reshard}"]
    assert_as_one_process(torch.load(out / f"exact_{reshard}.pt"), reference(2))


def test_gradients_that_wait_under_set_requires_gradient_sync_weigh_each_step_by_its_own_shares(out):
    # The shares change inside the first window, and the epoch's last step (two ranks on stand-ins) opens a window
    # that runs into the next epoch: one weight on the window's sum would be wrong for all of them.
    blocks = record(out, "accumulate")["blocks"]
    assert blocks[:2] == [[2, 2, 4, 8], [4, 2, 6, 4]] and blocks[4].count(0) == 2
    assert_as_one_process(torch.load(out / "accumulate.pt"), reference(2, every=2))


def test_mixed_precision_trains_as_fully_shard_of_one_rank_under_the_same_policy(out):
    # bf16 parameters with an fp32 reduction, at shares 1, 1, 2, 4, against fully_shard of one rank under the same
    # policy on the same global batches. The error guarded against is a weighting of the ranks other than by their
    # samples: plain FSDP2's 1/W moves the parameters `wrong` from the exact run, and weights off by a fraction f of
    # that move them about f x `wrong`. The bound takes f = 1/16, above bf16's own noise (forwards of other shapes):
    # a mis-weighting of a sixteenth of the bug's fails.
    assert record(out, "mixed")["blocks"][0] == [2, 2, 4, 8]
    states = torch.load(out / "mixed.pt")
    expected = states["reference"]
    gap = max((states["hetdp"][name] - value).abs().max().item() for name, value in expected.items())
    wrong = max((states["rank_means"][name] - value).abs().max().item() for name, value in expected.items())
    assert gap <= wrong / MIS_WEIGHTING_FRACTION, (gap, wrong)


def test_a_rank_s_cap_is_what_its_device_memory_leaves_beside_its_shard_and_the_rest_re_split(out):
    figures = record(out, "caps")
    held, per_sample = figures["held_bytes"], figures["plain_per_sample_bytes"]
    given, probed = figures["given"], figures["probed"]
    # The device table's activations: 0.34 MB of memory, 0.1 MB a sample, beside the shard and FSDP2's buffers.
    assert given["caps"] == [None, None, None, math.floor((0.34e6 - held) / 0.1e6)] == [None, None, None, 2]
    # Probed on the sharded model, what a sample adds to a step's peak is what it adds in the same model whole (its
    # unsharded parameters, live while a unit runs, and FSDP2's buffers are state, the same at any batch).
    assert probed["caps"] == [None, None, None, math.floor((0.145e6 - held) / per_sample)] == [None, None, None, 2]
    for shares in (given["shares"], probed["shares"]):
        assert shares[3] == 2 and sum(shares) == 16 and max(shares[:3]) - min(shares[:3]) <= 1


def test_a_device_too_small_for_its_shard_plus_one_sample_is_one_error_naming_it_and_the_bytes(out):
    figures = record(out, "caps")
    need = (figures["held_bytes"] + figures["plain_per_sample_bytes"]) / 1e6
    error = figures["too_small"]["error"]
    assert error.startswith("rank 3: its emulated device of 0.02 MB cannot hold its shard plus one sample: "
                            f"it would need {need:.3f} MB")
    assert "\n" not in error


def test_a_checkpoint_crafted_to_run_code_is_refused_on_every_rank_and_runs_nothing(out):
    # Its metadata asks DCP's metadata module for a class by a dotted name (one that creates a file when called).
    errors = [rank_errors["crafted"] for rank_errors in record(out, "checkpoints")["errors"]]
    assert len(errors) == RANKS
    for error in errors:
        assert error.startswith("RefusedCheckpointError: refused checkpoint ") and "step-00000000" in error, error
        assert f"metadata refers to torch.distributed.checkpoint.metadata.{CRAFTED_CLASS}" in error, error
    assert not (out / "crafted-ran").exists()


def test_a_checkpoint_folder_not_every_rank_sees_is_one_error_at_the_first_save_naming_the_ranks(out):
    errors = [rank_errors["local"] for rank_errors in record(out, "checkpoints")["errors"]]
    assert len(errors) == RANKS
    for error in errors:
        assert error.startswith("ConfigError: checkpoint folder "), error
        assert "is not one folder on every rank: ranks 1, 2, 3 cannot read what rank 0 wrote there" in error, error
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
    env = Emulation(speeds=(1.0, 1.0, 2.0, 4.0), sample_cost_ms=10.0).to_env()
    torchrun("sharded_worker.py", RANKS, "--out", tmp_path, "--scenarios", "adaptive,memory_bound", env=env,
             timeout_s=300)
    figures = record(tmp_path, "adaptive")
    assert figures["speeds"] == [1.0, 1.0, 2.0, 4.0]
    for share, ideal in zip(figures["shares"], [8, 8, 16, 32]):
        assert abs(share - ideal) <= 0.2 * ideal, figures["shares"]
    assert figures["replans"][0], "no re-plan in the first epoch"
    bound = record(tmp_path, "memory_bound")
    assert bound["caps"] == [None, None, None, 2] and bound["shares"] == [5, 5, 4, 2]
    assert "rank 3 is bound by memory, not speed: its share 2 is its cap" in bound["diagnosis"]
