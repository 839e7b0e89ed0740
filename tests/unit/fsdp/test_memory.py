"""What a sharded rank holds whatever its batch, the budget its device gives (the sharded spike's formula), and what
one more sample adds to a step's peak (probed on real modules in one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hetdp.cluster.devices import DeviceModel
from hetdp.cluster.emulate import Emulation
from hetdp.fsdp.memory import OPTIMIZER_COPIES, Footprint, UnitShape, budget, footprint, probe_activation_bytes

FLOAT = 4
"""Bytes of a float32."""


def test_a_rank_holds_its_shards_the_optimizer_s_copies_and_fsdp2_s_buffers():
    shapes = [UnitShape(gathered_bytes=400, reduced_bytes=800, kept=True),  # a root kept gathered
              UnitShape(gathered_bytes=1000, reduced_bytes=2000, kept=False),
              UnitShape(gathered_bytes=1000, reduced_bytes=2000, kept=False)]
    held = footprint(shapes, parameter_bytes=600)
    assert held == Footprint(parameters=600, gradients=600, optimizer=OPTIMIZER_COPIES * 600,
                             buffers=3 * 1000 + 2000 + 400)
    assert held.state == 600 * (2 + OPTIMIZER_COPIES) and held.held == held.state + held.buffers


def test_an_emulated_device_s_budget_is_its_table_memory_beside_its_fixed_part():
    held = footprint([UnitShape(gathered_bytes=1000, reduced_bytes=1000, kept=False)], parameter_bytes=500)
    devices = (DeviceModel(), DeviceModel(memory_mb=2.0, fixed_memory_mb=0.5, activation_mb_per_sample=0.25))
    emulation = Emulation(sample_cost_ms=1.0, devices=devices)
    mine = budget(1, torch.device("cpu"), emulation, held)
    assert mine.memory_bytes == pytest.approx(1.5e6) and mine.held_bytes == held.held
    assert mine.per_sample_bytes == pytest.approx(0.25e6) and mine.device == "its emulated device of 2 MB"
    assert budget(0, torch.device("cpu"), emulation, held) is None  # no memory given: nothing bounds the share


def test_a_device_table_without_activations_asks_for_a_probe():
    held = footprint([], parameter_bytes=0)
    emulation = Emulation(sample_cost_ms=1.0, devices=(DeviceModel(memory_mb=1.0),))
    assert budget(0, torch.device("cpu"), emulation, held).per_sample_bytes is None


def test_gradients_that_wait_hold_every_unit_s_unsharded_gradient_beside_the_rest():
    shapes = [UnitShape(gathered_bytes=400, reduced_bytes=800, kept=True),
              UnitShape(gathered_bytes=1000, reduced_bytes=2000, kept=False),
              UnitShape(gathered_bytes=1000, reduced_bytes=2000, kept=False)]
    waiting = footprint(shapes, parameter_bytes=600, gradients_wait=True)
    assert waiting.waiting == 800 + 2000 + 2000  # in the dtype each unit reduce-scatters in
    assert waiting.held == footprint(shapes, parameter_bytes=600).held + waiting.waiting


class Blocks(nn.Module):
    """A residual MLP of ``depth`` blocks over a classifier of ``classes`` logits, each block checkpointed or not."""

    def __init__(self, *, width: int = 64, depth: int = 6, classes: int = 10, checkpointed: str = "none") -> None:
        super().__init__()
        self.width, self.checkpointed = width, checkpointed
        self.embed = nn.Linear(16, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))
                                    for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            if self.checkpointed == "none":
                h = h + block(h)
            else:
                h = h + checkpoint(block, h, use_reentrant=self.checkpointed == "reentrant")
        return self.head(h)


def _probe(model: nn.Module) -> float:
    torch.manual_seed(0)
    return probe_activation_bytes(model, (torch.randn(8, 16), torch.zeros(8)), model.parameters)


def test_the_probe_counts_the_logits_the_loss_s_own_tensors_and_their_gradients():
    # 5,000 classes: a loss on logits holds them, their float32 log-softmax and, in backward, a gradient of that
    # size: 60 kB a sample, where the layers save 64 floats (the probe once backpropagated the output's sum and
    # counted what autograd saves: 0.3 kB).
    classes = 5000
    per_sample = _probe(Blocks(depth=1, classes=classes))
    assert per_sample >= 3 * classes * FLOAT


@pytest.mark.parametrize("checkpointed", ["non-reentrant", "reentrant"])
def test_under_activation_checkpointing_the_probe_counts_what_recomputation_holds_at_its_peak(checkpointed):
    width, depth = 64, 6
    per_sample = _probe(Blocks(width=width, depth=depth, checkpointed=checkpointed))
    # Each block's input stays for its recomputation; in the last block's backward its recomputed activations
    # (the 4 x width of its ReLU) live beside them. What autograd saves outside the blocks reads far less.
    assert per_sample >= (depth * width + 4 * width) * FLOAT
    assert per_sample < _probe(Blocks(width=width, depth=depth))  # and less than the model holds uncheckpointed
