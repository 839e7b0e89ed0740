"""Single-machine heterogeneity: per-rank speeds, injected stragglers and throttled links.

Settings travel to every worker through environment variables, so an emulated
run launches under torchrun exactly as a real one does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from hetdp.cluster.devices import DeviceModel, device_model, per_sample_ms
from hetdp.cluster.spec import ClusterSpec
from hetdp.errors import ConfigError

ENV_SPEEDS = "HETDP_SPEEDS"
ENV_SAMPLE_COST_MS = "HETDP_SAMPLE_COST_MS"
ENV_STRAGGLERS = "HETDP_STRAGGLERS"
ENV_SEED = "HETDP_EMULATION_SEED"
ENV_SPEED_CHANGES = "HETDP_SPEED_CHANGES"
ENV_DEVICES = "HETDP_DEVICES"

LEAD_FRACTION = 0.1
"""Share of a synthetic compute block slept before its real compute instead of after. Ranks sharing a few cores
would otherwise start computing the moment they leave a collective, starving the peers still finishing it (6 ranks
on 2 cores: the allreduce's tail after the last arrival fell from about 11 ms to 3.6 ms)."""


def sleep(seconds: float) -> None:
    """Sleep for a computed remainder of emulated time; a remainder that is not positive sleeps not at all."""
    if seconds > 0:
        time.sleep(seconds)


def parse_speeds(text: str, nproc: int | None = None) -> tuple[float, ...]:
    """Parse ``"1,1,2,4"`` into positive relative speeds, one per rank.

    Raises:
        ConfigError: a value is not a positive finite number, or the count differs from ``nproc``.
    """
    speeds = []
    for rank, item in enumerate(text.split(",")):
        try:
            value = float(item)
        except ValueError:
            raise ConfigError(f"speeds must be positive numbers, got {item.strip()!r} (rank {rank})") from None
        if not (value > 0 and np.isfinite(value)):
            raise ConfigError(f"speeds must be positive numbers, got {item.strip()!r} (rank {rank})")
        speeds.append(value)
    if nproc is not None and len(speeds) != nproc:
        raise ConfigError(f"--speeds gives {len(speeds)} values for {nproc} processes; give one per process")
    return tuple(speeds)


def parse_speed_change(text: str, nproc: int | None = None) -> tuple[int, tuple[float, ...]]:
    """Parse ``"STEP:V1,V2,..."``: from global step STEP on, the ranks run at speeds V1, V2, ...

    Raises:
        ConfigError: STEP is not an integer >= 0, or the speeds are bad (see ``parse_speeds``).
    """
    step_text, separator, speeds_text = text.partition(":")
    try:
        step = int(step_text)
    except ValueError:
        step = -1
    if not separator or step < 0:
        raise ConfigError(f"a speed change must look like STEP:V1,V2,... (e.g. 120:1,1,2,1), got {text!r}")
    return step, parse_speeds(speeds_text, nproc)


def parse_stragglers(text: str) -> tuple[int, float]:
    """Parse ``"K:DELAY_MS"`` (K random ranks delayed by DELAY_MS per step)."""
    try:
        count_text, delay_text = text.split(":")
        count, delay_ms = int(count_text), float(delay_text)
    except ValueError:
        raise ConfigError(f"stragglers must look like K:DELAY_MS (e.g. 1:200), got {text!r}") from None
    if count < 0 or not delay_ms >= 0:
        raise ConfigError(f"stragglers needs K >= 0 and DELAY_MS >= 0, got {text!r}")
    return count, delay_ms


@dataclass(kw_only=True, frozen=True)
class Emulation:
    """How this machine pretends its ranks are unequal.

    With ``sample_cost_ms`` at 0, a rank's measured compute time is stretched to
    ``measured * max(speeds) / speeds[rank]`` (the fastest rank runs natively).
    With ``sample_cost_ms`` > 0, each compute block is padded to take exactly
    ``samples * sample_cost_ms / speeds[rank]``: exact speed ratios even when
    several ranks share few cores, as long as real compute takes under
    ``1 - LEAD_FRACTION`` of that (the block's first part is a sleep, ``lead_s``).
    With ``devices``, each block is padded to its device model's time instead: a
    fixed cost per step, a knee, micro-batches forced by a memory cap, each with
    its overhead (``DeviceModel.step_ms`` at ``sample_cost_ms / speed`` per sample).
    """

    speeds: tuple[float, ...] | None = None
    """Relative speed of each rank; None means all equal (no stretching)."""
    sample_cost_ms: float = 0.0
    """Synthetic milliseconds per sample at speed 1; 0 stretches measured time instead."""
    straggler_count: int = 0
    """Ranks delayed at each step, drawn at random (the same draw on every rank)."""
    straggler_delay_ms: float = 0.0
    """Milliseconds each drawn straggler sleeps before its step."""
    seed: int = 0
    """Seed of the straggler draws."""
    speed_changes: tuple[tuple[int, tuple[float, ...]], ...] = ()
    """(global step, speeds from that step on), by increasing step: devices that slow down or recover mid-run
    (a co-tenant job, thermal throttling). Before the first change, ``speeds`` hold."""
    devices: tuple[DeviceModel, ...] | None = None
    """Per rank, what its steps cost beyond samples x cost / speed (overheads, knee, memory cap); None: nothing.
    Needs ``sample_cost_ms`` > 0. A speed change scales the samples' part of a step, not the overheads."""

    def __post_init__(self) -> None:
        if self.speeds is not None and not all(v > 0 and np.isfinite(v) for v in self.speeds):
            raise ConfigError(f"speeds must be positive numbers, got {list(self.speeds)}")
        steps = [step for step, _ in self.speed_changes]
        if steps != sorted(set(steps)):
            raise ConfigError(f"speed changes must be at distinct, increasing steps, got steps {steps}")
        for step, speeds in self.speed_changes:
            if not all(v > 0 and np.isfinite(v) for v in speeds):
                raise ConfigError(f"speeds must be positive numbers, got {list(speeds)} (change at step {step})")
            if self.speeds is not None and len(speeds) != len(self.speeds):
                raise ConfigError(
                    f"the speed change at step {step} gives {len(speeds)} speeds for {len(self.speeds)} ranks"
                )
        if not self.sample_cost_ms >= 0:
            raise ConfigError(f"sample_cost_ms must be >= 0, got {self.sample_cost_ms!r}")
        if self.devices is not None:
            if not self.sample_cost_ms > 0:
                raise ConfigError("device models price steps from a per-sample cost: give sample_cost_ms > 0")
            if self.speeds is not None and len(self.devices) != len(self.speeds):
                raise ConfigError(f"{len(self.devices)} device models for {len(self.speeds)} speeds; give one per rank")
        if self.straggler_count < 0 or not self.straggler_delay_ms >= 0:
            raise ConfigError(
                f"stragglers need count >= 0 and delay >= 0, got {self.straggler_count}:{self.straggler_delay_ms}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Emulation:
        """Read the settings ``to_env`` wrote (what torchrun passes to every worker)."""
        speeds = parse_speeds(env[ENV_SPEEDS]) if env.get(ENV_SPEEDS) else None
        count, delay_ms = parse_stragglers(env[ENV_STRAGGLERS]) if env.get(ENV_STRAGGLERS) else (0, 0.0)
        changes = env.get(ENV_SPEED_CHANGES, "")
        return cls(
            speeds=speeds,
            sample_cost_ms=float(env.get(ENV_SAMPLE_COST_MS, 0.0)),
            straggler_count=count,
            straggler_delay_ms=delay_ms,
            seed=int(env.get(ENV_SEED, 0)),
            speed_changes=tuple(parse_speed_change(change) for change in changes.split(";") if change),
            devices=_devices_from_json(env[ENV_DEVICES]) if env.get(ENV_DEVICES) else None,
        )

    @classmethod
    def from_device_table(cls, cluster: ClusterSpec, *, seed: int = 0) -> Emulation:
        """Emulate the devices of a device table (``read_device_table``), one per rank.

        Each device's time per sample (``batch_time_s / batch_size``) sets its speed: the
        slowest runs at speed 1 and ``sample_cost_ms`` is its time per sample. Its
        overheads, knee and memory cap (floor of C-ADP eq. 3's P_max) make its model.
        """
        sample_ms = per_sample_ms(cluster)
        slowest_ms = max(sample_ms)
        return cls(speeds=tuple(slowest_ms / ms for ms in sample_ms), sample_cost_ms=slowest_ms, seed=seed,
                   devices=tuple(device_model(device) for device in cluster.devices))

    def to_env(self) -> dict[str, str]:
        """Environment variables that reproduce this emulation in a worker process."""
        env = {ENV_SAMPLE_COST_MS: repr(self.sample_cost_ms), ENV_SEED: str(self.seed)}
        if self.speeds is not None:
            env[ENV_SPEEDS] = ",".join(repr(v) for v in self.speeds)
        if self.straggler_count:
            env[ENV_STRAGGLERS] = f"{self.straggler_count}:{self.straggler_delay_ms!r}"
        if self.speed_changes:
            env[ENV_SPEED_CHANGES] = ";".join(
                f"{step}:{','.join(repr(v) for v in speeds)}" for step, speeds in self.speed_changes
            )
        if self.devices is not None:
            env[ENV_DEVICES] = json.dumps([dataclasses.asdict(device) for device in self.devices])
        return env

    @property
    def active(self) -> bool:
        return (self.speeds is not None or self.sample_cost_ms > 0 or self.straggler_count > 0
                or bool(self.speed_changes) or self.devices is not None)

    def speeds_at(self, step: int = 0) -> tuple[float, ...] | None:
        """Every rank's speed at global step ``step``: the last change at or before it, else ``speeds``."""
        current = self.speeds
        for change_step, speeds in self.speed_changes:
            if change_step > step:
                break
            current = speeds
        return current

    def speed(self, rank: int, step: int = 0) -> float:
        speeds = self.speeds_at(step)
        return 1.0 if speeds is None else speeds[rank]

    def lead_s(self, rank: int, samples: float, step: int = 0) -> float:
        """Seconds to sleep before the real compute of a block of ``samples`` (synthetic mode only)."""
        return LEAD_FRACTION * self.block_s(rank, samples, step)

    def padding_s(self, rank: int, measured_s: float, samples: float, step: int = 0,
                  forwards: int | None = None) -> float:
        """Seconds to sleep after a compute block of ``samples`` that took ``measured_s``, its lead included, and
        ran as ``forwards`` micro-batches (None: as few as the device's memory cap allows)."""
        if self.sample_cost_ms > 0:
            return max(0.0, self.block_s(rank, samples, step, forwards) - measured_s)
        speeds = self.speeds_at(step)
        if speeds is None:
            return 0.0
        return measured_s * (max(speeds) / speeds[rank] - 1.0)

    def block_s(self, rank: int, samples: float, step: int = 0, forwards: int | None = None) -> float:
        """Emulated seconds of a compute block of ``samples`` (synthetic mode; 0 when stretching measured time)."""
        sample_ms = self.sample_cost_ms / self.speed(rank, step)
        if self.devices is None:
            return samples * sample_ms / 1000.0
        return self.devices[rank].step_ms(samples, sample_ms, forwards) / 1000.0

    def stragglers(self, step: int, world_size: int) -> frozenset[int]:
        """Ranks delayed at ``step``: a pure function of (seed, step), so every rank agrees."""
        if not self.straggler_count:
            return frozenset()
        rng = np.random.default_rng([self.seed, step])
        count = min(self.straggler_count, world_size)
        return frozenset(int(r) for r in rng.choice(world_size, size=count, replace=False))

    def straggler_delay_s(self, step: int, rank: int, world_size: int) -> float:
        return self.straggler_delay_ms / 1000.0 if rank in self.stragglers(step, world_size) else 0.0

    @contextmanager
    def compute(self, rank: int, samples: int, step: int = 0) -> Iterator[None]:
        """Run a compute block between two sleeps (``lead_s``, ``padding_s``) so that it lasts as long as on the
        emulated device."""
        start = time.perf_counter()
        sleep(self.lead_s(rank, samples, step))
        yield
        sleep(self.padding_s(rank, time.perf_counter() - start, samples, step))

    def pacer(self, rank: int, world_size: int) -> Pacer:
        """The one seam between a training step and this emulation, for ``rank`` of ``world_size``.

        Raises:
            ConfigError: speeds or device models for another number of ranks (set by hand in the environment under
                an engine, where no ``hetdp run`` counted the ranks).
        """
        counts = [("speeds", ENV_SPEEDS, self.speeds), ("device models", ENV_DEVICES, self.devices),
                  *((f"speeds from step {step}", ENV_SPEED_CHANGES, speeds) for step, speeds in self.speed_changes)]
        for what, variable, values in counts:
            if values is not None and len(values) != world_size:
                raise ConfigError(f"the emulation gives {len(values)} {what} ({variable}) for a group of {world_size} "
                                  "ranks: give one per rank")
        return Pacer(self, rank, world_size)


class Pacer:
    """Make one rank's training steps last as long as on its emulated device.

    A step calls ``start`` when its compute begins (the injected straggler delay,
    then the lead) and ``finish`` when its real compute is done, just before its
    gradients are exchanged (the padding). Without emulation both return at once,
    so training code calls them unconditionally.

    With ``sample_cost_ms`` > 0 the pacer keeps a deadline: ``start`` moves it by the
    step's straggler delay and lead, ``finish`` by the rest of the step's block, and
    each sleeps until it. While the rank exchanges nothing with the others, the
    deadline runs on from one step to the next (``finish(alone=True)``): the real
    host work between two steps (the optimizer's step, the next batch, Python), a
    sleep's overshoot and a block whose real compute ran long come out of the next
    sleeps instead of adding to every step. So k blocks of T seconds last k T as
    long as the real work of every prefix is cheaper than that, which is how C-ADP
    prices a rank's local epoch: its batches times its batch time (C-ADP paper,
    eq. 5). Where the rank has just synchronized with the others, the deadline
    restarts at the next step's start instead, because what it waited there must
    not come out of its next blocks:

    - after a step whose gradients leave the rank (allreduce, partial allreduce):
      the exchange waits for the slowest rank, a round's initiator or quorum, or
      at least the round's own transfer, and a synchronous step is priced as the
      slowest block, then the exchange (C-ADP paper, eq. 7 for DDP; the simulator);
    - after a meeting (local averaging every K steps or at an epoch's end): the
      step before it says so when the meeting is foreseen (``alone=False``),
      ``restart`` when it is not (an epoch a loop of its own ends);
    - when more time passed since the last step than the coming step's whole
      block: that is no host work but a collective nobody announced (torch DDP's
      bucket rebuild at the second step, a planning gather);
    - always when stretching measured time (``sample_cost_ms`` = 0): a step's
      emulated time is a multiple of its own real compute.

    Args:
        emulation: the settings to pace by.
        rank: this rank, in ``emulation``'s speeds and straggler draws.
        world_size: ranks the stragglers are drawn from.
        clock: seconds of a monotonic clock (default ``time.perf_counter``).
        sleep: sleeps that many seconds, not at all when not positive (default this module's ``sleep``).
    """

    def __init__(self, emulation: Emulation, rank: int, world_size: int, *,
                 clock: Callable[[], float] | None = None, sleep: Callable[[float], None] | None = None) -> None:
        self.emulation = emulation
        self.rank = rank
        self.world_size = world_size
        self.active = emulation.active
        self._clock = clock
        self._sleep = sleep
        self._deadline = 0.0
        """Where the sleeps of the started step end (sample-cost mode); the next step's run on from it if alone."""
        self._runs_on_to: int | None = None
        """The step whose deadline runs on from the last one's: the step after one that ended ``alone``."""
        self._lead_s = 0.0
        """The lead ``start`` slept; ``finish`` pads the rest of the block (a caller may know the samples only then)."""
        self._delay_s = 0.0
        """The straggler delay ``start`` slept."""
        self._finished_s = 0.0
        """When the last step's padding ended (sample-cost mode): where a step that runs on from it began."""
        self._warned = False

    def start(self, step: int, samples: float) -> float | None:
        """Sleep through the straggler delay drawn for ``step``, then the lead of its ``samples``; return when the
        emulated device began the step, on the pacer's clock: where the last step ended if this one runs on from it
        (None: now).

        A step that runs on is timed from there, as a device's own clock times work queued behind the last: the
        host work between the two ran while the device computed, and timed from the host's start the step would
        read as its block less that host work (a fast rank's 4 ms block as 1 ms), which the allocation takes for
        speed.
        """
        if not self.active:
            return None
        emulation, now = self.emulation, self._now()
        block_s = emulation.block_s(self.rank, samples, step)
        runs_on = self._runs_on_to == step and emulation.sample_cost_ms > 0 and now - self._deadline <= block_s
        self._runs_on_to = None
        origin = self._deadline if runs_on else now
        self._lead_s = emulation.lead_s(self.rank, samples, step)
        self._delay_s = emulation.straggler_delay_s(step, self.rank, self.world_size)
        self._deadline = origin + self._delay_s + self._lead_s
        self._sleep_until(self._deadline)
        return self._finished_s if runs_on else None

    def finish(self, step: int, samples: float, compute_s: float, forwards: int | None = None, *,
               alone: bool = False) -> None:
        """Sleep so that a compute block of ``samples`` that took ``compute_s`` (delay and lead included), in
        ``forwards`` micro-batches, lasts as long as on the emulated device; the straggler delay comes on top.
        ``alone``: the rank exchanges nothing with others before step ``step + 1``, whose deadline then runs on
        from this one's."""
        if not self.active:
            return
        self._check_memory(samples, forwards)
        emulation = self.emulation
        if emulation.sample_cost_ms > 0:
            self._deadline += emulation.block_s(self.rank, samples, step, forwards) - self._lead_s
            self._sleep_until(self._deadline)
            self._runs_on_to = step + 1 if alone else None
            self._finished_s = self._now()
        else:
            delay_s = emulation.straggler_delay_s(step, self.rank, self.world_size)
            (self._sleep or sleep)(emulation.padding_s(self.rank, compute_s - delay_s, samples, step, forwards))

    def pace(self, step: int, samples: float, fraction: float, computed_s: float, segment_s: float) -> None:
        """Pace one segment of a started step whose collectives hold the ranks in lockstep (the sharded drop-in's
        all-gathers and reduce-scatters), before its next collective: sleep until the step has computed its
        straggler delay, its lead and ``fraction`` of the rest of its emulated block (``sample_cost_ms`` > 0;
        ``computed_s``: its seconds outside collectives so far), or stretch the segment of ``segment_s`` seconds
        just computed.

        Padding once at the step's end would leave each collective waiting for the slowest rank's real compute and
        then add the slow rank's whole padding at the end, so that steps last longer than emulated; pacing
        every segment keeps each collective where the emulated devices would reach it. The
        time a rank waits inside collectives is not compute, and does not count towards its block.
        """
        if not self.active:
            return
        emulation = self.emulation
        if emulation.sample_cost_ms > 0:
            rest_s = emulation.block_s(self.rank, samples, step) - self._lead_s
            (self._sleep or sleep)(self._delay_s + self._lead_s + min(max(fraction, 0.0), 1.0) * rest_s - computed_s)
        else:
            (self._sleep or sleep)(emulation.padding_s(self.rank, segment_s, samples, step))

    def finish_segments(self, step: int, samples: float, computed_s: float, segment_s: float,
                        forwards: int | None = None) -> None:
        """End a step paced by ``pace``: sleep until it has computed its straggler delay and its whole block, run
        as ``forwards`` micro-batches (``sample_cost_ms`` > 0), or stretch its last segment of ``segment_s``."""
        if not self.active:
            return
        self._check_memory(samples, forwards)
        emulation = self.emulation
        if emulation.sample_cost_ms > 0:
            block_s = emulation.block_s(self.rank, samples, step, forwards)
            (self._sleep or sleep)(self._delay_s + block_s - computed_s)
        else:
            (self._sleep or sleep)(emulation.padding_s(self.rank, segment_s, samples, step))

    def restart(self) -> None:
        """The rank just synchronized with the others outside a step: the next step's deadline starts afresh even if
        the last step ended ``alone``."""
        self._runs_on_to = None

    def _now(self) -> float:
        return (self._clock or time.perf_counter)()

    def _sleep_until(self, deadline: float) -> None:
        (self._sleep or sleep)(deadline - self._now())

    def _check_memory(self, samples: float, forwards: int | None) -> None:
        """Warn once if a forward held more samples than the emulated device's memory cap."""
        devices = self.emulation.devices
        if forwards is None or devices is None or self._warned:
            return
        device = devices[self.rank]
        if device.forwards(samples) > forwards:
            self._warned = True
            warnings.warn(f"rank {self.rank} ran {samples:g} samples in {forwards} forward(s), above its emulated "
                          f"memory cap of {device.max_batch} per forward (a real device would run out of memory); "
                          f"priced as {device.forwards(samples)} micro-batches", RuntimeWarning, stacklevel=3)


@dataclass(kw_only=True, frozen=True)
class Link:
    """An emulated network link: latency plus size over bandwidth (the C-ADP paper's alpha + M/B)."""

    bandwidth_mbps: float
    """Megabits per second."""
    latency_ms: float = 0.0
    """One-way latency in milliseconds."""

    def __post_init__(self) -> None:
        if not self.bandwidth_mbps > 0:
            raise ConfigError(f"bandwidth_mbps must be > 0, got {self.bandwidth_mbps!r}")
        if not self.latency_ms >= 0:
            raise ConfigError(f"latency_ms must be >= 0, got {self.latency_ms!r}")

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` over this link."""
        return self.latency_ms / 1000.0 + nbytes * 8.0 / (self.bandwidth_mbps * 1e6)


def _devices_from_json(text: str) -> tuple[DeviceModel, ...]:
    """Device models from ``to_env``'s JSON."""
    try:
        entries = json.loads(text)
        return tuple(DeviceModel(**entry) for entry in entries)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{ENV_DEVICES} must be a JSON list of device models, got {text!r}: {error}") from error
