"""Worker for tests/distributed/test_sharded.py: the sharded drop-in (``hetdp.fully_shard``) in a user's own FSDP2
loop, one scenario per item of ``--scenarios``; rank 0 saves what the test checks (parameters as full tensors,
figures as JSON).

The model is a small causal transformer sharded as the adoption script shards its own: ``fully_shard`` on every
block, then on the root.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pickle
import struct
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hetdp
from hetdp.cluster.devices import DeviceModel
from hetdp.fsdp.memory import probe_activation_bytes
from torch_order import global_batches as torch_global_batches

VOCAB, WIDTH, HEADS, LAYERS, CONTEXT = 32, 16, 2, 2, 8
SIZE, BATCH, SEED = 66, 4, 3
"""66 samples in steps of 16: four full steps and one of 2. The scenarios that compare with one process set the
global batch of 16 on any number of ranks; those of the caps take ``BATCH`` a rank, as a DataLoader's batch_size."""
GLOBAL_BATCH = 16
STEPS_PER_EPOCH = math.ceil(SIZE / GLOBAL_BATCH)
"""Steps of ``GLOBAL_BATCH`` in an epoch of ``SIZE`` samples."""
ADAPTIVE_SIZE = 640
"""Two epochs of 10 steps of 64 samples (set on 3 ranks): room for the shares to settle."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        # No projection biases: the key's bias has a gradient of 0 in theory (softmax ignores a shift) and of rounding
        # noise in practice, which AdamW turns into steps of the learning rate's size in any two runs that sum in
        # another order (the sharded spike: plain FSDP2 at equal shares lands 3e-4 from one process there).
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True, bias=False)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Logits for every position of the tokens it is given (the loss shifts them)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.randn(CONTEXT + 1, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=tokens.device), 1)
        x = self.embed(tokens) + self.position[:t]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def make_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def sequences(size: int = SIZE) -> TensorDataset:
    """Arithmetic progressions modulo the vocabulary, each with its own start and stride."""
    generator = torch.Generator().manual_seed(1)
    start = torch.randint(0, VOCAB, (size, 1), generator=generator)
    stride = torch.randint(1, 5, (size, 1), generator=generator)
    return TensorDataset((start + stride * torch.arange(CONTEXT + 1)) % VOCAB)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)


def shard(model: nn.Module, **options) -> nn.Module:
    """fully_shard on every block, then on the root, as the adoption script does; hetdp's settings go to the root."""
    torch_options = {key: options.pop(key) for key in ("reshard_after_forward", "mp_policy") if key in options}
    for block in model.blocks:
        hetdp.fully_shard(block, **torch_options)
    return hetdp.fully_shard(model, **options, **torch_options)


def loader_for(dataset: TensorDataset, batch: int = BATCH) -> DataLoader:
    return DataLoader(dataset, batch_size=batch, sampler=DistributedSampler(dataset, seed=SEED))


def train(model: nn.Module, loader, optimizer: torch.optim.Optimizer, epochs: int, *, every: int = 1,
          clip: float | None = 0.5, schedule: bool = True, on_step=None) -> list[list[int]]:
    """The user's FSDP2 loop; ``every`` batches accumulated per optimizer step (the gradients' reduction off for
    all but the last, counted within each epoch). Returns every step's blocks (samples per rank)."""
    scheduler = (torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=epochs * len(loader))
                 if schedule else None)
    blocks = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for index, (tokens,) in enumerate(loader):
            synchronizing = (index + 1) % every == 0
            if every > 1:
                model.set_requires_gradient_sync(synchronizing)
            (loss_of(model, tokens) / every).backward()
            blocks.append(_every_rank(model.step_samples))
            if synchronizing:
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad()
                if scheduler is not None:
                    scheduler.step()
            if on_step is not None:
                on_step(model, epoch, index)
    return blocks


def _every_rank(value: int) -> list[int]:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (collective)."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def one_rank_mesh() -> DeviceMesh:
    """A mesh of this rank alone (collective: every rank makes its own)."""
    group, _ = dist.new_subgroups(group_size=1)
    return DeviceMesh.from_group(group, "cpu")


def run(scenario: str, out: Path, rank: int) -> dict:
    record: dict = {}
    if scenario == "exact":
        # A rank with no share (stand-ins every step), a last step of 2 samples for 3 ranks, AdamW state sharded,
        # clipping on the sharded parameters, a per-step schedule; both settings of reshard_after_forward.
        for reshard in (True, False):
            model = shard(make_model(), allocation=hetdp.Static((0.0, 1.0, 3.0)), reshard_after_forward=reshard)
            loader = model.allocate(loader_for(sequences()), global_batch=GLOBAL_BATCH)
            optimizer = make_optimizer(model, "adamw")
            record[f"blocks_{reshard}"] = train(model, loader, optimizer, 2)
            record[f"shares_{reshard}"] = model.shares
            state = full_state(model)
            record[f"sharded_state_{reshard}"] = all(
                isinstance(value, DTensor) for value in optimizer.state[next(iter(model.parameters()))].values()
                if isinstance(value, torch.Tensor) and value.dim())
            if rank == 0:
                torch.save(state, out / f"exact_{reshard}.pt")
            model.close()
    elif scenario == "accumulate":
        # Windows of two batches with the gradients' reduction off for the first; the shares change inside the first
        # window, and the epoch's last step (a rank on a stand-in) opens a window that runs into the next epoch.
        model = shard(make_model(), allocation=hetdp.Static((1.0, 1.0, 2.0)))
        loader = model.allocate(loader_for(sequences()), global_batch=GLOBAL_BATCH)

        def change_shares(model, epoch, index):
            if epoch == 0 and index == 0:
                model.set_shares([4, 2, 10], at_step=1)

        record["blocks"] = train(model, loader, make_optimizer(model, "adamw"), 2, every=2, on_step=change_shares)
        state = full_state(model)
        if rank == 0:
            torch.save(state, out / "accumulate.pt")
        model.close()
    elif scenario == "mixed":
        # bf16 parameters, fp32 reduction: against fully_shard of one rank with the same policy on the global batches,
        # and beside it the same one rank trained with plain FSDP2's weighting of these shares (the error the test's
        # bound is derived from).
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = shard(make_model(), allocation=hetdp.Static((1.0, 1.0, 2.0)), mp_policy=policy)
        loader = model.allocate(loader_for(sequences()), global_batch=GLOBAL_BATCH)
        record["blocks"] = blocks = train(model, loader, make_optimizer(model, "sgd"), 1, schedule=False)
        state = full_state(model)
        model.close()
        mesh = one_rank_mesh()
        references = {}
        for name, loss in (("reference", lambda model, tokens, _: loss_of(model, tokens)),
                           ("rank_means", loss_of_rank_means)):
            reference = make_model()
            for block in reference.blocks:
                torch_fully_shard(block, mesh=mesh, mp_policy=policy)
            torch_fully_shard(reference, mesh=mesh, mp_policy=policy)
            if rank == 0:
                optimizer = make_optimizer(reference, "sgd")
                for tokens, block in zip(global_batches(1), blocks, strict=True):
                    optimizer.zero_grad()
                    loss(reference, tokens, block).backward()
                    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
                    optimizer.step()
                references[name] = full_state(reference)
        if rank == 0:
            torch.save({"hetdp": state, **references}, out / "mixed.pt")
    elif scenario == "caps":
        record.update(caps_scenario())
    elif scenario == "adaptive":
        # The emulation of `hetdp run --speeds 1,2,5 --sample-cost-ms ...` (the test's environment) reaches the
        # drop-in with no code, and the adaptive shares follow the emulated speeds.
        model = shard(make_model())
        loader = model.allocate(loader_for(sequences(ADAPTIVE_SIZE), batch=16), global_batch=64)
        train(model, loader, make_optimizer(model, "sgd"), 2, schedule=False)
        record.update(shares=model.shares, speeds=list(model.drop_in.emulation.speeds or ()),
                      replans=[report.replans for report in model.epoch_reports],
                      compute_s=model.last_epoch.compute_s, samples=model.last_epoch.samples)
        model.close()
    elif scenario == "memory_bound":
        # The fastest rank's memory caps its share below what its speed would take: the diagnosis says so.
        devices = (DeviceModel(),) * 2 + (DeviceModel(memory_mb=0.34, activation_mb_per_sample=0.1),)
        model = shard(make_model(), allocation=hetdp.Static((1.0, 1.0, 4.0)),
                      emulation=hetdp.Emulation(speeds=(1.0, 1.0, 4.0), sample_cost_ms=20.0, devices=devices))
        loader = model.allocate(loader_for(sequences()))
        train(model, loader, make_optimizer(model, "sgd"), 1, schedule=False)
        record.update(shares=model.shares, caps=model.allocator.caps, diagnosis=model.last_epoch.diagnosis())
        model.close()
    elif scenario == "checkpoints":
        record.update(checkpoints_scenario(out, rank))
    return record


CRAFTED_CLASS = "torch._utils.logging.FileHandler"
"""A class with a side effect (it creates its file), reached by a dotted name from DCP's metadata module."""


def crafted_metadata(marker: Path) -> bytes:
    """A protocol-4 ``.metadata`` that asks DCP's metadata module for ``CRAFTED_CLASS`` and calls it on ``marker``."""
    def text(value: str) -> bytes:
        return pickle.BINUNICODE + struct.pack("<I", len(value.encode())) + value.encode()

    return (pickle.PROTO + b"\x04" + text("torch.distributed.checkpoint.metadata") + text(CRAFTED_CLASS)
            + pickle.STACK_GLOBAL + pickle.MARK + text(str(marker)) + pickle.TUPLE + pickle.REDUCE + pickle.STOP)


def checkpoints_scenario(out: Path, rank: int) -> dict:
    """Every rank's error: resuming a checkpoint whose metadata was crafted to run code (``crafted``), and the first
    save to a folder that is each rank's own, as a node-local path on several machines is (``local``)."""
    errors = {}
    model = shard(make_model(), allocation="equal")
    model.allocate(loader_for(sequences()), global_batch=16)
    optimizer = make_optimizer(model, "adamw")
    saved = model.checkpointer(out / "crafted", optimizer, every=1).save()
    if rank == 0:
        (saved / ".metadata").write_bytes(crafted_metadata(out / "crafted-ran"))
    dist.barrier()
    for name, folder, act in (("crafted", out / "crafted", "resume"), ("local", out / f"local-{rank}", "save")):
        try:
            getattr(model.checkpointer(folder, optimizer, every=1), act)()
            errors[name] = ""
        except hetdp.HetDPError as error:
            errors[name] = f"{type(error).__name__}: {error}"
    model.close()
    return {"errors": _every_rank(errors)}


def loss_of_rank_means(model: nn.Module, tokens: torch.Tensor, block: list[int]) -> torch.Tensor:
    """The loss plain FSDP2 trains a step's ``block`` (samples per rank) by: each rank's mean loss, averaged over
    the ranks (1 / W each, whatever its samples; a rank without samples adds nothing)."""
    parts = [part for part in tokens.split(block) if len(part)]
    return torch.stack([loss_of(model, part) for part in parts]).sum() / len(block)


def global_batches(epochs: int, size: int = SIZE, global_batch: int = GLOBAL_BATCH):
    """The steps' global batches in the order of the ranks' ``DistributedSampler(seed=SEED)``, drawn by torch."""
    data = sequences(size).tensors[0]
    for epoch in range(epochs):
        for index in torch_global_batches(size, global_batch, SEED, epoch):
            yield data[index]


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


def caps_scenario() -> dict:
    """Memory caps from the emulated devices' memory fields, once the shard is placed: given activations, probed
    ones, and a device too small for its shard plus one sample."""
    record: dict = {}
    plain = make_model()
    slope = _plain_activation_bytes(plain)
    record["plain_per_sample_bytes"] = slope
    for name, memory_mb, activation_mb in (("given", 0.34, 0.1), ("probed", 0.16, 0.0), ("too_small", 0.02, 0.0)):
        devices = (DeviceModel(),) * 2 + (DeviceModel(memory_mb=memory_mb, activation_mb_per_sample=activation_mb),)
        model = shard(make_model(), allocation="equal",
                      emulation=hetdp.Emulation(sample_cost_ms=0.01, devices=devices))
        try:
            model.allocate(loader_for(sequences()))
            record[name] = {"caps": model.allocator.caps, "shares": model.shares}
        except hetdp.ConfigError as error:
            record[name] = {"error": str(error)}
        model.close()
    from hetdp.cluster.memory import storage_bytes
    from hetdp.fsdp.memory import footprint, unit_shapes

    model = shard(make_model())
    units = [unit for unit in model.modules() if isinstance(unit, FSDPModule)]
    record["held_bytes"] = footprint(unit_shapes(units, lambda unit: unit._hetdp_options),
                                     storage_bytes(model.parameters())).held
    return record


def _plain_activation_bytes(model: nn.Module) -> float:
    """What a sample adds to a step's peak in the unsharded model, probed alone at 2 and 4 samples: what the sharded
    probe must find (FSDP2's gathers, reduce-scatters and unsharded parameters do not grow with the batch)."""
    return probe_activation_bytes(model, (sequences().tensors[0][:4],), model.parameters)


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
        record = run(scenario, args.out, rank)
        if rank == 0:
            (args.out / f"{scenario}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
