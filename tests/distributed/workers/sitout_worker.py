"""Worker for tests/distributed/test_sitout.py: ranks that do not pay sit out of the exchange, and rejoin.

Two fast ranks beside two slow ones train a model whose exchange costs more than
the slow ranks' samples save (a slow rank's one sample outlasts the fast ranks'
whole step); from ``--change-at`` on the fast ranks slow down to the others'
speed, so the slow ones pay again. Every rank records, per step, the
members and a checksum of the parameters it starts the step with, and its final
parameters.

With ``--forced`` the memberships are set by hand (``FORCED``), and the same
launch goes on to four more runs: one resumed from the step checkpoint saved while
rank 2 sat out, one of a BatchNorm model, whose buffers every rank records
after each step and each epoch, one that accumulates ``ACCUMULATE`` batches
per optimizer step under ``no_sync``, across the forced membership changes, and one
of adaptive allocation resumed from that checkpoint with its allocator's state
saying that ranks 2 and 3 sit out (``RESTORED_MEMBERS``), as a re-plan would have
left it: they are out from the first restored step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dropin_worker import Pairs  # noqa: E402  (the test puts this folder on the path)
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import hetdp
from hetdp.cluster.emulate import Emulation

SIZE, GLOBAL_BATCH, EPOCHS = 320, 32, 5


def make_wide_model(seed: int = 0) -> nn.Module:
    """A model whose exchange (66k parameters) outweighs a slow rank's few samples."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 2))


def make_batchnorm_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 2))


def checksum(module: nn.Module) -> float:
    return float(torch.cat([p.detach().flatten() for p in module.parameters()]).double().sum())


def buffer_sum(module: nn.Module) -> float:
    return float(sum(b.double().sum() for b in module.buffers()))


FORCED = {1: (2, [11, 11, 0, 10]), 4: (5, [0, 16, 16, 0]), 7: (8, [8, 8, 8, 8])}
"""--forced: at loop step k, the shares and members (those with a share) from step s on, as a re-plan would set
them: three members (one folded into the doubling), then two that were not both members, then all again."""
BATCHNORM_FORCED = {1: (2, [11, 11, 0, 10]), 6: (7, [0, 10, 11, 11])}
"""--forced, the BatchNorm run: rank 2 sits out steps 2 to 6, rank 0 from step 7 to the end (its buffers, which
torch DDP would broadcast at each forward, are out of date; every epoch ends with a rank out)."""
ACCUMULATE = 2
"""--forced, the accumulating run: batches per optimizer step. FORCED's change at step 5 falls inside the window of
steps 4 and 5: ranks 0 and 3 leave the exchange with the gradient of step 4 still on them, and rank 2 rejoins."""
SAVED_AT = 4
"""--forced: the step count of the checkpoint the resumed run starts from (rank 2 sits out steps 2 to 4)."""
RESTORED_MEMBERS = [0, 1]
"""--forced, the restored run: the members its checkpoint's allocator state holds (ranks 2 and 3 sat out)."""


def restored_out(checkpoint: Path, folder: Path, allocator: Any) -> None:
    """Copy ``checkpoint`` (the forced run's, saved by equal allocation) into ``folder`` with the state of the
    adaptive ``allocator`` set as a re-plan that let ranks 2 and 3 sit out would have saved it."""
    state = torch.load(checkpoint, weights_only=False)
    saved = allocator.state_dict()
    shares = [GLOBAL_BATCH // len(RESTORED_MEMBERS) if rank in RESTORED_MEMBERS else 0
              for rank in range(len(saved["shares"]))]
    state["hetdp"]["allocator"] = {**saved, "shares": shares, "members": RESTORED_MEMBERS, "adaptive": None,
                                   "sat_out": {rank: "restored" for rank, share in enumerate(shares) if not share}}
    folder.mkdir()
    torch.save(state, folder / checkpoint.name)


def train(model: hetdp.DDP, loader, optimizer, epochs: range, forced: dict | None, ckpt=None, every: int = 1
          ) -> dict[str, list]:
    """The user's loop, ``every`` batches per optimizer step (the others under ``no_sync``, the epoch's last batch
    stepping too); per step, the members and the checksums of the parameters at its start and of the buffers at its
    end, and per epoch, the buffers' checksum after it ended."""
    record: dict[str, list] = {"members": [], "sums": [], "buffers": [], "epoch_buffers": [], "epoch_sums": []}
    for epoch in epochs:
        loader.sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if forced and model.steps_done in forced:
                first, shares = forced[model.steps_done]
                model.set_shares(shares, at_step=first)
            record["members"].append(list(model._sitting.members_at(model.steps_done)))
            record["sums"].append(checksum(model.module))
            if i % every == 0:
                optimizer.zero_grad()
            steps = (i + 1) % every == 0 or i == len(loader) - 1
            with contextlib.nullcontext() if steps else model.no_sync():
                (nn.functional.cross_entropy(model(batch["x"]), batch["y"]) / every).backward()
            if steps:
                optimizer.step()
            record["buffers"].append(buffer_sum(model.module))
            if ckpt is not None and model.steps_done == SAVED_AT + 1 and model.rank == 0:
                shutil.copytree(ckpt.folder, ckpt.folder.with_name("resume"))  # the save at SAVED_AT, kept apart
        record["epoch_buffers"].append(buffer_sum(model.module))
        record["epoch_sums"].append(checksum(model.module))
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--change-at", type=int, required=True)
    parser.add_argument("--forced", action="store_true", help="memberships set by FORCED, not decided")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    emulation = Emulation(speeds=(40.0, 40.0, 1.0, 1.0), sample_cost_ms=4.0,
                          speed_changes=((args.change_at, (1.0, 1.0, 1.0, 1.0)),))
    data = Pairs(SIZE)
    name = "forced" if args.forced else "sitout"

    def run(make_model, forced: dict | None, resume_from: Path | None = None, save_to: Path | None = None,
            every: int = 1, allocation: str | None = None) -> tuple[hetdp.DDP, dict]:
        allocation = allocation or ("equal" if args.forced else "adaptive")
        model = hetdp.DDP(make_model(), allocation, emulation=emulation)
        loader = model.allocate(DataLoader(data, batch_size=GLOBAL_BATCH // 4,
                                           sampler=DistributedSampler(data, seed=3)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ckpt = None
        if allocation == "adaptive" and resume_from is not None and rank == 0:
            (saved,) = (args.out / "resume").iterdir()
            restored_out(saved, resume_from, model.allocator)
        dist.barrier()
        if resume_from is not None or save_to is not None:
            ckpt = model.checkpointer(resume_from or save_to, optimizer, every=SAVED_AT if save_to else 10**6)
            ckpt.resume()
        record = train(model, loader, optimizer, range(ckpt.epoch if ckpt else 0, EPOCHS), forced,
                       ckpt if save_to else None, every)
        record["reports"] = [{"sat_out": report.sat_out, "diagnosis": report.diagnosis(), "shares": report.shares}
                             for report in model.epoch_reports]
        return model, record

    runs = [(name, make_wide_model, FORCED if args.forced else None, None, args.forced, 1, None)]
    if args.forced:
        runs += [("resumed", make_wide_model, FORCED, args.out / "resume", False, 1, None),
                 ("batchnorm", make_batchnorm_model, BATCHNORM_FORCED, None, False, 1, None),
                 ("accumulated", make_wide_model, FORCED, None, False, ACCUMULATE, None),
                 ("restored", make_wide_model, None, args.out / "restored", False, 1, "adaptive")]
    for label, make_model, forced, resume_from, saves, every, allocation in runs:
        dist.barrier()
        model, record = run(make_model, forced, resume_from, args.out / "ckpt" if saves else None, every,
                            allocation)
        (args.out / f"{label}_{rank}.json").write_text(json.dumps(record))
        torch.save(model.module.state_dict(), args.out / f"{label}_{rank}.pt")
        model.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
