"""Chaos: a worker killed (SIGKILL) at a random step of a short adaptive run, restarted from its step checkpoint.

Each trial launches the drop-in (adaptive allocation, allreduce, AdamW) at
speeds 1,1,2,4 with step checkpoints every ``--every`` steps under
``max_restarts=2``; a killer thread SIGKILLs a random rank once rank 0 has
logged a random step. One more trial resumes a 4-rank checkpoint on 3 ranks.

Figures: ``recovered`` of ``trials`` (runs that finished), ``max_lost_steps``
(steps run again after a fault), ``final_param_gap`` (largest difference of the
final parameters against an uninterrupted run with the same seed: adaptive
shares follow measured times, so the sum order of the gradient differs between
runs and the gap is rounding, not 0), ``resize_ok`` (the 3-rank resume finished
and trained each sample of every epoch exactly once, ``data_exact``).

Run as a module under torchrun it is the worker; imported, it is the benchmark.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hetdp.cli.run import positive_int
from hetdp.cluster.emulate import Emulation
from hetdp.launch import ENV_RESTART, run_local
from hetdp.report import format_table
from hetdp.runtime import init_distributed
from hetdp.train.ddp import DistributedDataParallel

SPEEDS = (1.0, 1.0, 2.0, 4.0)
DATASET = 192
GLOBAL_BATCH = 16
EPOCHS = 2
TIMEOUT_S = 300.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trials", type=positive_int, help="killed runs (default 20; --quick 5)")
    parser.add_argument("--every", type=positive_int, default=4, help="steps between checkpoints (default 4)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    trials = args.trials or (5 if args.quick else 20)
    chooser = random.Random(args.seed)
    steps = EPOCHS * DATASET // GLOBAL_BATCH
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hetdp-chaos-") as folder:
        root = Path(folder)
        reference = _launch(root / "reference", len(SPEEDS), args)
        outcomes = []
        for trial in range(trials):
            kill_at = chooser.randrange(2, steps - 1)
            victim = chooser.randrange(len(SPEEDS))
            outcome = _trial(root / f"trial-{trial}", args, kill_at, victim)
            outcome["param_gap"] = _gap(reference["params"], outcome["params"]) if outcome["finished"] else None
            outcomes.append(outcome)
            print(f"trial {trial + 1}/{trials}: rank {victim} killed at step {kill_at}, "
                  f"finished {outcome['finished']}, lost steps {outcome['lost_steps']}", flush=True)
        resize = _resize(root / "resize", args)
    gaps = [o["param_gap"] for o in outcomes if o["param_gap"] is not None]
    return {
        "trials": trials,
        "recovered": sum(o["finished"] for o in outcomes),
        "max_lost_steps": max(o["lost_steps"] for o in outcomes),
        "every": args.every,
        "final_param_gap": max(gaps) if gaps else None,
        "resize_ok": resize,
        "seconds": round(time.monotonic() - started, 1),
    }


def render(result: dict[str, Any]) -> str:
    table = format_table([{key: result[key] for key in ("recovered", "trials", "max_lost_steps", "every",
                                                          "final_param_gap", "resize_ok", "seconds")}],
                         title="a random rank killed (SIGKILL) at a random step, --max-restarts 2")
    return table + ("\nmax_lost_steps: steps run again after a fault (target <= every); final_param_gap: against "
                    "an uninterrupted run (adaptive shares vary the gradient's sum order: rounding only)")


def _launch(folder: Path, nproc: int, args: argparse.Namespace, *, max_restarts: int = 0,
            killer: threading.Thread | None = None) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    if killer is not None:
        killer.start()
    completed = run_local("hetdp.bench.chaos", nproc, ["--folder", folder, "--every", args.every], module=True,
                          capture=True, timeout_s=TIMEOUT_S, max_restarts=max_restarts)
    if killer is not None:
        killer.join()
    out = folder / "params.pt"
    finished = completed.returncode == 0 and out.is_file()
    return {"finished": finished, "params": torch.load(out) if finished else None, "log": folder / "steps.log"}


def _trial(folder: Path, args: argparse.Namespace, kill_at: int, victim: int) -> dict[str, Any]:
    killer = threading.Thread(target=_kill_when, args=(folder, kill_at, victim), daemon=True)
    outcome = _launch(folder, len(SPEEDS), args, max_restarts=2, killer=killer)
    outcome["lost_steps"] = _lost_steps(outcome["log"])
    return outcome


def _kill_when(folder: Path, step: int, rank: int) -> None:
    """SIGKILL ``rank`` of the first attempt once rank 0 has logged ``step``."""
    deadline = time.monotonic() + TIMEOUT_S
    log, pid = folder / "steps.log", folder / f"pid-0-{rank}"
    while time.monotonic() < deadline:
        if pid.is_file() and log.is_file() and any(int(line.split()[2]) >= step and line.split()[3] == "0"
                                                   for line in log.read_text().splitlines() if line.strip()):
            os.kill(int(pid.read_text()), signal.SIGKILL)
            return
        time.sleep(0.05)


def _resize(folder: Path, args: argparse.Namespace) -> bool:
    """Run 4 ranks killed mid-epoch (no restart), then resume the checkpoint on 3: finished, each sample once."""
    killer = threading.Thread(target=_kill_when, args=(folder, DATASET // GLOBAL_BATCH // 2, 1), daemon=True)
    first = _launch(folder, len(SPEEDS), args, killer=killer)
    second = _launch(folder, len(SPEEDS) - 1, args)
    return not first["finished"] and second["finished"] and _data_exact(second["log"])


def _records(log: Path) -> dict[int, dict[str, list[tuple[int, list[int]]]]]:
    """Step -> launch -> (epoch, indices) per rank line, in the order written."""
    steps: dict[int, dict[str, list[tuple[int, list[int]]]]] = collections.defaultdict(dict)
    for line in log.read_text().splitlines():
        launch, epoch, step, _, *indices = line.split()
        steps[int(step)].setdefault(launch, []).append((int(epoch), [int(i) for i in indices]))
    return steps


def _lost_steps(log: Path) -> int:
    """The most steps one launch ran that a later launch ran again."""
    redone = collections.Counter(launch for by_launch in _records(log).values() for launch in list(by_launch)[:-1])
    return max(redone.values(), default=0)


def _data_exact(log: Path) -> bool:
    """Every epoch, as its steps were last run, covers each sample exactly once."""
    covered: dict[int, list[int]] = collections.defaultdict(list)
    for by_launch in _records(log).values():
        for epoch, indices in list(by_launch.values())[-1]:
            covered[epoch].extend(indices)
    return sorted(covered) == list(range(EPOCHS)) and all(
        sorted(indices) == list(range(DATASET)) for indices in covered.values())


def _gap(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> float:
    return max(float((actual[name] - value).abs().max()) for name, value in expected.items())


# --- the worker: runs under torchrun, one process per rank -------------------------------------------------------


class _Indexed(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(DATASET, 16, generator=generator)
        self.y = (self.x[:, :8].sum(1) > 0).long()

    def __len__(self) -> int:
        return DATASET

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hetdp.bench.chaos")
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--every", type=int, required=True)
    args = parser.parse_args(argv)
    rank, world_size = init_distributed()
    torch.set_num_threads(1)
    attempt, launch = os.environ.get(ENV_RESTART, "0"), os.environ["TORCHELASTIC_RUN_ID"]
    (args.folder / f"pid-{attempt}-{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    emulation = Emulation(speeds=SPEEDS[:world_size], sample_cost_ms=1.0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 2)), "adaptive",
                                    emulation=emulation)
    loader = model.allocate(DataLoader(_Indexed(), batch_size=4), global_batch=GLOBAL_BATCH, shuffle=True, seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ckpt = model.checkpointer(args.folder / "ckpt", optimizer, every=args.every)
    ckpt.resume()
    with (args.folder / "steps.log").open("a") as log:
        for epoch in range(ckpt.epoch, EPOCHS):
            loader.sampler.set_epoch(epoch)
            for x, y, index in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                log.write(f"{launch} {epoch} {model.steps_done} {rank} {' '.join(map(str, index.tolist()))}\n")
                log.flush()
    if rank == 0:
        torch.save(model.module.state_dict(), args.folder / "params.pt")
    model.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
