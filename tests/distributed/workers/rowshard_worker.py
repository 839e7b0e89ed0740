"""Worker for tests/distributed/test_rowshard.py: the storage of memory-sized shards (``hetdp.fsdp.rowshard``) on its
own, without a module's hooks or the drop-in: three ranks of weights 0, 1 and 3 (rank 0 holds no row), each check's
result gathered to rank 0 and written as JSON (``--out``/rowshard.json) with the checkpoints' folders beside it."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from hetdp.fsdp.rows import split_rows
from hetdp.fsdp.rowshard import RowShardedUnit, full_tensor
from hetdp.runtime.teardown import collect_at_exit

WEIGHTS = (0.0, 1.0, 3.0)


def make_unit(mesh, seed: int = 0, weights=WEIGHTS, **dtypes) -> tuple[nn.Module, RowShardedUnit, dict]:
    """A Linear(6, 8) and a parameter of one row (too small to split), sharded in rows of ``weights``."""
    torch.manual_seed(seed)
    module = nn.Linear(6, 8)
    module.register_parameter("small", nn.Parameter(torch.randn(1, 5)))
    wholes = {name: parameter.detach().clone() for name, parameter in module.named_parameters()}
    own = [([(module, name)], parameter) for name, parameter in module.named_parameters()]
    item = 4
    splits = split_rows([p.shape[0] for _, p in own], [math.prod(p.shape[1:]) * item for _, p in own], weights)
    return module, RowShardedUnit(own, splits, mesh, **dtypes), wholes


def checks(out: Path) -> dict:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    module, unit, wholes = make_unit(mesh)
    result: dict = {"rows": {name: p.to_local().shape[0] for name, p in module.named_parameters()}}
    result["sharded_views"] = all(p.to_local().untyped_storage().data_ptr() == unit.segment.untyped_storage().data_ptr()
                                  for p in module.parameters() if p.to_local().numel())

    # Gathered whole on every rank; freed to no storage; gathered again after the rows changed in place.
    unit.gather()
    unit.show("unsharded")
    result["gathered"] = all(torch.equal(getattr(module, name), whole) for name, whole in wholes.items())
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    y = module(x)  # autograd saves the weight
    unit.show("sharded")
    unit.free()
    result["freed"] = all(p.unsharded.untyped_storage().nbytes() == 0 for p in unit.parameters)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.to_local().mul_(2.0)
    unit.gather()  # refilled through the writer: the version autograd saved is unchanged, the values are new
    y.sum().backward()
    result["backward_after_regather"] = torch.allclose(
        unit.parameters[0].unsharded.grad, torch.ones(4, 8).T @ x)
    result["regathered"] = torch.equal(unit.parameters[0].unsharded, 2 * wholes["weight"])

    # Each rank's gradient weighed, summed onto the rows' owners; a zero weight zeroes a NaN; a second reduce adds.
    weights = [0.0, 0.25, 0.75]
    for parameter in unit.parameters:
        parameter.unsharded.grad = torch.full_like(parameter.unsharded, float(rank + 1))
    if rank == 0:
        unit.parameters[0].unsharded.grad[0, 0] = float("nan")
    unit.reduce(weights[rank])
    expected = sum(weight * (r + 1) for r, weight in enumerate(weights))
    result["reduced"] = all(torch.all(p.sharded.grad.to_local() == expected).item() for p in unit.parameters)
    result["unsharded_grads_dropped"] = all(p.unsharded.grad is None for p in unit.parameters)
    for parameter in unit.parameters:
        parameter.unsharded.grad = torch.ones_like(parameter.unsharded)
    unit.reduce(1.0)
    result["accumulated"] = all(torch.all(p.sharded.grad.to_local() == expected + 3).item() for p in unit.parameters)
    result["grad_is_dtensor_of_the_rows"] = all(
        isinstance(p.sharded.grad, DTensor) and p.sharded.grad.to_local().shape == p.sharded.to_local().shape
        for p in unit.parameters)

    # A bf16 gather of fp32 rows, gradients reduced in fp32 back into fp32 rows.
    _, low, low_wholes = make_unit(mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    low.gather()
    result["bf16_gathered"] = all(p.unsharded.dtype == torch.bfloat16 for p in low.parameters) and torch.equal(
        low.parameters[0].unsharded, low_wholes["weight"].to(torch.bfloat16))
    for parameter in low.parameters:
        parameter.unsharded.grad = torch.ones_like(parameter.unsharded)
    low.reduce(1.0)
    result["fp32_reduced"] = all(p.sharded.grad.dtype == torch.float32 for p in low.parameters)

    # full_tensor of uneven rows; DCP writes each rank's real rows and reshards them onto torch's even shards and
    # onto other rows.
    module, unit, wholes = make_unit(mesh, seed=3)
    result["full_tensor"] = all(torch.equal(full_tensor(p), wholes[name]) for name, p in module.named_parameters())
    dcp.save(module.state_dict(), checkpoint_id=out / "rows")
    metadata = dcp.FileSystemReader(str(out / "rows")).read_metadata()
    result["chunks"] = sorted([list(c.offsets), list(c.sizes)] for c in metadata.state_dict_metadata["weight"].chunks)
    torch.manual_seed(9)
    even = nn.Linear(6, 8)
    even.register_parameter("small", nn.Parameter(torch.randn(1, 5)))
    for name, parameter in list(even.named_parameters()):
        setattr(even, name, nn.Parameter(distribute_tensor(parameter.detach(), mesh, [Shard(0)])))
    state = even.state_dict()
    dcp.load(state, checkpoint_id=out / "rows")
    result["onto_even"] = all(torch.equal(state[name].full_tensor(), whole) for name, whole in wholes.items())
    other, _, _ = make_unit(mesh, seed=5, weights=(2.0, 1.0, 1.0))
    state = other.state_dict()
    dcp.load(state, checkpoint_id=out / "rows")
    other.load_state_dict(state)
    result["onto_other_rows"] = all(torch.equal(full_tensor(p), wholes[name]) for name, p in other.named_parameters())
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    collect_at_exit()  # as hetdp's drop-ins do: the units' cycles go before finalization, not during it
    torch.set_num_threads(1)
    result = checks(args.out)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, result)
    if dist.get_rank() == 0:
        (args.out / "rowshard.json").write_text(json.dumps(every))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
