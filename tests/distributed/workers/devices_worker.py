"""Worker for tests/distributed/test_devices.py: cost-balanced steps, memory caps; every scenario on 3 ranks."""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import hetdp
from hetdp.bench.loop import train_share
from hetdp.cluster.devices import DeviceModel

FEATURES = 4
COST_SHARES = (1.0, 2.0, 3.0)


class Sequences(Dataset):
    """Variable-length sequences of token features, a label per token and one per sequence."""

    def __init__(self, size: int, seed: int = 1) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(1, 13, (size,), generator=generator).tolist()
        self.tokens = [torch.randn(length, FEATURES, generator=generator) for length in self.lengths]
        self.token_labels = [(tokens.sum(1) > 0).long() for tokens in self.tokens]
        self.labels = [int(tokens.mean() > 0) for tokens in self.tokens]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int):
        return self.tokens[index], self.token_labels[index], self.labels[index]


def as_list(batch):
    return batch


def per_token_loss(model: nn.Module, batch) -> torch.Tensor:
    """Mean over every token of the batch (language-model style)."""
    tokens = torch.cat([item[0] for item in batch])
    return nn.functional.cross_entropy(model(tokens), torch.cat([item[1] for item in batch]))


def per_sequence_loss(model: nn.Module, batch) -> torch.Tensor:
    """Mean over the batch's sequences of a loss on each sequence's mean token (classification style)."""
    pooled = torch.stack([item[0].mean(0) for item in batch])
    return nn.functional.cross_entropy(model(pooled), torch.tensor([item[2] for item in batch]))


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 2))


def train_cost_balanced(dataset: Sequences, mean_over: str, loss_fn, out: Path) -> dict:
    model = hetdp.DDP(make_model(), hetdp.Static(COST_SHARES))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = model.allocate(DataLoader(dataset, batch_size=4, sampler=sampler, collate_fn=as_list), global_batch=12,
                            cost=hetdp.CostBalance(cost=dataset.lengths, mean_over=mean_over))
    blocks, costs = [], []
    with model:
        for batch in loader:
            optimizer.zero_grad()
            loss_fn(model, batch).backward()
            optimizer.step()
            ticket = model._steps.open.ticket
            blocks.append(list(ticket.block))
            costs.append(list(ticket.cost))
        if model.rank == 0:
            torch.save(model.module.state_dict(), out / f"cost_{mean_over}.pt")
    return {"blocks": blocks, "costs": costs}


def capped_drop_in(emulation: hetdp.Emulation, global_batch: int) -> dict:
    """Adaptive shares under emulated memory caps, or the error when the step does not fit under them."""
    dataset = torch.utils.data.TensorDataset(torch.randn(96, FEATURES), torch.randint(0, 2, (96,)))
    model = hetdp.DDP(make_model(), "adaptive", emulation=emulation)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with model:
        try:
            loader = model.allocate(DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset)),
                                    global_batch=global_batch)
        except hetdp.ConfigError as error:
            return {"error": str(error)}
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)
            for inputs, targets in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(inputs), targets).backward()
                optimizer.step()
        return {"shares": [shares for _, shares in model._schedule]}


def micro_batches_under_emulated_caps(emulation: hetdp.Emulation) -> dict:
    """Shares of 8 on ranks whose emulated memory holds 3, 5 and any samples per forward: ``accumulates=True`` leaves
    the shares uncapped, and the loop runs each as micro-batches under its rank's cap; the forwards of every step."""
    dataset = torch.utils.data.TensorDataset(torch.randn(48, FEATURES), torch.randint(0, 2, (48,)))
    model = hetdp.DDP(make_model(), "equal", emulation=emulation)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cap = model.emulation.devices[model.rank].max_batch
    forwards = []
    with model, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = model.allocate(DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset)),
                                accumulates=True)
        for inputs, targets in loader:
            optimizer.zero_grad()
            train_share(model, inputs, targets, largest=cap)
            forwards.append(model.clock.forwards)
            optimizer.step()
        return {"shares": model.shares, "forwards": forwards,
                "memory_warnings": [str(w.message) for w in caught if "memory cap" in str(w.message)]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    rank, _ = hetdp.init_distributed()
    dataset = Sequences(30)
    results = {
        "cost": train_cost_balanced(dataset, "cost", per_token_loss, out),
        "samples": train_cost_balanced(dataset, "samples", per_sequence_loss, out),
    }
    caps = tuple(DeviceModel(max_batch=cap) for cap in (3, 5, 6))
    emulation = hetdp.Emulation(sample_cost_ms=0.05, devices=caps)
    results["capped"] = capped_drop_in(emulation, global_batch=12)
    results["too_big"] = capped_drop_in(emulation, global_batch=20)
    results["micro_batches"] = micro_batches_under_emulated_caps(
        hetdp.Emulation(sample_cost_ms=0.05, devices=(DeviceModel(max_batch=3), DeviceModel(max_batch=5),
                                                      DeviceModel())))
    all_results = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(all_results, results)
    if rank == 0:
        (out / "results.json").write_text(json.dumps(all_results))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
