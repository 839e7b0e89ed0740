"""Worker for tests/distributed/test_integrations.py: an Accelerate loop with hetdp's Accelerator, the scenarios given
one after another in each process.

"exact": unequal static shares, AdamW with clipping when gradients sync, two batches accumulated per optimizer step
through ``accelerator.accumulate``, a last step of 2 samples for 4 ranks, and an evaluation loader gathered with
``gather_for_metrics``. "emulated": adaptive shares under ``hetdp run``'s emulation (the environment). "sum": a
summed loss (``Accelerator(loss="sum")``) at unequal static shares, SGD.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
from dropin_worker import Pairs, make_model
from loops_worker import LR_SUM
from torch import nn
from torch.utils.data import DataLoader

import hetdp
from hetdp.integrations.accelerate import Accelerator


def train(accelerator: Accelerator, model, optimizer, loader, epochs: int, clip: float | None) -> None:
    """The user's Accelerate loop, untouched by hetdp."""
    for _ in range(epochs):
        model.train()
        for batch in loader:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
                accelerator.backward(loss)
                if clip is not None and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad()


def run(scenario: str, out: Path) -> tuple[Accelerator, dict]:
    if scenario == "exact":
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2,
                                  allocation=hetdp.Static((1.0, 2.0, 3.0, 2.0)))
        net = make_model(7 + accelerator.process_index)  # hetdp.DDP starts every rank from rank 0's parameters
        optimizer = torch.optim.AdamW(net.parameters(), lr=0.05)
        loader = DataLoader(Pairs(50), batch_size=4, shuffle=True, num_workers=1)
        evaluation = DataLoader(Pairs(40), batch_size=5)
        model, optimizer, loader, evaluation = accelerator.prepare(net, optimizer, loader, evaluation)
        train(accelerator, model, optimizer, loader, 2, clip=0.5)
        model.eval()
        with torch.no_grad():
            seen = [accelerator.gather_for_metrics(batch["y"]).numel() for batch in evaluation]
        ddp = accelerator.hetdp_model
        if accelerator.is_main_process:
            torch.save(ddp.module.state_dict(), out / "accelerate_exact.pt")
        refused = {}
        hooked = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(
            comm_hook=DDPCommunicationHookType.FP16)])
        for name, attempt in (("second_model", lambda: accelerator.prepare(make_model(0))),
                              ("comm_hook", lambda: hooked.prepare(make_model(0)))):
            try:
                attempt()
            except hetdp.ConfigError as error:
                refused[name] = str(error)
        result = {"blocks": [f.shares for f in ddp.step_figures], "batches": len(loader), "seed": loader.sampler.seed,
                  "epochs": len(ddp.epoch_reports), "evaluated": sum(seen),
                  "evaluation_loader": type(evaluation).__name__, "refused": refused}
    elif scenario == "emulated":
        accelerator = Accelerator(cpu=True)
        net = make_model(0)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.3)
        loader = DataLoader(Pairs(2560), batch_size=32, shuffle=True)
        model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
        train(accelerator, model, optimizer, loader, 1, clip=None)
        ddp = accelerator.hetdp_model
        report = ddp.epoch_reports[0]
        result = {"shares": report.shares, "replans": report.replans, "speeds": list(ddp.emulation.speeds)}
    elif scenario == "sum":
        accelerator = Accelerator(cpu=True, allocation=hetdp.Static((1.0, 2.0, 3.0, 2.0)), loss="sum")
        net = make_model(7 + accelerator.process_index)
        optimizer = torch.optim.SGD(net.parameters(), lr=LR_SUM)
        loader = DataLoader(Pairs(50), batch_size=4, shuffle=True)
        model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
        for _ in range(2):
            for batch in loader:
                accelerator.backward(nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="sum"))
                optimizer.step()
                optimizer.zero_grad()
        ddp = accelerator.hetdp_model
        if accelerator.is_main_process:
            torch.save(ddp.module.state_dict(), out / "accelerate_sum.pt")
        result = {"blocks": [f.shares for f in ddp.step_figures], "seed": loader.sampler.seed}
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    return accelerator, result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenarios", required=True, help="comma-separated, run in this order")
    args = parser.parse_args()
    for scenario in args.scenarios.split(","):
        accelerator, result = run(scenario, args.out)
        (args.out / f"accelerate_{scenario}_{accelerator.process_index}.json").write_text(json.dumps(result))
        if accelerator.hetdp_model is not None:
            accelerator.hetdp_model.close()
    accelerator.end_training()  # after the last scenario: it destroys the default group every Accelerator shares


if __name__ == "__main__":
    main()
