"""Chaos: a worker killed (SIGKILL) or hung (SIGSTOP) at a random step of a short adaptive run, restarted.

Each trial launches the drop-in (adaptive allocation, allreduce, AdamW) at
speeds 1,1,2,4 with step checkpoints every ``--every`` steps under
``max_restarts=2``; a killer thread signals a random rank once rank 0 has
logged a random step: SIGKILL, or SIGSTOP in every other trial. The last trial
is not restarted on 4 ranks but resumed on 3.

Figures: ``recovered`` of ``trials`` (runs that finished), ``max_lost_steps``
(steps run again after a fault), ``delivered`` (faults sent: a run that failed before its fault's step got
none), ``final_param_gap`` (largest difference of the
final parameters against an uninterrupted run with the same seed: adaptive
shares follow measured times, so the sum order of the gradient differs between
runs and the gap is rounding, not 0), ``named`` (faults after which every
survivor's PeerTimeoutError named the signalled rank), ``max_detect_s`` (the
longest time from a SIGSTOP to the last survivor's error; the target is
``STEP_TIMEOUT_S`` + 5 s), ``data_exact`` (runs whose epochs, as their
steps were last run, trained each sample exactly once), ``resize_ok`` (the 3-rank resume finished and
trained each sample of every epoch exactly once; its parameters count in the
gap too, since the gradient is the global batch's mean on any number of ranks)
and ``resize_stable_steps`` (steps after the 3-rank resume until the adaptive
shares were stable again; an epoch is ``DATASET // GLOBAL_BATCH`` steps).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from hetdp.cluster.emulate import Emulation
from hetdp.ddp.model import DistributedDataParallel
from hetdp.errors import HetDPError, PeerTimeoutError
from hetdp.flags import positive_int
from hetdp.launch import ENV_RESTART, run_local
from hetdp.report import format_table
from hetdp.runtime import init_distributed

SPEEDS = (1.0, 1.0, 2.0, 4.0)
DATASET = 192
GLOBAL_BATCH = 16
EPOCHS = 2
TIMEOUT_S = 300.0
STEP_TIMEOUT_S = 5.0
"""The workers' ``step_timeout_s``: how long a stopped peer may go unnoticed."""


@dataclass(frozen=True)
class Fault:
    """One trial's fault: ``signal`` sent to ``rank`` of the first attempt once rank 0 has logged ``step``."""

    rank: int
    step: int
    signal: signal.Signals


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trials", type=positive_int, help="faulty runs, the last one resumed on 3 ranks (default 20; --quick 5)")
    parser.add_argument("--every", type=positive_int, default=4, help="steps between checkpoints (default 4)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    trials = args.trials or (5 if args.quick else 20)
    chooser = random.Random(args.seed)
    steps, epoch_steps = EPOCHS * DATASET // GLOBAL_BATCH, DATASET // GLOBAL_BATCH
    started = time.monotonic()
    faults = [Fault(chooser.randrange(len(SPEEDS)), chooser.randrange(2, steps - 1),
                    signal.SIGSTOP if trial % 2 else signal.SIGKILL) for trial in range(trials - 1)]
    # the last trial resumes on 3 ranks, early enough that an epoch is left to see the shares settle again
    faults.append(Fault(chooser.randrange(len(SPEEDS)), chooser.randrange(2, epoch_steps), signal.SIGKILL))
    progress = tqdm(total=trials + 1, desc="chaos", unit="run", file=sys.stderr, disable=None)
    with tempfile.TemporaryDirectory(prefix="hetdp-chaos-") as folder, progress:
        root = Path(folder)
        progress.set_postfix_str("uninterrupted reference")
        reference = _launch(root / "reference", len(SPEEDS), args)
        progress.update()
        outcomes = []
        for trial, fault in enumerate(faults):
            resize = trial == trials - 1
            progress.set_postfix_str(f"rank {fault.rank} {fault.signal.name} at step {fault.step}"
                                     + (", resumed on 3 ranks" if resize else ""))
            outcome = _trial(root / f"trial-{trial}", args, fault, resize=resize)
            outcome["param_gap"] = _gap(reference["params"], outcome["params"]) if outcome["finished"] else None
            outcomes.append(outcome)
            progress.update()
    resized = outcomes[-1]  # its log went with the folder: what it showed is in the outcome
    gaps = [o["param_gap"] for o in outcomes if o["param_gap"] is not None]
    detect = [o["detect_s"] for o in outcomes if o["detect_s"] is not None]
    return {
        "trials": trials,
        "recovered": sum(o["finished"] for o in outcomes),
        "delivered": sum(o["delivered"] for o in outcomes),
        "stopped": sum(fault.signal == signal.SIGSTOP for fault in faults),
        "named": sum(o["named"] for o in outcomes),
        "max_detect_s": round(max(detect), 1) if detect else None,
        "step_timeout_s": STEP_TIMEOUT_S,
        "max_lost_steps": max(o["lost_steps"] for o in outcomes),
        "data_exact": sum(o["finished"] and o["data_exact"] for o in outcomes),
        "every": args.every,
        "final_param_gap": max(gaps) if gaps else None,
        "resize_ok": resized["finished"] and resized["data_exact"],
        "resize_stable_steps": resized["stable_steps"],
        "epoch_steps": epoch_steps,
        "seconds": round(time.monotonic() - started, 1),
    }


def render(result: dict[str, Any]) -> str:
    keys = ("recovered", "trials", "delivered", "stopped", "named", "max_detect_s", "max_lost_steps", "every",
            "data_exact", "final_param_gap", "resize_ok", "resize_stable_steps", "epoch_steps", "seconds")
    table = format_table([{key: result[key] for key in keys}],
                         title="a random rank killed (SIGKILL) or hung (SIGSTOP) at a random step, --max-restarts 2")
    return table + ("\ndelivered: faults sent (a run that failed before its fault's step got none); named: faults "
                    "after which every survivor named the signalled rank; max_detect_s: SIGSTOP to "
                    f"the survivors' error (target <= step_timeout_s + 5 = {result['step_timeout_s'] + 5:g}); "
                    "max_lost_steps: steps run again after a fault (target <= every); data_exact: runs that trained "
                    "each sample once per epoch; final_param_gap: against an uninterrupted run (adaptive shares vary "
                    "the gradient's sum order: rounding only); "
                    "resize_stable_steps: steps until adaptive shares are stable on 3 ranks (target <= epoch_steps)")


def _launch(folder: Path, nproc: int, args: argparse.Namespace, *, max_restarts: int = 0,
            killer: threading.Thread | None = None) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    if killer is not None:
        killer.start()
    try:
        completed = run_local("hetdp.bench.chaos", nproc, ["--folder", folder, "--every", args.every], module=True,
                              capture=True, timeout_s=TIMEOUT_S, max_restarts=max_restarts, report_errors=True)
        finished = completed.returncode == 0
    except HetDPError:  # the last attempt failed too
        finished = False
    if killer is not None:
        killer.join()
    out = folder / "params.pt"
    finished = finished and out.is_file()
    return {"finished": finished, "params": torch.load(out) if finished else None, "log": folder / "steps.log"}


def _trial(folder: Path, args: argparse.Namespace, fault: Fault, *, resize: bool = False) -> dict[str, Any]:
    """One faulty run under ``max_restarts=2``; with ``resize``, the first attempt is not restarted but resumed on
    one rank fewer."""
    killer = threading.Thread(target=_signal_when, args=(folder, fault), daemon=True)
    if resize:
        _launch(folder, len(SPEEDS), args, killer=killer)
        outcome = _launch(folder, len(SPEEDS) - 1, args, max_restarts=2)
    else:
        outcome = _launch(folder, len(SPEEDS), args, max_restarts=2, killer=killer)
    outcome["lost_steps"] = _lost_steps(outcome["log"])
    outcome["data_exact"] = data_exact(outcome["log"])
    outcome["named"], outcome["detect_s"] = False, None
    outcome["delivered"] = (folder / "signalled").is_file()  # the run may have failed before the fault's step
    if fault.signal == signal.SIGSTOP and outcome["delivered"]:
        signalled = float((folder / "signalled").read_text())
        survivors = [line.split() for line in _lines(folder / "faults.log") if line.startswith("0 ")]
        outcome["named"] = len(survivors) == len(SPEEDS) - 1 and all(int(culprit) == fault.rank
                                                                     for _, _, culprit, _ in survivors)
        outcome["detect_s"] = max((float(at) for *_, at in survivors), default=float("inf")) - signalled
    resumed = [line.split() for line in _lines(folder / "stable.log") if line.startswith(f"{len(SPEEDS) - 1} ")]
    outcome["stable_steps"] = int(resumed[0][2]) - int(resumed[0][1]) if resumed else None
    return outcome


def _signal_when(folder: Path, fault: Fault) -> None:
    """Send the fault's signal to its rank of the first attempt once rank 0 has logged its step; note the time."""
    deadline = time.monotonic() + TIMEOUT_S
    log, pid = folder / "steps.log", folder / f"pid-0-{fault.rank}"
    while time.monotonic() < deadline:
        if pid.is_file() and any(int(line.split()[2]) >= fault.step and line.split()[3] == "0" for line in _lines(log)):
            (folder / "signalled").write_text(repr(time.time()))
            os.kill(int(pid.read_text()), fault.signal)
            return
        time.sleep(0.05)


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


TRAINED, STAND_IN = "trained", "stand-in"
"""How a step log line says what its batch was: samples the rank trained, or a stand-in that trains nothing (a
rank that sits out the step, or one with no sample in the epoch's short last step)."""


def log_step(log: Any, launch: str, epoch: int, step: int, rank: int, indices: list[int], trained: bool) -> None:
    """Write one rank's step: ``launch epoch step rank trained|stand-in indices...``."""
    log.write(f"{launch} {epoch} {step} {rank} {TRAINED if trained else STAND_IN} {' '.join(map(str, indices))}\n")
    log.flush()


def _records(log: Path) -> dict[int, dict[str, list[tuple[int, list[int]]]]]:
    """Step -> launch -> (epoch, indices trained) per rank line, in the order written. A stand-in's line counts as
    the rank's step, with no samples."""
    steps: dict[int, dict[str, list[tuple[int, list[int]]]]] = collections.defaultdict(dict)
    for line in _lines(log):
        launch, epoch, step, _, kind, *indices = line.split()
        trained = [int(i) for i in indices] if kind == TRAINED else []
        steps[int(step)].setdefault(launch, []).append((int(epoch), trained))
    return steps


def _lost_steps(log: Path) -> int:
    """The most steps one launch ran that a later launch ran again."""
    redone = collections.Counter(launch for by_launch in _records(log).values() for launch in list(by_launch)[:-1])
    return max(redone.values(), default=0)


def coverage(log: Path) -> dict[int, collections.Counter[int]]:
    """Epoch -> how many times each sample was trained, counting every step as the launch that ran it last ran it
    (stand-ins train nothing)."""
    covered: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for by_launch in _records(log).values():
        for epoch, indices in list(by_launch.values())[-1]:
            covered[epoch].update(indices)
    return dict(covered)


def data_exact(log: Path) -> bool:
    """Every epoch, as its steps were last run, trained each sample exactly once: none twice, none missed."""
    covered = coverage(log)
    return sorted(covered) == list(range(EPOCHS)) and all(
        sorted(counts) == list(range(DATASET)) and set(counts.values()) == {1} for counts in covered.values())


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
    # A fault of the data, for the tests of data_exact: the epoch's order repeats a sample.
    parser.add_argument("--repeat-a-sample-in-epoch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rank, world_size = init_distributed()
    torch.set_num_threads(1)
    attempt, launch = os.environ.get(ENV_RESTART, "0"), os.environ["TORCHELASTIC_RUN_ID"]
    (args.folder / f"pid-{attempt}-{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    emulation = Emulation(speeds=SPEEDS[:world_size], sample_cost_ms=1.0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 2)), "adaptive",
                                    emulation=emulation, step_timeout_s=STEP_TIMEOUT_S)
    loader = model.allocate(DataLoader(_Indexed(), batch_size=4), global_batch=GLOBAL_BATCH, shuffle=True, seed=3)
    if args.repeat_a_sample_in_epoch is not None:
        _repeat_a_sample(loader.sampler, args.repeat_a_sample_in_epoch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ckpt = model.checkpointer(args.folder / "ckpt", optimizer, every=args.every)
    ckpt.resume()
    resumed_at, stable = model.steps_done, model.allocator.stable
    with (args.folder / "steps.log").open("a") as log:
        try:
            for epoch in range(ckpt.epoch, EPOCHS):
                loader.sampler.set_epoch(epoch)
                for x, y, index in loader:
                    optimizer.zero_grad()
                    nn.functional.cross_entropy(model(x), y).backward()
                    optimizer.step()
                    log_step(log, launch, epoch, model.steps_done, rank, index.tolist(), trained=model.step_samples > 0)
                    if rank == 0 and not stable and model.allocator.stable:
                        stable = True
                        with (args.folder / "stable.log").open("a") as stable_log:
                            stable_log.write(f"{world_size} {resumed_at} {model.steps_done}\n")
        except PeerTimeoutError as error:
            with (args.folder / "faults.log").open("a") as faults:
                faults.write(f"{attempt} {rank} {error.rank} {time.time()!r}\n")
            raise
    if rank == 0:
        torch.save(model.module.state_dict(), args.folder / "params.pt")
    model.close()
    dist.destroy_process_group()


def _repeat_a_sample(sampler: Any, epoch: int) -> None:
    """Make ``epoch``'s order hold its first sample twice and its second never: the worker then trains a sample twice
    (the fault ``data_exact`` must catch, as a sampler that handed one sample to two ranks would)."""
    permutation = sampler.permutation

    def repeated() -> list[int]:
        order = permutation()
        if sampler.epoch == epoch:
            order[1] = order[0]
        return order

    sampler.permutation = repeated


if __name__ == "__main__":
    _worker(sys.argv[1:])
