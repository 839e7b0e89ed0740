"""Inherent load imbalance: an LSTM on variable-length sequences, synchronous SGD against eager-SGD's solo and
majority partial allreduce (the eager-SGD paper's video-classification case, section 7.3, at small scale), and
count-balanced against cost-balanced steps, every run through the drop-in.

Sequence lengths follow the paper's UCF101 figures (29 to 1,776 frames, mean
187, sd 97; a clipped log-normal). Each frame is a noisy view of its class's
feature vector; a single-layer LSTM reads every eighth frame and classifies the
sequence. As in the paper, sequences of similar length are batched together, so
a step's cost follows its batch's length: compute is padded to a fixed time per
frame, and ranks computing long and short batches side by side wait for one
another under synchronous SGD. Every mode is the drop-in,
``hetdp.DDP(model, "equal", sync)``, whose steps the loop opens itself
(``begin_step``), its batches being its own length buckets. Figures: test
accuracy against training wall time, the time each mode needs to reach the
synchronous run's final accuracy (less one point), and the final accuracies
(smoothed over the last epoch).

The second part trains the same LSTM through ``hetdp.DDP`` on random (not
length-bucketed) global batches, at equal and at unequal speeds, with each
step's blocks cut by sample count or packed by cost (frames, ``CostBalance``).
A step's compute is paced to its block's frames (packed sequences: the LSTM's
work is their total length). Figures: samples per second, the spread of the
ranks' compute within a step, and ``speedup_cost_vs_count``.

Run as a module under torchrun it is the worker; imported, it is the benchmark.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm

from hetdp import DDP, CostBalance, Emulation, Equal, Partial, Static, init_distributed
from hetdp.errors import ConfigError, HetDPError
from hetdp.launch import run_local
from hetdp.report import format_table

MODES = ("sync", "solo", "majority")
SYNC = {"sync": "allreduce", "solo": "solo", "majority": Partial(mode="majority", grace=0.0, bypass=False)}
"""The drop-in's synchronization of each mode; majority as the paper runs it, a round always waiting for its
initiator."""
FRAMES = {"min": 29, "max": 1776, "mean": 187.0, "sd": 97.0}
"""UCF101's training videos (paper, section 2.1)."""
STRIDE = 8
"""The LSTM reads every STRIDE-th frame; the emulated cost counts every frame."""
FEATURES, CLASSES, HIDDEN, NOISE_SD = 16, 10, 32, 4.0
SIZES = {
    "full": {"nproc": 8, "train": 3072, "test": 1024, "batch": 8, "epochs": 8, "frame_ms": 1.0,
             "balance_epochs": 3, "balance_frame_ms": 0.05},
    "quick": {"nproc": 4, "train": 768, "test": 1024, "batch": 8, "epochs": 8, "frame_ms": 0.4,
              "balance_epochs": 2, "balance_frame_ms": 0.05},
}
"""Per-rank batch of ``batch`` sequences; ``frame_ms``: emulated compute per frame of a batch's longest sequence;
``balance_frame_ms``: per frame of a block of packed sequences, at speed 1 (the count/cost part)."""
BALANCINGS = ("count", "cost")
UNEQUAL_SPEEDS = (1.0, 1.0, 2.0, 4.0)
"""Speeds of the unequal runs, repeated over the ranks."""
SNAPSHOTS_PER_EPOCH = 4
PAPER = {"speedup_majority": 1.27, "speedup_solo": 1.64, "top1_sync": 69.6, "top1_majority": 69.7, "top1_solo": 60.6}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, help="processes, 4 to 8 (default 8; --quick 4)")
    parser.add_argument("--epochs", type=int, help="epochs per mode (default 8)")
    parser.add_argument("--frame-ms", type=float, help="emulated compute per frame (default 1.0; --quick 0.4)")
    parser.add_argument("--balance-epochs", type=int, help="epochs per count/cost run (default 3; --quick 2)")
    parser.add_argument("--balance-frame-ms", type=float,
                        help="emulated compute per frame of packed sequences, count/cost runs (default 0.05)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    size = dict(SIZES["quick" if args.quick else "full"])
    for key in ("nproc", "epochs", "frame_ms", "balance_epochs", "balance_frame_ms"):
        if getattr(args, key) is not None:
            size[key] = getattr(args, key)
    if not 2 <= size["nproc"] <= 16 or size["epochs"] < 1 or not size["frame_ms"] >= 0:
        raise ConfigError(f"need 2 <= --nproc <= 16, --epochs >= 1, --frame-ms >= 0; got {size['nproc']}, "
                          f"{size['epochs']}, {size['frame_ms']}")
    if size["balance_epochs"] < 1 or not size["balance_frame_ms"] > 0:
        raise ConfigError(f"need --balance-epochs >= 1 and --balance-frame-ms > 0; got {size['balance_epochs']}, "
                          f"{size['balance_frame_ms']}")
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "imbalance.json"
        worker_args = ["--out", out, "--seed", args.seed] + [
            item for key, value in size.items() if key != "nproc" for item in (f"--{key.replace('_', '-')}", value)]
        completed = run_local("hetdp.bench.imbalance", size["nproc"], worker_args, module=True)
        if completed.returncode != 0 or not out.is_file():
            raise HetDPError(f"imbalance workers failed (exit code {completed.returncode}); see their output above")
        raw = json.loads(out.read_text())
    return summarize(raw, size)


def time_to(curve: list[list[float]], target: float) -> float | None:
    """Training seconds at the first point of ``curve`` ([seconds, accuracy], in time order) at or above target."""
    return next((seconds for seconds, accuracy in curve if accuracy >= target), None)


def final_accuracy(run_: dict[str, Any]) -> float:
    """Test accuracy at the end of a run, smoothed over its last epoch's snapshots and the final model."""
    last = [accuracy for _, accuracy in run_["curve"][-SNAPSHOTS_PER_EPOCH:]] + [run_["end_accuracy"]]
    return float(np.mean(last))


def summarize(raw: dict[str, Any], size: dict[str, Any]) -> dict[str, Any]:
    runs = raw["runs"]
    final = {mode: final_accuracy(runs[mode]) for mode in MODES}
    target = final["sync"] - 0.01
    reach = {mode: time_to(runs[mode]["curve"] + [[runs[mode]["wall_s"], runs[mode]["end_accuracy"]]], target)
             for mode in MODES}
    wall = {mode: runs[mode]["wall_s"] for mode in MODES}
    balance = raw["balance"]
    speedups = {speeds: figures["cost"]["samples_per_s"] / figures["count"]["samples_per_s"]
                for speeds, figures in balance.items()}
    return {
        "speedup_cost_vs_count": min(speedups.values()),
        "speedup_cost_vs_count_by_speeds": speedups,
        "balance": balance,
        "nproc": size["nproc"],
        "target_accuracy": target,
        "time_to_target_s": reach,
        "final_accuracy": final,
        "wall_s": wall,
        "speedup_solo": wall["sync"] / wall["solo"],
        "speedup_majority": wall["sync"] / wall["majority"],
        "majority_reaches_target_faster": reach["majority"] is not None and reach["majority"] < reach["sync"],
        "settings": {**size, "frames": FRAMES, "stride": STRIDE, "features": FEATURES, "classes": CLASSES,
                     "hidden": HIDDEN, "noise_sd": NOISE_SD,
                     "note": "quick: fewer processes and sequences, cheaper frames" if size["nproc"] < 8 else "full"},
        "paper": PAPER,
        "runs": runs,
        "balance_speeds": raw["balance_speeds"],
    }


def render(result: dict[str, Any]) -> str:
    rows = [{
        "mode": mode,
        "wall s": result["wall_s"][mode],
        "speedup": result["wall_s"]["sync"] / result["wall_s"][mode],
        "final accuracy": result["final_accuracy"][mode],
        "s to target": result["time_to_target_s"][mode] if result["time_to_target_s"][mode] is not None else "never",
    } for mode in MODES]
    s = result["settings"]
    title = (f"LSTM on {s['train']} variable-length sequences ({s['frames']['min']}-{s['frames']['max']} frames), "
             f"{result['nproc']} processes, {s['epochs']} epochs; target = sync final accuracy - 1 point "
             f"= {result['target_accuracy']:.3f}")
    balance_rows = [{
        "speeds": speeds,
        "steps cut by": balancing,
        "samples/s": figures["samples_per_s"],
        "step spread": figures["step_spread"],
        "wall s": figures["wall_s"],
        "accuracy": figures["accuracy"],
        "speedup": figures["samples_per_s"] / result["balance"][speeds]["count"]["samples_per_s"],
    } for speeds, by_balancing in result["balance"].items() for balancing, figures in by_balancing.items()]
    balance_title = (f"hetdp.DDP on random global batches of {s['batch'] * result['nproc']} sequences: count- vs "
                     f"cost-balanced steps (step spread: (slowest - fastest) / slowest rank's compute, mean over "
                     f"steps); unequal speeds {list(result['balance_speeds']['unequal'])}")
    speedup = (f"speedup of cost- over count-balanced steps: {result['speedup_cost_vs_count']:.3f} "
               f"(the smaller of equal and unequal speeds)")
    return "\n\n".join([format_table(rows, title=title), format_table(balance_rows, title=balance_title), speedup])


# --- the worker: runs under torchrun, one process per rank -------------------------------------------------------


class SequenceClassifier(nn.Module):
    """A single-layer LSTM over the frames, its last hidden state into a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(FEATURES, HIDDEN, batch_first=True)
        self.out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, sequences: list[torch.Tensor]) -> torch.Tensor:
        lengths = torch.tensor([len(s) for s in sequences])
        packed = pack_padded_sequence(pad_sequence(sequences, batch_first=True), lengths, batch_first=True,
                                      enforce_sorted=False)
        _, (hidden, _) = self.lstm(packed)
        return self.out(hidden[-1])


def frame_counts(rng: np.random.Generator, n: int) -> np.ndarray:
    """Video lengths with UCF101's mean and sd (a log-normal), clipped to its range."""
    sigma2 = np.log(1 + (FRAMES["sd"] / FRAMES["mean"]) ** 2)
    mu = np.log(FRAMES["mean"]) - sigma2 / 2
    return np.clip(np.round(rng.lognormal(mu, np.sqrt(sigma2), n)), FRAMES["min"], FRAMES["max"]).astype(int)


def make_split(seed: int, n: int, tag: int) -> tuple[list[torch.Tensor], torch.Tensor, np.ndarray]:
    """``n`` sequences (every STRIDE-th frame), their labels and their full frame counts, from (seed, tag)."""
    prototypes = torch.from_numpy(np.random.default_rng([seed, 0]).normal(0, 1, (CLASSES, FEATURES))).float()
    rng = np.random.default_rng([seed, tag])
    frames = frame_counts(rng, n)
    labels = rng.integers(0, CLASSES, n)
    generator = torch.Generator().manual_seed(int(rng.integers(2**31)))
    sequences = [prototypes[c] + NOISE_SD * torch.randn(-(-f // STRIDE), FEATURES, generator=generator)
                 for c, f in zip(labels, frames)]
    return sequences, torch.from_numpy(labels), frames


def accuracy(model: nn.Module, split: tuple[list[torch.Tensor], torch.Tensor, np.ndarray]) -> float:
    with torch.no_grad():
        return (model(split[0]).argmax(1) == split[1]).float().mean().item()


def _buckets(frames: np.ndarray, mine: np.ndarray, batch: int, seed: int, epoch: int, rank: int) -> list[np.ndarray]:
    """This rank's sequences in batches of similar length, the batches in a seeded random order."""
    ordered = mine[np.argsort(frames[mine], kind="stable")]
    buckets = [ordered[i : i + batch] for i in range(0, len(ordered) - batch + 1, batch)]
    order = np.random.default_rng([seed, epoch, rank]).permutation(len(buckets))
    return [buckets[i] for i in order]


def _paced_by_frames(steps: list[list[np.ndarray]], frames: np.ndarray, frame_ms: float) -> Emulation:
    """The drop-in's emulation, pacing every rank's step ``k`` (its batch ``steps[rank][k]``) to what the batch's
    longest sequence costs, ``frame_ms`` a frame: the LSTM runs over the padded batch.

    The step's speed is its samples per frame of that sequence, so that samples x
    ``frame_ms`` / speed lasts its frames. The drop-in pads at the gradient's last
    bucket, so the exchange follows the emulated compute, as on a real device.
    """
    if frame_ms == 0:
        return Emulation()
    speeds = [tuple(len(per_rank[k]) / int(frames[per_rank[k]].max()) for per_rank in steps)
              for k in range(len(steps[0]))]
    return Emulation(sample_cost_ms=frame_ms, speed_changes=tuple(enumerate(speeds)))


def _train(args: argparse.Namespace, mode: str, train: tuple, progress: tqdm) -> dict[str, Any]:
    """One run of ``mode`` through the drop-in: every rank runs the same steps on its own length-bucketed batches."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sequences, labels, frames = train
    order = np.random.default_rng([args.seed, 1]).permutation(len(labels))
    steps = [[bucket for epoch in range(args.epochs)
              for bucket in _buckets(frames, order[r::world_size], args.batch, args.seed, epoch, r)]
             for r in range(world_size)]
    torch.manual_seed(args.seed)
    net = SequenceClassifier()
    optimizer = torch.optim.Adam(net.parameters(), lr=5e-3)
    rounds = [0]
    optimizer.register_step_post_hook(lambda *_: rounds.__setitem__(0, rounds[0] + 1))  # once per round applied
    model = DDP(net, "equal", SYNC[mode], emulation=_paced_by_frames(steps, frames, args.frame_ms))
    snapshot_every = max(1, len(steps[rank]) // args.epochs // SNAPSHOTS_PER_EPOCH)
    snapshots: list[tuple[float, dict[str, torch.Tensor]]] = []
    dist.barrier()
    started = time.perf_counter()
    for step, bucket in enumerate(steps[rank], start=1):
        model.begin_step(len(bucket), len(bucket) * world_size)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model([sequences[i] for i in bucket]), labels[bucket]).backward()
        optimizer.step()
        model.end_step()
        if rank == 0 and step % snapshot_every == 0:
            # Rank 0's replica after the rounds it applied so far: keep a copy, evaluated after training so
            # evaluation never delays the run.
            snapshots.append((time.perf_counter() - started, {k: v.clone() for k, v in net.state_dict().items()}))
        progress.update()
    model.end_epoch()  # the ranks meet: partial synchronization applies the rounds in flight everywhere
    wall_s = time.perf_counter() - started
    model.close()
    walls: list[Any] = [None] * world_size
    dist.all_gather_object(walls, wall_s)
    return {"model": net, "snapshots": snapshots, "wall_s": max(walls), "steps": len(steps[rank]),
            "rounds": rounds[0]}


class _Sequences(Dataset):
    """The split's sequences as (frames, label) pairs."""

    def __init__(self, split: tuple[list[torch.Tensor], torch.Tensor, np.ndarray]) -> None:
        self.sequences, self.labels = split[0], split[1]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.sequences[index], int(self.labels[index])


def _collate(batch: list[tuple[torch.Tensor, int]]) -> tuple[list[torch.Tensor], torch.Tensor]:
    return [sequence for sequence, _ in batch], torch.tensor([label for _, label in batch])


def _balanced(args: argparse.Namespace, balancing: str, speeds: tuple[float, ...], train: tuple,
              test: tuple | None, progress: tqdm) -> dict[str, Any]:
    """One run of the drop-in with steps cut by count or packed by cost; every step is paced to its frames."""
    world_size = dist.get_world_size()
    torch.manual_seed(args.seed)
    allocation = Equal() if len(set(speeds)) == 1 else Static(speeds)
    emulation = Emulation(speeds=speeds, sample_cost_ms=args.balance_frame_ms)
    dataset = _Sequences(train)
    cost = CostBalance(cost=train[2].tolist(), pack=balancing == "cost", mean_over="samples")
    with DDP(SequenceClassifier(), allocation, "allreduce", emulation=emulation) as model:
        optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
        loader = model.allocate(DataLoader(dataset, batch_size=args.batch, collate_fn=_collate,
                                           sampler=DistributedSampler(dataset, seed=args.seed)), cost=cost)
        dist.barrier()
        started = time.perf_counter()
        for epoch in range(args.balance_epochs):
            loader.sampler.set_epoch(epoch)
            for sequences, labels in loader:
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(sequences), labels).backward()
                optimizer.step()
                progress.update()
        dist.barrier()
        wall_s = time.perf_counter() - started
        steps = list(model.step_figures)
        accuracy_ = accuracy(model.module, test) if test is not None else None
    spreads = [(max(step.compute_s) - min(step.compute_s)) / max(step.compute_s) for step in steps]
    samples = sum(sum(step.shares) for step in steps)
    return {"samples_per_s": samples / wall_s, "wall_s": wall_s, "step_spread": float(np.mean(spreads)),
            "steps": len(steps), "samples": samples, "accuracy": accuracy_, "world_size": world_size}


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="hetdp.bench.imbalance")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    for key in ("train", "test", "batch", "epochs"):
        parser.add_argument(f"--{key}", type=int, required=True)
    parser.add_argument("--frame-ms", type=float, required=True)
    parser.add_argument("--balance-epochs", type=int, required=True)
    parser.add_argument("--balance-frame-ms", type=float, required=True)
    args = parser.parse_args(argv)
    rank, world_size = init_distributed()
    torch.set_num_threads(1)
    train = make_split(args.seed, args.train, tag=1)
    test = make_split(args.seed, args.test, tag=2) if rank == 0 else None
    steps = args.epochs * (args.train // world_size // args.batch)
    balance_steps = args.balance_epochs * -(-args.train // (args.batch * world_size))
    progress = tqdm(total=len(MODES) * steps + 2 * len(BALANCINGS) * balance_steps, desc="imbalance runs",
                    unit="step", disable=None if rank == 0 else True, file=sys.stderr)
    runs = {}
    for mode in MODES:
        progress.set_postfix(mode=mode)
        record = _train(args, mode, train, progress)
        if test is not None:
            model = record["model"]
            end = accuracy(model, test)
            curve = []
            for seconds, state in record["snapshots"]:
                model.load_state_dict(state)
                curve.append([seconds, accuracy(model, test)])
            runs[mode] = {"wall_s": record["wall_s"], "steps": record["steps"], "rounds": record["rounds"],
                          "end_accuracy": end, "curve": curve}
        dist.barrier()
    all_speeds = {"equal": (1.0,) * world_size,
                  "unequal": tuple(UNEQUAL_SPEEDS[r % len(UNEQUAL_SPEEDS)] for r in range(world_size))}
    balance: dict[str, dict[str, Any]] = {}
    for name, speeds in all_speeds.items():
        for balancing in BALANCINGS:
            progress.set_postfix(speeds=name, steps=balancing)
            balance.setdefault(name, {})[balancing] = _balanced(args, balancing, speeds, train, test, progress)
    progress.close()
    if rank == 0:
        args.out.write_text(json.dumps({"runs": runs, "balance": balance, "balance_speeds": all_speeds}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
