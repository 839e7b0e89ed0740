"""Worker for tests/distributed/test_standin.py: stand-ins that are training steps weighing nothing, and ranks that
use different parameters in a step, through both drop-ins, in one launch.

``AuxNet`` returns ``(logits, aux)`` in training and logits in eval (as torchvision's GoogLeNet does), its aux head's
parameters used by training only, with a BatchNorm; ``MoE`` routes each sample to one of three experts by a fixed rule
on its input, so some experts get no token on some ranks in some steps. Each scenario trains on a dataset whose last
step has fewer samples than ranks and writes, on rank 0, its final parameters and buffers and every step's blocks
(samples per rank), which the test replays in one process.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hetdp

SIZE, BATCH, SEED, EPOCHS = 50, 4, 7, 2
"""50 samples in steps of 12 over 3 ranks: each epoch's last step has 2 samples, fewer than the ranks."""
SITOUT = (1, [0, 4, 8])
"""The DDP sit-out scenario: from step 1 on, rank 0 has no share and sits out of the exchange."""


class AuxNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh())
        self.head = nn.Linear(16, 2)
        self.aux = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor):
        hidden = self.body(x)
        logits = self.head(hidden)
        return (logits, self.aux(hidden)) if self.training else logits


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(Expert() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = (x[:, 0] > 0).long() + (x[:, 1] > 1.2).long()  # expert 2 takes few samples
        out = torch.zeros(x.shape[0], 2, dtype=x.dtype)
        for index, expert in enumerate(self.experts):
            chosen = route == index
            if chosen.any():
                out = out.index_put((chosen.nonzero().squeeze(1),), expert(x[chosen]))
        return out


def make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return AuxNet() if kind == "aux" else MoE()


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SIZE, 6, generator=generator)
    return TensorDataset(x, torch.randn(SIZE, 2, generator=generator))


def loss_of(kind: str, output, y: torch.Tensor) -> torch.Tensor:
    """The training loop's loss: ``AuxNet``'s training output unpacked, as a GoogLeNet loop does (a stand-in in eval
    mode would give logits alone: ``ValueError``), the MoE's one tensor."""
    if kind == "aux":
        if not isinstance(output, tuple):  # a tensor of two rows would unpack too
            raise ValueError(f"not enough values to unpack: a {type(output).__name__}, not (logits, aux)")
        logits, aux = output
        return nn.functional.mse_loss(logits, y) + 0.3 * nn.functional.mse_loss(aux, y)
    return nn.functional.mse_loss(output, y)


def every_rank(value: int) -> list[int]:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def train(kind: str, model: nn.Module, *, sit_out: bool = False) -> list[list[int]]:
    data = dataset()
    loader = model.allocate(DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, seed=SEED)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if sit_out:
        model.set_shares(SITOUT[1], at_step=SITOUT[0])
    blocks = []
    for epoch in range(EPOCHS):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss_of(kind, model(x), y).backward()
            optimizer.step()
            blocks.append(every_rank(model.step_samples))
    return blocks


def state(model: nn.Module) -> dict[str, list]:
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {name.removeprefix("module."): (t.full_tensor() if isinstance(t, DTensor) else t).detach().double().tolist()
            for name, t in tensors.items()}


def run(scenario: str) -> dict:
    kind, drop_in = scenario.split("_", 1)
    if drop_in in ("ddp", "sitout"):
        model = hetdp.DDP(make(kind), allocation=hetdp.Static((1.0, 1.0, 2.0)),
                          find_unused_parameters=kind == "moe")
    else:
        module = make(kind)
        if kind == "aux":
            hetdp.fully_shard(module.body)
        # The MoE is one unit: FSDP2 gathers a unit in its forward, so an expert some ranks skip must not be one.
        # A rank with no share: stand-ins every step.
        model = hetdp.fully_shard(module, allocation=hetdp.Static((0.0, 1.0, 2.0)))
    blocks = train(kind, model, sit_out=drop_in == "sitout")
    record = {"blocks": blocks, "state": state(model)}
    model.close()
    if drop_in == "sharded":  # closed, the drop-in released its group: FSDP2's gathers run over the mesh's again
        model.eval()
        with torch.no_grad():
            record["closed_output"] = model(dataset().tensors[0][:BATCH]).tolist()
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenarios", required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    hetdp.init_distributed("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    for scenario in args.scenarios.split(","):
        record = run(scenario)
        (args.out / f"{scenario}_{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
