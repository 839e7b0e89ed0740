"""Synchronous data-parallel training where ranks compute unequal shares of every step.

Task-allocation paper: rank i computes ``shares[i]`` samples per step (as several
accumulated micro-batches, or one batch), then one allreduce combines them. The
shares are equal, static or re-planned from measured compute times.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, TensorDataset, default_collate

from hetdp.allocate.adaptive import AdaptiveAllocator
from hetdp.allocate.sampler import WeightedDistributedSampler
from hetdp.cluster.emulate import Emulation, sleep
from hetdp.collectives import doubling
from hetdp.errors import CheckpointError, ConfigError, PeerTimeoutError
from hetdp.runtime import local_device, synchronize
from hetdp.train.checkpoint import load_checkpoint, save_checkpoint

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(kw_only=True, frozen=True)
class AllocationConfig:
    """Who computes how much of each step, and how a rank runs its share."""

    policy: Literal["equal", "static", "adaptive"] = "adaptive"
    """equal: plain DDP split; static: split by ``weights``; adaptive: re-planned from measured compute times."""
    global_batch: int = 256
    """Samples per optimizer step over all ranks (the paper's C x minibatch); fixed, so the learning rate holds."""
    micro_batch: int = 32
    """Samples per forward/backward in ``accumulate`` mode (the paper's minibatch)."""
    mode: Literal["accumulate", "batch"] = "accumulate"
    """accumulate: the share runs as micro-batches under ``no_sync``; batch: as one forward of the whole share."""
    max_batch: tuple[int, ...] | None = None
    """Per rank, the most samples one forward may hold (its memory limit); larger shares are split. None: no limit."""
    weights: tuple[float, ...] | None = None
    """Static weights, one per rank (``static``), or the adaptive policy's starting point. None: equal."""
    minimum: int = 1
    """Fewest samples any rank computes per step, so a slow rank keeps being measured."""
    replan_every: int = 0
    """Adaptive only: re-plan every this many steps as well as at each epoch's end; 0 re-plans per epoch (the paper)."""
    smoothing: float = 0.0
    """Adaptive only: weight of past speed estimates against timing noise (0 = newest measurement only)."""
    tolerance: float = 0.02
    """Adaptive only: apply a re-plan only if it shortens the predicted step time by this fraction (noise guard)."""
    patience: int = 2
    """Adaptive only: calm re-plans in a row after which re-planning stops, as in the paper."""
    seed: int = 0
    """Seed of the per-epoch shuffle; every rank must use the same."""
    drop_last: bool = False
    """Drop the epoch's last, partial step instead of splitting it by the shares."""
    step_timeout_s: float = 60.0
    """Seconds a step's collectives may wait for the slowest rank; past it a dead or hung peer raises
    PeerTimeoutError instead of hanging. Too small: a slow but healthy step raises too."""

    def __post_init__(self) -> None:
        if self.policy not in ("equal", "static", "adaptive"):
            raise ConfigError(f"policy must be equal, static or adaptive, got {self.policy!r}")
        if self.mode not in ("accumulate", "batch"):
            raise ConfigError(f"mode must be accumulate or batch, got {self.mode!r}")
        for name in ("global_batch", "micro_batch", "minimum"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.replan_every < 0:
            raise ConfigError(f"replan_every must be >= 0 steps, got {self.replan_every}")
        if self.policy == "static" and self.weights is None:
            raise ConfigError("policy 'static' needs weights, one per rank")
        if not self.step_timeout_s > 0:
            raise ConfigError(f"step_timeout_s must be > 0 seconds, got {self.step_timeout_s!r}")
        if self.max_batch is not None and min(self.max_batch) < 1:
            raise ConfigError(f"max_batch must be >= 1 per rank, got {list(self.max_batch)}")

    def chunk_size(self, rank: int, share: int) -> int:
        """Samples per forward/backward for ``rank`` computing ``share`` samples."""
        size = self.micro_batch if self.mode == "accumulate" else max(share, 1)
        return size if self.max_batch is None else min(size, self.max_batch[rank])


@dataclass
class EpochReport:
    """What one epoch did on every rank; identical on all ranks."""

    epoch: int
    shares: list[int]
    """Samples per step of each rank at the end of the epoch."""
    steps: int
    epoch_s: float
    """Wall-clock seconds of the epoch (the slowest rank's)."""
    compute_s: list[float]
    """Per rank: seconds computing its shares (forward, backward, emulated slowness), no waiting."""
    wait_s: list[float]
    """Per rank: seconds from its compute's end to the synchronized gradient (waiting for others + allreduce)."""
    samples: list[int]
    loss: float
    """Mean training loss over the epoch's samples."""
    replans: list[tuple[int, list[int]]] = field(default_factory=list)
    """Each re-plan that changed the shares: (steps of this epoch done before it, the new shares)."""
    stable: bool = False

    def diagnosis(self) -> str:
        """Which rank held the epoch back, and whether by computing or by communicating."""
        return diagnose_straggler(self.compute_s, self.wait_s)


def diagnose_straggler(compute_s: Sequence[float], wait_s: Sequence[float]) -> str:
    """Name the rank that held a synchronous run back, and whether by compute or by communication.

    The slowest computer is the straggler if its extra compute over the median rank
    exceeds the time every rank spends in the allreduce itself (the smallest wait);
    otherwise the step is bound by communication.
    """
    slowest = max(range(len(compute_s)), key=compute_s.__getitem__)
    extra_s = compute_s[slowest] - statistics.median(compute_s)
    comm_s = min(wait_s)
    if extra_s > comm_s:
        return (
            f"rank {slowest} is the straggler, by compute: {compute_s[slowest]:.2f} s computing, "
            f"{extra_s:.2f} s more than the median rank; the others wait up to {max(wait_s):.2f} s"
        )
    return (
        f"no compute straggler: communication-bound, every rank spends at least {comm_s:.2f} s "
        f"in the allreduce, more than the {extra_s:.2f} s compute spread"
    )


class _SyncClock:
    """When this rank's compute ended (its last gradient bucket ready, before any waiting), each step paced to the
    emulated device.

    On CUDA the times come from events on the device's timeline, since the host
    only queues kernels; on the CPU from the host clock. The emulated slowness
    runs in two sleeps: a lead at ``start``, before the real compute, so ranks
    leaving the last allreduce leave the cores to peers still in it; and the
    rest just before the last bucket's allreduce, after all of the step's real
    compute, so the real work of ranks sharing a few cores overlaps with their
    sleeps instead of delaying the allreduce.
    """

    def __init__(self, device: torch.device, emulation: Emulation, rank: int) -> None:
        self.device = device
        self.emulation = emulation
        self.rank = rank
        self.events = (
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if device.type == "cuda" else None
        )
        self.started_at = self.ready_at = 0.0
        self.samples: int | None = None
        """The started step's sample count, until its padding has run."""

    def start(self, samples: int) -> None:
        self.started_at = self.ready_at = time.perf_counter()
        self.samples = samples
        if self.events:
            self.events[0].record()
        sleep(self.emulation.lead_s(self.rank, samples))

    def mark_ready(self, last_bucket: bool) -> None:
        if last_bucket and self.samples is not None:
            self._pad(self.samples)
            self.samples = None
        self.ready_at = time.perf_counter()
        if self.events:
            self.events[1].record()

    def _pad(self, samples: int) -> None:
        """Sleep so that the allreduce starts when the emulated device would have finished.

        Counted from ``start``, so the lead is included and an injected straggler delay comes on top.
        """
        synchronize(self.device)
        sleep(self.emulation.padding_s(self.rank, time.perf_counter() - self.started_at, samples))

    def compute_s(self) -> float:
        """Seconds from ``start`` to the last ``mark_ready``; call after synchronizing the device."""
        if self.events:
            return self.events[0].elapsed_time(self.events[1]) / 1000.0
        return self.ready_at - self.started_at


class _GradientSum:
    """DDP comm-hook state: sum gradient buckets over the group, noting when this rank's compute ended.

    Sums instead of averaging because the loss is pre-scaled by the global sample
    count. The last bucket has no backward left to overlap with, so only its
    latency counts: when it is small and on the CPU over gloo it goes by recursive
    doubling, since gloo's ring takes 2(P - 1) hops, each waiting for a process to
    be scheduled (24 KB on 6 ranks sharing 2 cores: about 18 ms by ring, 3.5 ms
    by doubling). Earlier buckets go asynchronously, overlapping the backward.
    """

    def __init__(self, clock: _SyncClock, group: dist.ProcessGroup, timeout_s: float) -> None:
        self.clock = clock
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.point_to_point = dist.get_backend(group) == "gloo"
        self.timeout_s = timeout_s
        self.rounds = 0

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        last = bucket.is_last()
        self.clock.mark_ready(last)
        buffer = bucket.buffer()
        if not (last and self.point_to_point and buffer.device.type == "cpu" and doubling.is_latency_bound(buffer)):
            work = dist.all_reduce(buffer, group=self.group, async_op=True)
            return work.get_future().then(lambda future: future.value()[0])
        self.rounds += 1
        deadline = time.monotonic() + self.timeout_s
        doubling.allreduce(self.group, buffer, self.rank, self.world_size, self.rounds, deadline)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done


def _sum_gradients(state, bucket):  # no annotations: DDP checks them as types, and here they'd be strings
    """DDP comm hook: see ``_GradientSum``."""
    return state.reduce(bucket)


@dataclass
class _Window:
    """This rank's compute times over the steps since the last re-plan."""

    steps: int = 0
    seconds: float = 0.0
    squares: float = 0.0

    def add(self, step_s: float) -> None:
        self.steps, self.seconds, self.squares = self.steps + 1, self.seconds + step_s, self.squares + step_s**2


def _pooled_cv(figures: torch.Tensor, steps: int) -> float | None:
    """Relative standard deviation of one step's compute time, pooled over ranks (rows: seconds, squares)."""
    if steps < 2:
        return None
    means = figures[:, 0] / steps
    variances = (figures[:, 1] / steps - means**2).clamp(min=0.0) * steps / (steps - 1)
    return float((variances / means.clamp(min=1e-12) ** 2).mean().sqrt())


def fetch(dataset: Dataset, indices: Sequence[int]) -> Any:
    """Collate the samples at ``indices`` into one batch (one gather for a TensorDataset)."""
    if isinstance(dataset, TensorDataset):
        index = torch.as_tensor(indices, dtype=torch.long)
        return tuple(tensor[index] for tensor in dataset.tensors)
    return default_collate([dataset[i] for i in indices])


class AllocatedTrainer:
    """Train a model with DDP where each rank computes its own share of every global batch.

    The synchronized gradient is exactly the mean over all samples of the step: each
    micro-batch's mean loss is scaled by its share of the global step, and the comm
    hook sums instead of averaging over ranks (plain DDP's average is wrong when
    ranks do unequal work). Per-rank compute time excludes waiting: it ends when the
    last gradient bucket is ready, which the comm hook records.

    .. warning::
        Every rank of the group must build the trainer with the same config and
        dataset order, and call ``train_epoch`` for the same epochs: each step is
        a collective.

    Example::

        >>> # on every rank, launched with `hetdp run -n 4 train.py` or torchrun
        >>> hetdp.init_distributed()
        >>> trainer = AllocatedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), train_set,
        ...                            AllocationConfig(policy="adaptive", global_batch=128, micro_batch=16))
        >>> for epoch in range(trainer.start_epoch, 10):
        ...     report = trainer.train_epoch(epoch)   # report.shares, report.compute_s, report.wait_s
        ...     trainer.save_checkpoint("ckpt.pt")
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Dataset,
        config: AllocationConfig,
        *,
        loss_fn: LossFn = nn.functional.cross_entropy,
        emulation: Emulation | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """Wrap ``model`` in DDP over ``group`` (default: a new group of all ranks with the step timeout)."""
        self._own_group = group is None
        if group is None:
            group = dist.new_group(timeout=datetime.timedelta(seconds=config.step_timeout_s))
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        for name in ("weights", "max_batch"):
            value = getattr(config, name)
            if value is not None and len(value) != self.world_size:
                raise ConfigError(f"{name} gives {len(value)} values for {self.world_size} ranks")
        if config.global_batch < config.minimum * self.world_size:
            raise ConfigError(
                f"global_batch {config.global_batch} cannot give {self.world_size} ranks {config.minimum} samples each"
            )
        self.config = config
        self.dataset = dataset
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.emulation = emulation or Emulation()
        self.group = group
        self.device = local_device()
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self.model = DistributedDataParallel(model.to(self.device), device_ids=device_ids, process_group=group)
        self._clock = _SyncClock(self.device, self.emulation, self.rank)
        self.model.register_comm_hook(_GradientSum(self._clock, group, config.step_timeout_s), _sum_gradients)
        self.allocator = AdaptiveAllocator(
            self.world_size,
            config.global_batch,
            config.minimum,
            initial=None if config.policy == "equal" else config.weights,
            smoothing=config.smoothing,
            tolerance=config.tolerance,
            patience=config.patience,
        )
        self.sampler = WeightedDistributedSampler(
            dataset, self.allocator.shares, self.rank, seed=config.seed, drop_last=config.drop_last
        )
        self.start_epoch = 0
        self._step_count = 0

    def close(self) -> None:
        """Release the process group the trainer made; every rank must call it (idempotent).

        A gloo group left alive at interpreter exit can abort the process, so
        scripts should close the trainer (or use it as a context manager).
        """
        if self._own_group and self.group is not None:
            dist.destroy_process_group(self.group)
        self.group = None

    def __enter__(self) -> AllocatedTrainer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def shares(self) -> list[int]:
        """Samples per step of every rank, as currently planned."""
        return list(self.allocator.shares)

    def train_epoch(self, epoch: int) -> EpochReport:
        """Run one epoch; re-plan the shares if adaptive; return what every rank did."""
        self.model.train()
        started = time.perf_counter()
        self.sampler.set_shares(self.allocator.shares)
        self.sampler.set_epoch(epoch)
        compute_s = wait_s = loss_sum = 0.0
        samples = steps = position = 0
        window, replans = _Window(), []
        while True:
            for block, mine in self._remaining_steps():
                step_compute_s, step_wait_s, step_loss = self._step(mine, sum(block))
                compute_s, wait_s, loss_sum = compute_s + step_compute_s, wait_s + step_wait_s, loss_sum + step_loss
                samples, steps, position = samples + len(mine), steps + 1, position + sum(block)
                # A partial last step says nothing about speed; the very first step pays one-time set-up costs.
                if block == self.allocator.shares and self._step_count > 1:
                    window.add(step_compute_s)
                if not self._replan_due(window.steps):
                    continue
                old_shares = self.shares
                new_shares = self._replan(window)
                window = _Window()
                if new_shares != old_shares:
                    replans.append((steps, new_shares))
                    self.sampler.set_shares(new_shares)
                    self.sampler.set_epoch(epoch, start=position)
                    break
            else:
                break
        if self.config.policy == "adaptive" and self.config.replan_every == 0 and window.steps:
            old_shares = self.shares
            if not self.allocator.stable and self._replan(window) != old_shares:
                replans.append((steps, self.shares))
        totals = self._gather([compute_s, wait_s, float(samples), loss_sum, time.perf_counter() - started])
        return EpochReport(
            epoch=epoch,
            shares=self.shares,
            steps=steps,
            epoch_s=float(totals[:, 4].max()),
            compute_s=totals[:, 0].tolist(),
            wait_s=totals[:, 1].tolist(),
            samples=[int(n) for n in totals[:, 2].tolist()],
            loss=float(totals[:, 3].sum() / max(totals[:, 2].sum(), 1)),
            replans=replans,
            stable=self.allocator.stable,
        )

    def _remaining_steps(self) -> Iterator[tuple[list[int], list[int]]]:
        """Each remaining step of the epoch under the current shares: (every rank's count, this rank's indices)."""
        indices = list(self.sampler)
        offset = 0
        for block in self.sampler.blocks():
            yield block, indices[offset : offset + block[self.rank]]
            offset += block[self.rank]

    def _replan_due(self, window_steps: int) -> bool:
        every = self.config.replan_every
        return self.config.policy == "adaptive" and 0 < every <= window_steps and not self.allocator.stable

    def _replan(self, window: _Window) -> list[int]:
        """Share this rank's compute times with one small collective and apply the adaptive rule on every rank."""
        figures = self._gather([window.seconds, window.squares])
        seconds = figures[:, 0].tolist()
        shares = self.allocator.update(seconds, window.steps, step_cv=_pooled_cv(figures, window.steps))
        log.debug("re-planned shares %s from compute times %s", shares, seconds)
        return shares

    def _gather(self, values: Sequence[float]) -> torch.Tensor:
        """All ranks' ``values`` as a world_size x len(values) CPU tensor (float64)."""
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        with self._collective("gathering per-rank figures"):
            dist.all_gather(rows, mine, group=self.group)
        return torch.stack(rows).cpu()

    def _step(self, indices: list[int], global_count: int) -> tuple[float, float, float]:
        """One synchronized step on this rank's ``indices``; returns (compute s, wait s, summed loss)."""
        started = time.perf_counter()
        sleep(self.emulation.straggler_delay_s(self._step_count, self.rank, self.world_size))
        self._step_count += 1
        self._clock.start(len(indices))
        self.optimizer.zero_grad()
        chunk = self.config.chunk_size(self.rank, len(indices))
        pieces = [indices[i : i + chunk] for i in range(0, len(indices), chunk)] or [[]]
        loss_sum = torch.zeros((), device=self.device)
        for number, piece in enumerate(pieces):
            last = number == len(pieces) - 1
            inputs, targets = (t.to(self.device) for t in fetch(self.dataset, piece))
            with contextlib.nullcontext() if last else self.model.no_sync():
                outputs = self.model(inputs)
                if piece:
                    loss = self.loss_fn(outputs, targets)
                    loss_sum += loss.detach() * len(piece)
                    scaled = loss * (len(piece) / global_count)
                else:  # a rank with no samples this step still joins the allreduce, with zero gradients
                    scaled = outputs.sum() * 0.0
                with self._collective(f"step {self._step_count}'s gradient allreduce") if last else contextlib.nullcontext():
                    scaled.backward()
        synchronize(self.device)
        step_s = time.perf_counter() - started
        self.optimizer.step()
        compute_s = min(self._clock.started_at - started + self._clock.compute_s(), step_s)
        return compute_s, step_s - compute_s, float(loss_sum)

    @contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """Turn a collective that failed because a peer died or timed out into a PeerTimeoutError."""
        try:
            yield
        except RuntimeError as error:
            text = str(error)
            if not (isinstance(error, dist.DistError) or "gloo" in text or "NCCL" in text):
                raise
            timeout_s = self.config.step_timeout_s
            raise PeerTimeoutError(
                f"rank {self.rank}: {what} failed within step_timeout_s={timeout_s:g}: a peer died or hung "
                f"({text.splitlines()[0] if text else type(error).__name__})",
                rank=self.rank,
                timeout_s=timeout_s,
            ) from error

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "allocator": self.allocator.state_dict(),
            "config": asdict(self.config),
            "world_size": self.world_size,
            "epoch": self.start_epoch,
            "step_count": self._step_count,
        }

    def save_checkpoint(self, path: str | Path, next_epoch: int | None = None) -> None:
        """Rank 0 writes the model, optimizer, allocator and next epoch atomically; every rank waits for it."""
        if next_epoch is not None:
            self.start_epoch = next_epoch
        if self.rank == 0:
            save_checkpoint(path, self.state_dict())
        dist.barrier(group=self.group)

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore a checkpoint written by ``save_checkpoint``; return the epoch to continue from.

        Raises:
            CheckpointError: unreadable, or written by a run with another world size.
        """
        state = load_checkpoint(path)
        if state.get("world_size") != self.world_size:
            raise CheckpointError(f"{path} was written by {state.get('world_size')} ranks, this run has {self.world_size}")
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.allocator.load_state_dict(state["allocator"])
        self.start_epoch = state["epoch"]
        self._step_count = state["step_count"]
        return self.start_epoch


@torch.no_grad()
def accuracy(model: nn.Module, dataset: TensorDataset, batch_size: int = 1024) -> float:
    """Fraction of ``dataset`` that ``model`` classifies correctly (evaluated locally, no collective)."""
    model.eval()
    device = next(model.parameters()).device
    inputs, targets = dataset.tensors
    correct = 0
    for start in range(0, len(inputs), batch_size):
        logits = model(inputs[start : start + batch_size].to(device))
        correct += int((logits.argmax(1).cpu() == targets[start : start + batch_size]).sum())
    model.train()
    return correct / max(len(inputs), 1)
