"""Worker for tests/distributed/test_sharded.py: ``hetdp.fully_shard`` with memory-sized shards in a user's own FSDP2
loop, one scenario per item of ``--scenarios``; rank 0 saves what the test checks. First, in the same launch,
``sharded_worker``'s scenarios named by ``--even-scenarios`` (torch's even shards), their files in ``OUT/even``.

Each scenario sets the emulated devices' memories the way ``hetdp run --devices`` does (its environment) before the
model is sharded: memories 1, 1, 2 MB unless it says otherwise (3 ranks). The model, data and loop are
``sharded_worker``'s, so that the one-process references of test_sharded.py hold here too.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import sharded_worker
from sharded_worker import (
    GLOBAL_BATCH,
    global_batches,
    loader_for,
    loss_of,
    make_model,
    make_optimizer,
    one_rank_mesh,
    sequences,
    shard,
    train,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import hetdp
from hetdp.checkpoint.dcp import latest_sharded, read_metadata
from hetdp.cluster.devices import DeviceModel
from hetdp.cluster.emulate import ENV_DEVICES, Emulation
from hetdp.fsdp.rowshard import full_tensor
from hetdp.fsdp.uneven import UnevenModule

MEMORIES_MB = (1.0, 1.0, 2.0)


def set_memories(memories_mb: tuple[float, ...] | None, activation_mb: float = 0.0) -> None:
    """The environment ``hetdp run --devices`` gives the ranks: device models with these memories (None: none)."""
    os.environ.pop(ENV_DEVICES, None)
    if memories_mb is not None:
        devices = tuple(DeviceModel(memory_mb=memory, activation_mb_per_sample=activation_mb)
                        for memory in memories_mb)
        os.environ.update(Emulation(sample_cost_ms=0.001, devices=devices).to_env())


def whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (collective), whatever its rows per rank."""
    return {name: full_tensor(parameter).detach().clone() for name, parameter in model.named_parameters()}


def every_rank(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def layout(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's rows of each parameter and of the optimizer's state over it, and whether each unit is uneven."""
    return {
        "uneven": all(isinstance(unit, UnevenModule) for unit in [model, *model.blocks]),
        "fsdp2": any(isinstance(unit, FSDPModule) for unit in model.modules()),
        "rows": {name: p.to_local().shape[0] for name, p in model.named_parameters()},
        "bytes": sum(p.to_local().numel() * p.element_size() for p in model.parameters()),
        "state_rows": sorted({value.to_local().shape[0] == p.to_local().shape[0]
                              for p in model.parameters() for value in optimizer.state[p].values()
                              if isinstance(value, DTensor)}),
    }


def run(scenario: str, out: Path, rank: int) -> dict:
    record: dict = {}
    if scenario == "exact":
        # A rank with no share, a short last step, AdamW (state sharded in the same rows), clipping on the sharded
        # parameters, a per-step schedule; both settings of reshard_after_forward.
        set_memories(MEMORIES_MB)
        for reshard in (True, False):
            model = shard(make_model(), allocation=hetdp.Static((0.0, 1.0, 3.0)), reshard_after_forward=reshard)
            loader = model.allocate(loader_for(sequences()), global_batch=GLOBAL_BATCH)
            optimizer = make_optimizer(model, "adamw")
            record[f"blocks_{reshard}"] = train(model, loader, optimizer, 2)
            record[f"layout_{reshard}"] = every_rank(layout(model, optimizer))
            state = whole(model)
            if rank == 0:
                torch.save(state, out / f"exact_{reshard}.pt")
            model.close()
    elif scenario == "recompute":
        # Activation checkpointing (torch.utils.checkpoint, non-reentrant) around every block.
        set_memories(MEMORIES_MB)
        model = make_model()
        model.forward = lambda tokens: _checkpointed_forward(model, tokens)
        model = shard(model, allocation=hetdp.Static((1.0, 1.0, 2.0)))
        loader = model.allocate(loader_for(sequences()), global_batch=GLOBAL_BATCH)
        train(model, loader, make_optimizer(model, "adamw"), 2)
        state = whole(model)
        if rank == 0:
            torch.save(state, out / "recompute.pt")
        model.close()
    elif scenario == "compiled":
        # torch.compile of the sharded model (aot_eager: dynamo and AOT autograd without a C++ toolchain's time).
        set_memories(MEMORIES_MB)
        model = shard(make_model(), allocation=hetdp.Static((1.0, 1.0, 2.0)))
        loader = model.allocate(loader_for(sequences()), global_batch=GLOBAL_BATCH)
        train(torch.compile(model, backend="aot_eager"), loader, make_optimizer(model, "adamw"), 1)
        state = whole(model)
        if rank == 0:
            torch.save(state, out / "compiled.pt")
        model.close()
    elif scenario == "accumulate":
        set_memories(MEMORIES_MB)
        model = shard(make_model(), allocation=hetdp.Static((1.0, 1.0, 2.0)))
        loader = model.allocate(loader_for(sequences()), global_batch=GLOBAL_BATCH)

        def change_shares(model, epoch, index):
            if epoch == 0 and index == 0:
                model.set_shares([4, 2, 10], at_step=1)

        record["blocks"] = train(model, loader, make_optimizer(model, "adamw"), 2, every=2, on_step=change_shares)
        state = whole(model)
        if rank == 0:
            torch.save(state, out / "accumulate.pt")
        model.close()
    elif scenario == "mixed":
        set_memories(MEMORIES_MB)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = shard(make_model(), allocation=hetdp.Static((1.0, 1.0, 2.0)), mp_policy=policy)
        record["uneven"] = every_rank(isinstance(model, UnevenModule))
        loader = model.allocate(loader_for(sequences()), global_batch=GLOBAL_BATCH)
        train(model, loader, make_optimizer(model, "sgd"), 1, schedule=False)
        state = whole(model)
        model.close()
        set_memories(None)
        mesh = one_rank_mesh()
        reference = make_model()
        for block in reference.blocks:
            torch_fully_shard(block, mesh=mesh, mp_policy=policy)
        torch_fully_shard(reference, mesh=mesh, mp_policy=policy)
        if rank == 0:
            optimizer = make_optimizer(reference, "sgd")
            for tokens in global_batches(1):
                optimizer.zero_grad()
                loss_of(reference, tokens).backward()
                torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
                optimizer.step()
            torch.save({"hetdp": state, "reference": whole(reference)}, out / "mixed.pt")
    elif scenario == "caps":
        # Memory caps computed after the uneven shard is placed: each rank's from what it holds.
        set_memories((0.3, 0.3, 1.2), activation_mb=0.05)
        model = shard(make_model(), allocation="equal")
        model.allocate(loader_for(sequences(), batch=8))
        held = model.drop_in.footprint
        record.update(caps=model.allocator.caps, shares=model.shares,
                      held=every_rank(held.held), state=every_rank(held.state))
        model.close()
    elif scenario == "too_small":
        # The last device cannot hold a block whole beside its part of the state.
        set_memories((1.0, 1.0, 0.02))
        errors = []
        try:
            shard(make_model(), allocation="equal")
        except hetdp.ConfigError as error:
            errors.append(str(error))
        record["errors"] = every_rank(errors)
    elif scenario == "checkpoints":
        record.update(checkpoints_scenario(out, rank))
    elif scenario == "refusals":
        set_memories(MEMORIES_MB)
        model = shard(make_model())
        refused = {}
        for call in ("set_modules_to_forward_prefetch", "set_custom_reduce_scatter"):
            try:
                getattr(model, call)([])
                refused[call] = ""
            except hetdp.ConfigError as error:
                refused[call] = str(error)
        model.unshard()
        record["unsharded"] = not any(isinstance(p, DTensor) for p in model._parameters.values())
        model.reshard()
        record["resharded"] = all(isinstance(p, DTensor) for p in model.parameters())
        record["refused"] = refused
        try:
            model.allocate(loader_for(sequences()))
            model.drop_in.units[0].set_custom_all_gather(None)
        except hetdp.ConfigError as error:
            record["after_allocate"] = str(error)
        model.close()
        # Equal memories, or shard_sizes="even": torch's own FSDP2 units; a model mixing both is one error.
        set_memories((2.0, 2.0, 2.0))
        record["equal_is_fsdp2"] = isinstance(shard(make_model()), FSDPModule)
        set_memories(MEMORIES_MB)
        even = make_model()
        for unit in [*even.blocks, even]:
            hetdp.fully_shard(unit, shard_sizes="even")
        record["even_is_fsdp2"] = all(isinstance(unit, FSDPModule) for unit in [*even.blocks, even])
        mixed = make_model()
        hetdp.fully_shard(mixed.blocks[0])
        try:
            hetdp.fully_shard(mixed, shard_sizes="even")
            record["mixed"] = ""
        except hetdp.ConfigError as error:
            record["mixed"] = str(error)
    set_memories(None)
    return record


def _checkpointed_forward(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    t = tokens.shape[1]
    mask = torch.triu(torch.full((t, t), float("-inf")), 1)
    x = model.embed(tokens) + model.position[:t]
    for block in model.blocks:
        x = checkpoint(block, x, mask, use_reentrant=False)
    return model.head(x)


def checkpoints_scenario(out: Path, rank: int) -> dict:
    """Memory-sized shards saved after the first epoch resume on torch's even shards, and even ones on memory-sized
    shards, each then trains the second epoch (the one-process reference of 2 epochs). The saved metadata's chunks
    of one parameter are the ranks' real rows."""
    record: dict = {}
    for name, first, then in (("uneven_to_even", MEMORIES_MB, None), ("even_to_uneven", None, MEMORIES_MB)):
        folder = out / name
        rows = []
        for epochs, memories in ((range(0, 1), first), (range(1, 2), then)):
            set_memories(memories)
            model = shard(make_model(), allocation=hetdp.Static((1.0, 1.0, 2.0)))
            loader = model.allocate(loader_for(sequences()), global_batch=GLOBAL_BATCH)
            optimizer = make_optimizer(model, "adamw")
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=2 * len(loader))
            ckpt = model.checkpointer(folder, optimizer, scheduler=scheduler, every=len(loader))
            ckpt.resume()
            rows.append(every_rank(model.head.weight.to_local().shape[0]))
            for epoch in epochs:
                loader.sampler.set_epoch(epoch)
                for (tokens,) in loader:
                    loss_of(model, tokens).backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                    optimizer.step()
                    optimizer.zero_grad()
                    scheduler.step()
            state = whole(model)
            model.close()
            if epochs.start == 0:
                saved = read_metadata(latest_sharded(folder)).state_dict_metadata["model.head.weight"]
                record[f"{name}_chunks"] = sorted([list(chunk.offsets), list(chunk.sizes)] for chunk in saved.chunks)
        record[f"{name}_rows"] = rows
        if rank == 0:
            torch.save(state, out / f"{name}.pt")
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenarios", required=True)
    parser.add_argument("--even-scenarios", default="")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    hetdp.init_distributed("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    even = args.out / "even"
    even.mkdir(exist_ok=True)
    for folder, scenario_of, scenarios in ((even, sharded_worker.run, args.even_scenarios),
                                           (args.out, run, args.scenarios)):
        for scenario in filter(None, scenarios.split(",")):
            record = scenario_of(scenario, folder, rank)
            if rank == 0:
                (folder / f"{scenario}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
